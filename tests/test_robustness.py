"""Robustness: combinations of settings that must load, convert and fail (or not) with one clear line."""
import os
import re

import pytest

from conftest import ROOT
from hgsgc.config import compression_from_config, fc_compression_from_config, load_config

SGC = os.path.join(ROOT, "configs", "fashion_mnist_sgc.yaml")


@pytest.mark.parametrize("overrides", [
    # CONV side with momentum correction (dgc / momentum_correction) and masking off, FC side sparse
    ["compression.method=dgc", "compression.momentum_masking=false", "hourglass.fc_method=topk"],
    ["compression.method=dgc", "compression.momentum_masking=false", "hourglass.fc_method=sgc"],
    ["compression.method=topk", "compression.momentum_correction=true", "compression.momentum_masking=false",
     "hourglass.fc_method=sgc"],
    # CONV side's delay-1-only settings with a communication delay among FC ranks
    ["compression.method=topk", "compression.momentum_correction=true", "hourglass.fc_method=sgc",
     "hourglass.fc_delay=2"],
    ["compression.method=topk", "compression.local_clip_norm=5", "hourglass.fc_method=sgc",
     "hourglass.fc_delay=2"],
    ["compression.method=dgc", "compression.momentum_masking=false", "compression.local_clip_norm=5",
     "hourglass.fc_method=sgc", "hourglass.fc_delay=3"],
])
@pytest.mark.parametrize("layout", ["hourglass", "auto"])
def test_fc_side_drops_conv_momentum_settings(overrides, layout):
    """A config that loads builds both sides: the FC ranks run without momentum correction,
    masking or local clipping (fc_compression_from_config's contract), whatever the CONV side uses."""
    cfg = load_config(SGC, ["compression.delay=1", f"layout={layout}"] + overrides)
    conv = compression_from_config(cfg.compression)
    fc = fc_compression_from_config(cfg)
    assert (fc.method, fc.momentum_correction, fc.momentum_masking, fc.local_clip_norm) == \
        (cfg.hourglass.fc_method, False, True, None)
    assert fc.delay == (cfg.hourglass.fc_delay if fc.method == "sgc" else 1)
    assert (fc.density, fc.hierarchy, fc.error_feedback) == (conv.density, conv.hierarchy, conv.error_feedback)


def _identity(comp):
    return {"world_size": 2, "layout": "data_parallel", "model": "tiny", "parameters": {"w:0": [3]},
            "compression": comp.to_dict()}


@pytest.mark.parametrize("added", [("momentum_masking",), ("momentum_masking", "dense_vectors")])
def test_checkpoint_from_before_a_new_setting_resumes(tmp_path, added):
    """A checkpoint written before a compression setting existed (its identity lacks the key) ran
    with the setting's default: the same run resumes from it; a run that changes the setting is
    still refused, naming it."""
    import numpy as np

    from hgsgc import checkpoint as ckpt
    from hgsgc.compression import Compression

    comp = Compression.dgc(0.01)
    old = _identity(comp)
    for k in added:
        del old["compression"][k]
    d = str(tmp_path)
    ckpt.save(d, 5, {"w": np.zeros(3)}, old)
    assert ckpt.resolve(d, "auto", _identity(comp))[0] == ckpt.step_dir(d, 5)
    import dataclasses

    changed = dataclasses.replace(comp, momentum_masking=False)
    with pytest.raises(ckpt.CheckpointMismatch, match=r"momentum_masking\": true.*momentum_masking\": false"):
        ckpt.resolve(d, "auto", _identity(changed))
    with pytest.raises(ckpt.CheckpointMismatch, match="compression"):
        ckpt.resolve(d, "auto", _identity(Compression.topk(0.01)))


def _hgsgc(*args, timeout=300):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "hgsgc.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["--reps", "0"], "--reps must be >= 1"),
    (["--reps", "-2"], "--reps must be >= 1"),
    (["--compute-ms", "-5"], "--compute-ms must be a number > 0"),
    (["--compute-ms", "0"], "--compute-ms must be a number > 0"),
    (["--compute-ms", "nan"], "--compute-ms must be a number > 0"),
    (["--compute-ms", "inf"], "--compute-ms must be a number > 0"),
])
def test_plan_bad_measurement_arguments_are_one_line(args, needle):
    """--reps 0 ended in an IndexError traceback after the measurements; a negative, zero or NaN
    --compute-ms printed a plan with 'compute -5.0 ms/step'. One line, exit 2, before measuring."""
    r = _hgsgc("plan", "configs/fashion_mnist_sgc.yaml", "model.name=tiny", "--nodes", "4",
               "--bandwidth", "1gbit", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]


