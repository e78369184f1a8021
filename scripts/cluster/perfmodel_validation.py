#!/usr/bin/env python3
"""Predicted vs measured step time: hgsgc/perfmodel.py against every emulated cell given.

Two kinds of cells:

* ``step_profile.py`` results (2 pinned hosts): the prediction is
  ``perfmodel.predict_step(compute, compression, traffic(method), 2, link, wait_s=wait)`` with
  inputs measured *in the same run* (same machine load): ``compute`` = the ranks' mean
  ``compute_no_hvd`` wall time, ``compression`` = their mean ``compression`` phase (0 for dense),
  ``wait`` = ``perfmodel.sync_wait_s`` of the per-rank per-repetition times (files from before
  this session have means only: the slowest rank's mean, no wait term); measured = the slowest
  rank's mean ``step``.
* ``hgsgc bench`` results (``--bench``, every ok cell; see :func:`bench_rows`).

``link`` = ``perfmodel.link_for(bandwidth, calibration)`` from a calibrate_link.py JSON, with
Open MPI's ``put`` protocol where the cell ran with it (``FILE=CAL.json`` gives one file its own
calibration). Writes a Markdown table (stdout, ``--md``) and the rows as JSON (``--json``). The
committed table (docs/benchmarks/perfmodel.md)::

    Q=docs/benchmarks/link_calibration_quiet.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py \
        $(for f in docs/benchmarks/step_profile/s3_*.json; do echo $f=docs/benchmarks/link_calibration_load15.json; done) \
        $(for f in docs/benchmarks/step_profile/s4_sgc1_*.json; do echo $f=$Q; done) \
        $(ls docs/benchmarks/step_profile/s7_*.json | grep -v 100mbit_io1 | sed "s|$|=$Q|") \
        $(ls docs/benchmarks/step_profile/*.json | grep -v -e s3_ -e s4_ -e s7_ -e timeline) \
        --calibration docs/benchmarks/link_calibration.json \
        --bench docs/benchmarks/vgg16_4h_ttt.json=docs/benchmarks/link_calibration_load15.json \
                docs/benchmarks/ptb_4h_ttt.json=docs/benchmarks/link_calibration.json \
                docs/benchmarks/clean_2h.json=$Q docs/benchmarks/clean_2h_cycle5.json=$Q \
                docs/benchmarks/resnet20_4h.json=$Q \
                docs/benchmarks/clean_2h_buckets_r1.json=$Q docs/benchmarks/clean_2h_buckets_r4.json=$Q \
        --json docs/benchmarks/perfmodel_validation.json

Session 8's cells with the measured Horovod/MPI CPU (:func:`hvd_mpi_cpu_term`;
docs/benchmarks.md, "Validation with the measured Horovod/MPI CPU")::

    Q=docs/benchmarks/link_calibration_quiet.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py \
        $(ls docs/benchmarks/step_profile/s7_*.json | grep -v 100mbit_io1 | sed "s|$|=$Q|") --cpu-term-step-profiles \
        --bench docs/benchmarks/clean_2h_s8_r1.json=$Q docs/benchmarks/clean_2h_s8_r2.json=$Q \
                docs/benchmarks/fmnist_4h_s8_r1.json=$Q docs/benchmarks/clean_2h_s8_load6.json=$Q \
        --md docs/benchmarks/perfmodel_validation_cpu.md --json docs/benchmarks/perfmodel_validation_cpu.json

Session 9's grid cells on 2 and 8 hosts (docs/benchmarks.md, "The grid on 2 and 8 hosts"; the
8-host cells are time-dilated and predicted on their emulated link)::

    Q=docs/benchmarks/link_calibration_quiet.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py \
        --bench docs/benchmarks/ptb_2h.json=$Q docs/benchmarks/vgg16_2h.json=$Q docs/benchmarks/ptb_8h.json=$Q \
        --md docs/benchmarks/perfmodel_validation_grid_s9.md --json docs/benchmarks/perfmodel_validation_grid_s9.json

Session 10 (pm10): the quiet 2-host cells of sessions 9 and 10, before (the unpinned probe of
session 8) and after (the pinned probe, as the cells ran; docs/benchmarks.md "Session 10")::

    B=docs/benchmarks; Q=$B/link_calibration_quiet.json; P=$B/link_calibration_pinned_s10.json
    CELLS="clean_2h_s9_quiet clean_2h_buckets_s9_r1 clean_2h_buckets_s9_r2 clean_2h_buckets_s9_r3 vgg16_2h_s10 ptb_2h_s10"
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $(for c in $CELLS; do echo $B/$c.json=$Q; done) \
        --json $B/perfmodel_validation_s10_before.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $(for c in $CELLS; do echo $B/$c.json=$P; done) \
        --before $B/perfmodel_validation_s10_before.json --md $B/perfmodel_validation_s10.md --json $B/perfmodel_validation_s10.json

Session 11 (pm11): the same cells, the lead's quiet re-runs ``vgg16_2h_s11`` / ``ptb_2h_s11`` and the
fp16 cells of clean_2h re-run (``perfmodel_validation_s11_clean_fp16``), all with the thread window fixed
(a73aa81) in the new benches; before = the model of session 10, after = with the fp16 casts
(``--fp16-cast``, the calibration of ``scripts/cluster/calibrate_fp16_cast.py``; docs/benchmarks.md
"Session 11: the model")::

    B=docs/benchmarks; P=$B/link_calibration_pinned_s10.json; C=$B/perfmodel_validation_s11_fp16_cast.json
    CELLS="clean_2h_s9_quiet clean_2h_buckets_s9_r1 clean_2h_buckets_s9_r2 clean_2h_buckets_s9_r3 vgg16_2h_s10 ptb_2h_s10
           vgg16_2h_s11 ptb_2h_s11 perfmodel_validation_s11_clean_fp16"
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $(for c in $CELLS; do echo $B/$c.json=$P; done) \
        --json $B/perfmodel_validation_s11_before.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $(for c in $CELLS; do echo $B/$c.json=$P; done) \
        --fp16-cast $C --before $B/perfmodel_validation_s11_before.json \
        --md $B/perfmodel_validation_s11.md --json $B/perfmodel_validation_s11.json

Session 17: ResNet-20 on 2 pinned hosts (``resnet20_2h``, the grid's compute-heavy 2-host row, quiet;
docs/benchmarks.md "Session 17"), session 11's probe and cast calibration::

    B=docs/benchmarks; P=$B/link_calibration_pinned_s10.json; C=$B/perfmodel_validation_s11_fp16_cast.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $B/resnet20_2h.json=$P --fp16-cast $C \
        --md $B/perfmodel_validation_s17_resnet20_2h.md --json $B/perfmodel_validation_s17_resnet20_2h.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $B/vgg16_4h_s17_1gbit.json=$B/link_calibration_unpinned_s10.json \
        --fp16-cast $C --md $B/perfmodel_validation_s17_vgg16_4h_1gbit.md --json $B/perfmodel_validation_s17_vgg16_4h_1gbit.json

Session 18: the same VGG-16 cells re-run after the start barrier (the shared compute-only copies' timed steps
lined up, :func:`hgsgc.bench_threads.start_barrier`; docs/benchmarks.md "Session 18")::

    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $B/vgg16_4h_s18_1gbit.json=$B/link_calibration_unpinned_s10.json \
        --fp16-cast $C --md $B/perfmodel_validation_s18_vgg16_4h_1gbit.md --json $B/perfmodel_validation_s18_vgg16_4h_1gbit.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $B/resnet20_4h_s18.json=$B/link_calibration_unpinned_s10.json \
        --fp16-cast $C --md $B/perfmodel_validation_s18_resnet20_4h.md --json $B/perfmodel_validation_s18_resnet20_4h.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $B/vgg16_4h_s18_fair.json=$B/link_calibration_unpinned_s10.json \
        --fp16-cast $C --md $B/perfmodel_validation_s18_vgg16_4h_fair.md --json $B/perfmodel_validation_s18_vgg16_4h_fair.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $B/ptb_4h_ttt_testend_s18.json=$B/link_calibration_unpinned_s10.json \
        --fp16-cast $C --md $B/perfmodel_validation_s18_ptb_4h.md --json $B/perfmodel_validation_s18_ptb_4h.json
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $B/ptb_4h_s18_fair.json=$B/link_calibration_unpinned_s10.json \
        --fp16-cast $C --md $B/perfmodel_validation_s18_ptb_4h_fair.md --json $B/perfmodel_validation_s18_ptb_4h_fair.json

Every session-18 shared-core cell in one table (``perfmodel_validation_s18``: 50 cells on 4 hosts)::

    U=$B/link_calibration_unpinned_s10.json
    CELLS="vgg16_4h_s18_1gbit vgg16_4h_s18_fair vgg16_4h_s18_10mbit resnet20_4h_s18 resnet20_4h_s18_10mbit
           ptb_4h_ttt_testend_s18 ptb_4h_s18_fair"
    .venv/bin/python scripts/cluster/perfmodel_validation.py --bench $(for c in $CELLS; do echo $B/$c.json=$U; done) \
        --fp16-cast $C --md $B/perfmodel_validation_s18.md --json $B/perfmodel_validation_s18.json

A cell's per-thread figures (the Horovod/MPI CPU term, the per-cell profile) are used only where they
hold its timed steps alone (:func:`thread_figures_valid`); the others are marked superseded.

(the cells of sessions 4 and 7, on a quiet machine with a core per rank, use the quiet
calibration; the older rows keep the calibration they were predicted with, taken with both ranks
on one core. Left out as disturbed by another job (docs/benchmarks/step_profile.md and
docs/benchmarks.md, "Session 7"): ``s7_buckets_100mbit_io1`` and the bench runs
``clean_2h_buckets_r2`` / ``_r3``, which have disturbed cells; this script takes every ok cell.)

Every link is the emulator's, a ``tbf`` token bucket (``perfmodel.link_for(..., tbf=True)``:
cluster.sh's burst, max(2 ms of the rate, 15,140 bytes)); ``--no-burst`` charges every byte at the
rate, the model before session 7. Session 7's ``s7_buckets_*`` runs timed no ``compression``
phase: their compression input is the in-step CPU (:func:`in_step_compression_s`) and their
measured step the mean of the ``buckets=1`` rounds (:func:`step_rounds`).
"""
import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


