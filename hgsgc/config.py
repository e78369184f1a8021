"""Experiment configuration: YAML file + dotted ``key=value`` overrides, validated.

Schema (OmegaConf structured config, unknown keys rejected) and defaults below; see
``configs/*.yaml``. :func:`load_config` raises :class:`ConfigError` with one line that names the
key and the fix, so every rank can stop before any collective.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hgsgc.compression import DEFAULT_DENSITY, DEFAULT_SELECTOR  # written into a sparse method's config when left out
from hgsgc.compression import base as _methods
from hgsgc.models import BOUNDARY, MODELS, TASK_OF, WHY_NO_BOUNDARY
from hgsgc.tasks import FORMATS, TASK_OF_FORMAT

METHODS = _methods.method_names()  # the registry of hgsgc.compression (a new method adds itself)
SPARSE_METHODS = tuple(m for m, spec in _methods.METHODS.items() if spec.sparse)
LAYOUTS = ("data_parallel", "hourglass", "auto")  # auto: measured choice (docs/hourglass.md)


class ConfigError(ValueError):
    """Invalid configuration; the message names the key and the fix."""


@dataclass
class RunConfig:
    name: str = "fashion_mnist"
    out_dir: str = "runs"
    id: Optional[str] = None  # default: <name>-<UTC time>
    seed: int = 42


@dataclass
class DataConfig:
    format: str = "fashion_mnist"  # fashion_mnist | cifar10 | imagenet_jpeg | imagenet_tfrecord | ptb | librispeech
    path: Optional[str] = None  # default: the offline default of the format (hgsgc.tasks.DEFAULT_DATA)
    train_limit: int = 0  # 0 = all training examples (PTB: tokens)
    test_limit: int = 0  # 0 = all test examples
    train_split: Optional[str] = None  # ImageNet / LibriSpeech split folder (default: train, train-clean-100)
    test_split: Optional[str] = None  # default: val / validation / test-clean
    image_size: int = 0  # ImageNet crop size; 0 = 224
    num_classes: int = 0  # ImageNet TFRecord classes; 0 = 1000
    vocab_size: int = 10000  # PTB vocabulary (with <unk> and <eos>)
    bptt: int = 20  # PTB steps of truncated backpropagation through time
    n_mels: int = 40  # LibriSpeech log-mel bins


@dataclass
class ModelConfig:
    name: str = "alexnet_small"
    width: float = 1.0  # channel / FC-unit multiplier (resnet20, vgg16, alexnet)
    units: int = 0  # LSTM units; 0 = the model's setting (200 small, 650 medium)
    dropout: float = -1.0  # LSTM dropout; < 0 = the model's setting (0 small, 0.5 medium)


@dataclass
class TrainConfig:
    epochs: int = 2
    batch_size: int = 32  # per rank
    lr: float = 0.05
    momentum: float = 0.9
    warmup_steps: int = 0  # linear learning-rate warm-up
    lr_schedule: str = "constant"  # constant | step | cosine
    lr_decay: float = 0.1  # step schedule: factor at each of lr_decay_epochs
    lr_decay_epochs: List[int] = field(default_factory=list)  # step schedule: 1-based epochs
    base_batch_size: int = 0  # linear scaling rule: lr x global batch / base_batch_size (0 = off)
    weight_decay: float = 0.0  # L2 on kernels and embeddings
    clip_norm: float = 0.0  # clip this rank's gradients to this global norm (0 = off; LSTM: 5)
    eval_batch_size: int = 0  # 0 = 4 x batch_size (language model: batch_size)
    test_every_epoch: bool = True  # language model: the test split after every epoch (false: after the last only, as Zaremba et al.'s code; valid: every epoch)
    threads: int = 0  # TF threads per rank; 0 = cores / ranks on the host
    max_steps_per_epoch: int = 0  # 0 = the whole epoch
    progress: bool = True  # progress on rank 0 (a bar on a terminal, else a line every progress_interval_s)
    progress_interval_s: float = 15.0
    log_every_steps: int = 0  # a metrics.jsonl line every N steps (0 = per epoch only)
    tensorboard: bool = True  # TensorBoard event files under <run dir>/tb (rank 0)
    deterministic: bool = False  # TensorFlow op determinism (bit-exact resume; docs/reliability.md)


@dataclass
class CompressionConfig:
    method: str = "sgc"  # none | fp16 | topk | sgc | localsgd | dgc | terngrad | powersgd
    density: Optional[float] = None  # topk/sgc/dgc (and the Hourglass FC topk/sgc): k = ceil(density numel); default DEFAULT_DENSITY
    bits: Optional[int] = None  # 2 or 32; default: 2 for sgc, 32 (fp32 values) for topk and dgc
    delay: int = 1
    hierarchy: str = "allgather"
    selector: Optional[str] = None  # topk/sgc/dgc: exact | sampled (same selection, sampled is faster); default sampled
    error_feedback: bool = True
    momentum_correction: bool = False  # DGC momentum correction + masking (delay 1 only)
    momentum_masking: bool = True  # with momentum_correction: DGC's momentum factor masking (false: keep the velocity)
    warmup_steps: int = 0  # DGC warm-up of sparsity: density 0.25 -> 0.004 in 4 stages
    local_clip_norm: float = 0.0  # DGC local gradient clipping (global norm; 0 = off)
    dense_vectors: bool = False  # topk/sgc/dgc: biases and batch-norm parameters (rank < 2) averaged densely, as DGC
    buckets: int = 1  # topk/sgc/dgc with hierarchy allgather: allgathers per exchange, last layers first (overlap with the backward pass)
    index_coding: Optional[str] = None  # topk/sgc/dgc: payload indices elias_fano (~floor(log2(numel/k)) + 2 bits; lossless) or fixed (ceil(log2 numel) bits); default: elias_fano for topk/sgc/dgc (and the Hourglass FC topk/sgc)
    powersgd_rank: int = 4  # PowerSGD rank r
    terngrad_clip_sigma: float = 2.5  # TernGrad gradient clipping at c standard deviations (0 = off)


@dataclass
class HourglassConfig:
    fc_workers: Any = "auto"  # number of FC ranks, or "auto" (cost model, docs/hourglass.md); under layout auto an integer is the only Hourglass candidate
    split_layer: Optional[str] = None  # first FC-head layer; default: first Dense after the last conv
    fc_method: str = "none"  # compression among FC ranks: none | fp16 | topk | sgc
    # link of fc_workers=auto / layout=auto: null = ping-pong probe at start-up (default); a number
    # (Mbit/s) is an explicit override: no probe, beta = mbps * 1e6 / 8, alpha = 0
    link_bandwidth_mbps: Optional[float] = None
    wire_dtype: str = "float32"  # activations + activation gradients on the wire: float32 | float16
    micro_batches: int = 1  # pipeline the boundary exchange in this many micro-batches (1..batch_size)
    act_codec: Optional[str] = None  # CONV -> FC: fp32 | fp16 | q8 | q4, optionally sparse+ (default: wire_dtype)
    grad_codec: Optional[str] = None  # FC -> CONV: same choices (docs/hourglass.md, "Boundary codecs")
    fc_delay: int = 1  # SGC communication delay among FC ranks (fc_method=sgc)


@dataclass
class CheckpointConfig:
    """Checkpoints and resume (docs/reliability.md)."""
    dir: Optional[str] = None  # default: <run.out_dir>/<run.id>/checkpoints
    every_steps: int = 0  # 0 = off
    every_minutes: float = 0.0  # 0 = off (rank 0's clock, agreed among ranks)
    at_end: bool = True  # also after the last step
    keep: int = 2  # complete checkpoints kept
    resume: str = "auto"  # auto (newest complete checkpoint, if any) | never | <checkpoint folder>


@dataclass
class FaultConfig:
    """Reaction to faults (docs/reliability.md)."""
    nonfinite: str = "skip"  # NaN/Inf gradient on any rank: skip the step on every rank | raise | off
    stall_timeout_s: float = 0.0  # > 0: end the job when a rank issues no collective (Hourglass: no boundary message) this long


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    layout: str = "data_parallel"  # data_parallel | hourglass
    hourglass: HourglassConfig = field(default_factory=HourglassConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)


#: the config's sections, each with one of its keys (for messages)
SECTIONS = {f.name: dataclasses.fields(f.default_factory)[0].name for f in dataclasses.fields(Config)
            if f.default_factory is not dataclasses.MISSING}


def _yaml_kind(node) -> str:
    if OmegaConf.is_list(node):
        return "list"
    return {str: "string", int: "number", float: "number", bool: "boolean"}.get(type(node), type(node).__name__)


def _valid_keys(node, prefix=""):
    keys = []
    for f in dataclasses.fields(node):
        v = getattr(node, f.name)
        if dataclasses.is_dataclass(v):
            keys += _valid_keys(v, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def load_config(path: Optional[str] = None, overrides: Optional[List[str]] = None) -> Config:
    """Read ``path`` (YAML), apply ``overrides`` (``["train.epochs=3", ...]``), validate.

    Returns:
        a :class:`Config` dataclass instance.

    Raises:
        ConfigError: missing file, unknown key, wrong type or out-of-range value.
    """
    base = OmegaConf.structured(Config)
    parts = [base]
    try:
        if path is not None:
            if not os.path.exists(path):
                raise ConfigError(f"config file not found: {path} (see configs/*.yaml)")
            loaded = OmegaConf.load(path)
            if os.path.isfile(path) and not loaded:  # empty, or comments only: not a config
                raise ConfigError(f"config file {path} is empty (no settings): a truncated copy? "
                                  f"Re-copy it, or give a config from configs/*.yaml")
            if not OmegaConf.is_dict(loaded):
                raise ConfigError(f"config file {path} is a YAML {_yaml_kind(loaded)}, not a mapping of "
                                  f"sections (run, data, model, train, ...): see configs/*.yaml")
            for key, value in loaded.items():
                if key in SECTIONS and not OmegaConf.is_dict(value) and value is not None:
                    raise ConfigError(f"config file {path}: '{key}' is a section, not a value: give its "
                                      f"keys under it (e.g. '{SECTIONS[key]}: ...' indented under '{key}:')")
            parts.append(loaded)
        for o in overrides or []:
            if "=" not in o:
                raise ConfigError(f"override {o!r} is not key=value (e.g. train.epochs=3)")
            key = o.split("=", 1)[0].strip()
            if not key:
                raise ConfigError(f"override {o!r} has no key (e.g. train.epochs=3)")
            if key in SECTIONS:
                raise ConfigError(f"override {o!r}: '{key}' is a section, not a value: give one of its "
                                  f"keys, e.g. {key}.{SECTIONS[key]}=...")
        if overrides:
            parts.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*parts)
        cfg: Config = OmegaConf.to_object(merged)  # resolves ${...} interpolations
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        msg = str(exc).splitlines()[0]
        if "Interpolation" not in msg and ("not in" in msg or "Key" in msg and "not" in msg):
            raise ConfigError(f"unknown config key '{key}': valid keys are "
                              f"{', '.join(_valid_keys(Config()))}") from None
        raise ConfigError(f"config key '{key}': {msg}") from None
    except Exception as exc:  # YAML syntax errors and the like (their messages span lines: one line here)
        raise ConfigError(f"cannot read config {path}: {' '.join(str(exc).split())}") from None
    validate(cfg)
    return cfg


#: upper bounds of counts that reach C code (TensorFlow's thread pools, int64 step arithmetic)
MAX_DELAY = 2 ** 31 - 1
MAX_THREADS = 4096


def validate(cfg: Config) -> None:
    """Range checks; raises :class:`ConfigError` naming the key and the fix."""
    c, t = cfg.compression, cfg.train

    def bad(key, value, fix):
        raise ConfigError(f"{key}={value!r} is invalid: {fix}")

    if c.method not in METHODS:
        bad("compression.method", c.method, f"use one of {', '.join(METHODS)}")
    sparse = c.method in SPARSE_METHODS
    fc_sparse = _fc_sparse(cfg)
    unused = []
    for key, default in (("density", DEFAULT_DENSITY), ("selector", DEFAULT_SELECTOR)):
        if getattr(c, key) is None:
            if sparse or fc_sparse:  # the default, written out (the run's config.json)
                setattr(c, key, default)
        elif not sparse and not fc_sparse:
            unused.append(key)
    if unused:  # one message for both (a config.json of a dense run before session 21 has both)
        fc_note = (f"; hourglass.fc_method={cfg.hourglass.fc_method} uses them only with layout hourglass or auto "
                   f"(layout is {cfg.layout})" if cfg.hourglass.fc_method in SPARSE_METHODS else "")
        raise ConfigError(
            f"{', '.join(f'compression.{k}={getattr(c, k)!r}' for k in unused)} "
            f"{'is' if len(unused) == 1 else 'are'} invalid: "
            f"{'it applies' if len(unused) == 1 else 'they apply'} to methods {', '.join(SPARSE_METHODS)} "
            f"(and a sparse hourglass.fc_method); method is {c.method}{fc_note}: remove "
            f"{'it' if len(unused) == 1 else 'them'} (on the command line: "
            f"{' '.join(f'compression.{k}=null' for k in unused)})")
    if c.density is not None and not (isinstance(c.density, (int, float)) and 0.0 < c.density <= 1.0):
        bad("compression.density", c.density, "must be in (0, 1], e.g. 0.005")
    if c.bits is not None and c.bits not in (2, 32):
        bad("compression.bits", c.bits, "use 2 (2-bit values) or 32 (fp32 values)")
    if c.delay < 1:
        bad("compression.delay", c.delay, "must be an integer >= 1 (1 = synchronize every step)")
    if c.delay > MAX_DELAY:  # a 21-digit delay ended in a bare OverflowError naming no key
        bad("compression.delay", c.delay, f"must be <= {MAX_DELAY} (steps between synchronizations)")
    if c.method not in ("sgc", "localsgd") and c.delay != 1:
        bad("compression.delay", c.delay, f"method {c.method} synchronizes every step: use "
                                          "method=sgc or method=localsgd for delay > 1")
    from hgsgc.compression import HIERARCHIES

    if c.hierarchy not in HIERARCHIES:
        bad("compression.hierarchy", c.hierarchy, f"use one of {', '.join(HIERARCHIES)}")
    if c.hierarchy != "allgather" and not sparse and not fc_sparse:
        bad("compression.hierarchy", c.hierarchy, f"method {c.method} does not exchange top-k "
                                                  "payloads: hierarchies apply to topk, sgc and dgc")
    if c.momentum_correction and (not sparse or c.delay != 1):
        bad("compression.momentum_correction", True, "needs method topk, sgc or dgc with delay=1")
    if not c.momentum_masking and not (c.momentum_correction or c.method == "dgc"):
        bad("compression.momentum_masking", False, "applies to momentum correction only: set "
                                                   "compression.momentum_correction=true (or method dgc), "
                                                   "or drop momentum_masking")
    if (c.momentum_correction or c.method == "dgc") and not c.error_feedback:
        bad("compression.error_feedback", False, "momentum correction (and so method dgc) needs "
                                                 "error feedback: set compression.error_feedback=true")
    if not math.isfinite(c.local_clip_norm) or c.local_clip_norm < 0:
        bad("compression.local_clip_norm", c.local_clip_norm, "must be a finite number >= 0 "
                                                              "(0 = off), e.g. 5.0")
    if c.local_clip_norm and (not sparse or c.delay != 1):
        bad("compression.local_clip_norm", c.local_clip_norm, "needs method topk, sgc or dgc "
                                                              "with delay=1")
    if c.powersgd_rank < 1:
        bad("compression.powersgd_rank", c.powersgd_rank, "must be an integer >= 1, e.g. 4")
    if not math.isfinite(c.terngrad_clip_sigma) or c.terngrad_clip_sigma < 0:
        bad("compression.terngrad_clip_sigma", c.terngrad_clip_sigma,
            "must be >= 0 (0 = no clipping; the paper uses 2.5)")
    if c.selector is not None and c.selector not in ("exact", "sampled"):
        bad("compression.selector", c.selector, "use exact or sampled")
    if not 0 <= cfg.run.seed < 2 ** 32:
        bad("run.seed", cfg.run.seed, "must be an integer in 0..4294967295 (2**32 - 1), e.g. 42")
    if t.epochs < 1:
        bad("train.epochs", t.epochs, "must be >= 1")
    if t.batch_size < 1:
        bad("train.batch_size", t.batch_size, "must be >= 1 (examples per rank per step)")
    if not (t.lr > 0 and math.isfinite(t.lr)):
        bad("train.lr", t.lr, "must be a finite number > 0")
    if not 0 <= t.momentum < 1:
        bad("train.momentum", t.momentum, "must be in [0, 1)")
    if isinstance(c.buckets, bool) or not isinstance(c.buckets, int) or c.buckets < 1:
        bad("compression.buckets", c.buckets, "must be an integer >= 1 (1 = one fused allgather per exchange)")
    if c.buckets > 1 and (not sparse or c.hierarchy != "allgather"):
        bad("compression.buckets", c.buckets, "splits the flat allgather of top-k payloads: needs "
                                              "method topk, sgc or dgc with hierarchy=allgather")
    if c.index_coding is not None and c.index_coding not in ("fixed", "elias_fano"):
        bad("compression.index_coding", c.index_coding, "use elias_fano (default) or fixed")
    if c.index_coding == "elias_fano" and not sparse and not fc_sparse:
        bad("compression.index_coding", c.index_coding, "codes the indices of top-k payloads: needs "
                                                        "method topk, sgc or dgc (or index_coding=fixed, "
                                                        "or leave it out)")
    if c.index_coding is None and (sparse or fc_sparse):  # the default, written out (the run's config.json)
        from hgsgc.compression import DEFAULT_INDEX_CODING

        c.index_coding = DEFAULT_INDEX_CODING
    if c.dense_vectors and not sparse:
        bad("compression.dense_vectors", c.dense_vectors,
            "dense averaging of rank < 2 tensors is part of the sparse methods: use method topk, sgc or dgc, "
            "or remove it")
    if c.warmup_steps and not sparse:
        bad("compression.warmup_steps", c.warmup_steps,
            "warm-up of sparsity needs method topk, sgc or dgc")
    if c.warmup_steps and cfg.layout != "data_parallel":
        bad("compression.warmup_steps", c.warmup_steps,
            f"warm-up of sparsity is run by the data-parallel runner only (layout is {cfg.layout}): "
            "remove it or set layout=data_parallel")
    for key, v in (("train.warmup_steps", t.warmup_steps), ("compression.warmup_steps", c.warmup_steps), ("train.threads", t.threads),
                   ("train.max_steps_per_epoch", t.max_steps_per_epoch),
                   ("data.train_limit", cfg.data.train_limit), ("data.test_limit", cfg.data.test_limit)):
        if v < 0:
            bad(key, v, "must be >= 0")
    if cfg.model.name not in MODELS:
        bad("model.name", cfg.model.name, f"use one of {', '.join(MODELS)}")
    if cfg.layout not in LAYOUTS:
        bad("layout", cfg.layout, f"use one of {', '.join(LAYOUTS)}")
    k = cfg.checkpoint
    for key, v in (("checkpoint.every_steps", k.every_steps), ("checkpoint.every_minutes", k.every_minutes)):
        if not (math.isfinite(v) and v >= 0):
            bad(key, v, "must be >= 0 (0 = off)")
    if k.keep < 1:
        bad("checkpoint.keep", k.keep, "must be >= 1 (complete checkpoints kept)")
    if not k.resume:
        bad("checkpoint.resume", k.resume, "use auto, never or a checkpoint folder")
    if k.resume in ("False", "True"):  # YAML reads an unquoted no / off / yes / on as a boolean
        bad("checkpoint.resume", k.resume, "YAML reads an unquoted no, off, yes or on as a boolean: use "
                                           "auto or never (or a checkpoint folder, quoted or as ./NAME)")
    if t.threads > MAX_THREADS:  # 100000 aborted inside TensorFlow with a C stack trace
        bad("train.threads", t.threads, f"must be <= {MAX_THREADS} TensorFlow threads per rank (0 = the "
                                        f"host's cores / its ranks)")
    rid = cfg.run.id
    if rid is not None and (not str(rid).strip() or "/" in str(rid) or os.sep in str(rid)
                            or str(rid) in (".", "..")):
        bad("run.id", rid, "is the run's folder name under run.out_dir, not a path: put the location in "
                           "run.out_dir (a run.id with '/' or '..' wrote outside it)")
    if cfg.faults.nonfinite == "False":  # YAML reads an unquoted off as false
        cfg.faults.nonfinite = "off"
    if cfg.faults.nonfinite not in ("skip", "raise", "off"):
        bad("faults.nonfinite", cfg.faults.nonfinite, "use skip (skip the step on every rank), raise "
                                                      "or off (no check, no extra allreduce)")
    if not (math.isfinite(cfg.faults.stall_timeout_s) and cfg.faults.stall_timeout_s >= 0):
        bad("faults.stall_timeout_s", cfg.faults.stall_timeout_s, "must be >= 0 seconds (0 = off)")
    if c.warmup_steps and c.delay > 1 and c.warmup_steps // 4 < c.delay:
        bad("compression.warmup_steps", c.warmup_steps,
            f"with delay={c.delay} each of the 4 warm-up stages lasts warmup_steps // 4 = "
            f"{c.warmup_steps // 4} steps, fewer than one synchronization every {c.delay} steps, "
            f"so some densities would never reach an exchange: use warmup_steps >= {4 * c.delay}")
    _check_task(cfg, bad)
    h = cfg.hourglass
    _check_unused(cfg, bad)
    if not (h.fc_workers == "auto" or (isinstance(h.fc_workers, int) and not isinstance(h.fc_workers, bool)
                                       and h.fc_workers >= 1)):
        bad("hourglass.fc_workers", h.fc_workers, "use auto or an integer >= 1")
    if h.fc_method not in ("none", "fp16", "topk", "sgc"):
        bad("hourglass.fc_method", h.fc_method, "use none, fp16, topk or sgc")
    if not 1 <= h.micro_batches <= t.batch_size:
        bad("hourglass.micro_batches", h.micro_batches,
            f"must be an integer in 1..train.batch_size ({t.batch_size}), e.g. 4")
    if h.wire_dtype not in ("float32", "float16"):
        bad("hourglass.wire_dtype", h.wire_dtype, "use float32 (exact) or float16 (half the bytes)")
    if h.link_bandwidth_mbps is not None and not (h.link_bandwidth_mbps > 0 and math.isfinite(h.link_bandwidth_mbps)):
        bad("hourglass.link_bandwidth_mbps", h.link_bandwidth_mbps,
            "must be a finite number > 0 (Mbit/s), or null to probe the link at start-up")
    from hgsgc.hourglass.boundary import BoundaryCodec, BoundaryCodecError, check_pair

    for key in ("act_codec", "grad_codec"):
        v = getattr(h, key)
        if v is None:
            continue
        try:
            BoundaryCodec.parse(v)
        except BoundaryCodecError:
            bad(f"hourglass.{key}", v, "use fp32, fp16, q8 or q4, optionally prefixed with sparse+ "
                                      "(e.g. sparse+q8)")
        if h.wire_dtype != "float32":
            bad("hourglass.wire_dtype", h.wire_dtype, f"set either wire_dtype or hourglass.{key}, "
                                                      f"not both (fp16 is the codec fp16)")
    if h.grad_codec is not None:
        try:
            check_pair(h.act_codec or "fp32", h.grad_codec)
        except BoundaryCodecError as exc:
            raise ConfigError(str(exc)) from None
    if isinstance(h.fc_delay, bool) or not isinstance(h.fc_delay, int) or not 1 <= h.fc_delay <= MAX_DELAY:
        bad("hourglass.fc_delay", h.fc_delay, f"must be an integer in 1..{MAX_DELAY}")
    if h.fc_delay != 1 and h.fc_method != "sgc":
        bad("hourglass.fc_delay", h.fc_delay, f"communication delay among FC ranks needs "
                                              f"hourglass.fc_method=sgc (it is {h.fc_method})")


def _check_task(cfg: Config, bad) -> None:
    """Data format, model and layout fit together; the task's own keys are in range."""
    d, m, t = cfg.data, cfg.model, cfg.train
    if d.format not in FORMATS:
        bad("data.format", d.format, f"use one of {', '.join(FORMATS)}")
    task = TASK_OF_FORMAT[d.format]
    if TASK_OF[m.name] != task:
        fits = ", ".join(n for n in MODELS if TASK_OF[n] == task)
        bad("model.name", m.name, f"data.format={d.format} needs a {task} model: use one of {fits}")
    if cfg.layout == "hourglass" and BOUNDARY[m.name] is None:
        raise ConfigError(f"layout=hourglass needs a model with a conv/FC boundary; model {m.name} "
                          f"has none ({WHY_NO_BOUNDARY[m.name]}): use layout=data_parallel")
    if t.lr_schedule not in ("constant", "step", "cosine"):
        bad("train.lr_schedule", t.lr_schedule, "use constant, step or cosine")
    if t.lr_schedule != "step" and t.lr_decay_epochs:
        bad("train.lr_decay_epochs", t.lr_decay_epochs, "it applies to train.lr_schedule=step only")
    if not 0 < t.lr_decay <= 1:
        bad("train.lr_decay", t.lr_decay, "must be in (0, 1], e.g. 0.1")
    for key, v in (("train.base_batch_size", t.base_batch_size), ("train.weight_decay", t.weight_decay),
                   ("train.clip_norm", t.clip_norm), ("train.eval_batch_size", t.eval_batch_size),
                   ("train.log_every_steps", t.log_every_steps), ("data.image_size", d.image_size),
                   ("data.num_classes", d.num_classes), ("model.units", m.units)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            bad(key, v, "must be a finite number >= 0")
    if not t.progress_interval_s > 0:
        bad("train.progress_interval_s", t.progress_interval_s, "must be > 0 (seconds)")
    if d.bptt < 1 or d.vocab_size < 3 or d.n_mels < 1:
        bad("data.bptt/vocab_size/n_mels", (d.bptt, d.vocab_size, d.n_mels), "must be >= 1 (vocab_size >= 3)")
    if not (m.width > 0 and math.isfinite(m.width)):
        bad("model.width", m.width, "must be a finite number > 0, e.g. 0.25")
    if not m.dropout < 1:
        bad("model.dropout", m.dropout, "must be < 1 (a probability; < 0 = the model's setting)")
    if any(e < 1 for e in t.lr_decay_epochs):
        bad("train.lr_decay_epochs", list(t.lr_decay_epochs), "epochs are 1-based: each must be >= 1")


def _fc_sparse(cfg: Config) -> bool:
    """A Hourglass layout whose FC ranks exchange top-k payloads (they use density/bits/hierarchy)."""
    return cfg.layout in ("hourglass", "auto") and cfg.hourglass.fc_method in SPARSE_METHODS


#: ``hourglass.*`` settings that only the Hourglass layout uses: refused under ``layout:
#: data_parallel`` (:func:`_check_unused`); ``layout: auto`` resets them when it chooses data
#: parallelism (:func:`hgsgc.hourglass.auto.chosen_config`).
HOURGLASS_ONLY_KEYS = ("wire_dtype", "micro_batches", "act_codec", "grad_codec", "fc_delay")


def _check_unused(cfg: Config, bad) -> None:
    """Settings given for a method or layout that does not use them are errors, not no-ops."""
    c, h = cfg.compression, cfg.hourglass
    dc, dh = CompressionConfig(), HourglassConfig()
    if c.powersgd_rank != dc.powersgd_rank and c.method != "powersgd":
        bad("compression.powersgd_rank", c.powersgd_rank, f"it applies to method=powersgd only "
                                                          f"(method is {c.method}): remove it")
    if c.terngrad_clip_sigma != dc.terngrad_clip_sigma and c.method != "terngrad":
        bad("compression.terngrad_clip_sigma", c.terngrad_clip_sigma,
            f"it applies to method=terngrad only (method is {c.method}): remove it")
    if c.bits is not None and c.method not in SPARSE_METHODS and not _fc_sparse(cfg):
        bad("compression.bits", c.bits, f"method {c.method} has no value bits (they apply to "
                                        "topk, sgc and dgc): remove it")
    if cfg.layout not in ("hourglass", "auto"):
        for key in HOURGLASS_ONLY_KEYS:
            if getattr(h, key) != getattr(dh, key):
                bad(f"hourglass.{key}", getattr(h, key), "it applies to layout=hourglass only: "
                                                          "remove it or set layout=hourglass")


def resolved_bits(c: CompressionConfig, method: Optional[str] = None) -> int:
    """``compression.bits``, or the method's default: 2 for sgc, 32 (fp32) for topk and dgc."""
    if c.bits is not None:
        return c.bits
    return 2 if (method or c.method) == "sgc" else 32


def resolved_index_coding(c: CompressionConfig) -> str:
    """``compression.index_coding``, or the default of the sparse methods (topk, sgc, dgc and the
    Hourglass FC topk / sgc): ``hgsgc.compression.DEFAULT_INDEX_CODING`` (``"elias_fano"``)."""
    from hgsgc.compression import DEFAULT_INDEX_CODING

    return c.index_coding or DEFAULT_INDEX_CODING


def recorded_index_coding(recorded) -> str:
    """The index coding a RECORDED run used, from its compression settings dict (a bench cell's or a
    summary.json's ``compression``, a step profile's): its ``index_coding``; ``"fixed"`` when the
    dict has none (or there is no dict): runs recorded before session 9 had no such setting and
    ran fixed-width indices, the default until session 10 (every run since records it). Tools
    that rebuild a committed cell's setting from its config (scripts/cluster/burst_adjust.py,
    perfmodel_validation.py) must use this, not today's default."""
    coding = recorded.get("index_coding") if isinstance(recorded, dict) else None
    return coding or "fixed"


def compression_from_config(c: CompressionConfig, method: Optional[str] = None, **overrides):
    """The ``hgsgc.Compression`` value a :class:`CompressionConfig` describes.

    One conversion for every method (the registry of :mod:`hgsgc.compression.base`) and both
    sides of the Hourglass layout. ``method`` overrides ``c.method``; ``overrides`` (``delay``,
    ``hierarchy``) are passed to the method's builder.
    """
    return _methods.METHODS[method or c.method].from_config(c, **overrides)


def fc_compression_from_config(cfg: Config):
    """Compression among Hourglass FC ranks: ``hourglass.fc_method`` (none | fp16 | topk | sgc).

    ``topk`` / ``sgc`` take density, bits, selector, error feedback and hierarchy from the
    ``compression`` section through :func:`compression_from_config` (as the data-parallel and
    CONV sides do); ``sgc`` takes its delay from ``hourglass.fc_delay`` (default 1), without DGC momentum
    correction or local clipping (those belong to the CONV side's optimizer).
    """
    m = cfg.hourglass.fc_method
    # Drop the CONV side's momentum correction, masking and local clipping before building: built
    # with them, SparseCompression rejects the FC side's own combination (masking off without
    # momentum correction when fc_method is not dgc; momentum correction or clipping with fc_delay > 1).
    c = dataclasses.replace(cfg.compression, momentum_correction=False, momentum_masking=True,
                            local_clip_norm=0.0)
    # sgc: communication delay hourglass.fc_delay (local steps + compressed delta, as on CONV ranks)
    return compression_from_config(c, m, delay=cfg.hourglass.fc_delay if m == "sgc" else 1)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