@pytest.mark.parametrize("content,needle", [
    ('{"topk": "abc"}', "'topk': 'abc'"),
    ('{"sgc_d1": -5}', "'sgc_d1': -5"),
    ('{"sgc_d1": true}', "'sgc_d1': True"),
    ('{"sgc_d1": [1]}', "'sgc_d1': [1]"),
    ('{bad', "is not JSON"),
])
def test_plan_bad_steps_to_target_is_one_line(tmp_path, content, needle):
    """A steps value that is not a number >= 0 or null ended in a TypeError traceback after the
    measurements; the message names the file, the entry and the form expected."""
    f = tmp_path / "steps.json"
    f.write_text(content)
    r = _hgsgc("plan", "configs/fashion_mnist_sgc.yaml", "model.name=tiny", "--nodes", "4",
               "--bandwidth", "1gbit", "--steps-to-target", str(f))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and str(f) in lines[0], r.stderr[-2000:]


def test_plan_json_into_a_missing_folder_is_one_line(tmp_path):
    """--json into a folder that does not exist ended in a FileNotFoundError traceback after the
    whole measurement; now one line before measuring."""
    out = tmp_path / "missing" / "plan.json"
    r = _hgsgc("plan", "configs/fashion_mnist_sgc.yaml", "model.name=tiny", "--nodes", "4",
               "--bandwidth", "1gbit", "--json", str(out))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--json" in lines[0] and str(out.parent) in lines[0], r.stderr[-2000:]


def test_dgc_factory_takes_momentum_masking():
    """compression.momentum_masking applies to dgc in a config (docs/api.md); the Python factory
    Compression.dgc took no such argument (TypeError), unlike Compression.topk / sgc."""
    from hgsgc.compression import Compression

    assert Compression.dgc(0.01).momentum_masking is True
    c = Compression.dgc(0.01, momentum_masking=False)
    assert (c.method, c.momentum_correction, c.momentum_masking) == ("dgc", True, False)
    cfg = load_config(SGC, ["compression.delay=1", "compression.method=dgc", "compression.density=0.01",
                            "compression.momentum_masking=false"])
    assert compression_from_config(cfg.compression) == c


@pytest.mark.parametrize("text,needle", [
    ("train:\n  epochs: [\n", "did not find expected node content"),      # YAML syntax error
    ("train:\n  epochs: 2\ntrain:\n  epochs: 3\n", "found duplicate key train"),
    ("train:\n  epochs: ${oops}\n", "config key 'train.epochs': Interpolation key 'oops' not found"),
])
def test_yaml_errors_are_one_config_error_line(tmp_path, text, needle):
    """YAML errors came out over 3-4 lines; an unresolved ${...} interpolation escaped
    load_config as an omegaconf InterpolationKeyError (a traceback in hgsgc plan)."""
    from hgsgc.config import ConfigError

    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(str(f))
    msg = str(ei.value)
    assert needle in msg and "\n" not in msg, msg
    for cmd in (["train", str(f)], ["plan", str(f), "--nodes", "2", "--bandwidth", "1gbit"]):
        r = _hgsgc(*cmd)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr[-2000:]


@pytest.mark.mpi
@pytest.mark.parametrize("np_,override,needle", [
    # a different learning rate trained diverging replicas without a word (rank 0 reported its own)
    (2, "train.lr=0.5", "train.lr: 0.05 on rank 0, 0.5 on rank 1"),
    # a different density ended in a TensorFlow graph error (a Reshape of the payloads) on every rank
    (3, "compression.density=0.02", "compression.density: 0.005 on ranks 0,2, 0.02 on rank 1"),
    # the index coding: the default (elias_fano, written out) on two ranks, fixed on one
    (3, "compression.index_coding=fixed", 'compression.index_coding: "elias_fano" on ranks 0,2, "fixed" on rank 1'),
])
def test_config_that_differs_between_ranks_is_one_config_error(np_, override, needle, tmp_path):
    from conftest import mpirun

    p = mpirun(np_, ["tests/mpi/config_differs_one_rank.py", override], timeout=180,
               env={"OUT_DIR": str(tmp_path)})  # a hang hits the timeout
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hgsgc: ")]
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("hgsgc: config error: ") and needle in lines[0], p.stderr[-3000:]
    assert not os.listdir(tmp_path)  # stopped before training: no run directory