QUIET_LOAD = 5.0  # 1-minute load average below which a cell counts as "quiet" (2 cores; our own ranks add ~2)


#: The thread_cpu window fix (commit a73aa81, 2026-12-02 09:13 UTC): before it, both runners closed a
#: cell's per-step CPU window after the epoch's loop, whose exit tears the data iterator down (0.1-7 s),
#: so every thread_cpu / hvd_mpi_cpu_s_per_step / run-queue figure of a bench started earlier holds it.
THREAD_WINDOW_FIX_UTC = "2026-12-02T09:13:43Z"
#: A cell's thread figures are used (the CPU term, the profile) only where its window holds its timed
#: steps and no more: max over ranks of window_s / (steps x mean step) <= this (rule fixed at 11:20 UTC
#: of session 11, before any session-11 cell was predicted).
WINDOW_RATIO_OK = 1.10


def thread_window_ratio(cell):
    """``window_s / (steps x mean_step_time_s)`` of a bench cell's ``thread_cpu`` record, the largest
    over its ranks (1.0: the window held exactly the timed steps; more: something else, e.g. the
    data iterator's teardown before a73aa81); None when the cell has no per-rank window."""
    ranks = (cell.get("thread_cpu") or {}).get("ranks") or []
    step = cell.get("mean_step_time_s")
    vals = [r["window_s"] / (r["steps"] * step) for r in ranks if r.get("window_s") and r.get("steps")]
    return max(vals) if vals and step else None


