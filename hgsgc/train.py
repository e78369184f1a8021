"""The main job: data-parallel training on Fashion-MNIST with a chosen compression.

Every rank runs :func:`run`; rank 0 prints progress and writes ``runs/<id>/metrics.jsonl``
(one JSON line per epoch) and ``runs/<id>/summary.json`` (keys in DESIGN.md / docs/api.md).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from hgsgc.costs import ring_allreduce_bytes_f as _ring


def _setup_threads(threads: int):
    import tensorflow as tf

    if threads <= 0:
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")) or 1)
        threads = max(1, (os.cpu_count() or 1) // max(1, local))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
    return threads


def density_schedule(c):
    """Warm-up of sparsity (Deep Gradient Compression, Lin et al. 2018, Sec. 4): over the first
    ``c.warmup_steps`` steps the density falls exponentially, 0.25, 0.0625, 0.015625, 0.00390625
    (four equal stages, never below the target ``c.density``), then stays at ``c.density``.

    Returns:
        ``step -> density`` (a Python float), or None when there is no warm-up.
    """
    if not getattr(c, "warmup_steps", 0):
        return None
    stage_len = max(1, c.warmup_steps // 4)

    def density(step: int) -> float:
        if step >= c.warmup_steps:
            return float(c.density)
        return max(float(c.density), 0.25 ** (step // stage_len + 1))

    return density


def summary_base(cfg, run_id, history, total_steps, size, layout, parameters, compression,
                 step_times, first_step_time, wall) -> dict:
    """The summary.json keys every layout shares (accuracy, sizes, settings, times in seconds)."""
    last = history[-1]
    return {
        "run_id": run_id,
        "final_test_accuracy": last["test_accuracy"],
        "final_test_loss": last["test_loss"],
        "final_train_loss": last["train_loss"],
        "epochs": cfg.train.epochs,
        "steps": total_steps,
        "world_size": size,
        "layout": layout,
        "model": cfg.model.name,
        "parameters": parameters,
        "compression": compression.to_dict(),
        "mean_step_time_s": float(np.mean(step_times)) if step_times else 0.0,
        "first_step_time_s": first_step_time,
        "wall_time_s": wall,
        "seed": cfg.run.seed,
        "batch_size_per_rank": cfg.train.batch_size,
    }


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
        "dense_bytes_per_step_per_rank": _ring(size, grad_bytes),
        "compression_ratio": grad_bytes / payload if payload else float("inf"),
        "exchanges": counts["exchanges"],
    }


def run(cfg, log=print) -> dict:
    """Train and evaluate as configured; returns the summary (same on every rank).

    Raises:
        hgsgc.data.DataError: data files missing or malformed.
    """
    if cfg.layout == "hourglass":  # CONV/FC roles: its own runner (builds its process sets)
        from hgsgc.hourglass.train import run as run_hourglass

        return run_hourglass(cfg, log=log)
    threads = _setup_threads(cfg.train.threads)
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hgsgc
    from hgsgc import config as config_mod
    from hgsgc.data import epoch_batches, load_fashion_mnist, shard
    from hgsgc.models import build_model

    from hgsgc import checkpoint as ckpt
    from hgsgc.faults import configure_stall_check, world_comm

    configure_stall_check(cfg.faults.stall_timeout_s)  # before hvd.init (Horovod reads it there)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    is_root = rank == 0
    tf.keras.utils.set_random_seed(cfg.run.seed)
    if cfg.train.deterministic:
        tf.config.experimental.enable_op_determinism()
    comm = world_comm()

    data = load_fashion_mnist(cfg.data.path, cfg.data.train_limit, cfg.data.test_limit)
    steps_per_epoch = len(data.x_train) // (size * cfg.train.batch_size)
    if steps_per_epoch < 1:
        raise ValueError(f"train.batch_size={cfg.train.batch_size} x {size} ranks exceeds the "
                         f"{len(data.x_train)} training images: lower train.batch_size")
    if cfg.train.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, cfg.train.max_steps_per_epoch)

    model = build_model(cfg.model.name, seed=cfg.run.seed)
    compression = config_mod.compression_from_config(cfg.compression)
    lr = cfg.train.lr
    if cfg.train.warmup_steps:
        lr = _Warmup(cfg.train.lr, cfg.train.warmup_steps)
    opt = tf.keras.optimizers.legacy.SGD(learning_rate=lr, momentum=cfg.train.momentum)
    opt = hgsgc.DistributedOptimizer(opt, compression=compression)
    if hasattr(opt, "hgsgc_set_nonfinite"):
        opt.hgsgc_set_nonfinite(cfg.faults.nonfinite)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    hvd.broadcast_variables(model.variables, root_rank=0)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    train_step = tf.function(step_fn)
    schedule = density_schedule(cfg.compression) if hasattr(compression, "density") else None
    current_density = compression.density if schedule else None

    @tf.function
    def eval_step(x, y):
        logits = model(x, training=False)
        loss = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), tf.float32))
        return tf.reduce_sum(loss), correct

    def evaluate():
        idx = shard(len(data.x_test), rank, size)
        tot_loss = tot_correct = 0.0
        for s in range(0, len(idx), 500):
            b = idx[s:s + 500]
            l, c = eval_step(data.x_test[b], data.y_test[b])
            tot_loss += float(l)
            tot_correct += float(c)
        sums = hvd.allreduce(tf.constant([tot_loss, tot_correct, float(len(idx))], tf.float64),
                             op=hvd.Sum, name="hgsgc_eval").numpy()
        return sums[0] / sums[2], sums[1] / sums[2]

    run_id = cfg.run.id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    if comm is not None:
        run_id = comm.bcast(run_id, root=0)  # same directory even if the clock ticks between ranks
    run_dir = os.path.join(cfg.run.out_dir, run_id)
    identity = {"world_size": size, "layout": "data_parallel", "model": cfg.model.name,
                "parameters": ckpt.parameter_shapes(model.variables),
                "compression": compression.to_dict()}
    checkpointer = ckpt.Checkpointer(cfg.checkpoint, run_dir, identity, comm, log if is_root else None)
    loop = {"global_step": 0, "history": [], "losses": [], "before": None,
            "step_times": [], "first_step_time": None, "wall_s": 0.0}
    saved = checkpointer.resume()
    if saved is not None:
        def restore():
            ckpt.load_model_state(model, saved["model"])
            ckpt.load_optimizer_state(opt, model.trainable_variables, saved["optimizer"])
            loop.update(saved["loop"])

        checkpointer.restore(restore)
    if is_root:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config_mod.to_dict(cfg), f, indent=2)
        d = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        log(f"hgsgc: {size} ranks, {threads} TF threads each, model {cfg.model.name} "
            f"({d:,} parameters), compression {compression.to_dict()}, "
            f"{steps_per_epoch} steps/epoch x {cfg.train.epochs} epochs, run dir {run_dir}")

    stats = opt.hgsgc_stats
    d = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    grad_bytes = 4 * d
    t_start = time.perf_counter() - loop["wall_s"]
    step_times, history, total_steps = list(loop["step_times"]), list(loop["history"]), 0
    first_step_time = loop["first_step_time"]
    start_step = int(loop["global_step"])
    metrics_f = None
    if is_root:
        metrics_f = open(os.path.join(run_dir, "metrics.jsonl"), "w")
        for rec in history:  # metrics so far (a resumed run rewrites them)
            metrics_f.write(json.dumps(rec) + "\n")
        metrics_f.flush()
    traced = False  # this process's first step traces the graph (also after a resume)

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
            batches = epoch_batches(len(data.x_train), cfg.train.batch_size, rank, size, epoch,
                                    cfg.run.seed)[:steps_per_epoch]
            skip = max(0, start_step - epoch * steps_per_epoch)  # data-order position
            resumed = skip > 0 and loop["before"] is not None
            before = loop["before"] if resumed else stats.snapshot()
            bar = None
            if is_root and cfg.train.progress:
                # not a terminal (log file, CI): a line every 15 s instead of every 0.05 s
                bar = tf.keras.utils.Progbar(steps_per_epoch, stateful_metrics=["loss"], unit_name="step",
                                             interval=0.05 if sys.stdout.isatty() else 15.0)
            losses = list(loop["losses"]) if resumed else []
            epoch_t0 = time.perf_counter()
            for i in range(skip, len(batches)):
                b = batches[i]
                retrace = False
                if schedule is not None:
                    want = schedule(total_steps + i)
                    if want != current_density:  # density warm-up stage: new k, so a new graph
                        opt.hgsgc_set_density(want)
                        current_density = want
                        train_step = tf.function(step_fn)
                        retrace = True
                t0 = time.perf_counter()
                loss = float(train_step(data.x_train[b], data.y_train[b]))
                if not traced:  # graph tracing: reported apart, not in the mean
                    traced = True
                    if first_step_time is None:
                        first_step_time = time.perf_counter() - t0
                elif not retrace:
                    step_times.append(time.perf_counter() - t0)
                losses.append(loss)
                if bar is not None:
                    bar.update(i + 1, values=[("loss", float(np.mean(losses[-50:])))])
                step = total_steps_now[0] = total_steps + i + 1
                checkpointer.after_step(step, lambda: state_fn(losses, before),
                                        lambda: {"history": history})
            opt.hgsgc_synchronize(model.trainable_variables)  # delay: pending sync before evaluating
            epoch_time = time.perf_counter() - epoch_t0
            total_steps += len(batches)
            after = stats.snapshot()
            diff = {k: after[k] - before[k] for k in after}
            test_loss, test_acc = evaluate()
            n_steps = max(1, len(batches))
            rec = {
                "epoch": epoch + 1,
                "steps": len(batches),
                "train_loss": float(np.mean(losses)) if losses else float("nan"),
                "test_loss": test_loss,
                "test_accuracy": test_acc,
                "epoch_time_s": epoch_time,
                "mean_step_time_s": float(np.mean(step_times[-n_steps:])) if step_times else 0.0,
                **byte_figures(diff, len(batches), size, grad_bytes),
            }
            if getattr(opt, "hgsgc_skipped_steps", None) is not None:
                rec["skipped_nonfinite_steps"] = int(opt.hgsgc_skipped_steps)
            history.append(rec)
            loop["losses"], loop["before"] = [], None
            if is_root:
                metrics_f.write(json.dumps(rec) + "\n")
                metrics_f.flush()
                log(f"epoch {epoch + 1}/{cfg.train.epochs}: train_loss {rec['train_loss']:.4f} "
                    f"test_acc {test_acc:.4f} test_loss {test_loss:.4f} "
                    f"step {rec['mean_step_time_s'] * 1e3:.1f} ms "
                    f"sent/step/rank {rec['bytes_sent_per_step_per_rank'] / 1e3:.1f} kB "
                    f"(dense {rec['dense_bytes_per_step_per_rank'] / 1e3:.1f} kB) "
                    f"compression_ratio {rec['compression_ratio']:.1f}")
        total_steps_now[0] = total_steps
        t_end = time.perf_counter()  # the end checkpoint is not part of the wall time
        checkpointer.finish(total_steps, state_fn, {"history": history})
    finally:
        checkpointer.close()
    wall = t_end - t_start
    if metrics_f:
        metrics_f.close()

    summary = {
        **summary_base(cfg, run_id, history, total_steps, size, cfg.layout, d, compression,
                       step_times, first_step_time, wall),
        **byte_figures(stats.snapshot(), total_steps, size, grad_bytes),
    }
    if is_root:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        model.save(os.path.join(run_dir, "model.keras"))
        log(f"hgsgc: final test accuracy {summary['final_test_accuracy']:.4f}, "
            f"compression ratio {summary['compression_ratio']:.1f}, "
            f"summary: {os.path.join(run_dir, 'summary.json')}")
    return summary


class _Warmup:
    """Linear learning-rate warm-up (Goyal et al. 2017) as a Keras LearningRateSchedule."""

    def __new__(cls, lr, steps):
        import tensorflow as tf

        class Sched(tf.keras.optimizers.schedules.LearningRateSchedule):
            def __call__(self, step):
                frac = tf.minimum(1.0, tf.cast(step + 1, tf.float32) / float(steps))
                return lr * frac

            def get_config(self):
                return {"lr": lr, "steps": steps}

        return Sched()
