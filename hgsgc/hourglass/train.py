"""The Hourglass runner: an image task with CONV ranks (trunk + SGC) and FC ranks (head).

Every rank runs :func:`run`. The run folder, metrics.jsonl, TensorBoard, progress and shared summary
keys come from :mod:`hgsgc.loop` (the data-parallel runner uses the same), the data and model from
the task (:mod:`hgsgc.tasks`; image formats only: the config refuses models without a conv/FC
boundary). Rank 0 (always a CONV rank) prints progress and writes
``runs/<id>/metrics.jsonl`` (one JSON line per epoch; with ``train.log_every_steps`` also a line
every N steps whose ``train_loss`` is the epoch's running mean), ``runs/<id>/summary.json`` and
``runs/<id>/model.keras`` (one ordinary Keras model: trunk from CONV rank 0, head from the first
FC rank). The summary has the keys of the data-parallel job (``hgsgc.train``) plus per-role
figures under ``roles`` and the layout under ``hourglass``; the per-rank keys are means over all
ranks (see docs/hourglass.md, "Accounting"). ``thread_cpu``: the CPU per timed step of each thread
group of every rank (:mod:`hgsgc.bench_threads`, as the data-parallel runner writes it), with a
per-role split under ``thread_cpu["roles"]``.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from hgsgc.costs import ring_allreduce_bytes_f as _ring


def fc_compression_from_config(cfg):
    """Compression among FC ranks: :func:`hgsgc.config.fc_compression_from_config`."""
    from hgsgc.config import fc_compression_from_config as convert

    return convert(cfg)


def phase_profile(records) -> dict:
    """Per-role mean seconds per step of each phase, from every rank's
    ``(rank, role, trainer.phase_times(), step_times)`` (the first, tracing step excluded).

    Returns:
        ``{"conv": {...}, "fc": {...}}``, each with ``step_s`` (the role's mean step time), the
        role's phases (``conv_wait_s``, ``codec_s``; ``fc_recv_wait_s``, ``fc_compute_s``,
        ``fc_apply_s``, ``fc_send_wait_s``, ``codec_s``) and ``other_s`` = step_s minus the phases
        (CONV: trunk compute + the CONV gradient exchange; FC: decode/concatenate and loop
        overhead), all seconds per step averaged over the role's ranks.
    """
    keys = {"conv": ("conv_wait_s", "codec_s"),
            "fc": ("fc_recv_wait_s", "fc_compute_s", "fc_apply_s", "fc_send_wait_s", "codec_s")}
    out = {}
    for role, ks in keys.items():
        rows = [(t, st) for _, r, t, st in records if r == role and st]
        if not rows:
            continue
        steps = [len(st) for _, st in rows]
        rec = {"step_s": float(np.mean([sum(st) / n for (_, st), n in zip(rows, steps)]))}
        for k in ks:
            rec[k] = float(np.mean([t[k] / n for (t, _), n in zip(rows, steps)]))
        rec["other_s"] = rec["step_s"] - sum(rec[k] for k in ks)
        out[role] = rec
    return out


def pipeline_overlap(profile) -> dict:
    """How much of the two stages' work ran at the same time, from :func:`phase_profile`.

    ``conv_busy_s`` = CONV step time minus its waits for activation gradients (trunk forward +
    backward, codec, CONV exchange); ``fc_busy_s`` = head compute + codec + FC exchange/update;
    ``step_s`` = the slower role's mean step time. ``overlap = (conv_busy + fc_busy - step) /
    min(conv_busy, fc_busy)``, clipped to [0, 1]: 0 = the stages ran one after the other (or wire
    time filled the gap), 1 = the shorter stage was hidden entirely behind the longer one;
    ``step_over_slower_stage = step / max(conv_busy, fc_busy)`` (1 = the step takes as long as the
    slower stage, the pipelined ideal). Empty when a role has no profile.
    """
    if "conv" not in profile or "fc" not in profile:
        return {}
    c, f = profile["conv"], profile["fc"]
    conv_busy = max(0.0, c["step_s"] - c["conv_wait_s"])
    fc_busy = f["fc_compute_s"] + f["codec_s"] + f["fc_apply_s"]
    step = max(c["step_s"], f["step_s"])
    lo = min(conv_busy, fc_busy)
    ov = (conv_busy + fc_busy - step) / lo if lo > 0 else 0.0
    return {"conv_busy_s": conv_busy, "fc_busy_s": fc_busy, "step_s": step,
            "overlap": float(min(1.0, max(0.0, ov))),
            "step_over_slower_stage": step / max(conv_busy, fc_busy) if max(conv_busy, fc_busy) else 0.0}


def role_figures(snaps, layout, d_role, steps, compression) -> dict:
    """Per-role bytes per step per rank from every rank's snapshot difference.

    Args:
        snaps: list indexed by world rank of :meth:`HourglassTrainer.snapshot` differences.
        d_role: ``{"conv": d_conv, "fc": d_fc}`` parameters of each role.
        steps: training steps the differences cover.
        compression: ``{"conv": settings dict, "fc": settings dict}``.
    """
    steps = max(1, steps)
    plan = layout.plan
    out = {}
    for role, ranks in (("conv", plan.conv_ranks), ("fc", plan.fc_ranks)):
        per_rank = []
        for r in ranks:
            s = snaps[r]
            per_rank.append({
                "rank": r,
                "activation_bytes_sent": (s["activation_bytes_sent"] + s["label_bytes_sent"]) / steps,
                "activation_bytes_received": (s["activation_bytes_received"] + s["label_bytes_received"]) / steps,
                "activation_grad_bytes_sent": s["activation_grad_bytes_sent"] / steps,
                "activation_grad_bytes_received": s["activation_grad_bytes_received"] / steps,
                "payload_bytes": s["exchange_payload_bytes"] / steps,
                "exchange_bytes_sent": s["exchange_bytes_sent"] / steps,
                "exchange_bytes_received": s["exchange_bytes_received"] / steps,
                "bytes_sent": s["bytes_sent"] / steps,
                "bytes_received": s["bytes_received"] / steps,
                "exchanges": s["exchange_exchanges"],
            })
        mean = {k: float(np.mean([p[k] for p in per_rank])) for k in per_rank[0] if k != "rank"}
        grad_bytes = 4 * d_role[role]
        payload = mean["payload_bytes"]
        fig = {
            "ranks": list(ranks),
            "parameters": d_role[role],
            "compression": compression[role],
            "gradient_bytes": grad_bytes,
            # activations: float32 A plus int32 labels (CONV -> FC); gradients: dL/dA (FC -> CONV)
            "activation_bytes_sent_per_step_per_rank": mean["activation_bytes_sent"],
            "activation_bytes_received_per_step_per_rank": mean["activation_bytes_received"],
            "activation_grad_bytes_sent_per_step_per_rank": mean["activation_grad_bytes_sent"],
            "activation_grad_bytes_received_per_step_per_rank": mean["activation_grad_bytes_received"],
            "payload_bytes_per_step_per_rank": payload,
            "exchange_bytes_sent_per_step_per_rank": mean["exchange_bytes_sent"],
            "exchange_bytes_received_per_step_per_rank": mean["exchange_bytes_received"],
            "bytes_sent_per_step_per_rank": mean["bytes_sent"],
            "bytes_received_per_step_per_rank": mean["bytes_received"],
            "dense_bytes_per_step_per_rank": _ring(len(ranks), grad_bytes),
            "compression_ratio": grad_bytes / payload if payload else float("inf"),
            "exchanges": int(max(p["exchanges"] for p in per_rank)),
            "per_rank": per_rank,
        }
        out[role] = fig
    return out


def _totals(roles, size, d):
    """The data-parallel summary keys for the whole job, comparable across layouts.

    ``gradient_bytes`` is ``4 d`` for the whole model (what a data-parallel rank exchanges);
    ``payload_bytes_per_step_per_rank`` is the mean over all ranks of the gradient payload each
    rank actually exchanges (a role with a single rank exchanges nothing: 0), so
    ``compression_ratio = 4 d / payload`` says how much less gradient data a rank exchanges than
    dense data parallelism; ``bytes_*_per_step_per_rank`` are means over all ranks of everything
    crossing a rank's link (activations, labels, activation gradients and gradient exchanges).
    Because ``compression_ratio`` ignores the activation traffic, ``traffic_reduction_vs_dense``
    (dense data-parallel bytes sent per step, all ranks, over this job's) is the figure to compare
    layouts by.
    """
    n = {r: len(roles[r]["ranks"]) for r in ("conv", "fc")}

    def mean(key):
        return sum(roles[r][key] * n[r] for r in n) / size

    payload = sum(roles[r]["payload_bytes_per_step_per_rank"] * n[r] for r in n if n[r] > 1) / size
    sent = mean("bytes_sent_per_step_per_rank")
    return {
        "gradient_bytes": 4 * d,
        "payload_bytes_per_step_per_rank": payload,
        "bytes_sent_per_step_per_rank": sent,
        "bytes_received_per_step_per_rank": mean("bytes_received_per_step_per_rank"),
        # the data-parallel dense baseline: fp32 ring allreduce of the whole model on every rank
        "dense_bytes_per_step_per_rank": _ring(size, 4 * d),
        "gradient_compression_ratio": 4 * d / payload if payload else float("inf"),
        "total_bytes_sent_per_step": sent * size,
        "dense_total_bytes_sent_per_step": _ring(size, 4 * d) * size,
        # everything on the wire (activations included) against dense data parallelism
        "traffic_reduction_vs_dense": (_ring(size, 4 * d) / sent) if sent else float("inf"),
    }


def step_traffic(snaps, layout, steps, d_conv, d_fc, batch_size, features) -> dict:
    """Every byte that crosses the network per step, by part, against its uncompressed size.

    Args:
        snaps: list indexed by world rank of :meth:`HourglassTrainer.snapshot` differences.
        steps: training steps the differences cover; ``d_conv``, ``d_fc``: parameter counts;
        batch_size: ``b`` per CONV rank; features: ``f`` boundary entries per example.

    Returns:
        ``{"bytes_per_step": total, "dense_data_parallel_bytes_per_step": 2 (n-1) 4 d,
        "ratio": dense / total (THE headline compression figure of the layout), "parts": {...}}``
        where each part (``activations``, ``labels``, ``activation_gradients``, ``conv_exchange``,
        ``fc_exchange``) has ``bytes_per_step`` (sent, summed over all ranks), ``reference_bytes_per_step``
        (activations / activation gradients: fp32 ``4 C b f``; labels ``4 C b``; exchanges: a
        dense fp32 ring allreduce of the role's ``4 d`` among the role's ranks, ``2 (k-1) 4 d``
        summed over its ``k`` ranks) and ``ratio`` = reference / bytes; plus ``boundary``
        (activations + labels + activation gradients together).
    """
    steps = max(1, steps)
    plan = layout.plan
    C, F, n = plan.n_conv, plan.n_fc, plan.world_size
    conv, fc = plan.conv_ranks, plan.fc_ranks

    def tot(ranks, key):
        return sum(snaps[r][key] for r in ranks) / steps

    fp32_boundary = 4 * C * batch_size * features
    parts = {
        "activations": (tot(conv, "activation_bytes_sent"), fp32_boundary),
        "labels": (tot(conv, "label_bytes_sent"), 4 * C * batch_size),
        "activation_gradients": (tot(fc, "activation_grad_bytes_sent"), fp32_boundary),
        "conv_exchange": (tot(conv, "exchange_bytes_sent"), _ring(C, 4 * d_conv) * C),
        "fc_exchange": (tot(fc, "exchange_bytes_sent"), _ring(F, 4 * d_fc) * F),
    }
    b_sent = sum(parts[k][0] for k in ("activations", "labels", "activation_gradients"))
    b_ref = sum(parts[k][1] for k in ("activations", "labels", "activation_gradients"))
    parts["boundary"] = (b_sent, b_ref)
    out = {k: {"bytes_per_step": v, "reference_bytes_per_step": r,
               "ratio": (r / v) if v else (float("inf") if r else 1.0)} for k, (v, r) in parts.items()}
    total = sum(out[k]["bytes_per_step"] for k in out if k != "boundary")
    dense = _ring(n, 4 * (d_conv + d_fc)) * n
    return {"bytes_per_step": total, "dense_data_parallel_bytes_per_step": dense,
            "ratio": dense / total if total else float("inf"), "parts": out}


def traffic_line(t) -> str:
    """One log line: the whole-step figure first, the parts beside it."""
    p = t["parts"]
    return (f"network per step {t['bytes_per_step'] / 1e3:.1f} kB vs dense data-parallel "
            f"{t['dense_data_parallel_bytes_per_step'] / 1e3:.1f} kB: {t['ratio']:.1f}x "
            f"(activations {p['activations']['bytes_per_step'] / 1e3:.1f} kB "
            f"[{p['activations']['ratio']:.1f}x vs fp32], activation gradients "
            f"{p['activation_gradients']['bytes_per_step'] / 1e3:.1f} kB "
            f"[{p['activation_gradients']['ratio']:.1f}x], labels {p['labels']['bytes_per_step'] / 1e3:.2f} kB, "
            f"CONV exchange {p['conv_exchange']['bytes_per_step'] / 1e3:.2f} kB, "
            f"FC exchange {p['fc_exchange']['bytes_per_step'] / 1e3:.2f} kB)")


def thread_cpu_by_role(per_rank, conv_ranks, fc_ranks) -> Optional[dict]:
    """The CPU per timed step of every thread group (hgsgc.bench_threads), over all ranks and per role.

    Args:
        per_rank: every world rank's :meth:`hgsgc.bench_threads.StepCPU.result` in rank order
            (None for a rank that timed no step).
        conv_ranks, fc_ranks: the world ranks of each role (``Layout.plan``).
    Returns:
        :func:`hgsgc.bench_threads.combine_ranks` of all ranks (the same keys as the data-parallel
        ``summary.json["thread_cpu"]``, so ``hgsgc bench`` reads both alike) plus ``roles``:
        ``{"conv": ..., "fc": ...}``, each ``combine_ranks`` of that role's ranks without the
        per-rank records (they are in ``ranks``) and with ``world_ranks``: the role's ranks that
        measured. None when no rank measured.
    """
    from hgsgc import bench_threads

    per_rank = list(per_rank)
    out = bench_threads.combine_ranks(per_rank)
    if out is None:
        return None
    roles = {}
    for role, ranks in (("conv", conv_ranks), ("fc", fc_ranks)):
        mine = [int(r) for r in ranks if per_rank[int(r)] is not None]
        c = bench_threads.combine_ranks([per_rank[r] for r in mine])
        if c is not None:
            c.pop("ranks")
            c["world_ranks"] = mine
        roles[role] = c
    out["roles"] = roles
    return out


def run(cfg, log=print) -> dict:
    """Train and evaluate with the Hourglass layout; returns the summary (same on every rank).

    Raises:
        hgsgc.hourglass.LayoutError: impossible layout (every rank, before any collective).
        hgsgc.hourglass.SplitError: the model has no conv/FC boundary (every rank, before any
            collective).
        hgsgc.data.DataError: data files missing or malformed.
        ValueError: batch size too large for the data.
    """
    from mpi4py import MPI

    from hgsgc.hourglass.layout import check_fc_workers

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    is_root = rank == 0
    check_fc_workers(size, cfg.hourglass.fc_workers)  # sizes only: same verdict on every rank

    from hgsgc.loop import RunLog, lr_schedule, new_run_id, setup_threads, summary_base

    threads = setup_threads(cfg.train.threads)
    import tensorflow as tf

    from hgsgc import checkpoint as ckpt
    from hgsgc import config as config_mod
    from hgsgc.faults import configure_stall_check, world_comm
    from hgsgc.tasks import check_same_data, make_task

    configure_stall_check(cfg.faults.stall_timeout_s)  # before Layout initialises Horovod
    from hgsgc.hourglass.layout import Layout
    from hgsgc.hourglass.split import split_model
    from hgsgc.hourglass.step import HourglassTrainer

    compression = config_mod.compression_from_config(cfg.compression)
    fc_compression = fc_compression_from_config(cfg)
    tf.keras.utils.set_random_seed(cfg.run.seed)
    if cfg.train.deterministic:
        tf.config.experimental.enable_op_determinism()
    ckpt_comm = world_comm()
    task = make_task(cfg)  # DataError on every rank (FC ranks too) before any collective
    check_same_data(task, ckpt_comm, cfg)  # node-local copies of another size: one line, not a hang
    model = task.build_model()
    split = split_model(model, cfg.hourglass.split_layer)  # SplitError on every rank
    b = cfg.train.batch_size

    fc_workers, auto_report = cfg.hourglass.fc_workers, None
    if fc_workers == "auto":
        # the measurement and model of layout: auto (compute, codec, pipeline stages per
        # micro-batch, compression, updates, CPU share, the link probe), among the Hourglass
        # candidates only (hgsgc.hourglass.auto.choose(hourglass_only=True)), on the first
        # training batch of epoch 0 as layout: auto measures it
        from hgsgc.hourglass.auto import choose

        first, _ = task.train_data(0, 1, 0)
        xb = np.asarray(next(iter(first))[0], dtype=np.float32)[:b]
        auto_report = choose(world, split, xb, cfg, log=log if is_root else None, hourglass_only=True)
        fc_workers = int(auto_report["fc_workers"])
    from hgsgc import bench_threads

    # which threads hvd.init() (inside Layout) starts: Horovod's background thread and Open MPI's
    # (MPI itself was initialised by mpi4py before, as in the data-parallel runner)
    thread_groups = bench_threads.ThreadGroups()
    thread_groups.before_init()
    layout = Layout(world, fc_workers, log=log if is_root else None)
    thread_groups.after_init()
    if auto_report is not None:
        layout.cost_report = auto_report
    C, F = layout.n_conv, layout.n_fc
    _, steps_per_epoch = task.train_data(0, C, 0)
    if steps_per_epoch < 1:
        raise ValueError(f"train.batch_size={b} x {C} CONV ranks exceeds the {task.n_train} "
                         f"training images: lower train.batch_size")
    if cfg.train.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, cfg.train.max_steps_per_epoch)

    lr = lr_schedule(cfg.train, steps_per_epoch, C * b)
    opt = tf.keras.optimizers.legacy.SGD(learning_rate=lr, momentum=cfg.train.momentum)
    trainer = HourglassTrainer(layout, split, b, opt, compression=compression,
                               fc_compression=fc_compression, wire_dtype=cfg.hourglass.wire_dtype,
                               micro_batches=cfg.hourglass.micro_batches,
                               act_codec=cfg.hourglass.act_codec, grad_codec=cfg.hourglass.grad_codec,
                               codec_seed=cfg.run.seed,
                               stall_timeout_s=cfg.faults.stall_timeout_s)
    if hasattr(trainer.opt, "hgsgc_set_nonfinite"):  # per role: each role skips alike
        trainer.opt.hgsgc_set_nonfinite(cfg.faults.nonfinite)

    d_conv = sum(int(np.prod(v.shape)) for v in split.trunk_variables)
    d_fc = sum(int(np.prod(v.shape)) for v in split.head_variables)
    d = d_conv + d_fc
    run_id = world.bcast(new_run_id(cfg), root=0)  # same directory even if the clock ticks between ranks
    rlog = RunLog(cfg, run_id, is_root, log)
    run_dir = rlog.dir
    if is_root:
        log(f"hgsgc: {size} ranks, {threads} TF threads each, model {cfg.model.name} "
            f"({d:,} parameters: {d_conv:,} CONV, {d_fc:,} FC, split at {split.boundary_layer!r}, "
            f"activations {split.boundary_shape}), {steps_per_epoch} steps/epoch x "
            f"{cfg.train.epochs} epochs, run dir {run_dir}")
        log(layout.describe())
        log(f"hgsgc: CONV compression {compression.to_dict()}, FC compression {fc_compression.to_dict()}")

    conv_idx = layout.role_index if layout.is_conv else None
    comp_dicts = {"conv": compression.to_dict(), "fc": fc_compression.to_dict()}
    d_role = {"conv": d_conv, "fc": d_fc}
    if layout.is_conv:  # this CONV rank's evaluation examples as arrays (the trainer takes arrays)
        parts = [(np.asarray(x), np.asarray(y)) for x, y in task.test_data(conv_idx, C)]
        x_eval = np.concatenate([p[0] for p in parts])
        y_eval = np.concatenate([p[1] for p in parts]).astype(np.int32)
    else:
        x_eval = y_eval = None

    # checkpoints (docs/reliability.md): every rank saves its role's network, optimizer and
    # hgsgc state; the identity names the roles so another split or role assignment is refused
    identity = {"world_size": size, "layout": "hourglass", "model": cfg.model.name,
                "parameters": ckpt.parameter_shapes(model.variables),
                "compression": compression.to_dict(), "fc_compression": fc_compression.to_dict(),
                "roles": {"conv": list(layout.plan.conv_ranks), "fc": list(layout.plan.fc_ranks)},
                "split_layer": split.boundary_layer,
                "data_order": ckpt.data_order(cfg.run.seed, b, steps_per_epoch)}
    checkpointer = ckpt.Checkpointer(cfg.checkpoint, run_dir, identity, ckpt_comm,
                                     log if is_root else None)
    loop = {"global_step": 0, "history": [], "before": None, "start_snap": None,
            "step_times": [], "first_step_time": None, "wall_s": 0.0}
    saved = checkpointer.resume(cfg.train.epochs * steps_per_epoch, steps_per_epoch)
    if saved is not None:
        def restore():
            ckpt.load_model_state(trainer.net, saved["net"], "Hourglass role network")
            ckpt.load_optimizer_state(trainer.opt, trainer.variables, saved["optimizer"])
            t = saved["trainer"]
            trainer.counts.update({k: int(v) for k, v in t["counts"].items()})
            trainer.steps = int(t["steps"])
            trainer._train_loss[:] = t["train_loss"]
            if "rng" in t:  # stochastic rounding of q8/q4 boundary codecs (older checkpoints lack it)
                trainer.load_rng_state(t["rng"])
            loop.update(saved["loop"])

        checkpointer.restore(restore, "Hourglass state")
    t_start = time.perf_counter() - loop["wall_s"]
    step_times, history, total_steps = list(loop["step_times"]), list(loop["history"]), 0
    first_step_time = loop["first_step_time"]
    start_step = int(loop["global_step"])
    start_snap = loop["start_snap"] or trainer.snapshot()
    for rec in history:  # metrics so far (a resumed run rewrites them)
        rlog.epoch(rec, int(rec.get("epoch", 0)) * steps_per_epoch, tensorboard=False)
    traced = False
    now = [start_step]

    def state_fn(before=None):
        return {"net": ckpt.model_state(trainer.net),
                "optimizer": ckpt.optimizer_state(trainer.opt),
                "trainer": {"counts": dict(trainer.counts), "steps": int(trainer.steps),
                            "train_loss": trainer._train_loss.copy(),
                            "rng": trainer.rng_state()},
                "loop": {"global_step": int(now[0]), "history": history, "before": before,
                         "start_snap": start_snap, "step_times": step_times,
                         "first_step_time": first_step_time,
                         "wall_s": time.perf_counter() - t_start}}

    every = cfg.train.log_every_steps
    # CPU per timed step of each thread (hgsgc.bench_threads, /proc), over the timed steps only:
    # a window per epoch, opened after the first (graph-tracing) step and closed before the
    # epoch's synchronisation and evaluation, as in the data-parallel runner
    step_cpu, win = bench_threads.StepCPU(thread_groups), 0
    for epoch in range(cfg.train.epochs):
        if (epoch + 1) * steps_per_epoch <= start_step and len(history) > epoch:
            total_steps += steps_per_epoch  # finished before the checkpoint
            continue
        skip = max(0, start_step - epoch * steps_per_epoch)  # data-order position
        resumed = skip > 0 and loop["before"] is not None
        if layout.is_conv:
            batches, _ = task.train_data(conv_idx, C, epoch)
        else:
            batches = [None] * steps_per_epoch
        before = loop["before"] if resumed else trainer.snapshot()
        bar = rlog.progress(epoch + 1, steps_per_epoch)
        epoch_t0 = time.perf_counter()
        n_done = 0
        if traced:
            step_cpu.start()
            win = 0
        for i, bi in enumerate(batches):
            if i >= steps_per_epoch:
                break
            if i < skip:
                continue
            t0 = time.perf_counter()
            if bi is None:
                trainer.train_step()
            else:
                trainer.train_step(np.asarray(bi[0]), np.asarray(bi[1]))
            if not traced:  # graph tracing: reported apart, not in the mean
                traced = True
                if first_step_time is None:
                    first_step_time = time.perf_counter() - t0
                # roles trace different graphs: without this barrier the CONV ranks' second step
                # would absorb the FC rank's longer first step (tracing), biasing their mean
                layout.p2p.Barrier()
                trainer.phase_times(reset=True)  # the profile covers the same steps as the mean
                step_cpu.start()  # the timed steps start (after the barrier, like the profile)
                win = 0
            else:
                step_times.append(time.perf_counter() - t0)
                win += 1
            n_done = i + 1
            if n_done >= steps_per_epoch:  # last step: close the window before the loop drops
                step_cpu.stop(win)  # the data iterator (its teardown is no step time)
            if every and (total_steps + n_done) % every == 0:  # collective: every rank, same step
                rlog.step(total_steps + n_done, epoch + 1, trainer.train_loss(reset=False))
            bar.update(n_done)
            now[0] = total_steps + i + 1
            checkpointer.after_step(now[0], lambda: state_fn(before), lambda: {"history": history})
        step_cpu.stop(win)
        batches = range(n_done)
        trainer.synchronize()  # delay: pending CONV sync before evaluating (identical trunks)
        epoch_time = time.perf_counter() - epoch_t0
        total_steps += len(batches)
        after = trainer.snapshot()
        diff = {k: after[k] - before[k] for k in after}
        train_loss = trainer.train_loss()
        test_loss, test_acc = trainer.evaluate(x_eval, y_eval)
        snaps = layout.p2p.allgather(diff)
        roles = role_figures(snaps, layout, d_role, len(batches), comp_dicts)
        n_steps = max(1, len(batches))
        rec = {
            "epoch": epoch + 1,
            "steps": len(batches),
            "train_loss": train_loss,
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "epoch_time_s": epoch_time,
            "mean_step_time_s": float(np.mean(step_times[-n_steps:])) if step_times else 0.0,
            **_totals(roles, size, d),
            "exchanges": roles["conv"]["exchanges"],
            "roles": roles,
        }
        rec["traffic"] = step_traffic(snaps, layout, len(batches), d_conv, d_fc, b, split.features)
        rec["compression_ratio"] = rec["traffic"]["ratio"]
        history.append(rec)
        loop["before"] = None
        rlog.epoch(rec, total_steps)
        if is_root:
            log(f"epoch {epoch + 1}/{cfg.train.epochs}: train_loss {train_loss:.4f} "
                f"test_acc {test_acc:.4f} test_loss {test_loss:.4f} "
                f"step {rec['mean_step_time_s'] * 1e3:.1f} ms; " + traffic_line(rec["traffic"]))
    now[0] = total_steps
    t_end = time.perf_counter()  # the end checkpoint is not part of the wall time
    checkpointer.finish(total_steps, state_fn, {"history": history})
    wall = t_end - t_start

    end_snap = trainer.snapshot()
    tot = {k: end_snap[k] - start_snap[k] for k in end_snap}
    snaps = layout.p2p.allgather(tot)
    roles = role_figures(snaps, layout, d_role, total_steps, comp_dicts)
    traffic = step_traffic(snaps, layout, total_steps, d_conv, d_fc, b, split.features)
    step_times_root = layout.p2p.bcast(step_times, root=0)
    profile = phase_profile(layout.p2p.allgather((layout.rank, "conv" if layout.is_conv else "fc",
                                                  trainer.phase_times(), step_times)))
    thread_cpu = thread_cpu_by_role(layout.p2p.allgather(step_cpu.result() if step_cpu.steps else None),
                                    layout.plan.conv_ranks, layout.plan.fc_ranks)
    summary = {
        **summary_base(cfg, run_id, history, total_steps, size, "hourglass", d, compression,
                       step_times_root, layout.p2p.bcast(first_step_time, root=0),
                       layout.p2p.bcast(wall, root=0)),
        **_totals(roles, size, d),
        "exchanges": roles["conv"]["exchanges"],
        "traffic": traffic,
        "compression_ratio": traffic["ratio"],
        "global_batch_size": C * b,
        "roles": roles,
        "profile": profile,
        "hourglass": {
            "conv_workers": C,
            "fc_workers": F,
            "fc_workers_setting": cfg.hourglass.fc_workers,
            "conv_ranks": layout.plan.conv_ranks,
            "fc_ranks": layout.plan.fc_ranks,
            "fc_of": {str(k): v for k, v in layout.plan.fc_of.items()},
            "split_layer": split.boundary_layer,
            "boundary_shape": list(split.boundary_shape),
            "conv_parameters": d_conv,
            "fc_parameters": d_fc,
            "fc_compression": fc_compression.to_dict(),
            "wire_dtype": cfg.hourglass.wire_dtype,
            "act_codec": trainer.act_codec.to_dict(),
            "grad_codec": trainer.grad_codec.to_dict(),
            "fc_delay": cfg.hourglass.fc_delay,
            "pipeline": {"schedule": "GPipe" if cfg.hourglass.micro_batches > 1 else "none",
                         "micro_batches": cfg.hourglass.micro_batches,
                         **pipeline_overlap(profile)},
            "micro_batches": cfg.hourglass.micro_batches,
            "cost_model": layout.cost_report,
        },
    }
    if thread_cpu is not None:
        summary["thread_cpu"] = thread_cpu
    full = trainer.assemble_model(root=0)
    rlog.summary(summary, full)
    if is_root:
        log(f"hgsgc: final test accuracy {summary['final_test_accuracy']:.4f}; "
            + traffic_line(traffic))
        log(f"hgsgc: per step per rank "
            f"sent: CONV {roles['conv']['bytes_sent_per_step_per_rank'] / 1e3:.1f} kB "
            f"(activations {roles['conv']['activation_bytes_sent_per_step_per_rank'] / 1e3:.1f} kB, "
            f"gradient exchange {roles['conv']['exchange_bytes_sent_per_step_per_rank'] / 1e3:.2f} kB), "
            f"FC {roles['fc']['bytes_sent_per_step_per_rank'] / 1e3:.1f} kB "
            f"(activation gradients {roles['fc']['activation_grad_bytes_sent_per_step_per_rank'] / 1e3:.1f} kB, "
            f"gradient exchange {roles['fc']['exchange_bytes_sent_per_step_per_rank'] / 1e3:.2f} kB); "
            f"summary: {run_dir}/summary.json")
    layout.p2p.Barrier()  # the model file exists when run() returns on any rank
    return summary
