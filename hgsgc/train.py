"""Training runners: :func:`run` dispatches on ``layout``; this module holds the data-parallel one.

Every rank runs :func:`run`. The task (``hgsgc.tasks``: data format, model, loss, metrics) comes
from the config; the run folder, ``metrics.jsonl``, TensorBoard, progress and the shared summary
keys come from :mod:`hgsgc.loop`, which the Hourglass runner (``hgsgc.hourglass.train``) uses too.
Rank 0 writes ``runs/<id>/{config.json, metrics.jsonl, tb/, summary.json, model.keras}`` (summary
keys in docs/api.md).
"""
from __future__ import annotations

import os
import time

import numpy as np

from hgsgc.loop import (RunLog, density_schedule, lr_at, lr_schedule, new_run_id, ring_bytes,
                        setup_threads, summary_base)

# names older code imported from here
_setup_threads = setup_threads
_ring = ring_bytes
__all__ = ["run", "run_data_parallel", "byte_figures", "density_schedule", "summary_base"]


def byte_figures(counts: dict, steps: int, size: int, grad_bytes: int) -> dict:
    """Per-step-per-rank byte figures of summary.json from :class:`CommStats` count deltas.

    Args:
        counts: ``payload_bytes``, ``bytes_sent``, ``bytes_received``, ``exchanges`` over ``steps``.
        steps: training steps the counts cover (delay included: syncs are averaged over steps).
        size: ranks exchanging; grad_bytes: fp32 size 4 d of the gradients (bytes).

    Returns:
        ``gradient_bytes``, ``payload_bytes_per_step_per_rank``, ``bytes_sent_per_step_per_rank``,
        ``bytes_received_per_step_per_rank``, ``dense_bytes_per_step_per_rank`` (2 (n-1)/n 4d),
        ``compression_ratio`` (gradient_bytes / payload per step, as in Deep Gradient
        Compression) and ``exchanges``.
    """
    steps = max(1, steps)
    payload = counts["payload_bytes"] / steps
    return {
        "gradient_bytes": grad_bytes,
        "payload_bytes_per_step_per_rank": payload,
        "bytes_sent_per_step_per_rank": counts["bytes_sent"] / steps,
        "bytes_received_per_step_per_rank": counts["bytes_received"] / steps,
        "dense_bytes_per_step_per_rank": ring_bytes(size, grad_bytes),
        "compression_ratio": grad_bytes / payload if payload else float("inf"),
        "exchanges": counts["exchanges"],
    }


def run(cfg, log=print) -> dict:
    """Train and evaluate as configured; returns the summary (same on every rank).

    Raises:
        hgsgc.data.DataError: data files missing or malformed (every rank, before training).
        ValueError: batch size too large for the data.
    """
    if cfg.layout == "auto":  # measure, predict, then run the faster layout (hgsgc/hourglass/auto.py)
        from hgsgc.hourglass.auto import run as run_auto

        return run_auto(cfg, run_layout=run, log=log)
    if cfg.layout == "hourglass":  # CONV/FC roles: its own runner (builds its process sets)
        from hgsgc.hourglass.train import run as run_hourglass

        return run_hourglass(cfg, log=log)
    return run_data_parallel(cfg, log=log)


def _epoch_line(rec: dict, epochs: int) -> str:
    keys = [k for k in rec if k.startswith(("test_", "valid_"))]
    m = " ".join(f"{k} {rec[k]:.4f}" for k in keys)
    return (f"epoch {rec['epoch']}/{epochs}: train_loss {rec['train_loss']:.4f} {m} "
            f"step {rec['mean_step_time_s'] * 1e3:.1f} ms "
            f"sent/step/rank {rec['bytes_sent_per_step_per_rank'] / 1e3:.1f} kB "
            f"(dense {rec['dense_bytes_per_step_per_rank'] / 1e3:.1f} kB) "
            f"compression_ratio {rec['compression_ratio']:.1f}")


