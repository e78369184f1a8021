"""``hgsgc bench SPEC.yaml``: the side-by-side benchmark matrix on the emulated cluster.

For every cell (method x bandwidth x host count) of a spec (YAML, see ``configs/bench/``) this
brings up an :class:`hgsgc.cluster.EmulatedCluster` (``scripts/cluster/cluster.sh``, docs/cluster.md) with its own prefix,
runs ``hgsgc train`` across its hosts with one rank per host, reads the run's ``summary.json`` and
the hosts' interface counters, and always tears the cluster down. A failed cell (bad override,
crash, timeout) is recorded with ``status: failed`` and its error; the matrix goes on.
It also measures the compute-only step time of every method: the same model and method in one
plain process (no MPI launch, no communication), the physical limit.

Spec::

    name: fmnist_4h                       # output: docs/benchmarks/<name>.{json,md,*.png}
    hosts: [4]
    bandwidths: [100mbit, 1gbit]          # tc rates
    overrides: [train.epochs=1, train.max_steps_per_epoch=30]   # for every cell
    mpi_args: []                          # extra mpirun options for every cell
    timeout_s: 900                        # per cell
    compute_only: true
    compute_only_shared: false            # also n processes at once, timed steps lined up (n = hosts)
    compute_only_steps: null              # steps of each compute-only run (null: the cell's own)
    dilation: none                        # none | cpu_share | gpu (see dilation_factor)
    cpu_share_reference: null             # cpu_share only: a method whose factor every method gets
    pin: false                            # true: each rank on core (rank % cores), train.threads=1
    methods:
      - name: horovod_dense               # a label
        config: configs/fashion_mnist_dense.yaml
        overrides: []                     # per-method dotted overrides
        mpi_args: []                      # per-method mpirun options
        role: dense                       # dense | baseline | ours | other
      - {name: hourglass_sgc, config: configs/fashion_mnist.yaml, role: ours}

A new method is one more entry in ``methods`` (``compression.method=terngrad`` ...): nothing in
this module knows the method names.

Roles: ``dense`` rows are Horovod dense allreduce variants (the best of them is "Horovod dense"
in the ratios), ``baseline`` rows are the state of the art the issue compares against (the best
of dense + baseline rows is "best baseline"), ``ours`` rows are the project's methods.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from typing import Any, Callable, Dict, List, Optional

from hgsgc import bench_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_TRAIN_IMAGES = 60000

ROLES = ("dense", "baseline", "ours", "other")

# what every cell of the results JSON has (an ok cell has all of CELL_FIELDS + OK_FIELDS)
CELL_FIELDS = ("method", "role", "config", "overrides", "mpi_args", "hosts", "bandwidth", "bandwidth_mbit",
               "prefix", "status", "error", "launch_time_s", "load_before", "load_after")
OK_FIELDS = ("run_id", "world_size", "layout", "compression", "steps", "mean_step_time_s", "time_per_epoch_s",
             "full_epoch_steps", "measured_epoch_time_s", "wall_time_s", "gradient_bytes", "parameters",
             "payload_bytes_per_step_per_rank", "bytes_sent_per_step_per_rank",
             "bytes_received_per_step_per_rank", "dense_bytes_per_step_per_rank", "compression_ratio",
             "final_test_accuracy", "interface", "iface_tx_bytes_per_step_per_rank",
             "iface_rx_bytes_per_step_per_rank", "iface_over_hgsgc", "vs_dense", "vs_best_baseline",
             "vs_compute_only")
COMPUTE_FIELDS = ("method", "status", "error", "mean_step_time_s", "steps", "final_test_accuracy")


class SpecError(ValueError):
    """Invalid bench spec; the message names the key."""


def _emulated():
    from hgsgc import cluster

    return cluster


SPEC_KEYS = ("name", "hosts", "bandwidths", "overrides", "mpi_args", "timeout_s", "compute_only", "compute_only_steps",
             "compute_only_shared", "out_dir", "runs_dir", "methods", "dilation", "gpu_step_ms", "gpu_source", "gpu_reference", "cpu_share_reference", "pin",
             "full_epoch_steps", "time_to_target", "cells_from")
DILATIONS = ("none", "cpu_share", "gpu")
METHOD_KEYS = ("name", "config", "overrides", "mpi_args", "role", "cell_overrides", "curve_run", "cells")
TTT_KEYS = ("metric", "mode", "reference", "rel", "abs", "curve_hosts", "curve_overrides", "curve_mpi_args",
            "curve_timeout_s", "reuse_curves", "eval_time", "budget_epochs")
_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _check_name(what: str, name) -> None:
    if not isinstance(name, str) or not name or not set(name) <= _NAME_OK or name.startswith("."):
        raise SpecError(f"spec: {what} {name!r} must use only letters, digits, '_', '.', '-' "
                        f"(it names files and run directories)")


def load_spec(path_or_dict) -> dict:
    """Read and validate a spec (a YAML path or a dict); fills in defaults.

    Raises:
        SpecError: unreadable YAML, an unknown key, a wrong type or value, a missing config file
            (checked before anything runs); OSError: the spec file cannot be read.
    """
    if isinstance(path_or_dict, dict):
        spec = dict(path_or_dict)
    else:
        import yaml

        with open(path_or_dict) as f:
            try:
                spec = yaml.safe_load(f) or {}
            except yaml.YAMLError as exc:
                raise SpecError(f"{path_or_dict}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(spec, dict):
            raise SpecError(f"{path_or_dict}: a spec is a mapping (name:, hosts:, methods: ...), "
                            f"got a {type(spec).__name__}")
        spec.setdefault("name", os.path.splitext(os.path.basename(path_or_dict))[0])
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise SpecError(f"spec: unknown key(s) {', '.join(unknown)}: valid keys are {', '.join(SPEC_KEYS)}")
    spec.setdefault("hosts", [2])
    spec.setdefault("bandwidths", ["100mbit"])
    spec.setdefault("overrides", [])
    spec.setdefault("mpi_args", [])
    spec.setdefault("timeout_s", 900)
    spec.setdefault("compute_only", True)
    spec.setdefault("compute_only_shared", False)  # also n processes at once (n = host count)
    spec.setdefault("compute_only_steps", None)  # steps per compute-only run (None: the cell's)
    cos = spec["compute_only_steps"]
    if cos is not None and (isinstance(cos, bool) or not isinstance(cos, int) or cos < 2):
        raise SpecError(f"spec: compute_only_steps must be an integer >= 2 (one traced step + timed steps) "
                        f"or null for the cells' own step count, got {cos!r}")
    spec.setdefault("out_dir", os.path.join("docs", "benchmarks"))
    spec.setdefault("runs_dir", os.path.join("runs", "bench"))
    _check_name("name", spec["name"])
    if not spec.get("methods") or not isinstance(spec["methods"], list):
        raise SpecError("spec: 'methods' must list at least one method")
    for key in ("hosts", "bandwidths", "overrides", "mpi_args"):
        if not isinstance(spec[key], list):
            raise SpecError(f"spec: '{key}' must be a list")
    for key in ("overrides", "mpi_args"):
        if not all(isinstance(x, str) for x in spec[key]):
            raise SpecError(f"spec: '{key}' must be a list of strings")
    if not spec["hosts"] or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1
                                    for h in spec["hosts"]):
        raise SpecError(f"spec: 'hosts' must be a list of integers >= 1, got {spec['hosts']!r}")
    for bw in spec["bandwidths"]:
        try:
            _bw_mbit(str(bw))
        except (ValueError, TypeError):
            raise SpecError(f"spec: bandwidth {bw!r} is not a tc rate like 100mbit or 1gbit") from None
    t = spec["timeout_s"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
        raise SpecError(f"spec: 'timeout_s' must be a number of seconds > 0, got {t!r}")
    names = set()
    for i, m in enumerate(spec["methods"]):
        if not isinstance(m, dict) or "name" not in m or "config" not in m:
            raise SpecError(f"spec: methods[{i}] needs 'name' and 'config'")
        unknown = sorted(set(m) - set(METHOD_KEYS))
        if unknown:
            raise SpecError(f"spec: methods[{i}] ({m['name']}): unknown key(s) {', '.join(unknown)}: "
                            f"valid keys are {', '.join(METHOD_KEYS)}")
        _check_name(f"methods[{i}].name", m["name"])
        m.setdefault("overrides", [])
        m.setdefault("mpi_args", [])
        m.setdefault("role", "other")
        m.setdefault("cell_overrides", [])
        for key in ("overrides", "mpi_args", "cell_overrides"):
            if not isinstance(m[key], list) or not all(isinstance(x, str) for x in m[key]):
                raise SpecError(f"spec: methods[{i}] ({m['name']}).{key} must be a list of strings")
        if m["role"] not in ROLES:
            raise SpecError(f"spec: methods[{i}].role must be one of {ROLES}")
        if m["name"] in names:
            raise SpecError(f"spec: duplicate method name {m['name']!r}")
        cr = m.get("curve_run")
        if cr is not None and (not isinstance(cr, str) or not cr):
            raise SpecError(f"spec: methods[{i}] ({m['name']}).curve_run must be a run directory, a results "
                            f"JSON or 'none', got {cr!r}")
        if cr is not None and cr.endswith(".json"):
            _stored_curve(cr, m["name"], lambda msg: SpecError(f"spec: methods[{i}] ({m['name']}).curve_run: {msg}"))
        elif cr not in (None, "none") and not os.path.exists(os.path.join(cr, "metrics.jsonl")):
            raise SpecError(f"spec: methods[{i}] ({m['name']}).curve_run: no metrics.jsonl in {cr} (give a finished "
                            f"run directory of 'hgsgc train', or 'none' for a method without a curve)")
        if not os.path.exists(m["config"]):
            raise SpecError(f"spec: methods[{i}] ({m['name']}): config {m['config']} not found "
                            f"(paths are relative to the directory you run hgsgc bench from)")
        names.add(m["name"])
    if spec.get("cells_from") is not None:
        _check_cells_from(spec)
    fe = spec.setdefault("full_epoch_steps", None)
    if fe is not None and (isinstance(fe, bool) or not isinstance(fe, int) or fe < 1):
        raise SpecError(f"spec: 'full_epoch_steps' must be an integer >= 1 (steps of one full epoch "
                        f"at the cells' global batch), got {fe!r}")
    if spec.get("time_to_target") is not None:
        spec["time_to_target"] = _check_ttt(spec["time_to_target"], names)
    spec.setdefault("dilation", "none")
    spec.setdefault("pin", False)
    if not isinstance(spec["pin"], bool):
        raise SpecError(f"spec: 'pin' must be true or false, got {spec['pin']!r}")
    if spec["dilation"] not in DILATIONS:
        raise SpecError(f"spec: 'dilation' must be one of {', '.join(DILATIONS)}, got {spec['dilation']!r}")
    if spec["dilation"] == "cpu_share" and not (spec["compute_only"] and spec["compute_only_shared"]):
        raise SpecError("spec: dilation: cpu_share needs compute_only and compute_only_shared "
                        "(the CPU share of a cell is its compute-only step alone / with n processes at once)")
    cref = spec.get("cpu_share_reference")
    if cref is not None:
        if spec["dilation"] != "cpu_share":
            raise SpecError(f"spec: cpu_share_reference needs dilation: cpu_share (got dilation: "
                            f"{spec['dilation']}); remove it or set dilation: cpu_share")
        listed = lambda key: spec[key] is True or (isinstance(spec[key], list) and cref in spec[key])
        if not isinstance(cref, str) or cref not in names or not listed("compute_only") \
                or not listed("compute_only_shared"):
            raise SpecError(f"spec: cpu_share_reference must name a method that is in compute_only and "
                            f"compute_only_shared (its factor is every method's), got {cref!r}")
    if spec["dilation"] == "gpu":
        g = spec.get("gpu_step_ms")
        if not isinstance(g, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in g.values()) \
                or not spec.get("gpu_source") or not spec["compute_only"]:
            raise SpecError("spec: dilation: gpu needs compute_only, gpu_step_ms: {method: ms > 0} "
                            "(a GPU's step for the same model and batch) and gpu_source: where that figure comes from")
        ref = spec.get("gpu_reference")
        if ref is not None and (ref not in g or ref not in names
                                or (isinstance(spec["compute_only"], list) and ref not in spec["compute_only"])):
            raise SpecError(f"spec: gpu_reference must name a method of gpu_step_ms that is in compute_only (its "
                            f"factor is every method's), got {ref!r}")
    for key in ("compute_only", "compute_only_shared"):
        v = spec[key]
        if isinstance(v, list):
            missing = [x for x in v if x not in names]
            if missing:
                raise SpecError(f"spec: '{key}' names unknown method(s) {', '.join(map(str, missing))}")
        elif not isinstance(v, bool):
            raise SpecError(f"spec: '{key}' must be true, false or a list of method names")
    return spec


def _check_cells_from(spec: dict) -> None:
    """Validate ``cells_from`` (a committed results JSON whose cells are read instead of run) and
    each method's ``cells`` (the names of its cells in that file; default: the method's name).

    Raises:
        SpecError: naming the file, the cell and the fix, when the file is missing or not JSON,
            a named cell is not in it, is not there on one of the spec's (hosts, bandwidth), failed
            there, or ran another config file than the method's (a results JSON of another spec).
    """
    cf = spec["cells_from"]
    if not isinstance(cf, str) or not cf.endswith(".json"):
        raise SpecError(f"spec: 'cells_from' must be a results JSON of hgsgc bench (docs/benchmarks/NAME.json), "
                        f"got {cf!r}")
    if not os.path.exists(cf):
        raise SpecError(f"spec: cells_from: {cf} not found (paths are relative to the directory you run "
                        f"hgsgc bench from)")
    if spec["compute_only"] or spec.get("compute_only_shared") or spec.get("dilation", "none") != "none":
        raise SpecError("spec: cells_from reads the cells, it runs none: set compute_only: false (and no "
                        "compute_only_shared, no dilation)")
    with open(cf) as f:
        try:
            stored = json.load(f)
        except ValueError as exc:
            raise SpecError(f"spec: cells_from: {cf} is not JSON ({exc})") from None
    have = [c.get("method") for c in (stored.get("cells") or []) if isinstance(c, dict)] \
        if isinstance(stored, dict) else []
    for i, m in enumerate(spec["methods"]):
        names = m.setdefault("cells", [m["name"]])
        if not isinstance(names, list) or not names or not all(isinstance(x, str) for x in names):
            raise SpecError(f"spec: methods[{i}] ({m['name']}).cells must be a non-empty list of cell (method) "
                            f"names of {cf}, got {names!r}")
        missing = [x for x in names if x not in have]
        if missing:
            raise SpecError(f"spec: methods[{i}] ({m['name']}).cells: {', '.join(missing)} not in {cf} (its "
                            f"cells: {', '.join(dict.fromkeys(map(str, have))) or 'none'})")
        # every named cell on each of the spec's (hosts, bandwidth), measured, of the method's config
        for name in names:
            mine = [c for c in stored["cells"] if isinstance(c, dict) and c.get("method") == name]
            for h in spec["hosts"]:
                for bw in spec["bandwidths"]:
                    at = [c for c in mine if c.get("hosts") == h and str(c.get("bandwidth")) == str(bw)]
                    if not at:
                        on = ", ".join(f"{c.get('hosts')} hosts at {c.get('bandwidth')}" for c in mine)
                        raise SpecError(f"spec: methods[{i}] ({m['name']}).cells: no cell {name} on {h} hosts at "
                                        f"{bw} in {cf} (it has {name} on: {on}): set the spec's hosts / "
                                        f"bandwidths to those of the file, or read another file")
                    for c in at:
                        if c.get("status") != "ok":
                            raise SpecError(f"spec: methods[{i}] ({m['name']}).cells: cell {name} on {h} hosts at "
                                            f"{bw} in {cf} failed ({c.get('error') or c.get('status')}): its "
                                            f"times are not measured; rerun it or name another cell")
                        if c.get("config") is not None and c["config"] != m["config"]:
                            raise SpecError(f"spec: methods[{i}] ({m['name']}).cells: cell {name} in {cf} ran "
                                            f"{c['config']}, not {m['config']} (a results JSON of another spec?): "
                                            f"give the method the cell's config or read the right file")


def cells_from(spec: dict) -> List[dict]:
    """The cells of ``spec['cells_from']`` (a committed results JSON), one per (method, name in its
    ``cells``, host count, bandwidth of the spec) in the spec's order (cells of other host counts
    or bandwidths in the file are not read; :func:`load_spec` refuses a missing or failed cell
    and one that ran another config file): a copy of the stored cell with
    ``method`` and ``role`` set to the spec's method, ``cell_name`` the stored cell's method name and
    ``cells_from`` the file. Nothing runs; the stored step and evaluation times are used as
    measured (with their own ``load_before``)."""
    with open(spec["cells_from"]) as f:
        stored = json.load(f)
    out = []
    for m in spec["methods"]:
        for name in m.get("cells") or [m["name"]]:
            for c in stored["cells"]:
                if c.get("method") == name and c.get("hosts") in spec["hosts"] \
                        and str(c.get("bandwidth")) in map(str, spec["bandwidths"]):
                    out.append(dict(c, method=m["name"], role=m["role"], cell_name=name,
                                    cells_from=spec["cells_from"]))
    return out


def _check_ttt(t, names) -> dict:
    """Validate and fill in the ``time_to_target`` section of a spec (see :func:`time_to_target`)."""
    if not isinstance(t, dict):
        raise SpecError("spec: 'time_to_target' must be a mapping (metric:, mode:, reference:, rel: ...)")
    t = dict(t)
    unknown = sorted(set(t) - set(TTT_KEYS))
    if unknown:
        raise SpecError(f"spec: time_to_target: unknown key(s) {', '.join(unknown)}: valid keys are "
                        f"{', '.join(TTT_KEYS)}")
    t.setdefault("metric", "valid_perplexity")
    t.setdefault("mode", "min")
    if t["mode"] not in ("min", "max"):
        raise SpecError(f"spec: time_to_target.mode must be 'min' (perplexity, loss: lower is better) or "
                        f"'max' (accuracy), got {t['mode']!r}")
    if t.get("reference") not in names:
        raise SpecError(f"spec: time_to_target.reference must name one of the methods (the dense run whose "
                        f"final {t['metric']} defines the target), got {t.get('reference')!r}")
    if t["mode"] == "min":
        t.setdefault("rel", 0.03)
        if t.get("abs") is not None or isinstance(t["rel"], bool) or not isinstance(t["rel"], (int, float)) \
                or t["rel"] < 0:
            raise SpecError("spec: time_to_target with mode: min takes rel: a fraction >= 0 (target = "
                            "reference's final value x (1 + rel)), not abs")
    else:
        t.setdefault("abs", 0.005)
        if t.get("rel") is not None or isinstance(t["abs"], bool) or not isinstance(t["abs"], (int, float)) \
                or t["abs"] < 0:
            raise SpecError("spec: time_to_target with mode: max takes abs: >= 0 (target = reference's "
                            "final value - abs), not rel")
    t.setdefault("curve_hosts", 4)
    h = t["curve_hosts"]
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
        raise SpecError(f"spec: time_to_target.curve_hosts must be an integer >= 1 (ranks of the loopback "
                        f"curve runs), got {h!r}")
    for key in ("curve_overrides", "curve_mpi_args"):
        t.setdefault(key, [])
        if not isinstance(t[key], list) or not all(isinstance(x, str) for x in t[key]):
            raise SpecError(f"spec: time_to_target.{key} must be a list of strings")
    t.setdefault("curve_timeout_s", 7200)
    ct = t["curve_timeout_s"]
    if isinstance(ct, bool) or not isinstance(ct, (int, float)) or ct <= 0:
        raise SpecError(f"spec: time_to_target.curve_timeout_s must be seconds > 0, got {ct!r}")
    t.setdefault("budget_epochs", None)
    be = t["budget_epochs"]
    if be is not None and (isinstance(be, bool) or not isinstance(be, int) or be < 1):
        raise SpecError(f"spec: time_to_target.budget_epochs must be an integer >= 1 (the first N epochs "
                        f"of every curve count), got {be!r}")
    t.setdefault("eval_time", "group_median")
    if t["eval_time"] not in ("cell", "group_median"):
        raise SpecError(f"spec: time_to_target.eval_time must be 'cell' (each cell's own evaluation time) or "
                        f"'group_median' (the median of the cell group's), got {t['eval_time']!r}")
    t.setdefault("reuse_curves", False)
    if not isinstance(t["reuse_curves"], bool):
        raise SpecError("spec: time_to_target.reuse_curves must be true or false")
    return t


def _bw_mbit(bw: str) -> float:
    """'100mbit' -> 100.0, '1gbit' -> 1000.0, '500kbit' -> 0.5 (tc rate units, bits)."""
    s = str(bw).lower().strip()
    for unit, f in (("gbit", 1e3), ("mbit", 1.0), ("kbit", 1e-3), ("bit", 1e-6)):
        if s.endswith(unit):
            return float(s[: -len(unit)]) * f
    return float(s) * 1e-6


def _read_run(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    cfg = {}
    if os.path.exists(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as f:
            cfg = json.load(f)
    epochs = []
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            # per-epoch records only (step lines, "kind": "step", every log_every_steps, dropped)
            epochs = [r for r in (json.loads(ln) for ln in f if ln.strip()) if r.get("kind") != "step"]
    return {"summary": summary, "config": cfg, "epochs": epochs}


def _full_epoch_steps(summary: dict, cfg: dict, given: Optional[int] = None) -> int:
    """Steps of one full epoch (all training images) for this run's global batch; ``given`` (the
    spec's ``full_epoch_steps``, e.g. for a language model whose epoch is counted in tokens) wins."""
    if given:
        return int(given)
    images = (cfg.get("data") or {}).get("train_limit") or FULL_TRAIN_IMAGES
    gb = summary.get("global_batch_size") or summary["batch_size_per_rank"] * summary["world_size"]
    return max(1, images // gb)


def _final_only_eval_s(cfg: dict, epochs: List[dict]) -> Optional[float]:
    """Seconds of the evaluation done once, after the last epoch only: the test split of a language
    model with ``train.test_every_epoch: false`` (rank 0's timer, ``eval_test_time_s``); None
    when every epoch evaluates the same splits (or the run did not time its splits)."""
    if not epochs or (cfg.get("train") or {}).get("test_every_epoch", True):
        return None
    return epochs[-1].get("eval_test_time_s")


def _eval_time(summary: dict, cfg: dict, epochs: List[dict]) -> Optional[float]:
    """One epoch's evaluation: the training wall time minus the epochs' step loops, per epoch (with
    checkpoint.at_end=false the rest of the loop is negligible), less the evaluation done only
    after the last epoch (:func:`_final_only_eval_s`: not a per-epoch cost, and not needed to see
    the validation target reached)."""
    if not epochs:
        return None
    rest = summary["wall_time_s"] - sum(e.get("epoch_time_s") or 0.0 for e in epochs)
    return (rest - (_final_only_eval_s(cfg, epochs) or 0.0)) / len(epochs)


def auto_probe_columns(summary: dict, tx_bytes: List[float], steps: int) -> dict:
    """``layout: auto``'s start-up probes (link + boundary message) cross the same interfaces as
    training, so a cell's interface bytes per step include them: their bytes apart, and the
    interface figure without them beside the raw one (session 12).

    Args:
        summary: the run's ``summary.json``; ``layout_choice.startup.probe_bytes``
            (:func:`hgsgc.hourglass.auto.probe_bytes`, MPI payload bytes per rank) is used when
            present. tx_bytes: bytes each host's interface sent during the launch; steps: >= 1.

    Returns:
        ``{}`` without probe bytes (not an auto run, or before session 12); else
        ``{"auto_probe_bytes_per_rank": [...], "iface_tx_bytes_per_step_per_rank_without_probes":
        (sum(tx) - sum(probe bytes)) / hosts / steps}`` (the probes' TCP/IP headers, about 4.6 %
        of their bytes, stay in).
    """
    pb = ((summary.get("layout_choice") or {}).get("startup") or {}).get("probe_bytes")
    if not pb or not tx_bytes:
        return {}
    return {"auto_probe_bytes_per_rank": list(pb["total_per_rank"]),
            "iface_tx_bytes_per_step_per_rank_without_probes":
                (sum(tx_bytes) - sum(pb["total_per_rank"])) / len(tx_bytes) / max(1, int(steps))}


def _record(run: dict, full_epoch_steps: Optional[int] = None) -> dict:
    """The per-cell figures from a run directory's files."""
    s, cfg, epochs = run["summary"], run["config"], run["epochs"]
    full_steps = _full_epoch_steps(s, cfg, full_epoch_steps)
    rec = {
        "run_id": s["run_id"],
        "world_size": s["world_size"],
        "layout": s["layout"],
        "compression": s["compression"],
        "steps": s["steps"],
        "epochs": s["epochs"],
        "global_batch_size": s.get("global_batch_size") or s["batch_size_per_rank"] * s["world_size"],
        "mean_step_time_s": s["mean_step_time_s"],
        "first_step_time_s": s.get("first_step_time_s"),
        "full_epoch_steps": full_steps,
        # a full epoch at the measured mean step time (runs are truncated to a few steps)
        "time_per_epoch_s": s["mean_step_time_s"] * full_steps,
        # what the truncated epochs took (first step = graph tracing included)
        "measured_epoch_time_s": [e.get("epoch_time_s") for e in epochs],
        "wall_time_s": s["wall_time_s"],
        # a shared compute-only copy's timed window (bench_threads.start_barrier; None elsewhere)
        "start_barrier": s.get("start_barrier"),
        "gradient_bytes": s.get("gradient_bytes"),
        "parameters": s.get("parameters"),
        "payload_bytes_per_step_per_rank": s.get("payload_bytes_per_step_per_rank"),
        "bytes_sent_per_step_per_rank": s.get("bytes_sent_per_step_per_rank"),
        "bytes_received_per_step_per_rank": s.get("bytes_received_per_step_per_rank"),
        "dense_bytes_per_step_per_rank": s.get("dense_bytes_per_step_per_rank"),
        "compression_ratio": s.get("compression_ratio"),
        "final_test_accuracy": s.get("final_test_accuracy"),
        "final_test_loss": s.get("final_test_loss"),
        "final_valid_perplexity": s.get("final_valid_perplexity"),
        "final_test_perplexity": s.get("final_test_perplexity"),
        "final_test_wer": s.get("final_test_wer"),
        # one evaluation: the training wall time minus the epochs' step loops, per evaluation (one
        # after every epoch; with checkpoint.at_end=false the rest of the loop is negligible)
        "eval_time_s": _eval_time(s, cfg, epochs),
        "final_eval_time_s": _final_only_eval_s(cfg, epochs),
        "eval_count": len(epochs),
        "eval_time_per_epoch_s": [e.get("eval_time_s") for e in epochs],
        "eval_split_time_s": [{k[5:-7]: e[k] for k in e if k.startswith("eval_") and k.endswith("_time_s")
                               and k != "eval_time_s"} for e in epochs],
        # the quality each epoch reported (accuracy, perplexity, WER: whatever the task's metrics)
        "accuracy_curve": [{"epoch": e["epoch"], "test_accuracy": e.get("test_accuracy"),
                            "epoch_time_s": e.get("epoch_time_s"),
                            **{k: e[k] for k in QUALITY_KEYS if e.get(k) is not None}} for e in epochs],
    }
    if "roles" in s:
        rec["roles"] = {r: {k: v for k, v in s["roles"][r].items()
                            if isinstance(v, (int, float, list, str))} for r in s["roles"]}
        rec["hourglass"] = {k: s["hourglass"][k] for k in ("conv_workers", "fc_workers", "conv_parameters",
                                                            "fc_parameters") if k in s.get("hourglass", {})}
    if "profile" in s:  # Hourglass: measured seconds per step in each phase, per role
        rec["profile"] = s["profile"]
    if s.get("thread_cpu"):  # CPU per timed step of each thread group, every rank (hgsgc.bench_threads)
        rec["thread_cpu"] = s["thread_cpu"]
        rec["hvd_mpi_cpu_s_per_step"] = s["thread_cpu"]["hvd_mpi_cpu_s_per_step"]["mean"]
        rec["hvd_mpi_cpu_s_per_step_max_rank"] = s["thread_cpu"]["hvd_mpi_cpu_s_per_step"]["max"]
        rec["thread_cpu_s_per_step"] = {g: v["mean_cpu_s_per_step"] for g, v in s["thread_cpu"]["groups"].items()}
        # time each group's threads were runnable but had no CPU (other processes on the core)
        rec["thread_runqueue_wait_s_per_step"] = {g: v.get("mean_runqueue_wait_s_per_step")
                                                  for g, v in s["thread_cpu"]["groups"].items()}
    return rec


def _load() -> Optional[List[float]]:
    """1/5/15-minute load averages: other jobs on the machine share its CPUs with the hosts."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _tail(text: str, n: int = 15) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def _error_of(stdout: str, stderr: str, rc) -> str:
    """The most telling line(s) of a failed run: hgsgc's own error line if there is one."""
    for text in (stderr, stdout):
        for ln in (text or "").splitlines():
            if ln.startswith("hgsgc:") and ("error" in ln):
                return ln.strip()
    return f"exit {rc}: " + _tail(stderr or stdout, 5)


def _train_args(python: str, method: dict, spec: dict, run_dir_root: str, run_id: str) -> List[str]:
    pin = ["train.threads=1"] if spec.get("pin") else []
    return [python, "-m", "hgsgc.cli", "train", method["config"], *spec["overrides"], *method["overrides"],
            *method.get("cell_overrides", []), *pin, f"run.out_dir={run_dir_root}", f"run.id={run_id}", "train.progress=false"]


def _cell_env(spec: dict) -> Optional[dict]:
    """The environment of a cell's mpirun: with ``pin``, ``HGSGC_PIN_CORES=1`` (forwarded to the
    ranks by cluster.sh, which pin themselves to core rank % cores: hgsgc.runtime.pin_to_core)."""
    if not spec.get("pin"):
        return None
    return dict(os.environ, HGSGC_PIN_CORES="1")


def dilation_factor(spec: dict, results: dict, method: str, hosts: int) -> Optional[float]:
    """Time-dilation factor ``f`` of a cell (Gupta et al., NSDI 2006): the emulated link runs at
    ``f`` times the nominal rate (``f <= 1``: this machine computes ``1/f`` times slower than the
    emulated one), so that the ratio of compute to communication time is that of the machine
    being emulated; a measured time times ``f`` is that time on the emulated machine's clock.
    What it preserves: the compute / communication ratio and so the relative ranking of methods.
    What it does not: latencies (alpha is not dilated: netem is missing here), the Horovod cycle
    and MPI software overheads (they run at this machine's speed), and memory effects.

    ``cpu_share``: ``f`` = the method's compute-only step alone / with ``hosts`` processes at once
    (the CPU share each emulated host gets on this machine; 1 host: 1). ``gpu``: ``f`` =
    ``gpu_step_ms[method]`` / this machine's compute-only step of the method as the cell's ranks
    get it: with ``hosts`` processes at once (``compute_only_shared``) when that was measured, else
    alone (a GPU host, tens of times faster; with the shared step ``f`` is the GPU factor times the
    CPU share). With ``gpu_reference: R`` every method gets R's factor: one emulated machine that
    computes ``1/f`` times faster than this one for every method alike (its compression compute
    included), every link at the same emulated rate. ``cpu_share_reference: R`` does the same for
    ``cpu_share``: every method gets R's factor (R's compute-only step alone / with ``hosts`` at
    once), so every method's link runs at one emulated rate; without it each method's factor is
    measured at its own moment, and on a loaded machine the methods' links run at different rates
    (docs/benchmarks.md, "Session 10": why the reference is the fairer comparison).
    ``none``: None. A missing measurement gives None and the cell records why.
    """
    mode = spec.get("dilation", "none")
    if mode == "none":
        return None
    if mode == "gpu" and spec.get("gpu_reference"):
        method = spec["gpu_reference"]  # one factor for every method: the reference's
    if mode == "cpu_share" and spec.get("cpu_share_reference"):
        method = spec["cpu_share_reference"]  # one factor for every method: the reference's
    alone = results["compute_only"].get(method, {})
    if alone.get("status") != "ok":
        return None
    if mode == "cpu_share":
        if hosts == 1:
            return 1.0
        shared = results["compute_only_shared"].get(f"{method}@{hosts}", {})
        if shared.get("status") != "ok":
            return None
        return min(1.0, alone["mean_step_time_s"] / shared["mean_step_time_s"])
    g = (spec.get("gpu_step_ms") or {}).get(method)
    if g is None:
        return None
    shared = (results.get("compute_only_shared") or {}).get(f"{method}@{hosts}", {}) if hosts > 1 else {}
    cpu = shared if shared.get("status") == "ok" else alone
    return g / 1e3 / cpu["mean_step_time_s"]


def dilated_rate(bandwidth: str, factor: float) -> str:
    """``bandwidth`` (tc rate) times ``factor``, as a tc rate in kbit (at least 8 kbit)."""
    return f"{max(8, int(round(_bw_mbit(bandwidth) * 1e3 * factor)))}kbit"


def run_cell(method: dict, hosts: int, bandwidth: str, spec: dict, python: Optional[str] = None,
             dilation: Optional[float] = None) -> dict:
    """One cell: an emulated cluster of ``hosts`` hosts at ``bandwidth``, one train run across it.

    ``dilation``: the factor of :func:`dilation_factor`; the link then runs at
    ``dilated_rate(bandwidth, dilation)`` and the cell also reports ``step_time_dilated_s`` =
    the measured mean step times the factor (the step on the emulated machine's clock)."""
    em = _emulated()
    py = python or sys.executable
    prefix = "hgb" + uuid.uuid4().hex[:6]
    run_id = f"{spec['name']}-{method['name']}-{hosts}h-{bandwidth}-{prefix}"
    cell = {"method": method["name"], "role": method["role"], "config": method["config"],
            "overrides": [*spec["overrides"], *method["overrides"], *method.get("cell_overrides", [])],
            "mpi_args": [*spec["mpi_args"], *method["mpi_args"]],
            "hosts": hosts, "bandwidth": bandwidth, "bandwidth_mbit": _bw_mbit(bandwidth),
            "prefix": prefix, "status": "failed", "error": None, "load_before": _load(),
            "pinned": bool(spec.get("pin"))}
    link_rate = bandwidth
    if spec.get("dilation", "none") != "none":
        cell["dilation"] = {"mode": spec["dilation"], "factor": dilation}
        ref = spec.get("cpu_share_reference") if spec["dilation"] == "cpu_share" else None
        if ref:
            cell["dilation"]["reference"] = ref
        if dilation is None:
            cell["error"] = (f"dilation {spec['dilation']}: no factor (compute-only measurement of "
                             f"{ref or method['name']!r} missing or failed)")
            cell["load_after"] = _load()
            return cell
        link_rate = dilated_rate(bandwidth, dilation)
        cell["dilation"]["emulated_rate"] = link_rate
        if spec["dilation"] == "gpu":
            cell["dilation"]["gpu_source"] = spec["gpu_source"]
    t0 = time.perf_counter()
    try:
        with em.EmulatedCluster(hosts, bandwidth=link_rate, prefix=prefix) as c:
            before = c.counters()
            p = c.mpirun([*cell["mpi_args"], "-np", str(hosts),
                          *_train_args(py, method, spec, spec["runs_dir"], run_id)],
                         check=False, timeout=spec["timeout_s"], env=_cell_env(spec))
            after = c.counters()
            per_host = c.delta(before, after)
        cell["launch_time_s"] = time.perf_counter() - t0
        cell["returncode"] = p.returncode
        cell["stdout_tail"] = _tail(p.stdout)
        cell["stderr_tail"] = _tail(p.stderr)
        if p.returncode != 0:
            cell["error"] = _error_of(p.stdout, p.stderr, p.returncode)
            return cell
        run = _read_run(os.path.join(spec["runs_dir"], run_id))
        cell.update(_record(run, spec.get("full_epoch_steps")))
        steps = max(1, cell["steps"])
        hosts_sorted = sorted(per_host)
        cell["interface"] = {h: per_host[h] for h in hosts_sorted}
        tx = [per_host[h]["tx_bytes"] for h in hosts_sorted]
        rx = [per_host[h]["rx_bytes"] for h in hosts_sorted]
        # everything the host sent during the mpirun (launch, initial broadcast, evaluation and
        # summary included) divided by the training steps: an upper bound of the per-step traffic
        cell["iface_tx_bytes_per_step_per_rank"] = sum(tx) / len(tx) / steps
        cell["iface_rx_bytes_per_step_per_rank"] = sum(rx) / len(rx) / steps
        cell["iface_tx_bytes_per_step_max_rank"] = max(tx) / steps
        hg = cell.get("bytes_sent_per_step_per_rank") or 0.0
        cell["iface_over_hgsgc"] = (cell["iface_tx_bytes_per_step_per_rank"] / hg) if hg else None
        cell.update(auto_probe_columns(run["summary"], tx, steps))
        if dilation is not None and cell.get("mean_step_time_s") is not None:
            cell["step_time_dilated_s"] = cell["mean_step_time_s"] * dilation
            if cell.get("eval_time_s") is not None:  # the evaluation runs on the same dilated machine
                cell["eval_time_dilated_s"] = cell["eval_time_s"] * dilation
        cell["status"] = "ok"
    except subprocess.TimeoutExpired:
        cell["error"] = f"timeout after {spec['timeout_s']} s"
    except Exception as exc:  # ClusterError, missing summary, ...
        cell["error"] = f"{type(exc).__name__}: {exc}"
        cell["traceback"] = _tail(traceback.format_exc(), 6)
    finally:
        cell.setdefault("launch_time_s", time.perf_counter() - t0)
        cell["load_after"] = _load()
        em.cluster_sh("down", "--prefix", prefix, check=False)  # idempotent; leftovers of a crash
    return cell


def run_compute_only(method: dict, spec: dict, python: Optional[str] = None, copies: int = 1) -> dict:
    """The same model and method in plain processes (world size 1, no communication).

    ``copies=1``: one process alone on the machine, the physical limit the issue asks for.
    ``copies=n``: n such processes at the same time, i.e. the compute of n emulated hosts that
    share this machine's CPUs (the limit an n-host cell on this machine can reach); the record is
    the mean over the copies. The copies start their timed steps together
    (:func:`hgsgc.bench_threads.start_barrier`, through ``HGSGC_START_BARRIER``) and the record gives
    ``timed_overlap`` (:func:`timed_overlap`); the spec's ``compute_only_steps`` sets every
    compute-only run's steps (``train.max_steps_per_epoch``, after the cell's overrides). A
    Hourglass method needs several ranks: it is measured with ``layout=data_parallel`` (the whole
    model on one process), the compute of one data-parallel step.

    With the spec's ``pin`` (the clean cells), the single process (``copies=1``) is pinned to one
    core as well (``HGSGC_PIN_CORES=1``: core 0; ``train.threads=1`` as in the cells), so that it
    measures the compute of a host with ONE core, as each pinned cell's rank has: unpinned, its
    input pipeline and runtime threads would also use the machine's other core. The record says
    ``pinned``. ``copies > 1`` never pins (the copies share the cores).
    """
    py = python or sys.executable
    extra = []
    import yaml

    try:
        with open(method["config"]) as f:
            layout = (yaml.safe_load(f) or {}).get("layout")
    except OSError:
        layout = None
    overrides = [*spec["overrides"], *method["overrides"]]
    if layout == "hourglass" or "layout=hourglass" in overrides:
        extra = ["layout=data_parallel"]
    if spec.get("compute_only_steps"):  # more timed steps than the cell: a steadier input, same model
        extra.append(f"train.max_steps_per_epoch={int(spec['compute_only_steps'])}")
    tag = uuid.uuid4().hex[:6]
    run_ids = [f"{spec['name']}-{method['name']}-compute-{tag}-{i}" for i in range(copies)]
    rec = {"method": method["name"], "copies": copies, "status": "failed", "error": None,
           "extra_overrides": extra, "load_before": _load()}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    rec["pinned"] = bool(spec.get("pin")) and copies == 1
    if rec["pinned"]:
        env["HGSGC_PIN_CORES"] = "1"
    else:
        env.pop("HGSGC_PIN_CORES", None)
    barrier_dir = None
    if copies > 1:  # line the copies' timed steps up (bench_threads.start_barrier)
        barrier_dir = os.path.join(spec["runs_dir"], f".barrier-{spec['name']}-{method['name']}-{tag}")
        env[bench_threads.START_BARRIER_ENV] = f"{barrier_dir}:{copies}:{float(spec['timeout_s']):g}"
    procs = []
    try:
        for rid in run_ids:
            procs.append(subprocess.Popen(_train_args(py, method, spec, spec["runs_dir"], rid) + extra,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        outs, killed = _communicate_all(procs, float(spec["timeout_s"]))
        for i, (p, (o, e)) in enumerate(zip(procs, outs)):
            if p.returncode != 0 and i not in killed:
                rec["error"] = _error_of(o, e, p.returncode)
                if killed:
                    rec["error"] += f" (the other {len(killed)} cop{'y' if len(killed) == 1 else 'ies'} stopped)"
                return rec
        runs = [_record(_read_run(os.path.join(spec["runs_dir"], rid))) for rid in run_ids]
        rec["mean_step_time_s"] = sum(r["mean_step_time_s"] for r in runs) / copies
        rec["step_times_s"] = [r["mean_step_time_s"] for r in runs]
        rec.update({k: runs[0][k] for k in ("steps", "final_test_accuracy", "wall_time_s")})
        if copies > 1:
            rec["timed_overlap"] = timed_overlap([r.get("start_barrier") for r in runs])
        if all(r.get("thread_cpu_s_per_step") for r in runs):  # CPU per timed step per thread group
            rec["thread_cpu_s_per_step"] = {g: sum(r["thread_cpu_s_per_step"][g] for r in runs) / copies
                                            for g in runs[0]["thread_cpu_s_per_step"]}
            rec["hvd_mpi_cpu_s_per_step"] = sum(r["hvd_mpi_cpu_s_per_step"] for r in runs) / copies
            if all(None not in r.get("thread_runqueue_wait_s_per_step", {None: None}).values() for r in runs):
                rec["thread_runqueue_wait_s_per_step"] = {
                    g: sum(r["thread_runqueue_wait_s_per_step"][g] for r in runs) / copies
                    for g in runs[0]["thread_runqueue_wait_s_per_step"]}
        rec["status"] = "ok"
    except subprocess.TimeoutExpired:
        rec["error"] = f"timeout after {spec['timeout_s']} s"
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        rec["load_after"] = _load()
        if barrier_dir:
            shutil.rmtree(barrier_dir, ignore_errors=True)
    return rec


def _communicate_all(procs: list, timeout_s: float, poll_s: float = 0.05):
    """Wait for every process of ``procs`` (``subprocess.Popen`` with piped stdout / stderr, text),
    reading their pipes concurrently; as soon as one exits non-zero, kill the others (shared
    compute-only copies wait for each other at the start barrier, so a failed copy would otherwise
    hold the rest until their barrier timeout).

    Returns ``(outs, killed)``: ``[(stdout, stderr)]`` in process order and the set of indices this
    function killed. Raises ``subprocess.TimeoutExpired`` after ``timeout_s`` seconds (every process
    still running is killed first)."""
    import threading

    outs = [("", "")] * len(procs)

    def drain(i, p):
        outs[i] = p.communicate()

    threads = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    deadline, killed = time.monotonic() + float(timeout_s), set()
    while any(t.is_alive() for t in threads):
        failed = any(p.poll() not in (None, 0) for i, p in enumerate(procs) if i not in killed)
        expired = time.monotonic() > deadline
        if failed or expired:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    killed.add(i)
            if expired and not failed:
                for t in threads:
                    t.join()
                raise subprocess.TimeoutExpired(procs[0].args, timeout_s)
        time.sleep(poll_s)
    for t in threads:
        t.join()
    return outs, killed


def timed_overlap(windows: list) -> Optional[float]:
    """How much of the copies' timed steps ran while all of them were in their timed steps: the
    length of the intersection of the windows ``[released_unix_s, timed_end_unix_s]`` (one per
    copy, :func:`hgsgc.bench_threads.start_barrier`'s record in each copy's summary.json) over the
    length of their union, in [0, 1] (1: all copies timed the same interval, so each timed step
    shared the cores with every other copy's; 0: disjoint). None when a copy has no window (it ran
    without the barrier: results from before session 18)."""
    if not windows or any(not w or w.get("timed_end_unix_s") is None for w in windows):
        return None
    starts = [float(w["released_unix_s"]) for w in windows]
    ends = [float(w["timed_end_unix_s"]) for w in windows]
    union = max(ends) - min(starts)
    return max(0.0, min(ends) - max(starts)) / union if union > 0 else 1.0


def curve_run_id(spec: dict, method: dict) -> str:
    """Run id of a method's loopback curve run (deterministic: ``reuse_curves`` finds it again)."""
    return f"{spec['name']}-curve-{method['name']}"


def _curve_of_run(run_dir: str, t: dict) -> dict:
    """A curve run's record: its per-epoch ``t['metric']`` (the first ``budget_epochs`` epochs when
    set: with a step learning-rate schedule by epoch, they are exactly a shorter run). A run
    without summary.json (stopped after the budget, or still running) gives the epochs it wrote:
    ``complete`` says whether they cover the budget (an incomplete curve can still show that a
    method reached the target; it cannot show that it did not)."""
    from hgsgc.bench_ttt import curve_from_epochs

    has_summary = os.path.exists(os.path.join(run_dir, "summary.json"))
    if has_summary:
        run = _read_run(run_dir)
    else:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            lines = [json.loads(ln) for ln in f if ln.strip()]
        cfg = {}
        if os.path.exists(os.path.join(run_dir, "config.json")):
            with open(os.path.join(run_dir, "config.json")) as f:
                cfg = json.load(f)
        run = {"summary": {}, "config": cfg, "epochs": [r for r in lines if r.get("kind") != "step"]}
    s = run["summary"]
    curve = curve_from_epochs(run["epochs"], t["metric"])
    if t.get("budget_epochs"):
        curve = [p for p in curve if p["epoch"] <= t["budget_epochs"]]
    budget = t.get("budget_epochs") or (len(curve) if has_summary else None)
    rec = {"curve": curve, "run_epochs": len(run["epochs"]), "steps": curve[-1]["steps"] if curve else 0,
           "run_finished": has_summary, "complete": bool(budget) and len(curve) >= budget,
           "wall_time_s": s.get("wall_time_s"),
           "mean_step_time_s": s.get("mean_step_time_s") or (
               sum(e.get("mean_step_time_s") or 0.0 for e in run["epochs"]) / len(run["epochs"])
               if run["epochs"] else None),
           "world_size": s.get("world_size"), "seed": (run["config"].get("run") or {}).get("seed"),
           "final_value": curve[-1]["value"] if curve else None,
           "status": "ok" if curve else "failed", "error": None if curve else "the run recorded no epoch"}
    return rec


def _given_curve(method: dict, spec: dict) -> Optional[dict]:
    """The curve record of a method whose spec entry names its curve (``curve_run``): ``'none'``
    (the method has no curve: recorded with status ``'none'``, "no curve" in the tables), or a
    finished run directory (e.g. a committed ``docs/experiments/<run>``) that is read, never run.
    None when the method has no ``curve_run`` (its curve is a loopback run of the bench)."""
    cr = method.get("curve_run")
    if cr is None:
        return None
    t = spec["time_to_target"]
    if cr == "none":
        return {"method": method["name"], "run_id": None, "status": "none", "reused": False,
                "error": "no curve (curve_run: none: no quality curve of this method exists)"}
    if cr.endswith(".json"):
        try:
            stored = _stored_curve(cr, method["name"], ValueError)
        except (OSError, ValueError) as exc:
            return {"method": method["name"], "run_id": None, "status": "failed", "reused": True,
                    "source": cr, "error": f"{type(exc).__name__}: {exc}"}
        curve = stored["curve"]
        if t.get("budget_epochs"):
            curve = [p for p in curve if p["epoch"] <= t["budget_epochs"]]
        return dict(stored, curve=curve, steps=curve[-1]["steps"] if curve else 0,
                    final_value=curve[-1]["value"] if curve else None,
                    source=f"{cr} (curves.{method['name']}, run {stored.get('run_id')})", reused=True)
    rec = {"method": method["name"], "run_id": os.path.basename(os.path.normpath(cr)), "source": cr,
           "status": "failed", "error": None, "reused": True, "hosts": t["curve_hosts"],
           "overrides": "as recorded in the run"}
    try:
        rec.update(_curve_of_run(cr, t))
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


def _stored_curve(path: str, name: str, error) -> dict:
    """The stored curve record ``curves[name]`` of a results JSON of ``hgsgc bench`` (``curve_run:
    <results>.json``: the curves of another matrix of the same workload, e.g. a GPU-dilated matrix
    reusing ``ptb_4h_ttt.json``'s loopback curves). ``error(msg)`` builds the exception raised when
    the file is missing or has no ok curve of that name."""
    if not os.path.exists(path):
        raise error(f"{path} not found (a results JSON of hgsgc bench)")
    with open(path) as f:
        res = json.load(f)
    rec = (res.get("curves") or {}).get(name)
    if not rec or rec.get("status") != "ok" or not rec.get("curve"):
        raise error(f"{path} has no ok curve of the method {name!r} (curves: "
                    f"{', '.join(sorted(res.get('curves') or {})) or 'none'})")
    return rec


def load_curves(results: dict) -> None:
    """Re-rendering with ``reuse_curves``: read every method's curve run from ``runs_dir`` (never
    runs anything; a run without summary.json counts with the epochs it wrote, see
    :func:`_curve_of_run`); a missing run is recorded as failed with the reason."""
    spec = results["spec"]
    t = spec.get("time_to_target")
    if not t or not t.get("reuse_curves"):
        return
    curves = results.setdefault("curves", {})
    for m in spec["methods"]:
        given = _given_curve(m, spec)
        if given is not None:
            curves[m["name"]] = given
            continue
        run_id = curve_run_id(spec, m)
        run_dir = os.path.join(spec["runs_dir"], run_id)
        if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            if m["name"] not in curves:
                curves[m["name"]] = {"method": m["name"], "run_id": run_id, "status": "failed",
                                     "error": f"no curve run in {run_dir}"}
            continue
        rec = dict(curves.get(m["name"]) or {}, method=m["name"], run_id=run_id,
                   overrides=[*m["overrides"], *t["curve_overrides"]], hosts=t["curve_hosts"])
        rec.setdefault("reused", True)
        rec.update(_curve_of_run(run_dir, t))
        curves[m["name"]] = rec


def run_curve(method: dict, spec: dict, python: Optional[str] = None) -> dict:
    """The quality-vs-steps curve of one method: a plain ``mpirun -np curve_hosts`` run on this
    machine (loopback; the curve does not depend on the network), with the method's config and
    ``overrides`` plus ``time_to_target.curve_overrides`` (NOT the spec's cell overrides nor the
    method's ``cell_overrides``). With ``reuse_curves``, a finished run of the same id in
    ``runs_dir`` (its summary.json exists) is read instead of run again (recorded as ``reused``)."""
    given = _given_curve(method, spec)
    if given is not None:
        return given
    t = spec["time_to_target"]
    py = python or sys.executable
    run_id = curve_run_id(spec, method)
    run_dir = os.path.join(spec["runs_dir"], run_id)
    rec = {"method": method["name"], "run_id": run_id, "status": "failed", "error": None,
           "overrides": [*method["overrides"], *t["curve_overrides"]], "hosts": t["curve_hosts"],
           "load_before": _load(), "reused": False}
    t0 = time.perf_counter()
    try:
        if t["reuse_curves"] and os.path.exists(os.path.join(run_dir, "summary.json")):
            rec["reused"] = True
        else:
            cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                   "-np", str(t["curve_hosts"]), *t["curve_mpi_args"],
                   *[a for k in ("PYTHONPATH", "HGSGC_REQUIRE_CUSTOM_OPS", "TF_CPP_MIN_LOG_LEVEL")
                     if k in os.environ for a in ("-x", k)],
                   py, "-m", "hgsgc.cli", "train", method["config"], *rec["overrides"],
                   f"run.out_dir={spec['runs_dir']}", f"run.id={run_id}", "train.progress=false"]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=t["curve_timeout_s"], env=env)
            if p.returncode != 0:
                rec["error"] = _error_of(p.stdout, p.stderr, p.returncode)
                return rec
        rec.update(_curve_of_run(run_dir, t))
    except subprocess.TimeoutExpired:
        rec["error"] = f"timeout after {t['curve_timeout_s']} s"
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        rec["run_time_s"] = time.perf_counter() - t0
        rec["load_after"] = _load()
        if rec["reused"]:  # nothing ran now: this moment's load is not the run's
            rec["load_before"] = rec["load_after"] = None
    return rec


def add_time_to_target(results: dict) -> None:
    """Fill ``results["time_to_target"]`` from the curves and the ok cells (hgsgc.bench_ttt.combine);
    records why when the reference curve is missing."""
    from hgsgc.bench_ttt import combine

    t = results["spec"].get("time_to_target")
    if not t:
        return
    curves = {m: r["curve"] for m, r in results.get("curves", {}).items() if r.get("status") == "ok"}
    roles = {m["name"]: m["role"] for m in results["spec"]["methods"]}
    try:
        results["time_to_target"] = combine(curves, results["cells"], t["reference"], t["mode"],
                                            t.get("rel"), t.get("abs"), roles, t.get("eval_time", "group_median"),
                                            t.get("budget_epochs"))
    except KeyError as exc:
        results["time_to_target"] = {"error": str(exc)}


def _fmt_line(cell: dict) -> str:
    if cell["status"] != "ok":
        return (f"[bench] {cell['method']:<22} {cell['hosts']}h {cell['bandwidth']:>8}: FAILED "
                f"({cell['error']})")
    return (f"[bench] {cell['method']:<22} {cell['hosts']}h {cell['bandwidth']:>8}: "
            f"step {cell['mean_step_time_s'] * 1e3:8.1f} ms, epoch {cell['time_per_epoch_s']:8.1f} s, "
            f"sent/step/rank {cell['bytes_sent_per_step_per_rank'] / 1e3:9.1f} kB (iface "
            f"{cell['iface_tx_bytes_per_step_per_rank'] / 1e3:9.1f} kB), ratio "
            f"{cell['compression_ratio']:.1f}, acc {_f(cell['final_test_accuracy'], '{:.4f}')}, "
            f"eval {_f(cell.get('eval_time_s'), '{:.1f}')} s, load {_f((cell.get('load_before') or [None])[0])}")


def _busiest_link_bytes(c: dict) -> float:
    """Bytes per step through the busiest rank's link, one direction (hgsgc's count)."""
    vals = [c.get("bytes_sent_per_step_per_rank") or 0.0, c.get("bytes_received_per_step_per_rank") or 0.0]
    for r in (c.get("roles") or {}).values():
        vals += [r.get("bytes_sent_per_step_per_rank") or 0.0, r.get("bytes_received_per_step_per_rank") or 0.0]
    return max(vals)


def breakdown(c: dict, results: dict) -> dict:
    """Where a step's time goes, from measurements (not a tracer):

    * ``compute_s``: the compute-only step of the same model and method, with as many processes
      at once as the cell has hosts when measured (they share this machine's CPUs), else alone;
    * ``compression_s``: that method's compute-only step minus Horovod dense's (both alone: the
      sparsify/quantize/error-feedback work; noisy when other jobs load the machine);
    * ``wire_s``: the busiest rank's bytes per step (hgsgc's count, one direction) x 1.05
      framing (docs/cluster.md) at the link rate (a time-dilated cell's emulated rate: every
      figure here is on this machine's clock): the time the link needs at full speed;
    * ``waiting_s``: the rest: synchronisation (ranks waiting for the slowest), the protocol's
      lost link rate (Open MPI's TCP put halving bidirectional exchanges, docs/cluster.md),
      Horovod's coordination cycle and latency of many small messages.
    """
    co = results.get("compute_only", {})
    cs = results.get("compute_only_shared", {}).get(f"{c['method']}@{c['hosts']}")
    own = co.get(c["method"], {})
    compute = (cs or {}).get("mean_step_time_s") if (cs or {}).get("status") == "ok" else None
    if compute is None:
        compute = own.get("mean_step_time_s") if own.get("status") == "ok" else None
    dense = [co[m["method"]] for m in results["cells"] if m["role"] == "dense" and m["method"] in co]
    dense_step = min((d["mean_step_time_s"] for d in dense if d.get("status") == "ok"), default=None)
    compression = (own["mean_step_time_s"] - dense_step) if own.get("status") == "ok" and dense_step else None
    # at the rate the link actually ran (a time-dilated cell's emulated rate), like the step
    rate = _bw_mbit((c.get("dilation") or {}).get("emulated_rate") or c["bandwidth"])
    wire = _busiest_link_bytes(c) * 1.05 * 8 / (rate * 1e6)
    step = c["mean_step_time_s"]
    basis = "shared" if cs else ("alone" if compute is not None else "not measured")
    return {"step_s": step, "compute_s": compute, "compute_basis": basis,
            "compression_s": compression, "wire_s": wire, "busiest_link_bytes_per_step": _busiest_link_bytes(c),
            # without a compute-only measurement the rest is compute + waiting together
            "waiting_s": step - (compute or 0.0) - wire}


def add_ratios(results: dict) -> None:
    """Per (hosts, bandwidth) group: each ok cell's time per epoch over Horovod dense (the best
    ``dense`` row) and over the best baseline (the best ``dense`` or ``baseline`` row)."""
    groups: Dict[tuple, List[dict]] = {}
    for c in results["cells"]:
        groups.setdefault((c["hosts"], c["bandwidth"]), []).append(c)
    results["groups"] = []
    for (h, bw), cells in groups.items():
        ok = [c for c in cells if c["status"] == "ok"]
        dense = [c for c in ok if c["role"] == "dense"]
        base = [c for c in ok if c["role"] in ("dense", "baseline")]
        d = min(dense, key=lambda c: c["time_per_epoch_s"]) if dense else None
        b = min(base, key=lambda c: c["time_per_epoch_s"]) if base else None
        for c in ok:
            c["vs_dense"] = c["time_per_epoch_s"] / d["time_per_epoch_s"] if d else None
            c["vs_best_baseline"] = c["time_per_epoch_s"] / b["time_per_epoch_s"] if b else None
            c["accuracy_minus_dense"] = (c["final_test_accuracy"] - d["final_test_accuracy"]
                                         if d and c.get("final_test_accuracy") is not None
                                         and d.get("final_test_accuracy") is not None else None)
            co = results.get("compute_only", {}).get(c["method"])
            c["vs_compute_only"] = (c["mean_step_time_s"] / co["mean_step_time_s"]
                                    if co and co.get("status") == "ok" and co["mean_step_time_s"] else None)
            cs = results.get("compute_only_shared", {}).get(f"{c['method']}@{c['hosts']}")
            c["vs_compute_only_shared"] = (c["mean_step_time_s"] / cs["mean_step_time_s"]
                                           if cs and cs.get("status") == "ok" and cs["mean_step_time_s"]
                                           else None)
        for c in ok:
            c["breakdown"] = breakdown(c, results)
        results["groups"].append({"hosts": h, "bandwidth": bw,
                                  "dense": d["method"] if d else None,
                                  "best_baseline": b["method"] if b else None})


def _runtime_settings() -> Dict[str, Optional[str]]:
    """The Horovod / Open MPI settings every cell's ``hgsgc train`` runs with: the environment's
    value, else hgsgc's default (``hgsgc.runtime.apply_defaults``); None when hgsgc's defaults are
    off and the variable is unset (Horovod's / Open MPI's own default then applies)."""
    from hgsgc import runtime

    off = os.environ.get("HGSGC_RUNTIME_DEFAULTS", "1") == "0"
    return {k: os.environ.get(k, None if off else v) for k, v in runtime.DEFAULTS.items()}


def run_matrix(spec, log: Callable[[str], None] = print, python: Optional[str] = None,
               on_cell: Optional[Callable[[dict], None]] = None) -> dict:
    """Run every cell of ``spec`` (a dict or a YAML path); returns the results (also the JSON).

    ``spec["compute_only"]``: true (every method), false, or a list of method names.
    ``on_cell(results)`` is called after every cell (e.g. to save partial results).
    """
    spec = load_spec(spec)
    os.makedirs(spec["runs_dir"], exist_ok=True)
    results: Dict[str, Any] = {"name": spec["name"], "spec": spec,
                               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                               "runtime": _runtime_settings(), "cells": [], "compute_only": {}}
    t0 = time.perf_counter()
    co = spec["compute_only"]
    if spec.get("cells_from"):
        results["cells_from"] = spec["cells_from"]
    if co:
        for m in spec["methods"]:
            if isinstance(co, list) and m["name"] not in co:
                continue
            rec = run_compute_only(m, spec, python)
            results["compute_only"][m["name"]] = rec
            if rec["status"] == "ok":
                log(f"[bench] {m['name']:<22} compute-only (1 process): step "
                    f"{rec['mean_step_time_s'] * 1e3:8.1f} ms")
            else:
                log(f"[bench] {m['name']:<22} compute-only: FAILED ({rec['error']})")
    curve_thread = None
    if spec.get("time_to_target"):
        # the curves (loopback, network-independent) run in a background thread while the cells
        # run: they share this machine's CPUs with the cells (each cell records the load average)
        import threading

        results["curves"] = {}
        ref = spec["time_to_target"]["reference"]
        order = [m for m in spec["methods"] if m["name"] != ref] + \
                [m for m in spec["methods"] if m["name"] == ref]  # the reference last

        def curves_job():
            for m in order:
                if m.get("curve_run") is None:
                    log(f"[bench] {m['name']:<22} curve: loopback run with "
                        f"{spec['time_to_target']['curve_hosts']} ranks ...")
                rec = run_curve(m, spec, python)
                results["curves"][m["name"]] = rec
                log(f"[bench] {m['name']:<22} curve: " + (
                    f"{len(rec['curve'])} epochs, {rec['steps']} steps, final "
                    f"{spec['time_to_target']['metric']} {rec['final_value']:.2f}"
                    f"{' (read from ' + rec['source'] + ')' if rec.get('source') else ' (reused)' if rec['reused'] else ''}"
                    if rec["status"] == "ok" else "no curve" if rec["status"] == "none"
                    else f"FAILED ({rec['error']})"))

        curve_thread = threading.Thread(target=curves_job, name="hgsgc-bench-curves", daemon=True)
        curve_thread.start()
    cs = spec.get("compute_only_shared", False)
    results["compute_only_shared"] = {}
    if cs:
        for h in spec["hosts"]:
            for m in spec["methods"]:
                if isinstance(cs, list) and m["name"] not in cs:
                    continue
                rec = run_compute_only(m, spec, python, copies=int(h))
                results["compute_only_shared"][f"{m['name']}@{h}"] = rec
                log(f"[bench] {m['name']:<22} compute-only, {h} processes at once: "
                    + (f"step {rec['mean_step_time_s'] * 1e3:8.1f} ms"
                       + (f", timed steps overlapping {rec['timed_overlap']:.2f}"
                          if rec.get("timed_overlap") is not None else "") if rec["status"] == "ok"
                       else f"FAILED ({rec['error']})"))
    for cell in cells_from(spec) if spec.get("cells_from") else []:  # read, not run
        results["cells"].append(cell)
        log(_fmt_line(cell) + f" (cell {cell['cell_name']} read from {cell['cells_from']})")
    for h in ([] if spec.get("cells_from") else spec["hosts"]):
        for bw in spec["bandwidths"]:
            for m in spec["methods"]:
                cell = run_cell(m, int(h), str(bw), spec, python,
                                dilation=dilation_factor(spec, results, m["name"], int(h)))
                results["cells"].append(cell)
                log(_fmt_line(cell))
                if on_cell is not None:
                    on_cell(results)
    if curve_thread is not None:
        log("[bench] cells done; waiting for the curve runs ...")
        curve_thread.join()
    results["bench_time_s"] = time.perf_counter() - t0
    add_ratios(results)
    add_time_to_target(results)
    return results


# ----------------------------------------------------------------------------- output

def _f(x, fmt="{:.1f}", none="-"):
    if x is None:
        return none
    try:
        return fmt.format(x)
    except (TypeError, ValueError):
        return str(x)


def markdown(results: dict) -> str:
    from hgsgc.bench_ttt import cell_label

    spec = results["spec"]
    out = [f"# Benchmark `{results['name']}`", "",
           f"Generated by `hgsgc bench` on {results['started_utc']} ({results['machine']['cpus']} CPUs); "
           f"spec: {', '.join(spec['overrides']) or 'no overrides'}; extra mpirun args: "
           f"{' '.join(spec['mpi_args']) or 'none'}.",
           (f"Time per epoch = mean step time x {spec['full_epoch_steps']} steps (the spec's full_epoch_steps). "
            if spec.get("full_epoch_steps") else
            "Time per epoch = mean step time x steps of a full 60,000-image epoch for the method's global "
            "batch. ") +
           "Bytes are per rank per step: hgsgc's count (`bytes_sent_per_step_per_rank`) and the "
           "interface counters (mean over hosts of tx bytes during the whole mpirun / training steps, so "
           "launch, initial broadcast and evaluation are included). Accuracy is after the truncated "
           "budget only (indicative). `load` = the machine's 1-minute load average when the cell "
           "started (other jobs share its CPUs).", ""]
    if results.get("cells_from"):
        out += [f"Cells read from `{results['cells_from']}` (not run here: its step and evaluation times, "
                "loads and accuracies as measured there; a method's row names its cell when the names differ).", ""]
    for g in results.get("groups", []):
        h, bw = g["hosts"], g["bandwidth"]
        out += [f"## {h} hosts, {bw}", "",
                f"Horovod dense = `{g['dense']}`, best baseline = `{g['best_baseline']}` (fastest in this run).", "",
                "| method | role | status | step ms | compute-only ms (1 proc"
                + (", pinned to 1 core" if any(r.get("pinned") for r in results.get("compute_only", {}).values())
                   else "") + ") | x compute | "
                f"compute-only ms ({h} procs) | x that | epoch s | vs dense | "
                "vs best baseline | sent kB/step/rank (hgsgc) | iface kB/step/rank | compr. ratio | test acc | load |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in results["cells"]:
            if (c["hosts"], c["bandwidth"]) != (h, bw):
                continue
            if c["status"] != "ok":
                err = str(c["error"]).replace("|", "/").replace("\n", " ")[:160]
                out.append(f"| {c['method']} | {c['role']} | **failed**: {err} |" + " - |" * 13)
                continue
            co = results["compute_only"].get(c["method"], {})
            cs = results.get("compute_only_shared", {}).get(f"{c['method']}@{h}", {})
            out.append("| " + " | ".join([
                cell_label(c),
                c["role"], "ok",
                _f(c["mean_step_time_s"] * 1e3),
                _f(co.get("mean_step_time_s") and co["mean_step_time_s"] * 1e3),
                _f(c.get("vs_compute_only"), "{:.2f}x"),
                _f(cs.get("mean_step_time_s") and cs["mean_step_time_s"] * 1e3)
                + (f" (overlap {cs['timed_overlap']:.2f})" if cs.get("timed_overlap") is not None else ""),
                _f(c.get("vs_compute_only_shared"), "{:.2f}x"),
                _f(c["time_per_epoch_s"]),
                _f(c.get("vs_dense"), "{:.3f}"),
                _f(c.get("vs_best_baseline"), "{:.3f}"),
                _f(c["bytes_sent_per_step_per_rank"] / 1e3),
                _f(c["iface_tx_bytes_per_step_per_rank"] / 1e3),
                _f(c["compression_ratio"]),
                _f(c["final_test_accuracy"], "{:.4f}"),
                _f((c.get("load_before") or [None])[0]),
            ]) + " |")
        out.append("")
        rows = [c for c in results["cells"] if (c["hosts"], c["bandwidth"]) == (h, bw)
                and c["status"] == "ok" and c.get("breakdown")]
        if rows:
            out += ["Where a step's time goes (ms; compute = compute-only step, measured with "
                    f"{h} processes at once where available, else alone; compression = the method's "
                    "compute-only step minus dense's; wire = busiest link's bytes x 1.05 at the link rate; "
                    "waiting = the rest, compute included where compute-only was not measured):", "",
                    "| method | step | compute | (basis) | compression | wire | waiting | busiest link kB/step |",
                    "|---|---|---|---|---|---|---|---|"]
            for c in rows:
                b = c["breakdown"]
                out.append("| " + " | ".join([
                    c["method"], _f(b["step_s"] * 1e3), _f(b["compute_s"] and b["compute_s"] * 1e3),
                    b["compute_basis"],
                    _f(b["compression_s"] and b["compression_s"] * 1e3), _f(b["wire_s"] * 1e3),
                    _f(b["waiting_s"] * 1e3), _f(b["busiest_link_bytes_per_step"] / 1e3)]) + " |")
            out.append("")
        cpu_rows = [c for c in results["cells"] if (c["hosts"], c["bandwidth"]) == (h, bw)
                    and c["status"] == "ok" and c.get("thread_cpu")]
        if cpu_rows:
            out += ["CPU per timed step of the rank process's threads (ms, mean over ranks, from "
                    "/proc/<pid>/task/<tid>/schedstat; hgsgc.bench_threads: Horovod's background thread, "
                    "Open MPI's and PMIx's progress threads, the main thread, the rest (TensorFlow's pools)); "
                    "CPU seconds do not grow when a thread waits for a core, wall time does:", "",
                    "| method | step ms (wall) | Horovod + MPI CPU ms/step (max rank) | Horovod background | "
                    "Open MPI/PMIx | main | other (TF pools) | timed steps |",
                    "|---|---|---|---|---|---|---|---|"]
            for c in cpu_rows:
                g = c["thread_cpu"]["groups"]
                ms = lambda x: _f(x * 1e3, "{:.2f}")
                out.append("| " + " | ".join([
                    c["method"], _f(c["mean_step_time_s"] * 1e3),
                    f"{ms(c['thread_cpu']['hvd_mpi_cpu_s_per_step']['mean'])} "
                    f"({ms(c['thread_cpu']['hvd_mpi_cpu_s_per_step']['max'])})",
                    ms(g["hvd_background"]["mean_cpu_s_per_step"]), ms(g["mpi"]["mean_cpu_s_per_step"]),
                    ms(g["main"]["mean_cpu_s_per_step"]), ms(g["other"]["mean_cpu_s_per_step"]),
                    str(min(c["thread_cpu"]["steps"]))]) + " |")
            out.append("")
        prof = [c for c in results["cells"] if (c["hosts"], c["bandwidth"]) == (h, bw)
                and c["status"] == "ok" and c.get("profile")]
        if prof:
            out += ["Hourglass, measured per phase (ms per step, mean over the role's ranks; CONV wait = "
                    "from posting the activation sends to holding the activation gradients; CONV other = "
                    "trunk compute + CONV gradient exchange; FC: waiting for activations, head compute, "
                    "FC exchange + update, activation-gradient sends still in flight):", "",
                    "| method | CONV step | CONV wait | CONV other | FC step | FC recv wait | FC compute "
                    "| FC apply | FC send wait |", "|---|---|---|---|---|---|---|---|---|"]
            for c in prof:
                cv, fc = c["profile"].get("conv", {}), c["profile"].get("fc", {})
                out.append("| " + " | ".join([c["method"]] + [
                    _f(d.get(k) is not None and d[k] * 1e3 or None) for d, k in (
                        (cv, "step_s"), (cv, "conv_wait_s"), (cv, "other_s"), (fc, "step_s"),
                        (fc, "fc_recv_wait_s"), (fc, "fc_compute_s"), (fc, "fc_apply_s"),
                        (fc, "fc_send_wait_s"))]) + " |")
            out.append("")
    from hgsgc.bench_ttt import markdown as ttt_markdown

    if results.get("provenance"):
        out += ["How this file's measurements were made: " + results["provenance"], ""]
    out += ttt_markdown(results)
    if results.get("bench_time_s") is not None:
        out.append(f"Whole matrix: {results['bench_time_s']:.0f} s.")
    return "\n".join(out) + "\n"


_MARKERS = "osD^vP*Xh<>p"


def _style(i: int) -> dict:
    """A distinct colour + marker per series (tab20 colours, markers cycling independently)."""
    import matplotlib.pyplot as plt

    return {"color": plt.get_cmap("tab20")(i % 20), "marker": _MARKERS[i % len(_MARKERS)],
            "linestyle": "-" if (i // 20) % 2 == 0 else "--"}


# (metric, better, axis label) of the quality a task reports, in the order one is picked for a plot
QUALITY = (("test_accuracy", "higher", "test accuracy (higher is better)"),
           ("valid_perplexity", "lower", "validation perplexity (lower is better)"),
           ("test_perplexity", "lower", "test perplexity (lower is better)"),
           ("test_wer", "lower", "test word error rate (lower is better)"))
QUALITY_KEYS = tuple(q[0] for q in QUALITY)


def quality_series(results: dict) -> dict:
    """What the quality-vs-wall-time plot draws: the quality the cells' task reports (accuracy for
    the image tasks, validation perplexity for the language model, WER for speech; the time to
    target's metric first when the spec has one), one series per ok cell: x = cumulative wall time
    of the truncated epochs (s), y = the metric after each epoch, or one point (the run's wall time,
    its final value) when the epochs did not record it (results files written before).

    Returns ``{"metric", "better", "label", "series": [{"label", "x", "y"}]}``; ``metric`` None and
    no series when no cell reports any known quality."""
    ok = [c for c in results.get("cells", []) if c.get("status") == "ok"]
    order = list(QUALITY)
    want = ((results.get("spec") or {}).get("time_to_target") or {}).get("metric")
    order.sort(key=lambda q: q[0] != want)  # stable: the time to target's metric first

    def points(c, key):
        xs, ys, t = [], [], 0.0
        for e in c.get("accuracy_curve") or []:
            t += e.get("epoch_time_s") or 0.0
            if e.get(key) is not None:
                xs.append(t)
                ys.append(e[key])
        if not xs and c.get("final_" + key) is not None and c.get("wall_time_s") is not None:
            xs, ys = [c["wall_time_s"]], [c["final_" + key]]
        return xs, ys

    for key, better, label in order:
        series = []
        for c in ok:
            xs, ys = points(c, key)
            if xs:
                series.append({"label": f"{c['method']} {c['hosts']}h {c['bandwidth']}", "x": xs, "y": ys})
        if series:
            return {"metric": key, "better": better, "label": label, "series": series}
    return {"metric": None, "better": None, "label": None, "series": []}


def plots(results: dict, out_dir: str, name: str) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ok = [c for c in results["cells"] if c["status"] == "ok"]
    if not ok:
        return paths
    methods = list(dict.fromkeys(c["method"] for c in ok))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = 0
    for h in sorted({c["hosts"] for c in ok}):
        for m in methods:
            pts = sorted((c["bandwidth_mbit"], c["time_per_epoch_s"]) for c in ok
                         if c["method"] == m and c["hosts"] == h)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{m} ({h} hosts)", **_style(series))
                series += 1
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth (Mbit/s)")
    ax.set_ylabel("time per epoch (s, from mean step time)")
    ax.set_title(f"{name}: time per epoch vs bandwidth")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out_dir, f"{name}_epoch_time.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    q = quality_series(results)
    if not q["series"]:
        return paths
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, sr in enumerate(q["series"]):
        ax.plot(sr["x"], sr["y"], label=sr["label"], **_style(i))
    ax.set_xlabel("training wall time (s, truncated epochs)")
    ax.set_ylabel(q["label"])
    ax.set_title(f"{name}: {q['metric'].replace('_', ' ')} vs wall time (short budget: indicative)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out_dir, f"{name}_accuracy.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def write_outputs(results: dict, out_dir: Optional[str] = None, name: Optional[str] = None) -> Dict[str, str]:
    out_dir = out_dir or results["spec"]["out_dir"]
    name = name or results["name"]
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json"), "md": os.path.join(out_dir, f"{name}.md")}
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=2, default=str)
    with open(paths["md"], "w") as f:
        f.write(markdown(results))
    try:
        from hgsgc.bench_ttt import plots as ttt_plots

        for i, p in enumerate(plots(results, out_dir, name) + ttt_plots(results, out_dir, name, _style)):
            paths[f"png{i}"] = p
    except Exception as exc:  # plotting must not lose the measured numbers
        print(f"[bench] plots failed: {exc}", file=sys.stderr)
    return paths


def main(spec_path: str, out: Optional[str] = None, out_dir: Optional[str] = None) -> int:
    """``hgsgc bench SPEC [--out NAME]``: run the matrix, write JSON, Markdown and PNGs.

    Given a results JSON (``docs/benchmarks/NAME.json``) instead of a spec, it only re-renders
    the Markdown, ratios and plots from the stored measurements (no runs).
    """
    if out is not None:
        try:
            _check_name("--out", out)
        except SpecError as exc:
            print(f"hgsgc: bench: {exc}", file=sys.stderr)
            return 2
    if spec_path.endswith(".json"):
        try:
            with open(spec_path) as f:
                results = json.load(f)
            if not isinstance(results, dict) or not isinstance(results.get("cells"), list):
                raise ValueError("not a results file of hgsgc bench (no 'cells' list)")
            add_ratios(results)
            load_curves(results)
            add_time_to_target(results)
            paths = write_outputs(results, out_dir=out_dir or os.path.dirname(spec_path) or ".",
                                  name=out or results["name"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"hgsgc: bench: {spec_path}: cannot re-render: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return 2
        print("[bench] re-rendered " + ", ".join(paths.values()), flush=True)
        return 0
    try:
        spec = load_spec(spec_path)
    except OSError as exc:
        print(f"hgsgc: bench: {spec_path}: cannot read the spec ({exc.strerror or exc}); give a bench spec "
              f"YAML, e.g. configs/bench/smoke.yaml", file=sys.stderr)
        return 2
    except SpecError as exc:
        msg = str(exc)
        if msg.startswith("spec: "):  # name the file the user gave
            msg = f"{spec_path}: {msg[len('spec: '):]}"
        print(f"hgsgc: bench: {msg}", file=sys.stderr)
        return 2
    if out:
        spec["name"] = out
    if out_dir:
        spec["out_dir"] = out_dir
    os.makedirs(spec["out_dir"], exist_ok=True)
    partial = os.path.join(spec["out_dir"], f"{spec['name']}.partial.json")

    def save_partial(res):
        try:
            with open(partial, "w") as f:
                json.dump(res, f, indent=2, default=str)
        except (RuntimeError, OSError) as exc:  # the curve thread changed results meanwhile
            print(f"[bench] partial results not saved this time: {exc}", file=sys.stderr)

    import signal

    def on_term(signum, frame):  # kill/timeout: unwind so each cell's finally tears its cluster down
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        results = run_matrix(spec, log=lambda s: print(s, flush=True), on_cell=save_partial)
    except KeyboardInterrupt:  # the current cell's cluster was torn down on the way out
        print(f"hgsgc: bench: interrupted; cells finished so far are in {partial}", file=sys.stderr)
        return 130
    if os.path.exists(partial):
        os.remove(partial)
    paths = write_outputs(results)
    print("[bench] wrote " + ", ".join(paths.values()), flush=True)
    return 0 if all(c["status"] == "ok" for c in results["cells"]) else 1