def test_config_agreement_ignores_node_local_keys():
    from hgsgc.cli import _config_disagreement, _comparable_config

    a = load_config(SGC)
    b = load_config(SGC, ["data.path=/elsewhere", "train.threads=3", "train.progress=false"])
    assert _config_disagreement([_comparable_config(a), _comparable_config(b)]) is None
    c = load_config(SGC, ["train.lr_decay_epochs=[2]", "train.lr_schedule=step"])
    msg = _config_disagreement([_comparable_config(a), _comparable_config(c), _comparable_config(c)])
    assert "train.lr_decay_epochs: [] on rank 0, [2] on ranks 1,2" in msg and "train.lr_schedule" in msg


def _fake_run(d, task_metrics, epochs):
    import json

    d.mkdir()
    base = {"run_id": d.name, "world_size": 2, "layout": "data_parallel", "compression": {"method": "sgc"},
            "mean_step_time_s": 0.01, "bytes_sent_per_step_per_rank": 1e3, "dense_bytes_per_step_per_rank": 2e5,
            "compression_ratio": 200.0, "wall_time_s": 3.0, "final_train_loss": 2.0}
    base.update({f"final_{k}": v for k, v in epochs[-1].items()})
    (d / "summary.json").write_text(json.dumps(base))
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({"epoch": i + 1, "train_loss": 2.0, "epoch_time_s": 1.0, **e}) + "\n" for i, e in enumerate(epochs)))