def thread_figures_valid(bench, cell):
    """Whether a bench cell's per-thread CPU and run-queue figures hold only its timed steps: the bench
    started after :data:`THREAD_WINDOW_FIX_UTC` and :func:`thread_window_ratio` <= :data:`WINDOW_RATIO_OK`.
    Returns ``(valid, ratio, why)``."""
    ratio = thread_window_ratio(cell)
    started = str(bench.get("started_utc") or "")
    if not started or started < THREAD_WINDOW_FIX_UTC:
        return False, ratio, f"bench started {started or 'unrecorded'}, before the window fix (a73aa81)"
    if ratio is None:
        return False, None, "no per-rank window recorded"
    if ratio > WINDOW_RATIO_OK:
        return False, ratio, f"window {ratio:.2f} x the timed steps"
    return True, ratio, "ok"


def cell_profile(cell, co, exchange_s):
    """Where a pinned 2-host bench cell's step went beyond its compute-only input, from the cell's own
    per-thread records (``thread_cpu_s_per_step``, ``thread_runqueue_wait_s_per_step``: CPU and
    run-queue wait per timed step, mean over ranks, /proc schedstat) and those of its compute-only
    run ``co``; seconds per step. With one core per rank the step-critical threads (TensorFlow's
    ``other`` pool and the ``main`` Python thread) either run, wait for the core (run queue), or are
    blocked on the exchange, so::

        blocked = step - (cpu_tf + cpu_main) - (wait_tf + wait_main)

    and the model's error splits into ``d_cpu`` = the critical threads' CPU in the cell minus in the
    compute-only run (work the compute input lacks: the fp16 casts, decoding the peer's payload),
    ``d_wait`` = their run-queue wait minus the compute-only run's (the core held by another thread:
    Horovod's background thread, the kernel's network work), and ``blocked - exchange_s`` (the
    exchange took longer or shorter than the model's wire + coordination). Waits of two threads
    may overlap, so ``blocked`` is a lower bound. None when a record lacks the figures."""
    need = ("thread_cpu_s_per_step", "thread_runqueue_wait_s_per_step")
    if not all(isinstance(cell.get(k), dict) and isinstance((co or {}).get(k), dict) for k in need):
        return None
    crit = ("other", "main")
    try:
        f = lambda rec, k: sum(float(rec[k][g]) for g in crit)  # noqa: E731
        cpu, wait, cpu0, wait0 = (f(cell, need[0]), f(cell, need[1]), f(co, need[0]), f(co, need[1]))
    except (KeyError, TypeError):
        return None
    step = float(cell["mean_step_time_s"])
    blocked = step - cpu - wait
    hv = lambda rec, k: float((rec.get(k) or {}).get("hvd_background") or 0.0)  # noqa: E731
    return {"cpu_s": cpu, "wait_s": wait, "co_cpu_s": cpu0, "co_wait_s": wait0, "d_cpu_s": cpu - cpu0,
            "d_wait_s": wait - wait0, "blocked_s": blocked, "exchange_s": float(exchange_s),
            "d_blocked_s": blocked - float(exchange_s), "co_step_s": float(co["mean_step_time_s"]),
            "hvd_cpu_s": hv(cell, need[0]), "hvd_wait_s": hv(cell, need[1])}


def _load_range(load):
    """``a-b`` of a cell's load average before / after, one decimal below 10."""
    f = lambda v: f"{v:.1f}" if v < 10 else f"{v:.0f}"
    return f"{f(load[0])}-{f(load[1])}"


def calibration_from(path, bandwidth, put=True):
    """The perfmodel calibration dict for ``bandwidth`` from calibrate_link.py's JSON: the probe
    (2 emulated hosts, ``Sendrecv`` rounds) of the probed bandwidth nearest to ``bandwidth``.

    ``efficiency`` = the probe's measured rate (the fit's beta without ``put``) / its nominal
    rate, so the link is charged at what the emulated link carried (e.g. 0.44 at 1 Gbit/s on this
    2-core machine, CPU-bound), not at the nominal rate; ``alpha_s`` = the median 0-byte round;
    ``bidir_factor`` = beta(put) / beta(no put), capped at 1, when ``put`` (Open MPI's default
    TCP flags) else 1; ``pinned``: whether the probe's ranks were pinned to a core each (the
    file's ``pinned``, ``calibrate_link.py --pin``; files from before it ran unpinned). No
    ``path``: :data:`hgsgc.perfmodel.EMULATOR` (``pinned`` None)."""
    from hgsgc import perfmodel as pm

    if not path:
        return dict(pm.EMULATOR, pinned=None)
    with open(path) as f:
        cal = json.load(f)
    rate = pm.parse_rate(bandwidth)
    cell = min(cal["cells"], key=lambda c: abs(c["rate_bit_s"] - rate))
    # alpha: the median 0-byte round (the fit's intercept is poorly determined under load)
    zero = [r["median_s"] for r in cell["no_put"]["runs"] if r["size"] == 0]
    alpha = zero[0] if zero else max(0.0, cell["no_put"]["alpha_s"])
    pinned = bool(cal.get("pinned", False))
    return {"alpha_s": alpha, "efficiency": cell["efficiency"],
            "bidir_factor": min(1.0, cell["bidir_factor"]) if put else 1.0,
            "cycle_s": pm.EMULATOR["cycle_s"], "pinned": pinned,
            "source": f"{path} ({cell['bandwidth']}, {'pinned' if pinned else 'unpinned'} probe)"}


def hvd_overhead_of(r):
    """Horovod's measured per-collective overhead of a step_profile.py result (seconds): the
    ranks' mean ``allgather_hvd`` minus ``allgather_mpi`` (one ``hvd.allgather`` vs one
    ``MPI_Allgather`` of the same payload with known sizes); None when not measured."""
    s = r.get("summary", {})
    if "allgather_hvd" not in s or "allgather_mpi" not in s:
        return None
    h, m = s["allgather_hvd"]["mean_ms_per_rank"], s["allgather_mpi"]["mean_ms_per_rank"]
    return (sum(h) / len(h) - sum(m) / len(m)) / 1e3


def step_rounds(summary):
    """The summary keys of a step_profile.py result's plain ``step`` phase and its repeated rounds
    (``step``, ``step_r1``, ...; ``step_b2*``, other bucket counts, are not these)."""
    return sorted(k for k in summary if re.fullmatch(r"step(_r\d+)?", k))