def run_data_parallel(cfg, log=print) -> dict:
    """The data-parallel runner (every rank trains the whole model on its shard), with
    checkpoints, resume and fault handling (``hgsgc.checkpoint``, ``hgsgc.faults``,
    docs/reliability.md)."""
    threads = setup_threads(cfg.train.threads)
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hgsgc
    from hgsgc import bench_threads
    from hgsgc import checkpoint as ckpt
    from hgsgc import config as config_mod
    from hgsgc.faults import configure_stall_check, world_comm
    from hgsgc.tasks import check_same_data, make_task

    configure_stall_check(cfg.faults.stall_timeout_s)  # before hvd.init (Horovod reads it there)
    thread_groups = bench_threads.ThreadGroups()  # which threads hvd.init() starts (Horovod, MPI)
    thread_groups.before_init()
    hvd.init()
    thread_groups.after_init()
    rank, size = hvd.rank(), hvd.size()
    is_root = rank == 0
    tf.keras.utils.set_random_seed(cfg.run.seed)
    if cfg.train.deterministic:
        tf.config.experimental.enable_op_determinism()
    comm = world_comm()

    task = make_task(cfg)  # DataError on every rank before any collective
    check_same_data(task, comm, cfg)  # node-local copies of another size: one line, not a hang
    _, steps_per_epoch = task.train_data(rank, size, 0)
    if steps_per_epoch < 1:
        raise ValueError(f"train.batch_size={cfg.train.batch_size} x {size} ranks exceeds the "
                         f"{task.n_train} training examples: lower train.batch_size")
    if hasattr(task, "check_eval"):  # a split too short to evaluate fails now, not after an epoch
        task.check_eval(size)
    if cfg.train.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, cfg.train.max_steps_per_epoch)

    model = task.build_model()
    compression = config_mod.compression_from_config(cfg.compression)
    world_batch = cfg.train.batch_size * size
    opt = tf.keras.optimizers.legacy.SGD(learning_rate=lr_schedule(cfg.train, steps_per_epoch, world_batch),
                                         momentum=cfg.train.momentum)
    opt = hgsgc.DistributedOptimizer(opt, compression=compression)
    if hasattr(opt, "hgsgc_set_nonfinite"):
        opt.hgsgc_set_nonfinite(cfg.faults.nonfinite)
    hvd.broadcast_variables(model.variables, root_rank=0)

    def new_step():
        return task.make_step(model, opt)

    train_step = new_step()
    schedule = density_schedule(cfg.compression) if hasattr(compression, "density") else None
    current_density = compression.density if schedule else None

    def allreduce_sum(v):
        return hvd.allreduce(tf.constant(np.asarray(v, np.float64)), op=hvd.Sum, name="hgsgc_eval").numpy()

    run_id = new_run_id(cfg)
    if comm is not None:
        run_id = comm.bcast(run_id, root=0)  # same directory even if the clock ticks between ranks
    run_dir = os.path.join(cfg.run.out_dir, run_id)
    identity = {"world_size": size, "layout": "data_parallel", "model": cfg.model.name,
                "parameters": ckpt.parameter_shapes(model.variables),
                "compression": compression.to_dict(),
                "data_order": ckpt.data_order(cfg.run.seed, cfg.train.batch_size, steps_per_epoch)}
    checkpointer = ckpt.Checkpointer(cfg.checkpoint, run_dir, identity, comm, log if is_root else None)
    loop = {"global_step": 0, "history": [], "losses": [], "before": None,
            "step_times": [], "first_step_time": None, "wall_s": 0.0}
    saved = checkpointer.resume(cfg.train.epochs * steps_per_epoch, steps_per_epoch)
    if saved is not None:
        def restore():
            ckpt.load_model_state(model, saved["model"])
            ckpt.load_optimizer_state(opt, model.trainable_variables, saved["optimizer"])
            loop.update(saved["loop"])

        checkpointer.restore(restore)
    rlog = RunLog(cfg, run_id, is_root, log)
    for rec in loop["history"]:  # metrics so far (a resumed run rewrites them)
        rlog.epoch(rec, int(rec.get("epoch", 0)) * steps_per_epoch, tensorboard=False)
    d = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    if is_root:
        log(f"hgsgc: {size} ranks, {threads} TF threads each, task {cfg.data.format}, model {cfg.model.name} "
            f"({d:,} parameters), compression {compression.to_dict()}, "
            f"{steps_per_epoch} steps/epoch x {cfg.train.epochs} epochs, run dir {run_dir}")

    stats = opt.hgsgc_stats
    grad_bytes = 4 * d
    t_start = time.perf_counter() - loop["wall_s"]
    step_times, history, total_steps = list(loop["step_times"]), list(loop["history"]), 0
    first_step_time = loop["first_step_time"]
    start_step = int(loop["global_step"])
    traced = False  # this process's first step traces the graph (also after a resume)
    # CPU per timed step of each thread (Horovod's, MPI's, TensorFlow's): /proc, over the timed
    # steps only (windows stop before a step that traces a graph and start after it)
    step_cpu, win = bench_threads.StepCPU(thread_groups), 0
    timed_end_unix = None
    barrier = None  # bench_threads.start_barrier's record (HGSGC_START_BARRIER), once per process

    def state_fn(epoch_losses=(), before=None):
        return {"model": ckpt.model_state(model),
                "optimizer": ckpt.optimizer_state(opt),
                "loop": {"global_step": int(total_steps_now[0]), "history": history,
                         "losses": list(epoch_losses), "before": before,
                         "step_times": step_times, "first_step_time": first_step_time,
                         "wall_s": time.perf_counter() - t_start}}

    total_steps_now = [start_step]
    try:
        for epoch in range(cfg.train.epochs):
            if (epoch + 1) * steps_per_epoch <= start_step and len(history) > epoch:
                total_steps += steps_per_epoch  # finished before the checkpoint
                continue
            batches, _ = task.train_data(rank, size, epoch)
            task.start_epoch()  # (a resume inside an epoch restarts the LSTM state at zero)
            skip = max(0, start_step - epoch * steps_per_epoch)  # data-order position
            resumed = skip > 0 and loop["before"] is not None
            before = loop["before"] if resumed else stats.snapshot()
            bar = rlog.progress(epoch + 1, steps_per_epoch)
            losses = list(loop["losses"]) if resumed else []
            epoch_t0 = time.perf_counter()
            if traced:
                step_cpu.start()
                win = 0
            for i, batch in enumerate(batches):
                if i >= steps_per_epoch:
                    break
                if i < skip:
                    continue
                retrace = False
                if schedule is not None:
                    want = schedule(total_steps + i)
                    if want != current_density:  # density warm-up stage: new k, so a new graph
                        opt.hgsgc_set_density(want)
                        current_density = want
                        train_step = new_step()
                        retrace = True
                if retrace:
                    step_cpu.stop(win)
                t0 = time.perf_counter()
                loss = float(train_step(batch))
                if not traced:  # graph tracing: reported apart, not in the mean
                    traced = True
                    if first_step_time is None:
                        first_step_time = time.perf_counter() - t0
                elif not retrace:
                    step_times.append(time.perf_counter() - t0)
                    if barrier:  # a bench's shared compute-only copy: the end of its timed window
                        timed_end_unix = time.time()
                    win += 1
                if not step_cpu.running:  # after a traced step: the timed steps start
                    if barrier is None and not retrace:  # the bench's shared compute-only copies
                        barrier = bench_threads.start_barrier() or {}  # line up their timed steps
                    step_cpu.start()
                    win = 0
                if i + 1 >= steps_per_epoch:  # the epoch's last step: close the window before the
                    step_cpu.stop(win)  # loop drops the data iterator (a cut-short tf.data
                    # pipeline's teardown cancels its prefetch threads: 0-7 s here, no step time)
                losses.append(loss)
                step = total_steps + i + 1
                rlog.step(step, epoch + 1, loss, lr_at(cfg.train, step - 1, steps_per_epoch, world_batch))
                bar.update(i + 1, float(np.mean(losses[-50:])))
                total_steps_now[0] = step
                checkpointer.after_step(step, lambda: state_fn(losses, before), lambda: {"history": history})
            step_cpu.stop(win)  # (a no-op unless the data ended before steps_per_epoch)
            opt.hgsgc_synchronize(model.trainable_variables)  # delay: pending sync before evaluating
            epoch_time = time.perf_counter() - epoch_t0
            total_steps += steps_per_epoch
            after = stats.snapshot()
            diff = {k: after[k] - before[k] for k in after}
            eval_t0 = time.perf_counter()
            metrics = task.evaluate(model, rank, size, allreduce_sum, final=epoch + 1 == cfg.train.epochs)
            eval_times = {"eval_time_s": time.perf_counter() - eval_t0,  # rank 0's, every split
                          **{f"eval_{k}_time_s": v for k, v in getattr(task, "eval_split_times_s", {}).items()}}
            rec = {
                "epoch": epoch + 1,
                "steps": steps_per_epoch,
                "train_loss": float(np.mean(losses)) if losses else float("nan"),
                **metrics,
                "epoch_time_s": epoch_time,
                **eval_times,
                "mean_step_time_s": float(np.mean(step_times[-steps_per_epoch:])) if step_times else 0.0,
                "lr": lr_at(cfg.train, max(0, total_steps - 1), steps_per_epoch, world_batch),
                **byte_figures(diff, steps_per_epoch, size, grad_bytes),
            }
            if getattr(opt, "hgsgc_skipped_steps", None) is not None:
                # every rank's count (one small allreduce per epoch, on every rank alike): with
                # delay 1 they agree (the job's count); with delay > 1 each rank skips its own
                per_rank = np.zeros(size)
                per_rank[rank] = int(opt.hgsgc_skipped_steps)
                per_rank = [int(x) for x in allreduce_sum(per_rank)]
                rec["skipped_nonfinite_steps"] = max(per_rank)
                rec["skipped_nonfinite_steps_per_rank"] = per_rank
            history.append(rec)
            loop["losses"], loop["before"] = [], None
            rlog.epoch(rec, total_steps)
            if is_root:
                log(_epoch_line(rec, cfg.train.epochs))
        total_steps_now[0] = total_steps
        t_end = time.perf_counter()  # the end checkpoint is not part of the wall time
        checkpointer.finish(total_steps, state_fn, {"history": history})
    finally:
        checkpointer.close()
    wall = t_end - t_start
    mine = step_cpu.result() if step_cpu.steps else None
    gathered = comm.gather(mine, root=0) if comm is not None else [mine]  # None on ranks > 0
    thread_cpu = bench_threads.combine_ranks(gathered) if gathered is not None else None

    summary = {
        **summary_base(cfg, run_id, history, total_steps, size, cfg.layout, d, compression,
                       step_times, first_step_time, wall),
        **byte_figures(stats.snapshot(), total_steps, size, grad_bytes),
        "global_batch_size": world_batch,
    }
    if thread_cpu is not None:  # rank 0's gather (other ranks: None)
        summary["thread_cpu"] = thread_cpu
    if barrier:  # the timed window of a bench's shared compute-only copy (its end: the last timed step)
        summary["start_barrier"] = {**barrier, "timed_end_unix_s": timed_end_unix}
    rlog.summary(summary, model)
    if is_root:
        key = "final_" + task.metric
        log(f"hgsgc: final {task.metric} {summary.get(key, float('nan')):.4f}, "
            f"compression ratio {summary['compression_ratio']:.1f}, "
            f"summary: {os.path.join(run_dir, 'summary.json')}")
    return summary