def test_report_of_language_model_and_speech_runs(tmp_path):
    """hgsgc report read final_test_accuracy / test_accuracy of every run: a language-model run
    (perplexity; test split only at the end with train.test_every_epoch=false) or a speech run
    (WER) ended in a KeyError traceback."""
    from hgsgc.cli import main

    _fake_run(tmp_path / "lm", None, [{"valid_loss": 5.0, "valid_perplexity": 150.0},
                                      {"valid_loss": 4.9, "valid_perplexity": 140.0, "test_loss": 4.8,
                                       "test_perplexity": 121.5}])
    _fake_run(tmp_path / "asr", None, [{"test_loss": 1.5, "test_wer": 0.85, "test_cer": 0.4}])
    _fake_run(tmp_path / "img", None, [{"test_loss": 0.5, "test_accuracy": 0.875}])
    out = tmp_path / "out"
    out.mkdir()
    assert main(["report", str(tmp_path / "lm"), str(tmp_path / "asr"), str(tmp_path / "img"), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "perplexity 121.5000" in md and "wer 0.8500" in md and "accuracy 0.8750" in md, md
    assert "| 1 | 2.0000 | n/a | n/a | 1.0 |" in md, md  # the LM's first epoch had no test split
    for png in ("accuracy.png", "loss.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_creates_its_out_folder(tmp_path):
    """hgsgc report --out NEW_FOLDER failed with 'No such file or directory: .../accuracy.png'."""
    from hgsgc.cli import main

    _fake_run(tmp_path / "img", None, [{"test_loss": 0.5, "test_accuracy": 0.875}])
    out = tmp_path / "new" / "cmp"
    assert main(["report", str(tmp_path / "img"), "--out", str(out)]) == 0
    assert {"report.md", "accuracy.png", "loss.png"} <= set(os.listdir(out))


@pytest.mark.parametrize("override,needle", [
    ("train.lr=inf", "train.lr=inf is invalid"),
    ("model.width=inf", "model.width=inf is invalid"),
    ("train.lr_decay_epochs=[0]", "train.lr_decay_epochs=[0] is invalid"),
    ("train.lr_decay_epochs=[3,-1]", "train.lr_decay_epochs=[3, -1] is invalid"),
    ("model.dropout=1.5", "model.dropout=1.5 is invalid"),
    ("layout=hourglass hourglass.link_bandwidth_mbps=inf", "hourglass.link_bandwidth_mbps=inf is invalid"),
])
def test_out_of_range_numbers_are_config_errors(override, needle):
    """Accepted before: an infinite learning rate / width / link, 1-based decay epochs <= 0 (read
    as epoch 1), LSTM dropout >= 1 (a Keras error at model build, not naming the key)."""
    from hgsgc.config import ConfigError

    ov = override.split() + (["train.lr_schedule=step"] if "decay" in override else [])
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(SGC, ov)


def test_split_of_a_variable_length_model_is_a_split_error():
    """split_model converted the boundary shape to ints before its None check: the speech model
    (time steps None) ended in a TypeError traceback in hgsgc plan and in layout: auto (which
    runs such a model data-parallel on a SplitError)."""
    from hgsgc import perfmodel as pm
    from hgsgc.hourglass.split import SplitError, split_model
    from hgsgc.models import build_model
    from hgsgc.plan import hourglass_inputs

    model = build_model("ctc_small", seed=0)
    with pytest.raises(SplitError, match="variable"):
        split_model(model)
    # the split layer given explicitly: hgsgc plan reaches split_model and reports its SplitError
    cfg = load_config(os.path.join(ROOT, "configs", "librispeech_ctc", "sgc.yaml"),
                      ["hourglass.split_layer=" + split_layer_after_conv(model)])
    inp, info = hourglass_inputs(cfg, model, 4, pm.link_for("1gbit"), 1e-3, 0.05, 1, {})
    assert inp is None and info["reason"].startswith("no conv/FC boundary") and "variable" in info["reason"]


def split_layer_after_conv(model):
    from hgsgc.hourglass.split import find_boundary

    return find_boundary(model, None)


def test_resume_from_a_path_that_does_not_exist_says_so(tmp_path):
    """checkpoint.resume=<a path that does not exist> said the checkpoint was incomplete (its
    writer stopped half-way), pointing at a crash that never happened."""
    from hgsgc import checkpoint as ckpt

    missing = str(tmp_path / "step-00000007")
    with pytest.raises(ckpt.CheckpointError, match=r"does not exist.*checkpoint\.resume"):
        ckpt.resolve(str(tmp_path), missing, {"world_size": 1})
    os.makedirs(missing)  # a folder without a manifest is still the incomplete case
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.resolve(str(tmp_path), missing, {"world_size": 1})


def test_tape_takes_a_numpy_momentum():
    """DistributedGradientTape(momentum=np.float32(0.9)) was refused: 'momentum must be a number
    in [0, 1), got 0.9' (only Python int/float were numbers); a bool is still refused."""
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import hgsgc

    hvd.init()
    w = tf.Variable(np.ones(8, np.float32))
    for m in (np.float32(0.9), np.float64(0.9), 0.9):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(w * w)
        tape = hgsgc.DistributedGradientTape(t, compression=hgsgc.Compression.dgc(1.0), momentum=m)
        (g,) = tape.gradient(loss, [w])
        assert np.isfinite(g.numpy()).all()
    with pytest.raises(ValueError, match="momentum must be a number"):
        hgsgc.DistributedGradientTape(tf.GradientTape(), compression=hgsgc.Compression.dgc(1.0), momentum=True)


def test_plan_says_why_a_recurrent_model_has_no_hourglass_row():
    """hgsgc plan on the LSTM said 'model 'lstm_small' has 5 inputs and 5 outputs: the Hourglass
    split supports one of each' (the LSTM's state tensors); it now names what the model is, as
    the config check of layout=hourglass does."""
    from hgsgc import perfmodel as pm
    from hgsgc.plan import hourglass_inputs

    for name in ("ptb_lstm/sgc.yaml", "librispeech_ctc/sgc.yaml"):
        cfg = load_config(os.path.join(ROOT, "configs", name))
        inp, info = hourglass_inputs(cfg, None, 4, pm.link_for("1gbit"), 1e-3, 0.05, 1, {})
        assert inp is None and info["reason"].startswith(f"no conv/FC boundary: model {cfg.model.name} has none (a ")


@pytest.mark.parametrize("config,why", [("ptb_lstm/sgc.yaml", "inputs"),
                                        ("librispeech_ctc/sgc.yaml", "variable")])
def test_plan_of_sequence_models_without_compute_ms_is_one_line(config, why):
    """hgsgc plan measures the compute step on a random batch of one fixed-shape input: the LSTM
    (5 inputs) and the speech model (variable length) ended in a TypeError traceback in
    perfmodel._random_batch. Now one line asking for --compute-ms, exit 2."""
    r = _hgsgc("plan", f"configs/{config}", "--nodes", "4", "--bandwidth", "1gbit", "--reps", "1")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert "--compute-ms" in lines[0] and why in lines[0], lines[0]