def in_step_compression_s(summary, rounds):
    """Seconds of compression inside the step when no ``compression`` phase was timed: the ranks'
    mean TensorFlow-thread CPU per step in the ``step`` rounds minus in ``compute_no_hvd`` (same
    run, a pinned core per rank: the top-k selection, encoding, decoding and summing the step adds
    to the compute; docs/benchmarks/step_profile.md "Session 7" reads 11.2 -> 13.9 ms)."""
    tf = lambda ph: sum(summary[ph]["cpu_ms_tf_other"]) / len(summary[ph]["cpu_ms_tf_other"])
    return max(0.0, sum(tf(x) for x in rounds) / len(rounds) - tf("compute_no_hvd")) / 1e3


def hvd_mpi_cpu_term(cell_cpu_s, compute_only_cpu_s, exchange_s):
    """The measured Horovod/MPI CPU term of a bench cell (seconds per step), session 8.

    ``cell_cpu_s``: the CPU per timed step of Horovod's background thread + Open MPI's and PMIx's
    progress threads in the cell (``hvd_mpi_cpu_s_per_step``: mean over ranks, /proc schedstat,
    hgsgc.bench_threads); ``compute_only_cpu_s``: the same in the cell's compute-only run (its
    Horovod thread also runs, in a world of one, and that run's step is the compute input, so that
    CPU is in the prediction already; 0 when not recorded); ``exchange_s``: the model's wire +
    coordination per step. While the exchange runs the TensorFlow threads wait and Horovod's thread
    polls Open MPI (``yield_when_idle``: it spins, yielding), so up to ``exchange_s`` of that CPU is
    the exchange's own time, already predicted. The rest ran beside the compute on the rank's
    core(s) and delays it by as much:

        term = max(0, cell - compute_only - exchange)

    Returns ``{"cell_s", "compute_only_s", "exchange_s", "term_s", "naive_term_s"}`` (``naive``:
    ``max(0, cell - compute_only)``, every second of that CPU charged, shown beside it)."""
    extra = float(cell_cpu_s) - float(compute_only_cpu_s or 0.0)
    return {"cell_s": float(cell_cpu_s), "compute_only_s": float(compute_only_cpu_s or 0.0),
            "exchange_s": float(exchange_s), "term_s": max(0.0, extra - float(exchange_s)),
            "naive_term_s": max(0.0, extra)}


