"""``layout: auto``: measure at start-up, predict data parallelism and the Hourglass, run the fastest.

Every rank measures (:func:`measure`), the per-field medians are the model's inputs:

* ``t_conv``, ``t_fc``: seconds per example of the trunk's and the head's forward + backward pass
  (the configured per-rank batch ``b``; median of 3 timed calls after a tracing call);
* ``act_bytes``, ``grad_bytes``: bytes per example of the boundary with the CONFIGURED codecs
  (:func:`hgsgc.hourglass.costmodel.configured_codecs`), by the codecs' payload formulas
  (:func:`hgsgc.hourglass.costmodel.boundary_bytes`, the function ``fc_workers: auto`` and
  ``hgsgc plan`` use too) over the non-zeros of the trunk's real activations of one training
  batch (initial weights: the density of non-zeros is higher at initialisation than after
  training, so this overestimates sparse codecs' bytes), in ``hourglass.micro_batches`` messages;
  ``codec_s``: encode + decode seconds per example for both directions together (one warm-up
  round, then the median of 3);
* ``alpha`` (seconds per message) and ``beta`` (bytes per second) of the link:
  :func:`hgsgc.hourglass.costmodel.link_inputs`: a short point-to-point ping-pong, since
  session 12 on disjoint pairs of ranks at once (:func:`~hgsgc.hourglass.costmodel.probe_link_pairs`:
  ``(0, 1), (2, 3), ...``, one round, two for an odd ``n``; before, rank 0 with every other
  rank in turn, :func:`~hgsgc.hourglass.costmodel.probe_link`; 8 B x 20 for ``alpha``, 1 MiB
  x 3 for ``beta``; medians; the slowest pair counts, as the slowest link bounds a step), unless
  ``hourglass.link_bandwidth_mbps`` overrides it (no probe, ``alpha = 0``); the bytes the
  probes send are in ``startup["probe_bytes"]`` (:func:`probe_bytes`);
* the gradient payloads of one exchange (data parallel: the whole model with the configured
  compression; Hourglass: the trunk with it, the head with ``hourglass.fc_method``) from
  :func:`hgsgc.compression.codec.exchange_payload_bytes`.

* ``boundary_msg_s`` (session 7): the boundary message's cost beyond ``alpha + bytes / beta`` and
  the codec's per-example time, from round trips of one micro-batch (the first ``b / M`` examples
  of the batch) on the trainer's path, rank 0 <-> every other rank
  (:func:`hgsgc.hourglass.costmodel.probe_boundary`, :func:`~hgsgc.hourglass.costmodel.message_cost_s`,
  the slowest pair counting), after the link probe;
* Horovod's cycle time (``HOROVOD_CYCLE_TIME``, :func:`hgsgc.perfmodel.horovod_cycle_s`) for the
  coordination of each gradient exchange;
* the compression seconds of one exchange (selection, encoding, decoding, error feedback, DGC
  momentum correction) of the whole model (data parallel, configured ``compression``), of the
  trunk (CONV ranks, the same setting) and of the head (FC ranks, ``hourglass.fc_method``):
  :func:`hgsgc.perfmodel.measure_compression_s`, as ``hgsgc plan`` measures them (Horovod on
  ``MPI.COMM_SELF`` for the measurement, shut down after it), turned into the cost among ``k``
  ranks by :func:`hgsgc.perfmodel.compression_at`; the optimizer update seconds of the trunk's
  and of the head's variables (``t_update_conv``, ``t_update_fc``:
  :func:`hgsgc.perfmodel.measure_update_s`, SGD with ``train.momentum``);
* the CPU share: which ranks share a machine's cores and how many cores it has
  (:func:`hgsgc.hourglass.costmodel.find_machines`: the kernel boot id, else MPI's shared-memory
  split; the union of the ranks' affinity masks), and ``u``, the cores one rank keeps busy
  while it computes alone (:func:`hgsgc.hourglass.costmodel.cpu_per_wall`), so that
  :func:`hgsgc.perfmodel.cpu_share` scales the times measured alone to what they cost when the
  co-located ranks compute at once (1 with one rank per machine). Since session 5 a machine's
  cores are the cores its ranks GET when they all compute (:func:`effective_cores`): after the
  turns, every rank runs the trunk pass at once (:func:`measure_together`; since session 6 in 5
  windows 0.25 s apart, the median window counting, :func:`slowdown_windows`), and the slowdown
  against the rank alone sets ``P_m = min(affinity cores, u k_m / slowdown)``, so that other
  jobs on the machine and the ranks' own background threads count (they are not in the
  affinity masks).

Every per-rank measurement above runs ALONE on its machine (:func:`hgsgc.hourglass.costmodel.take_turns`;
ranks of different machines measure at once). Since session 12 only the first rank of each
machine measures them (:data:`ONE_PER_MACHINE`, :func:`measuring_ranks`; 5 timed calls per
figure instead of 3) and the machine's other ranks take its figures: the same model, batch and
cores. Up to session 11 every rank measured, in turns, so on one machine with ``n`` ranks that
part took ``n`` times one rank's.

The predictions are :func:`hgsgc.perfmodel.predict_data_parallel` and
:func:`hgsgc.perfmodel.predict_hourglass` (the one performance model of the project, also used
by ``hgsgc plan``); the
choice is the highest predicted throughput (examples per second; the Hourglass trains
``C b`` examples per step, data parallelism ``n b``). Rank 0 decides and broadcasts, logs the
inputs, every prediction and the choice, and they are written to ``summary.json`` under
``layout_choice``.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from hgsgc.hourglass.costmodel import link_inputs, probe_link  # noqa: F401 (the one link probe)
from hgsgc.hourglass.costmodel import measure_pipeline_stages  # noqa: F401 (in costmodel since session 6: measure_costs uses it too)


def measure(split, x: np.ndarray, act_codec, grad_codec, repeats: int = 3, micro_batches: int = 1) -> dict:
    """This rank's compute and codec figures (see the module docstring).

    Args:
        split: :class:`~hgsgc.hourglass.split.SplitModel`; x: one real training batch ``[b, ...]``.
        act_codec, grad_codec: :class:`~hgsgc.hourglass.boundary.BoundaryCodec` (or specs).
        micro_batches: boundary messages per batch (``hourglass.micro_batches``).

    Returns:
        ``{"t_conv", "t_fc", "codec_s"}`` (seconds per example), ``{"act_bytes", "grad_bytes"}``
        (bytes per example, :func:`~hgsgc.hourglass.costmodel.boundary_bytes`) and ``"density"``
        (fraction of non-zero activations).
    """
    import tensorflow as tf

    from hgsgc.hourglass.boundary import BoundaryCodec
    from hgsgc.hourglass.costmodel import boundary_bytes, codec_seconds, median_seconds, stage_passes

    ac, gc = BoundaryCodec.parse(act_codec), BoundaryCodec.parse(grad_codec)
    trunk, head = split.trunk, split.head
    b = len(x)
    xt = tf.constant(x)
    a = trunk(xt, training=False).numpy().reshape(b, -1)
    n_out = int(head.outputs[0].shape[-1])
    y = tf.constant(np.random.default_rng(0).integers(0, n_out, b).astype(np.int32))

    conv_pass, fc_pass = stage_passes(split)
    t_conv = median_seconds(conv_pass, (xt,), repeats) / b
    a_t = tf.constant(a.reshape((b,) + tuple(split.boundary_shape)))
    t_fc = median_seconds(fc_pass, (a_t, y), repeats) / b
    g = fc_pass(a_t, y)[-1].numpy().reshape(b, -1)
    codec_s = codec_seconds(ac, gc, a, g, repeats)
    act_bytes, grad_bytes = boundary_bytes(ac, gc, a != 0, micro_batches)
    from hgsgc.hourglass.costmodel import cpu_per_wall

    cpu_c = cpu_per_wall(conv_pass, (xt,), repeats)
    cpu_f = cpu_per_wall(fc_pass, (a_t, y), repeats)
    # u over both stages, weighted by their times
    u = (cpu_c * t_conv + cpu_f * t_fc) / (t_conv + t_fc) if t_conv + t_fc > 0 else 1.0
    return {"t_conv": t_conv, "t_fc": t_fc, "act_bytes": act_bytes,
            "grad_bytes": grad_bytes, "codec_s": codec_s, "cpu_parallelism": float(u),
            "density": float(np.count_nonzero(a)) / a.size}


#: Windows of :func:`measure_together` (odd, so the median is one window's value), timed calls
#: per window and seconds between windows. Session 5 measured the contention in ONE window of 5
#: calls; at 1 Gbit/s it caught a load spike (12.7x against 3.1-4.9x in the other runs) that
#: made every prediction 2-3.5x too long. With 5 windows spread over about a second the median
#: ignores up to 2 windows that a spike distorts.
TOGETHER_WINDOWS = 5
TOGETHER_REPEATS = 3
TOGETHER_GAP_S = 0.25


def together_windows(comm, fn, windows: int = TOGETHER_WINDOWS, repeats: int = TOGETHER_REPEATS,
                     gap_s: float = TOGETHER_GAP_S, clock=None, sleep=None) -> list:
    """Time ``fn()`` in ``windows`` windows on every rank of ``comm`` at once; collective.

    Each window: ``comm.Barrier()`` (so the ranks' windows coincide), one untimed call, then
    ``repeats`` timed calls; the window's value is the median of its calls (``clock()`` after
    minus before each call; ``fn`` must return only when its work is done). Between windows the
    rank sleeps ``gap_s`` seconds (``sleep``), so the windows sample the load at different times.

    Args:
        comm: an mpi4py communicator (only ``Barrier`` is used).
        fn: zero-argument callable, the work to time.
        windows, repeats: >= 1. clock: seconds, default ``time.perf_counter``; sleep: default
            ``time.sleep`` (both injectable for tests).

    Returns:
        ``[seconds per call, one per window]`` (floats, in window order).

    Raises:
        ValueError: ``windows`` or ``repeats`` < 1, ``gap_s`` < 0.
    """
    import time

    if int(windows) < 1 or int(repeats) < 1 or not float(gap_s) >= 0:
        raise ValueError(f"together_windows: windows={windows}, repeats={repeats} must be >= 1 and "
                         f"gap_s={gap_s} >= 0")
    clock = clock or time.perf_counter
    sleep = sleep or time.sleep
    out = []
    for w in range(int(windows)):
        if w:
            sleep(float(gap_s))
        comm.Barrier()
        fn()
        ts = []
        for _ in range(int(repeats)):
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        out.append(float(np.median(ts)))
    return out


def measure_together(comm, split, x: np.ndarray, windows: int = TOGETHER_WINDOWS,
                     repeats: int = TOGETHER_REPEATS, gap_s: float = TOGETHER_GAP_S) -> list:
    """Seconds of one trunk forward + backward pass of the batch ``x`` while EVERY rank of ``comm``
    runs it at the same time (collective), in ``windows`` windows (:func:`together_windows`): the
    contention the ranks meet when they compute at once, on their machines' cores with whatever
    else runs there (other jobs, the ranks' own background threads), which :func:`choose` turns
    into each machine's effective cores (:func:`effective_cores`).

    The pass is traced before the first window's barrier. Returns ``[seconds per pass, one per
    window]``.
    """
    import tensorflow as tf

    from hgsgc.hourglass.costmodel import stage_passes

    conv_pass, _ = stage_passes(split)
    xt = tf.constant(x)
    float(tf.reduce_sum(conv_pass(xt)[0]))  # tracing, before the barrier
    return together_windows(comm, lambda: float(tf.reduce_sum(conv_pass(xt)[0])), windows, repeats, gap_s)


def slowdown_windows(machine_of, alone_s, together_s) -> dict:
    """The contention per machine and window, and the robust statistic :func:`effective_cores` uses.

    With ``together_s[r]`` rank ``r``'s window values (:func:`measure_together`; a single float
    is one window) and ``alone_s[r]`` its seconds for the same pass alone: in window ``w`` machine
    ``m``'s slowdown is ``s_{m,w} = median over the ranks r of m of together_s[r][w] / alone_s[r]``,
    and ``s_m = median over w of s_{m,w}`` (windows missing on a rank are left out).

    Why the median over windows: a load spike (another job's burst) slows the windows it
    overlaps; the median of ``W`` windows is unchanged by up to ``(W - 1) / 2`` of them, while
    the mean moves with every one. It estimates the typical contention of the minutes the
    measurement samples, not the load the job will meet later.

    Returns:
        ``{"per_window": [[s_{m,w} for each window] for each machine], "median": [s_m], "min":
        [...], "max": [...], "spread": [max / min per machine]}`` (floats).

    Raises:
        ValueError: a rank without window values, or ``alone_s[r] <= 0``.
    """
    tog = [list(t) if isinstance(t, (list, tuple)) else [float(t)] for t in together_s]
    if any(not t for t in tog) or any(not float(a) > 0 for a in alone_s):
        raise ValueError("slowdown_windows needs >= 1 window value per rank and alone seconds > 0")
    per_window, med, lo, hi, spread = [], [], [], [], []
    for m in range(max(machine_of) + 1 if len(machine_of) else 0):
        ranks = [r for r, mm in enumerate(machine_of) if mm == m]
        W = max(len(tog[r]) for r in ranks)
        sw = [float(np.median([tog[r][w] / alone_s[r] for r in ranks if w < len(tog[r])])) for w in range(W)]
        per_window.append(sw)
        med.append(float(np.median(sw)))
        lo.append(min(sw))
        hi.append(max(sw))
        spread.append(max(sw) / min(sw) if min(sw) > 0 else float("inf"))
    return {"per_window": per_window, "median": med, "min": lo, "max": hi, "spread": spread}


def effective_cores(machine_of, affinity_cores, alone_s, together_s, u: float):
    """Each machine's cores as its ranks get them when they all compute: with ``k_m`` ranks on
    machine ``m`` and ``s_m`` its slowdown (:func:`slowdown_windows`: the median over the
    windows of :func:`measure_together` of the median over the machine's ranks of
    ``together / alone``; one float per rank is one window),
    ``P_m = min(affinity_cores[m], u k_m / s_m)``, so that :func:`hgsgc.perfmodel.cpu_share` of
    all ranks is the measured slowdown ``s_m`` (or 1 where ``u k_m`` fits on the affinity cores).
    ``s_m <= 1`` (no contention seen): ``P_m = affinity_cores[m]`` (share 1 when ``u k_m`` fits).

    Returns:
        ``(cores per machine, slowdown per machine)`` (lists of floats).

    Raises:
        ValueError: as :func:`slowdown_windows`.
    """
    slow = slowdown_windows(machine_of, alone_s, together_s)["median"]
    cores = []
    for m, aff in enumerate(affinity_cores):
        k = sum(1 for mm in machine_of if mm == m)
        s_m = slow[m] if m < len(slow) else 1.0
        cores.append(float(aff) if s_m <= 1.0 else float(min(aff, u * k / s_m)))
    return cores, [float(x) for x in slow]


#: Seconds the delayed rank makes the others wait in :func:`measure_wait_cpu` (each of 2 rounds).
WAIT_PROBE_S = 0.5


def measure_wait_cpu(comm, wait_s: float = WAIT_PROBE_S, horovod: bool = True) -> float:
    """Cores this rank keeps busy while it WAITS for a peer, as a Hourglass rank waits: the
    ``w`` (``wait_cpu_cores``) of :func:`hgsgc.perfmodel.cpu_share`; collective over ``comm``.

    With Horovod initialised over ``comm`` (``horovod=True`` and not yet initialised: started
    here and shut down after; its background thread cycles while the rank waits, as in
    training), two rounds: in round 0 rank 0, in round 1 rank 1 sleeps ``wait_s`` seconds before
    joining an ``Ibarrier``; every other rank waits for it in :func:`hgsgc.faults.wait_for_peers`
    (the Hourglass step's wait: ``Testall`` polled with sleeps of 50 us doubling to 1 ms) and
    measures its process CPU seconds (``resource.getrusage``, all threads, user + system) over
    the wall seconds of the wait. A rank's value is its first round's.

    Session 6 measured it on the shared 2-core machine (load 10.7-15.0, 2 ranks, 2 s waits,
    ``scripts/wait_cpu.py``): median 0.29 cores (0.03-1.0) for this wait, of which the
    polling thread itself 0.015 cores and Horovod's background thread the rest; 0.21 cores
    with the rank merely sleeping (Horovod initialised); docs/hourglass.md.

    Returns:
        this rank's cores (float >= 0; 0.0 for a world of one rank).
    """
    import resource
    import time

    from hgsgc.faults import wait_for_peers

    def cpu_s():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    rank, n = comm.Get_rank(), comm.Get_size()
    if n < 2:
        return 0.0
    hvd, started = None, False
    if horovod:
        import horovod.tensorflow as hvd

        if not hvd.is_initialized():
            hvd.init(comm=comm)
            started = True
    mine = None
    try:
        for delayed in (0, 1):
            comm.Barrier()
            if rank == delayed:
                time.sleep(float(wait_s))
                wait_for_peers([comm.Ibarrier()], None, "the wait-CPU probe", max(60.0, 20 * float(wait_s)))
                continue
            c0, t0 = cpu_s(), time.perf_counter()
            wait_for_peers([comm.Ibarrier()], None, "the wait-CPU probe", max(60.0, 20 * float(wait_s)))
            wall = time.perf_counter() - t0
            if mine is None:
                mine = max(0.0, (cpu_s() - c0) / wall) if wall > 0 else 0.0
    finally:
        if started:
            hvd.shutdown()
    return float(mine or 0.0)


def measure_compression_and_update(conv_shapes, fc_shapes, compression, fc_compression,
                                   momentum: float, repeats: int = 3) -> dict:
    """This rank's compression and update costs, measured as ``hgsgc plan`` measures them.

    Compression: :func:`hgsgc.perfmodel.measure_compression_s` (``{"base_s", "per_payload_s"}``
    seconds) of one exchange of the whole model (``dp``: trunk + head shapes under
    ``compression``), of the trunk (``conv``, ``compression``) and of the head (``fc``,
    ``fc_compression``), with Horovod initialised on ``MPI.COMM_SELF`` (a world of this rank
    alone: no collective with the other ranks, which are waiting) and shut down afterwards, so
    the chosen layout initialises Horovod afresh. Update: :func:`hgsgc.perfmodel.measure_update_s`
    of the trunk's / the head's variables with SGD momentum ``momentum`` (seconds per step).

    Args:
        conv_shapes, fc_shapes: variable shapes of the trunk / the head.
        compression, fc_compression: ``hgsgc.Compression`` settings (CONV side / FC side).

    Returns:
        ``{"compression_cost": {"dp": cost, "conv": cost, "fc": cost}, "update_conv_s": s,
        "update_fc_s": s}``.

    Raises:
        RuntimeError: Horovod is already initialised in this process (``layout: auto`` must
            measure before the chosen layout starts Horovod).
    """
    import horovod.tensorflow as hvd
    from mpi4py import MPI

    from hgsgc import perfmodel

    if hvd.is_initialized():
        raise RuntimeError("layout=auto measures each rank's compression with Horovod on this rank alone: "
                           "call it before hvd.init() (hgsgc.train.run does)")
    hvd.init(comm=MPI.COMM_SELF)
    try:
        cost = {"dp": perfmodel.measure_compression_s(compression, list(conv_shapes) + list(fc_shapes), repeats),
                "conv": perfmodel.measure_compression_s(compression, conv_shapes, repeats),
                "fc": perfmodel.measure_compression_s(fc_compression, fc_shapes, repeats)}
    finally:
        hvd.shutdown()
    return {"compression_cost": cost,
            "update_conv_s": perfmodel.measure_update_s(conv_shapes, momentum, repeats),
            "update_fc_s": perfmodel.measure_update_s(fc_shapes, momentum, repeats)}


def _median_measurements(items) -> dict:
    """Per-field medians over the ranks' measurement dicts (the compression costs per key)."""
    out = {}
    for k, v in items[0].items():
        if isinstance(v, dict):
            out[k] = _median_measurements([m[k] for m in items])
        else:
            out[k] = float(np.median([m[k] for m in items]))
    return out


#: Since session 12 one rank per machine measures the per-rank figures (compute, codec, pipeline
#: stages, compression, updates) and the machine's other ranks take them: they run the same model
#: on the same batch on the same cores, so their turns repeated one measurement ``k`` times in
#: series (session 11: 4 turns, 13.4 s of AlexNet's 24 s start-up, 28 s of VGG-16's 41 s, on the
#: emulator whose 4 hosts are one machine). With one rank per host nothing changes.
ONE_PER_MACHINE = True
#: Timed calls per figure when one rank measures for its machine (5 instead of 3: the median of
#: one rank's 5 calls in place of the median over ``k`` ranks of medians of 3).
MEASURE_REPEATS_ONE_PER_MACHINE = 5
#: The parts of one rank's own turn (``startup["own_turn_parts_s"]``), in order.
OWN_TURN_PARTS = ("compute_and_codec", "pipeline_stages", "compression_and_update")


def measuring_ranks(machine_of, one_per_machine: bool = True) -> list:
    """Which rank measures for each rank: the first rank (lowest) of its machine with
    ``one_per_machine``, else the rank itself. Returns a list of ranks, one per rank."""
    first = {}
    for r, m in enumerate(machine_of):
        first.setdefault(m, r)
    return [first[m] if one_per_machine else r for r, m in enumerate(machine_of)]


def probe_bytes(link: dict, boundary: dict, n: int) -> dict:
    """``startup["probe_bytes"]``: the payload bytes the start-up's probes sent, per rank (MPI
    message bytes; the interfaces add TCP/IP headers, about 4.6 % on a 1500-byte MTU, and the
    collectives of the measurement, a few kB, are not counted):

    * ``link``: the link probe's messages (``link["bytes_sent_per_rank"]``, or by formula
      :func:`hgsgc.hourglass.costmodel.probe_link_bytes_per_rank` for the hub probe; 0 with the
      ``hourglass.link_bandwidth_mbps`` override);
    * ``boundary``: the boundary message probe's payloads (``boundary["bytes_sent_per_rank"]``).

    Returns:
        ``{"link_per_rank": [...], "boundary_per_rank": [...], "total_per_rank": [...], "total":
        sum}`` (ints, bytes).
    """
    from hgsgc.hourglass.costmodel import probe_link_bytes_per_rank

    if link.get("source") == "config":
        lk = [0] * n
    elif link.get("bytes_sent_per_rank") is not None:
        lk = [int(b) for b in link["bytes_sent_per_rank"]]
    else:
        lk = probe_link_bytes_per_rank(n)
    bd = [int(b) for b in ((boundary or {}).get("bytes_sent_per_rank") or [0] * n)]
    if len(bd) != n:
        bd = [0] * n
    tot = [a + b for a, b in zip(lk, bd)]
    return {"link_per_rank": lk, "boundary_per_rank": bd, "total_per_rank": tot, "total": int(sum(tot))}


def choose(comm, split, x, cfg, log: Optional[Callable] = None, hourglass_only: bool = False,
           one_per_machine: Optional[bool] = None, link_probe: Optional[Callable] = None) -> dict:
    """Measure on every rank, predict, decide on rank 0, broadcast; collective over ``comm``.

    A Horovod left initialised by an earlier run in this process is shut down first (on every
    rank, as :class:`~hgsgc.hourglass.layout.Layout` does); the chosen layout starts its own.
    Every rank measures alone on its machine (:func:`hgsgc.hourglass.costmodel.take_turns`):
    :func:`measure` and :func:`measure_compression_and_update`; then the link probe; rank 0 builds
    :class:`hgsgc.perfmodel.LayoutInputs` from the per-field medians (``dp_compression_s`` for
    ``n`` ranks; the CONV / FC compression per ``F`` by
    :func:`hgsgc.perfmodel.with_role_compression`, in each prediction's ``conv_exchange`` /
    ``fc_exchange``) and calls :func:`hgsgc.perfmodel.choose_layout`.

    ``hourglass_only`` (``hourglass.fc_workers: auto`` under ``layout: hourglass``): the same
    measurement and predictions, but the choice is the fastest Hourglass ``F`` (ties: fewer FC
    ranks); the data-parallel prediction stays in ``predictions`` for reference, ``"setting":
    "fc_workers=auto"``.

    ``one_per_machine`` (default :data:`ONE_PER_MACHINE`): only the first rank of each machine
    measures alone (5 timed calls per figure), the others take its figures; False: every rank
    measures, in turns (3 calls), as up to session 11. ``link_probe`` (default
    :func:`hgsgc.hourglass.costmodel.probe_link_pairs`, disjoint pairs at once; with
    ``hourglass_only`` :func:`~hgsgc.hourglass.costmodel.probe_link`, rank 0 with every rank in
    turn, as before session 12): the link probe.

    Returns (every rank): ``{"layout": "data_parallel" | "hourglass", "fc_workers": F or None,
    "inputs": {...}, "predictions": [...], "choice": {...}, "measured": {...}, "link": {...},
    "startup": {... "probe_bytes": :func:`probe_bytes`}}``.

    Raises:
        RuntimeError: a rank's measurement failed (every rank raises, naming the ranks).
    """
    from hgsgc import perfmodel
    from hgsgc.compression import as_compression
    from hgsgc.compression.codec import exchange_payload_bytes
    from hgsgc.config import compression_from_config, fc_compression_from_config

    from hgsgc.hourglass.costmodel import configured_codecs

    from hgsgc.hourglass import costmodel
    from hgsgc.hourglass.costmodel import find_machines, take_turns

    h = cfg.hourglass
    clock = StartupClock()
    one_per_machine = ONE_PER_MACHINE if one_per_machine is None else bool(one_per_machine)
    # fc_workers: auto (hourglass_only) keeps rank 0's probe with every rank in turn, as before
    link_probe = link_probe or (costmodel.probe_link if hourglass_only else costmodel.probe_link_pairs)
    cc = as_compression(compression_from_config(cfg.compression))
    fcc = as_compression(fc_compression_from_config(cfg))
    conv_shapes = [tuple(int(d) for d in v.shape) for v in split.trunk_variables]
    fc_shapes = [tuple(int(d) for d in v.shape) for v in split.head_variables]
    machines = find_machines(comm)  # collective
    import horovod.tensorflow as hvd

    from hgsgc.hourglass import layout as layout_mod

    if hvd.is_initialized():  # a Horovod of an earlier run in this process: every rank shuts it down
        hvd.shutdown()        # here, as Layout does before it initialises its own
    layout_mod._HOROVOD_GENERATION[0] += 1  # an earlier Layout's close() leaves the next Horovod alone

    clock.lap("machines")
    own = StartupClock(clock.now)  # this rank's own turn, by part
    machine_of = list(machines["machine_of"])
    measured_by = measuring_ranks(machine_of, one_per_machine)
    reps = MEASURE_REPEATS_ONE_PER_MACHINE if one_per_machine else 3

    def measure_me():
        own.lap("waiting_for_turn")
        if measured_by[comm.Get_rank()] != comm.Get_rank():  # the machine's first rank measures for it
            for part in OWN_TURN_PARTS:
                own.phases[part] = 0.0
            return None
        act_codec, grad_codec = configured_codecs(h)
        m = measure(split, x, act_codec, grad_codec, repeats=reps, micro_batches=int(h.micro_batches))
        own.lap("compute_and_codec")
        m.update(measure_pipeline_stages(split, x, int(h.micro_batches), comm.Get_size() - 1, repeats=reps))
        own.lap("pipeline_stages")
        m.update(measure_compression_and_update(conv_shapes, fc_shapes, cc, fcc, float(cfg.train.momentum)))
        own.lap("compression_and_update")
        return m

    stall = float(getattr(cfg.faults, "stall_timeout_s", 0.0) or 0.0)
    mine, err = take_turns(comm, machine_of, measure_me, stall if stall > 0 else 3600.0)
    gathered = comm.allgather((mine, err))
    errors = [e for _, e in gathered if e]
    if errors:
        raise RuntimeError("layout=auto: measurement failed on " + "; ".join(errors))
    # a rank that did not measure takes its machine's measuring rank's figures
    gathered = [(gathered[measured_by[r]][0] if m is None else m, e) for r, (m, e) in enumerate(gathered)]
    clock.lap("alone_in_turns")
    # every rank at once: the contention the alone measurements do not see (collective)
    together_all = _on_every_rank(comm, "measurement of all ranks at once",
                                  lambda: measure_together(comm, split, x))
    clock.lap("together")
    # what a waiting rank burns (Horovod's background thread + hgsgc's poll loop), collective
    wait_all = _on_every_rank(comm, "measurement of the waiting ranks' CPU", lambda: measure_wait_cpu(comm))
    clock.lap("wait_cpu")
    # collective (probe) unless overridden; disjoint pairs at once since session 12
    link = link_inputs(comm, getattr(h, "link_bandwidth_mbps", None), probe=link_probe)
    clock.lap("link")
    # the boundary message on the trainer's path, rank 0 <-> every other rank (collective)
    act_codec, grad_codec = configured_codecs(h)
    sample = []  # this rank's micro-batch (only errors travel: every rank computes its own)
    _on_every_rank(comm, "boundary sample",
                   lambda: sample.extend(costmodel.boundary_sample(split, x, int(h.micro_batches))))
    probe = costmodel.probe_boundary(comm, act_codec, grad_codec, *sample)
    clock.lap("boundary")
    report = None
    if comm.Get_rank() == 0:
        meas = _median_measurements([m for m, _ in gathered])
        msg = costmodel.boundary_message_inputs(probe, meas["act_bytes"], meas["grad_bytes"], meas["codec_s"],
                                                link["alpha_s"], link["beta_Bps"])
        cost = meas["compression_cost"]
        n = comm.Get_size()
        alone = [m["t_conv"] * len(x) for m, _ in gathered]
        windows = list(together_all)
        cores, slowdown = effective_cores(machines["machine_of"], machines["machine_cores"], alone, windows,
                                          meas["cpu_parallelism"])
        contention = slowdown_windows(machines["machine_of"], alone, windows)
        inputs = perfmodel.LayoutInputs(
            world_size=n, batch_size=len(x), t_conv=meas["t_conv"], t_fc=meas["t_fc"],
            act_bytes=meas["act_bytes"], grad_bytes=meas["grad_bytes"], codec_s=meas["codec_s"],
            alpha=link["alpha_s"], beta=link["beta_Bps"],
            dp_payload=float(exchange_payload_bytes(cc, conv_shapes + fc_shapes)),
            conv_payload=float(exchange_payload_bytes(cc, conv_shapes)),
            fc_payload=float(exchange_payload_bytes(fcc, fc_shapes)),
            dp_algorithm=perfmodel.algorithm_of(cc), conv_algorithm=perfmodel.algorithm_of(cc),
            fc_algorithm=perfmodel.algorithm_of(fcc), delay=int(cc.delay), fc_delay=int(fcc.delay),
            micro_batches=int(h.micro_batches), cycle_s=perfmodel.horovod_cycle_s(),
            dp_compression_s=perfmodel.compression_at(cost["dp"], n, perfmodel.algorithm_of(cc)),
            t_update_conv=meas["update_conv_s"], t_update_fc=meas["update_fc_s"],
            machine_of=tuple(machines["machine_of"]), machine_cores=tuple(cores),
            cpu_parallelism=meas["cpu_parallelism"], conv_fwd_mb_s=meas["conv_fwd_mb_s"],
            conv_bwd_mb_s=meas["conv_bwd_mb_s"], fc_call_s=meas["fc_call_s"], fc_row_s=meas["fc_row_s"],
            wait_cpu_cores=float(np.median(wait_all)), boundary_msg_s=msg["boundary_msg_s"],
            # compression.buckets: one collective per bucket, as hgsgc plan charges (same sizes)
            dp_buckets=perfmodel.allgather_buckets(cc, conv_shapes + fc_shapes),
            conv_buckets=perfmodel.allgather_buckets(cc, conv_shapes),
            fc_buckets=perfmodel.allgather_buckets(fcc, fc_shapes))
        report = perfmodel.choose_layout(
            inputs, inputs_at=lambda F: perfmodel.with_role_compression(inputs, F, cost["conv"], cost["fc"]),
            hourglass_only=hourglass_only, fc_workers=None if h.fc_workers == "auto" else int(h.fc_workers))
        report["setting"] = "fc_workers=auto" if hourglass_only else "layout=auto"
        report["measured"] = {"density_of_nonzero_activations": meas["density"], "link_pairs": link["pairs"],
                              "boundary_message": msg,
                              "compression_cost": cost, "machines": machines,
                              "together": {"trunk_pass_windows_s": windows,
                                           "trunk_pass_s": [float(np.median(w)) for w in windows],
                                           "slowdown_per_window": contention["per_window"],
                                           "slowdown_spread_per_machine": contention["spread"],
                                           "statistic": "median over windows of the median over a "
                                                        "machine's ranks of together / alone",
                                           "windows": len(contention["per_window"][0]), "gap_s": TOGETHER_GAP_S,
                                           "slowdown_per_machine": slowdown, "effective_cores": cores},
                              "per_rank": [{k: v for k, v in m.items()} for m, _ in gathered],
                              "wait_cpu_cores_per_rank": list(wait_all),
                              "measured_alone": ("the first rank of each machine, machines at once; a "
                                                 "machine's other ranks take its figures" if one_per_machine
                                                 else "ranks of one machine in turns (costmodel.take_turns)"),
                              "measured_by": list(measured_by), "repeats": reps}
        report["link"] = link
    report = comm.bcast(report, root=0)
    clock.lap("model")
    # what the start-up measurement cost (its own seconds, every rank; one more small collective)
    own_parts = {k: v for k, v in own.phases.items() if k != "waiting_for_turn"}
    report["startup"] = startup_record(comm.allgather({"phases_s": clock.phases, "own_turn_s": sum(own_parts.values()),
                                                       "own_turn_parts_s": own_parts}))
    report["startup"]["probe_bytes"] = probe_bytes(link, probe, comm.Get_size())
    if log is not None and comm.Get_rank() == 0:
        from hgsgc.hourglass.costmodel import describe_link

        tog = report["measured"]["together"]
        log(perfmodel.format_layout_report(report) + f"\nlink: {describe_link(link)}\ncontention, all ranks "
            f"at once / alone, per machine: windows " + "; ".join(
                " ".join(f"{v:.2f}" for v in sw) for sw in tog["slowdown_per_window"])
            + f" -> median {[round(v, 2) for v in tog['slowdown_per_machine']]}, spread (max/min) "
            f"{[round(v, 2) for v in tog['slowdown_spread_per_machine']]}; a waiting rank keeps "
            f"{report['inputs']['wait_cpu_cores']:.3f} cores busy (median over ranks of "
            f"{[round(v, 3) for v in report['measured']['wait_cpu_cores_per_rank']]})\n"
            + describe_startup(report["startup"]))
    return report


#: The phases of :func:`choose`'s start-up measurement, in order (:class:`StartupClock` laps).
STARTUP_PHASES = ("machines", "alone_in_turns", "together", "wait_cpu", "link", "boundary", "model")


class StartupClock:
    """Wall seconds of consecutive phases on this rank (``time.perf_counter``; ``clock``
    injectable): :meth:`lap` ``(name)`` records the seconds since the previous lap (or since
    construction) under ``name`` in :attr:`phases` (a dict in lap order)."""

    def __init__(self, clock=None):
        import time

        self.now = clock or time.perf_counter
        self.phases = {}
        self._last = self.now()

    def lap(self, name: str) -> float:
        """Record and return the seconds since the previous lap under ``name``."""
        t = self.now()
        self.phases[name] = float(t - self._last)
        self._last = t
        return self.phases[name]


def startup_record(per_rank: list, total_per_rank: Optional[list] = None) -> dict:
    """``layout_choice["startup"]``: what ``layout: auto``'s start-up measurement cost.

    Args:
        per_rank: one ``{"phases_s": {phase: seconds}, "own_turn_s": seconds,
            "own_turn_parts_s": {part: seconds}}`` per rank, in rank order (:class:`StartupClock`
            laps of :func:`choose`; ``own_turn_s``: this rank's own measurement alone, inside
            ``alone_in_turns``, where the ranks of one machine wait for each other's turns; its
            parts ``compute_and_codec`` (:func:`measure`), ``pipeline_stages``,
            ``compression_and_update``; optional).
        total_per_rank: seconds from the start of :func:`run` to the choice, per rank (TF
            thread set-up, checkpoint check, the task's data and model, the first batch, and
            :func:`choose`), or None (``fc_workers: auto``).

    Returns:
        ``{"phases_s": {phase: max over ranks}, "own_turn_s": [per rank], "own_turn_parts_s":
        [per rank], "per_rank_phases_s": [...], "total_s": max over ranks or None,
        "total_per_rank_s": [...] or None, "before_choose_s": [per rank: total minus the
        phases, i.e. the data, model and batch :func:`run` prepares] or None}``: the phases end at
        collectives, so the slowest rank's seconds are the job's.
    """
    names = [p for p in STARTUP_PHASES if any(p in r["phases_s"] for r in per_rank)]
    out = {"phases_s": {p: max(float(r["phases_s"].get(p, 0.0)) for r in per_rank) for p in names},
           "own_turn_s": [float(r["own_turn_s"]) for r in per_rank],
           "own_turn_parts_s": [dict(r.get("own_turn_parts_s", {})) for r in per_rank],
           "per_rank_phases_s": [dict(r["phases_s"]) for r in per_rank],
           "total_s": None, "total_per_rank_s": None, "before_choose_s": None}
    if total_per_rank is not None:
        set_total(out, total_per_rank)
    return out


def set_total(startup: dict, total_per_rank) -> dict:
    """Add the totals (seconds per rank from :func:`run`'s start to the choice) to a
    :func:`startup_record`: ``total_per_rank_s``, ``total_s`` (the max) and ``before_choose_s``
    (each rank's total minus its phases; the whole total where nothing was measured)."""
    per = startup.get("per_rank_phases_s") or []
    startup["total_per_rank_s"] = [float(t) for t in total_per_rank]
    startup["total_s"] = max(startup["total_per_rank_s"])
    startup["before_choose_s"] = [t - (sum(per[r].values()) if r < len(per) else 0.0)
                                  for r, t in enumerate(startup["total_per_rank_s"])]
    return startup


def describe_startup(startup: dict) -> str:
    """One log line of :func:`startup_record`'s figures."""
    ph = startup.get("phases_s", {})
    own = startup.get("own_turn_s") or []
    parts = [f"{p.replace('_', ' ')} {ph[p]:.2f}" for p in STARTUP_PHASES if p in ph]
    head = (f"layout auto: start-up {startup['total_s']:.2f} s in all; "
            if startup.get("total_s") is not None else "layout auto: start-up measurement: ")
    if startup.get("before_choose_s"):
        parts.insert(0, f"data, model and batch {max(startup['before_choose_s']):.2f}")
    turn = f" (own turn {float(np.median(own)):.2f} s per rank, median)" if own else ""
    pb = startup.get("probe_bytes")
    probes = (f"; the probes sent {pb['total'] / 1e6:.2f} MB (link {sum(pb['link_per_rank']) / 1e6:.2f}, "
              f"boundary {sum(pb['boundary_per_rank']) / 1e6:.2f}; per rank "
              f"{[round(b / 1e6, 2) for b in pb['total_per_rank']]} MB)") if pb else ""
    return head + ", ".join(parts) + " s" + turn + probes


def _on_every_rank(comm, what: str, measure):
    """``measure()`` on every rank, then one allgather of ``(value, error)`` that every rank
    reaches, failed or not: a failure on any rank raises on all of them (never a hang).

    Returns:
        the list of the ranks' values, in rank order.

    Raises:
        RuntimeError: ``"layout=auto: <what> failed on rank r: <Type>: <message>; ..."``.
    """
    try:
        value, err = measure(), None
    except Exception as exc:  # reported on every rank, never left to hang the others
        value, err = None, f"rank {comm.Get_rank()}: {type(exc).__name__}: {exc}"
    gathered = comm.allgather((value, err))
    errors = [e for _, e in gathered if e]
    if errors:
        raise RuntimeError(f"layout=auto: {what} failed on " + "; ".join(errors))
    return [v for v, _ in gathered]


def checkpoint_layout(cfg, world):
    """``(layout, fc_workers or None, folder)`` of the checkpoint the runner will resume
    (``checkpoint.resume``: auto, the newest complete one in the run's checkpoint folder; or the
    folder given), or None; rank 0 reads the manifest, every rank gets the same answer.

    A requeued ``layout: auto`` job measured and chose again; the choice is noisy, and any other
    layout or ``fc_workers`` than the checkpoint's was refused as another run's, so the requeued
    job failed. Problems with the checkpoint itself are left to the runner's resume, which
    reports them.
    """
    import os

    from hgsgc import checkpoint as ckpt

    found, k = None, cfg.checkpoint
    if world.Get_rank() == 0 and k.resume != "never":
        d = k.dir or (os.path.join(cfg.run.out_dir, cfg.run.id, "checkpoints") if cfg.run.id else None)
        try:
            path = (ckpt.latest(d) if d else None) if k.resume == "auto" else k.resume
            run = ckpt.read_manifest(path).get("run", {}) if path else {}
            if run.get("layout") == "hourglass":
                found = ("hourglass", len(run["roles"]["fc"]), path)
            elif run.get("layout") == "data_parallel":
                found = ("data_parallel", None, path)
        except (ckpt.CheckpointError, KeyError, TypeError):
            found = None
    return world.bcast(found, root=0)


def _measure_and_choose(cfg, world, log) -> dict:
    """:func:`run`'s choice for a run that resumes no checkpoint."""
    from hgsgc.hourglass.split import SplitError, split_model
    from hgsgc.models import why_no_boundary
    from hgsgc.tasks import make_task

    task = make_task(cfg)
    try:
        why = why_no_boundary(cfg.model.name, cfg.hourglass.split_layer)
        if why:  # what the model is, not how splitting fails
            raise SplitError(f"model {cfg.model.name} has no conv/FC boundary ({why})")
        split = split_model(task.build_model(), cfg.hourglass.split_layer)
    except SplitError as exc:
        split, reason = None, str(exc)
    if split is None or world.Get_size() < 2:
        report = {"layout": "data_parallel", "fc_workers": None,
                  "reason": reason if split is None else "one rank: no Hourglass layout possible"}
        if world.Get_rank() == 0:
            log(f"layout auto -> data_parallel ({report['reason']})")
        return report
    batches, _ = task.train_data(0, 1, 0)  # the first training batch of epoch 0 (every rank the same)
    x = np.asarray(next(iter(batches))[0], dtype=np.float32)
    return choose(world, split, x, cfg, log=log)


def chosen_config(cfg, report: dict):
    """The configuration the chosen layout runs with: ``cfg`` with ``layout`` (and, for the
    Hourglass, ``hourglass.fc_workers``) set from ``report`` (:func:`choose`'s or a resumed
    checkpoint's ``{"layout", "fc_workers"}``), i.e. the configuration of the explicit job.

    For data parallelism the Hourglass-only settings (``hgsgc.config.HOURGLASS_ONLY_KEYS``: codecs,
    micro-batches, wire dtype, FC delay) go back to their defaults, and ``compression.bits``,
    ``compression.index_coding``, ``density`` and ``selector`` to None where only a sparse ``hourglass.fc_method`` used them
    (the CONV method is not sparse): ``layout: data_parallel`` refuses them, so a run that kept them wrote a ``config.json`` that ``hgsgc train`` refused
    (``hourglass.micro_batches=2 is invalid``) and that was not the explicit data-parallel job's.
    The data-parallel runner never reads them, so training is unchanged.

    Returns:
        a validated :class:`hgsgc.config.Config`.

    Raises:
        hgsgc.config.ConfigError: the chosen configuration is invalid (a defect: ``layout:
            auto`` accepted it).
    """
    import dataclasses

    from hgsgc import config as config_mod

    h = cfg.hourglass
    if report["layout"] == "hourglass":
        chosen = dataclasses.replace(cfg, layout="hourglass",
                                     hourglass=dataclasses.replace(h, fc_workers=int(report["fc_workers"])))
    else:
        dh = config_mod.HourglassConfig()
        c = cfg.compression
        if c.method not in config_mod.SPARSE_METHODS:  # they were there for the FC ranks' sparse method only
            c = dataclasses.replace(c, bits=None, index_coding=None, density=None, selector=None)
        chosen = dataclasses.replace(cfg, layout="data_parallel", compression=c, hourglass=dataclasses.replace(
            h, **{k: getattr(dh, k) for k in config_mod.HOURGLASS_ONLY_KEYS}))
    config_mod.validate(chosen)
    return chosen


def run(cfg, run_layout, log=print) -> dict:
    """``layout: auto``: :func:`choose`, then run the chosen layout with ``run_layout(cfg, log=)``
    (``hgsgc.train.run``, passed in so this module does not import the runner); the summary
    (and rank 0's ``summary.json``) gets ``layout_setting: "auto"`` and ``layout_choice`` (the
    inputs, every prediction, the choice, and ``startup``: the seconds the start-up measurement
    itself took, per phase and in all, :func:`startup_record`). A model without a conv/FC
    boundary runs data-parallel without measuring (the reason is logged and recorded).

    ``hourglass.fc_workers``: ``auto`` weighs the Hourglass with ``F = 1 .. n/2`` FC ranks; an
    integer ``F`` weighs data parallelism against the Hourglass with ``F`` only (before session
    21 the integer was ignored; :class:`hgsgc.hourglass.layout.LayoutError` when ``F`` does not
    fit ``n`` ranks, as under ``layout: hourglass``).

    Nothing of the measurement stays in the chosen run: it gets the configuration of the explicit
    ``layout:`` job (:func:`chosen_config`), re-seeds, starts its own Horovod, and trains exactly
    as that explicit run does
    (tests/test_hourglass_auto_same_run.py: the same losses, bytes, threads and configuration).
    """
    import json
    import os
    import time

    from mpi4py import MPI

    from hgsgc.loop import setup_threads

    t_start = time.perf_counter()
    world = MPI.COMM_WORLD
    if cfg.hourglass.fc_workers != "auto" and world.Get_size() >= 2:
        # an integer restricts the Hourglass candidate to that many FC ranks: refused for this
        # rank count as layout: hourglass refuses it (sizes only: the same verdict on every rank)
        from hgsgc.hourglass.layout import check_fc_workers

        check_fc_workers(world.Get_size(), cfg.hourglass.fc_workers)
    setup_threads(cfg.train.threads)
    import tensorflow as tf

    tf.keras.utils.set_random_seed(cfg.run.seed)
    # the configured task's data and model (format, width, input shape, classes), as the runners
    # build them (_measure_and_choose); a DataError there is raised on every rank, before any
    # collective
    resumed = checkpoint_layout(cfg, world)
    if resumed is not None:  # a requeued job: the layout its checkpoint was written by
        lay, fc, path = resumed
        report = {"layout": lay, "fc_workers": fc,
                  "reason": f"the layout of the checkpoint being resumed, {path}"}
        if world.Get_rank() == 0:
            log(f"layout auto -> {lay}{f' with {fc} FC ranks' if fc else ''} ({report['reason']})")
    else:
        report = _measure_and_choose(cfg, world, log)
    # the start-up's own cost: seconds from here to the choice on every rank (one small collective)
    startup = report.get("startup") or startup_record([])
    report["startup"] = set_total(startup, world.allgather(time.perf_counter() - t_start))
    if world.Get_rank() == 0:
        log(describe_startup(startup))
    summary = run_layout(chosen_config(cfg, report), log=log)
    summary["layout_setting"] = "auto"
    summary["layout_choice"] = report
    if world.Get_rank() == 0:
        path = os.path.join(cfg.run.out_dir, summary["run_id"], "summary.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
    world.Barrier()
    return summary