def bench_rows(path, calibration, overhead_s=None, tbf=True, fp16_cast=None):
    """Predicted vs measured step time of every ok cell of an ``hgsgc bench`` result JSON.

    Inputs, all measured in separate runs of the same bench: compute + compression = the method's
    compute-only step measured with ``hosts`` processes at once (``compute_only_shared``: the CPU
    share each emulated host had on this machine; alone when not measured, and the row says so);
    a time-dilated cell (``dilation`` in the cell: ``cpu_share`` or ``gpu``) is predicted on the
    link it ran, at the emulated rate ``f`` x nominal, and compared with its measured step on this
    machine's clock (not the dilated one); bytes and messages from the method's setting
    (:func:`hgsgc.perfmodel.traffic`), for a sparse method with a density warm-up (DGC) averaged
    over the cell's timed steps (density per step
    from ``hgsgc.loop.density_schedule``); the link from the calibration (``put`` removed when the
    cell's mpirun arguments remove it); Horovod's cycle as hgsgc sets it (5 ms). No per-step
    samples: the wait for the slowest rank is 0 here. ``fp16_cast``: a
    ``calibrate_fp16_cast.py`` JSON (session 11): an fp16 cell on >= 2 hosts is charged the casts
    around its allreduce as compression, :func:`hgsgc.perfmodel.fp16_cast_s` ``(shapes,
    fp16_cast["fit"])`` (its compute-only step, a world of one, casts nothing); None: 0 (the
    model before session 11).
    """
    import dataclasses

    from hgsgc import perfmodel as pm
    from hgsgc.config import compression_from_config, load_config
    from hgsgc.loop import density_schedule
    from hgsgc.plan import build_plan_model

    with open(path) as f:
        d = json.load(f)
    spec = d["spec"]
    methods = {m["name"]: m for m in spec["methods"]}
    rows, shapes_of = [], {}
    for cell in d["cells"]:
        if cell.get("status") != "ok":
            continue
        m = methods[cell["method"]]
        mpi_args = [*spec.get("mpi_args", []), *m.get("mpi_args", [])]
        tuned = any("btl_tcp_flags" in a for a in mpi_args) and not any(
            "put" in a for a in mpi_args if "," in a)
        # the index coding the cell ran with (its record; cells from before session 9 have none and
        # ran fixed): the stored spec names only the overrides given, the library's current default
        # filled in the rest, and that default may have changed since
        cc = cell.get("compression") or {}
        coding = cc.get("index_coding", "fixed") if "density" in cc else None
        cfg = load_config(m["config"], [*spec["overrides"], *m["overrides"], *m.get("cell_overrides", []),
                                        *([f"compression.index_coding={coding}"] if coding else [])])
        key = (cfg.model.name, cfg.model.width, cfg.data.format)
        if key not in shapes_of:
            model, _ = build_plan_model(cfg)
            shapes_of[key] = [tuple(int(x) for x in v.shape) for v in model.trainable_variables]
        shapes = shapes_of[key]
        k, bw = cell["hosts"], cell["bandwidth"]
        # a time-dilated cell (hgsgc.bench.dilation_factor) ran its links at the emulated rate, and
        # its measured step is on this machine's clock: predicted on that link, same clock
        dil = cell.get("dilation") or {}
        rate = dil.get("emulated_rate") or bw
        cal = calibration_from(calibration, rate, put=not tuned)
        # the cycle the cells ran with (recorded since this session; older results ran with the
        # 5 ms hgsgc then set)
        cal["cycle_s"] = float((d.get("runtime") or {}).get("HOROVOD_CYCLE_TIME") or 5) / 1e3
        link = pm.link_for(rate, calibration=cal, tbf=tbf)
        # a method without its own compute-only run (e.g. the same config run without Open MPI's
        # put protocol) takes that of a method with the same config and overrides: only mpirun's
        # arguments differ, which a one-process run does not use
        same = [cell["method"]] + [o["name"] for o in spec["methods"] if o["name"] != cell["method"]
                                   and (o["config"], o.get("overrides", []), o.get("cell_overrides", []))
                                   == (m["config"], m.get("overrides", []), m.get("cell_overrides", []))]
        shared = next((d.get("compute_only_shared", {})[f"{x}@{k}"] for x in same
                       if d.get("compute_only_shared", {}).get(f"{x}@{k}", {}).get("status") == "ok"), {})
        alone = next((d.get("compute_only", {})[x] for x in same
                      if d.get("compute_only", {}).get(x, {}).get("status") == "ok"), {})
        basis = "shared" if shared.get("status") == "ok" else "alone" if alone.get("status") == "ok" else None
        if basis is None:
            print(f"{d['name']}: {cell['method']} @ {k} hosts {bw}: no compute-only measurement, no prediction",
                  file=sys.stderr)
            continue
        compute = (shared if basis == "shared" else alone)["mean_step_time_s"]
        dens = density_schedule(cfg.compression)
        payload_model = pm.traffic(compression_from_config(cfg.compression), shapes).payload_bytes
        timed = range(1, int(cell["steps"]))  # the first step (graph tracing) is not in the mean
        comp_cfg = compression_from_config(cfg.compression)
        # fp16 (session 11): the casts around the allreduce, which the compute-only run (a world of
        # one) skips, from the per-tensor-size calibration (perfmodel.fp16_cast_s)
        cast_s = pm.fp16_cast_s(shapes, fp16_cast["fit"]) if fp16_cast and getattr(comp_cfg, "kind", None) == "fp16" \
            and k >= 2 else 0.0
        if dens is None:
            p = pm.predict_step(compute, cast_s, pm.traffic(comp_cfg, shapes), k, link,
                                cycle_s=cal["cycle_s"], coordination_overhead_s=overhead_s)
        else:  # per step: the exchange at that step's density, averaged over the timed steps
            h = max(1, int(cfg.compression.delay))
            acc = {"wire_s": 0.0, "coordination_s": 0.0}
            for st in timed:
                if (st + 1) % h:
                    continue
                c = dataclasses.replace(cfg.compression, density=dens(st), warmup_steps=0, delay=1)
                q = pm.predict_step(0.0, 0.0, pm.traffic(compression_from_config(c), shapes), k, link,
                                    cycle_s=cal["cycle_s"], coordination_overhead_s=overhead_s,
                                    link_idle_s=h * compute)
                acc["wire_s"] += q["wire_s"] / len(timed)
                acc["coordination_s"] += q["coordination_s"] / len(timed)
            p = {"compute_s": compute, "compression_s": 0.0, "wait_s": 0.0, **acc}
            p["step_s"] = sum(p.values())
        meas = cell["mean_step_time_s"]
        valid, wratio, why = thread_figures_valid(d, cell)
        co_rec = shared if basis == "shared" else alone
        prof = cell_profile(cell, co_rec, p["wire_s"] + p["coordination_s"]) if valid else None
        cpu = None
        if cell.get("hvd_mpi_cpu_s_per_step") is not None:  # session 8: measured in the cell's run
            co = (shared if basis == "shared" else alone).get("hvd_mpi_cpu_s_per_step")
            cpu = hvd_mpi_cpu_term(cell["hvd_mpi_cpu_s_per_step"], co, p["wire_s"] + p["coordination_s"])
            cpu["compute_only_recorded"] = co is not None
            cpu["cell_max_rank_s"] = cell.get("hvd_mpi_cpu_s_per_step_max_rank")
            for key, t in (("predicted_cpu_term_s", cpu["term_s"]), ("predicted_naive_cpu_term_s", cpu["naive_term_s"])):
                cpu[key] = p["step_s"] + t
            cpu["error"] = cpu["predicted_cpu_term_s"] / meas - 1
            cpu["error_naive"] = cpu["predicted_naive_cpu_term_s"] / meas - 1
        rows.append({"hvd_mpi_cpu": cpu,
                     "run": f"{os.path.splitext(os.path.basename(path))[0]}:{cell['method']}@{k}h/{bw}",
                     "kind": f"bench cell ({k} hosts, {'pinned' if spec.get('pin') else 'unpinned'})",
                     "method": cell["method"], "delay": int(cfg.compression.delay),
                     "index_coding": coding, "payload_bytes_model": payload_model,
                     "bandwidth": bw if rate == bw else f"{bw} (dilated: {rate})",
                     "dilation": {"mode": dil.get("mode"), "factor": dil.get("factor"), "emulated_rate": rate}
                     if dil else None, "hosts": k,
                     "samples": False, "tuned": tuned, "compute_basis": basis,
                     "settings": ("put removed" if tuned else "Open MPI defaults (put)") + f", compute {basis}"
                     + ("" if cal.get("pinned") is None else
                        f", {'pinned' if cal['pinned'] else 'unpinned'} probe"
                        f" {1e-6 * cal['efficiency'] * pm.parse_rate(rate):.0f} Mbit/s"),
                     "calibration_pinned": cal.get("pinned"),
                     "load": [cell.get("load_before", [0])[0] if isinstance(cell.get("load_before"), list)
                              else cell.get("load_before", 0),
                              cell.get("load_after", [0])[0] if isinstance(cell.get("load_after"), list)
                              else cell.get("load_after", 0)],
                     "predicted": p, "measured_step_s": meas, "error": p["step_s"] / meas - 1,
                     "calibration": cal["source"], "coordination_overhead_s": overhead_s, "error_dedicated": None,
                     "fp16_cast_s": cast_s if fp16_cast else None,
                     "thread_figures": {"valid": valid, "window_ratio": wratio, "why": why}, "profile": prof})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="*", help="step_profile.py result JSONs (FILE=CAL.json: its own calibration)")
    ap.add_argument("--bench", nargs="*", default=[], help="hgsgc bench result JSONs (every ok cell); FILE=CAL.json gives that bench its own calibration")
    ap.add_argument("--calibration", default=None, help="calibrate_link.py JSON for the step_profile results")
    ap.add_argument("--bench-calibration", default=None,
                    help="calibrate_link.py JSON for the --bench cells (default: --calibration)")
    ap.add_argument("--bandwidth", default="100mbit", help="link rate of the runs (when not recorded)")
    ap.add_argument("--measured-coordination", nargs="*", default=None, metavar="STEP_PROFILE_JSON",
                    help="charge Horovod's MEASURED per-collective overhead instead of the cycle/negotiation "
                         "formula: step_profile cells use their own run's, bench cells the median over these files")
    ap.add_argument("--no-burst", action="store_true",
                    help="charge every byte at the link rate (links without cluster.sh's tbf bucket: the "
                         "model before session 7); default: the emulator's bucket, perfmodel.link_for(tbf=True)")
    ap.add_argument("--cpu-term-step-profiles", action="store_true",
                    help="also give step_profile cells the measured Horovod/MPI CPU term (their own run's "
                         "cpu_ms_hvd_mpi in the step rounds; compute_no_hvd has no Horovod thread)")
    ap.add_argument("--before", default=None, metavar="ROWS_JSON",
                    help="the --json of an earlier run of this script on the same cells (e.g. another "
                         "calibration): adds each cell's error there as 'error before' and its count")
    ap.add_argument("--fp16-cast", default=None, metavar="CAST_JSON",
                    help="charge fp16 cells on >= 2 ranks the casts around the allreduce as compression, "
                         "perfmodel.fp16_cast_s with this calibrate_fp16_cast.py JSON's fit (default: none, "
                         "the model before session 11)")
    ap.add_argument("--md", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import hgsgc
    from hgsgc import perfmodel as pm
    from hgsgc.models import build_model

    fp16_cast = None
    if args.fp16_cast:
        with open(args.fp16_cast) as f:
            fp16_cast = json.load(f)
        if not isinstance(fp16_cast, dict) or not isinstance(fp16_cast.get("fit"), dict):
            ap.error(f"--fp16-cast {args.fp16_cast}: not a calibrate_fp16_cast.py JSON (no 'fit' object)")
    shapes_of = {}
    rows = []
    for path in args.results:
        path, _, own_cal = path.partition("=")  # FILE=CALIBRATION: this run's own calibration
        with open(path) as f:
            r = json.load(f)
        s = r.get("summary", {})
        if "step" not in s or "compute_no_hvd" not in s:
            continue
        if r["model"] not in shapes_of:
            shapes_of[r["model"]] = [tuple(v.shape) for v in build_model(r["model"]).trainable_variables]
        shapes = shapes_of[r["model"]]
        m = r["method"]
        if m in ("sgc", "topk"):
            # the coding the profile ran with: recorded since session 9, none before (fixed)
            kw = {"density": r["density"], "index_coding": r.get("index_coding")
                  or (r.get("compression") or {}).get("index_coding") or "fixed"}
            if m == "sgc":
                kw["delay"] = r["delay"]
            comp = getattr(hgsgc.Compression, m)(**kw)
        elif m == "fp16":
            comp = hgsgc.Compression.fp16 if r["delay"] == 1 else hgsgc.Compression.localsgd(r["delay"])
        else:
            comp = hgsgc.Compression.none
        bw = r.get("bandwidth", args.bandwidth)
        flags = r["env"].get("OMPI_MCA_btl_tcp_flags")
        tuned = flags is not None and "put" not in flags  # Open MPI's TCP put protocol removed
        cal = calibration_from(own_cal or args.calibration, bw, put=not tuned)
        cal["cycle_s"] = float(r["env"].get("HOROVOD_CYCLE_TIME", 1.0)) / 1e3  # Horovod 0.28 default: 1 ms
        link = pm.link_for(bw, calibration=cal, tbf=not args.no_burst)
        ranks_ph = [a["phases"] for a in (r.get("ranks") or [])]
        samples = ranks_ph and all("times_ms" in ph.get("compute_no_hvd", {}) for ph in ranks_ph)
        if samples:  # per-rank, per-repetition times (step_profile.py keeps them since this session)
            cs = [[t / 1e3 for t in ph["compute_no_hvd"]["times_ms"]] for ph in ranks_ph]
            zs = ([[t / 1e3 for t in ph["compression"]["times_ms"]] for ph in ranks_ph]
                  if "compression" in s else None)
            compute = sum(sum(c) / len(c) for c in cs) / len(cs)
            compression = sum(sum(z) / len(z) for z in zs) / len(zs) if zs else 0.0
            wait = pm.sync_wait_s(cs, zs, h=max(1, int(r["delay"])))
        else:  # older files: means only (slowest rank), no wait term
            compute = s["compute_no_hvd"]["mean_ms_slowest_rank"] / 1e3
            compression = s["compression"]["mean_ms_slowest_rank"] / 1e3 if "compression" in s else 0.0
            wait = 0.0
        rounds = step_rounds(s)
        in_step = "compression" not in s and comp is not hgsgc.Compression.none and m != "fp16"
        if in_step:  # no compression phase timed (session 7's buckets runs): the in-step CPU
            compression = in_step_compression_s(s, rounds)
        over = hvd_overhead_of(r) if args.measured_coordination else None
        cast_s = None
        if fp16_cast:  # compute_no_hvd casts nothing: the fp16 exchange's casts (session 11)
            cast_s = pm.fp16_cast_s(shapes, fp16_cast["fit"]) if comp is hgsgc.Compression.fp16 \
                and r["world_size"] >= 2 else 0.0
            compression += cast_s
        p = pm.predict_step(compute, compression, pm.traffic(comp, shapes), r["world_size"], link,
                            cycle_s=cal["cycle_s"], wait_s=wait, coordination_overhead_s=over)
        meas = sum(s[x]["mean_ms_slowest_rank"] for x in rounds) / len(rounds) / 1e3
        # dedicated-core estimate: CPU-time inputs; measured step minus its TF threads' run-queue
        # wait (the time they were runnable but another process had the core), per rank, slowest
        cpu = lambda ph: max(a + b for a, b in zip(s[ph]["cpu_ms_tf_other"], s[ph]["cpu_ms_main"])) / 1e3
        p_cpu = pm.predict_step(cpu("compute_no_hvd"), cpu("compression") if "compression" in s
                                else compression if in_step else 0.0,
                                pm.traffic(comp, shapes), r["world_size"], link, cycle_s=cal["cycle_s"])
        ranks = r.get("ranks") or []
        waits = [a["phases"]["step"]["threads"]["tf_other"]["runqueue_wait_ms_per_rep"] for a in ranks]
        walls = [a["phases"]["step"]["mean_ms"] for a in ranks]
        meas_ded = max(w - q for w, q in zip(walls, waits)) / 1e3 if ranks else None
        cpu_term = None
        if all("cpu_ms_hvd_mpi" in s[x] for x in rounds):  # the step's Horovod/MPI threads, this run
            mean = lambda v: sum(v) / len(v)
            cell_cpu = mean([mean(s[x]["cpu_ms_hvd_mpi"]) for x in rounds]) / 1e3
            # compute_no_hvd runs before hvd.init(): no Horovod thread in the compute input
            co_cpu = mean(s["compute_no_hvd"]["cpu_ms_hvd_mpi"]) / 1e3 if "cpu_ms_hvd_mpi" in s["compute_no_hvd"] else 0.0
            cpu_term = hvd_mpi_cpu_term(cell_cpu, co_cpu, p["wire_s"] + p["coordination_s"])
            cpu_term.update({"compute_only_recorded": True, "cell_max_rank_s": None,
                             "predicted_cpu_term_s": p["step_s"] + cpu_term["term_s"],
                             "predicted_naive_cpu_term_s": p["step_s"] + cpu_term["naive_term_s"]})
            cpu_term["error"] = cpu_term["predicted_cpu_term_s"] / meas - 1
            cpu_term["error_naive"] = cpu_term["predicted_naive_cpu_term_s"] / meas - 1
        rows.append({"hvd_mpi_cpu": cpu_term if args.cpu_term_step_profiles else None,
                     "run": os.path.basename(path)[:-5], "kind": "step_profile (2 pinned hosts)",
                     "method": m, "delay": r["delay"], "bandwidth": bw,
                     "index_coding": kw["index_coding"] if m in ("sgc", "topk") else None,
                     "payload_bytes_model": pm.traffic(comp, shapes).payload_bytes,
                     "hosts": r["world_size"], "samples": bool(samples), "tuned": tuned,
                     "settings": ", ".join(f"{k.replace('OMPI_MCA_mpi_', '').replace('HOROVOD_', '')}={v}"
                                           for k, v in sorted(r["env"].items())
                                           if k in ("OMPI_MCA_mpi_yield_when_idle", "HOROVOD_CYCLE_TIME"))
                     + (f", compression = in-step TF CPU, {len(rounds)} rounds" if in_step else "")
                     or "Horovod/Open MPI defaults", "load": [r["load_before"][0], r["load_after"][0]],
                     "predicted": p, "measured_step_s": meas,
                     "error": p["step_s"] / meas - 1, "calibration": cal["source"],
                     "calibration_pinned": cal.get("pinned"), "predicted_cpu_inputs": p_cpu, "measured_minus_runqueue_s": meas_ded,
                     "fp16_cast_s": cast_s,
                     "error_dedicated": (p_cpu["step_s"] / meas_ded - 1) if meas_ded else None})
    for path in args.bench:
        path, _, cal = path.partition("=")  # FILE=CALIBRATION: this bench's own calibration
        over = None
        if args.measured_coordination:
            vals = []
            for f in args.measured_coordination:
                with open(f.partition("=")[0]) as fh:
                    v = hvd_overhead_of(json.load(fh))
                if v is not None:
                    vals.append(max(0.0, v))
            vals.sort()
            over = (vals[len(vals) // 2] if len(vals) % 2 else 0.5 * (vals[len(vals) // 2 - 1] + vals[len(vals) // 2])) \
                if vals else None
            print(f"bench cells: measured Horovod overhead per collective {over * 1e3:.1f} ms (median of "
                  f"{len(vals)} step-profile runs)", file=sys.stderr)
        rows += bench_rows(path, cal or args.bench_calibration or args.calibration, over, tbf=not args.no_burst,
                           fp16_cast=fp16_cast)
    before = None
    if args.before:
        with open(args.before) as f:
            old = json.load(f)
        if not (isinstance(old, list) and all(isinstance(x, dict) and "run" in x and "error" in x for x in old)):
            what = (f"a dict with keys {', '.join(map(str, list(old)[:3]))}, ..." if isinstance(old, dict)
                    else f"a {type(old).__name__}" if not isinstance(old, list) else "a list of other records")
            ap.error(f"--before {args.before}: not a rows file of perfmodel_validation.py --json (a list "
                     f"of rows with 'run' and 'error'; this holds {what}): pass the --json output of an "
                     "earlier run")
        before = {x["run"]: x["error"] for x in old}
        if not set(before) & {x["run"] for x in rows}:
            ap.error(f"--before {args.before}: none of its {len(before)} rows is a cell of this run "
                     "(compare runs of the same cells)")
        for x in rows:
            x["error_before"] = before.get(x["run"])
    lines = ["| cell | how it ran | method | H | link | settings | loadavg | compute ms | compression ms/step "
             "| wait for slowest ms/step | wire ms/step | coordination ms/step | predicted ms | measured ms | error |"
             + (" error before |" if before is not None else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if before is not None else "")]
    for x in rows:
        p = x["predicted"]
        eb = x.get("error_before")
        lines.append(f"| `{x['run']}` | {x['kind']} | {x['method']} | {x['delay']} | {x['bandwidth']} | "
                     f"{x['settings']} | {_load_range(x['load'])} | {p['compute_s'] * 1e3:.1f} | "
                     f"{p['compression_s'] * 1e3:.1f} | {p.get('wait_s', 0.0) * 1e3:.1f} | {p['wire_s'] * 1e3:.1f} | "
                     f"{p['coordination_s'] * 1e3:.1f} | {p['step_s'] * 1e3:.1f} | {x['measured_step_s'] * 1e3:.1f} | "
                     f"{100 * x['error']:+.{1 if before is not None else 0}f} % |"
                     + ("" if before is None else " - |" if eb is None else f" {100 * eb:+.1f} % |"))
    if before is not None:
        both = [x for x in rows if x.get("error_before") is not None]
        lines += ["", f"before (`{args.before}`), the same {len(both)} cells: within 15 %: "
                      f"{sum(abs(x['error_before']) <= 0.15 for x in both)} of {len(both)}; now: "
                      f"{sum(abs(x['error']) <= 0.15 for x in both)} of {len(both)}.  "]
    if rows:
        lines.append("")
        for label, sel in (("all", rows), (f"quiet (load average < {QUIET_LOAD:g} before and after)",
                                           [x for x in rows if max(x["load"]) < QUIET_LOAD]),
                           ("loaded", [x for x in rows if max(x["load"]) >= QUIET_LOAD])):
            if not sel:
                continue
            errs = sorted(abs(x["error"]) for x in sel)
            within = sum(e <= 0.15 for e in errs)
            lines.append(f"{label}: {len(sel)} cells: |error| {100 * errs[0]:.0f}-{100 * errs[-1]:.0f} %, median "
                         f"{100 * errs[len(errs) // 2]:.0f} %; within 15 %: {within} of {len(sel)}.  ")
    cpu_rows = [x for x in rows if x.get("hvd_mpi_cpu")]
    if cpu_rows:
        lines += ["", "Cells with the measured Horovod/MPI CPU (session 8, :func:`hvd_mpi_cpu_term`; ms per step; "
                  "`cell` / `compute-only` = CPU of Horovod's background thread + Open MPI's and PMIx's "
                  "progress threads, mean over ranks; `exchange` = predicted wire + coordination):", "",
                  "| cell | loadavg | window / timed steps | measured ms | predicted ms (no term) | error | cell CPU | compute-only CPU "
                  "| exchange | term | predicted with term | error | naive term | error |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in cpu_rows:
            c = x["hvd_mpi_cpu"]
            tf_ = x.get("thread_figures") or {}
            wr = tf_.get("window_ratio")
            wtxt = ("-" if wr is None else f"{wr:.2f}") + ("" if tf_.get("valid", True) else " (superseded)")
            lines.append(f"| `{x['run']}` | {_load_range(x['load'])} | {wtxt} | {x['measured_step_s'] * 1e3:.1f} | "
                         f"{x['predicted']['step_s'] * 1e3:.1f} | {100 * x['error']:+.0f} % | {c['cell_s'] * 1e3:.2f} | "
                         f"{c['compute_only_s'] * 1e3:.2f} | {c['exchange_s'] * 1e3:.2f} | {c['term_s'] * 1e3:.2f} | "
                         f"{c['predicted_cpu_term_s'] * 1e3:.1f} | {100 * c['error']:+.0f} % | "
                         f"{c['naive_term_s'] * 1e3:.2f} | {100 * c['error_naive']:+.0f} % |")
        lines.append("")
        for sel_label, sel in (("", cpu_rows),
                               (f" whose window holds the timed steps (bench after a73aa81, window <= "
                                f"{WINDOW_RATIO_OK:g} x)", [x for x in cpu_rows if (x.get("thread_figures") or {}).get("valid")])):
            n = len(sel)
            if not n or (sel_label and n == len(cpu_rows)):
                continue
            w = lambda key: sum(abs(key(x)) <= 0.15 for x in sel)  # noqa: E731
            med = lambda key: sorted(abs(key(x)) for x in sel)[n // 2]  # noqa: E731
            for label, key in (("no CPU term", lambda x: x["error"]),
                               ("with the measured term", lambda x: x["hvd_mpi_cpu"]["error"]),
                               ("with the naive term (all of it)", lambda x: x["hvd_mpi_cpu"]["error_naive"])):
                lines.append(f"same {n} cells{sel_label}, {label}: within 15 %: {w(key)} of {n}, median |error| "
                             f"{100 * med(key):.0f} %.  ")
    prof_rows = [x for x in rows if x.get("profile")]
    if prof_rows:
        lines += ["", "Where each step went beyond its compute-only input (:func:`cell_profile`; cells whose thread "
                  "window holds the timed steps; ms per step, mean over ranks; `cpu` / `wait` = CPU and run-queue "
                  "wait of the step-critical threads, TensorFlow's pool + main; `blocked` = step - cpu - wait; "
                  "`exchange` = the model's wire + coordination; hvd = Horovod's background thread):", "",
                  "| cell | loadavg | measured ms | predicted ms | error | compute-only step | cpu (compute-only) "
                  "| d cpu | wait (compute-only) | d wait | blocked | exchange | blocked - exchange | hvd cpu | hvd wait |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in prof_rows:
            q = x["profile"]
            ms = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
            lines.append(f"| `{x['run']}` | {_load_range(x['load'])} | {ms(x['measured_step_s'])} | "
                         f"{ms(x['predicted']['step_s'])} | {100 * x['error']:+.1f} % | {ms(q['co_step_s'])} | "
                         f"{ms(q['cpu_s'])} ({ms(q['co_cpu_s'])}) | {q['d_cpu_s'] * 1e3:+.1f} | {ms(q['wait_s'])} "
                         f"({ms(q['co_wait_s'])}) | {q['d_wait_s'] * 1e3:+.1f} | {ms(q['blocked_s'])} | "
                         f"{ms(q['exchange_s'])} | {q['d_blocked_s'] * 1e3:+.1f} | {ms(q['hvd_cpu_s'])} | "
                         f"{ms(q['hvd_wait_s'])} |")
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
