"""What both runners (data-parallel ``hgsgc.train`` and Hourglass ``hgsgc.hourglass.train``) share:
the run folder, ``metrics.jsonl``, TensorBoard, progress output, learning-rate schedules, thread
set-up and the summary keys.

Run folder ``<run.out_dir>/<run id>/`` (written by rank 0): ``config.json``; ``metrics.jsonl`` with
one JSON line per epoch (``"epoch"`` key) and, when ``train.log_every_steps > 0``, one line every
that many steps (``"kind": "step"``, ``step``, ``epoch``, ``train_loss`` = mean over the last
steps, ``lr``); ``tb/`` TensorBoard event files (``tf.summary``) when ``train.tensorboard``;
``summary.json``; ``model.keras``.

Progress on rank 0: a Keras progress bar when stdout is a terminal; otherwise (Slurm output files,
CI logs) one plain line every ``train.progress_interval_s`` seconds.

This module imports nothing from the runners, so neither runner imports the other's module to
get it (no import cycle).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional

import numpy as np


def setup_threads(threads: int) -> int:
    """Set TensorFlow's thread pools: ``threads`` intra-op (0 = cores / ranks on this host)."""
    import tensorflow as tf

    if threads <= 0:
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1")) or 1)
        threads = max(1, (os.cpu_count() or 1) // max(1, local))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(min(2, threads))
    return threads


def ring_bytes(n: int, nbytes: float) -> float:
    """Bytes a rank sends in a ring allreduce of ``nbytes`` among ``n`` ranks: ``2 (n-1)/n nbytes``
    (the one formula in :mod:`hgsgc.costs`)."""
    from hgsgc.costs import ring_allreduce_bytes_f

    return ring_allreduce_bytes_f(n, nbytes)


def peak_lr(t, world_batch: int) -> float:
    """``train.lr`` scaled by the linear scaling rule (Goyal et al. 2017):
    ``lr * world_batch / train.base_batch_size`` when ``base_batch_size > 0``, else ``lr``."""
    return t.lr * world_batch / t.base_batch_size if t.base_batch_size else t.lr


def lr_at(t, step: int, steps_per_epoch: int, world_batch: int) -> float:
    """The learning rate at (0-based) ``step`` as a Python float (numpy reference of :func:`lr_schedule`).

    ``peak_lr`` times the linear warm-up factor ``min(1, (step + 1) / warmup_steps)`` times the decay:
    ``constant``: 1; ``step``: ``lr_decay ** (number of lr_decay_epochs <= epoch)`` with
    ``epoch = step // steps_per_epoch + 1`` (1-based); ``cosine``: ``(1 + cos(pi * step / total)) / 2``
    over ``total = epochs * steps_per_epoch`` steps (Loshchilov & Hutter 2017, no restarts).
    """
    lr = peak_lr(t, world_batch)
    if t.warmup_steps:
        lr *= min(1.0, (step + 1) / t.warmup_steps)
    if t.lr_schedule == "step":
        epoch = step // max(1, steps_per_epoch) + 1
        lr *= t.lr_decay ** sum(1 for e in t.lr_decay_epochs if e <= epoch)
    elif t.lr_schedule == "cosine":
        total = max(1, t.epochs * steps_per_epoch)
        lr *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))
    return lr


_SCHEDULE = None


def _schedule_class():
    """The Keras schedule class, defined once and registered (``hgsgc>LRSchedule``) so that
    optimizers rebuilt from their config (Horovod's DistributedOptimizer does) can restore it."""
    global _SCHEDULE
    if _SCHEDULE is None:
        import tensorflow as tf

        @tf.keras.utils.register_keras_serializable(package="hgsgc")
        class LRSchedule(tf.keras.optimizers.schedules.LearningRateSchedule):
            def __init__(self, peak, warmup_steps=0, kind="constant", decay=0.1, bounds=(), steps_per_epoch=1,
                         total_steps=1):
                self.peak, self.warm, self.kind, self.decay = float(peak), int(warmup_steps), kind, float(decay)
                self.bounds, self.spe, self.total = sorted(bounds), int(steps_per_epoch), int(total_steps)

            def __call__(self, step):
                s = tf.cast(step, tf.float32)
                lr = tf.constant(self.peak, tf.float32)
                if self.warm:
                    lr *= tf.minimum(1.0, (s + 1.0) / float(self.warm))
                if self.kind == "step" and self.bounds:
                    epoch = tf.math.floordiv(s, float(self.spe)) + 1.0
                    n = tf.reduce_sum(tf.cast(tf.constant(self.bounds, tf.float32) <= epoch, tf.float32))
                    lr *= tf.pow(tf.constant(self.decay, tf.float32), n)
                elif self.kind == "cosine":
                    lr *= 0.5 * (1.0 + tf.cos(math.pi * tf.minimum(1.0, s / float(self.total))))
                return lr

            def get_config(self):
                return {"peak": self.peak, "warmup_steps": self.warm, "kind": self.kind, "decay": self.decay,
                        "bounds": list(self.bounds), "steps_per_epoch": self.spe, "total_steps": self.total}

        _SCHEDULE = LRSchedule
    return _SCHEDULE


def lr_schedule(t, steps_per_epoch: int, world_batch: int):
    """A Keras ``LearningRateSchedule`` computing :func:`lr_at` from the optimizer's step counter,
    or a float when the rate is constant."""
    if t.lr_schedule == "constant" and not t.warmup_steps:
        return peak_lr(t, world_batch)
    spe = max(1, steps_per_epoch)
    return _schedule_class()(peak_lr(t, world_batch), t.warmup_steps, t.lr_schedule, t.lr_decay,
                             t.lr_decay_epochs, spe, max(1, t.epochs * spe))


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
    from hgsgc.compression import DEFAULT_DENSITY

    target = float(DEFAULT_DENSITY if c.density is None else c.density)  # None: a config not validated

    def density(step: int) -> float:
        if step >= c.warmup_steps:
            return target
        return max(target, 0.25 ** (step // stage_len + 1))

    return density


def summary_base(cfg, run_id, history, total_steps, size, layout, parameters, compression,
                 step_times, first_step_time, wall) -> dict:
    """The summary.json keys every layout shares (metrics of the last epoch, sizes, settings,
    times in seconds). Every ``test_*`` / ``valid_*`` / ``train_loss`` key of the last epoch record
    appears as ``final_<key>``."""
    last = history[-1]
    out = {"run_id": run_id}
    for k, v in last.items():
        if k.startswith(("test_", "valid_")) or k == "train_loss":
            out["final_" + k] = v
    out.update({
        "task": getattr(cfg.data, "format", "fashion_mnist"),
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
    })
    return out


def stdout_is_terminal() -> bool:
    """Whether progress output ends up on a terminal.

    ``sys.stdout.isatty()``, except under Open MPI's ``mpirun``, which hands every rank a
    pseudo-terminal even when its own output goes to a file: there the answer is whether the
    launcher's standard output (``/proc/<launcher pid>/fd/1``) is a terminal.
    """
    if not sys.stdout.isatty():
        return False
    if "OMPI_COMM_WORLD_RANK" not in os.environ:
        return True
    pid = os.getppid()
    for _ in range(4):  # rank -> (prted ->) prterun/mpirun
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            if name in ("mpirun", "mpiexec", "orterun", "prterun", "prte"):
                target = os.readlink(f"/proc/{pid}/fd/1")
                return target.startswith(("/dev/pts/", "/dev/tty"))
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return True
    return True


class Progress:
    """Progress of one epoch on rank 0: a Keras ``Progbar`` on a terminal, else a plain line
    (``epoch E/N step S/T loss L, X steps/s``) every ``interval_s`` seconds through ``log``."""

    def __init__(self, enabled: bool, epoch: int, epochs: int, steps: int, interval_s: float, log=print,
                 tty: Optional[bool] = None):
        self.enabled, self.epoch, self.epochs, self.steps = enabled, epoch, epochs, steps
        self.interval, self.log = interval_s, log
        self.tty = stdout_is_terminal() if tty is None else tty
        self.bar = None
        self.t0 = self.last = time.perf_counter()
        if enabled and self.tty:
            import tensorflow as tf

            self.bar = tf.keras.utils.Progbar(steps, stateful_metrics=["loss"], unit_name="step")

    def update(self, step: int, loss: Optional[float] = None):
        """Report that ``step`` (1-based) steps of this epoch are done."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step, values=[("loss", loss)] if loss is not None else None)
            return
        now = time.perf_counter()
        if now - self.last >= self.interval or step == self.steps:
            self.last = now
            rate = step / max(1e-9, now - self.t0)
            ls = f" loss {loss:.4f}" if loss is not None else ""
            self.log(f"epoch {self.epoch}/{self.epochs} step {step}/{self.steps}{ls}, {rate:.2f} steps/s")


class RunLog:
    """The run folder of one run; every method is a no-op on ranks other than rank 0.

    Args:
        cfg: the :class:`hgsgc.config.Config`; run_id: the folder name (the same on every rank);
        is_root: rank 0; log: where progress lines go.
    """

    def __init__(self, cfg, run_id: str, is_root: bool, log=print):
        from hgsgc import config as config_mod

        self.cfg, self.is_root, self.log = cfg, is_root, log
        self.dir = os.path.join(cfg.run.out_dir, run_id)
        self.every = cfg.train.log_every_steps
        self._losses = []
        self._metrics = None
        self._tb = None
        if is_root:
            os.makedirs(self.dir, exist_ok=True)
            with open(os.path.join(self.dir, "config.json"), "w") as f:
                json.dump(config_mod.to_dict(cfg), f, indent=2)
            self._metrics = open(os.path.join(self.dir, "metrics.jsonl"), "w")
            if cfg.train.tensorboard:
                import tensorflow as tf

                self._tb = tf.summary.create_file_writer(os.path.join(self.dir, "tb"))

    def progress(self, epoch: int, steps: int) -> Progress:
        t = self.cfg.train
        return Progress(self.is_root and t.progress, epoch, t.epochs, steps, t.progress_interval_s, self.log)

    def _scalars(self, step: int, values: dict, prefix: str):
        if self._tb is None:
            return
        import tensorflow as tf

        with self._tb.as_default():
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    tf.summary.scalar(prefix + k, v, step=step)
        self._tb.flush()

    def step(self, global_step: int, epoch: int, loss: float, lr: Optional[float] = None):
        """Record one training step's loss; every ``log_every_steps`` steps write a step line."""
        if not self.is_root:
            return
        self._losses.append(loss)
        if self.every and global_step % self.every == 0:
            rec = {"kind": "step", "step": global_step, "epoch": epoch,
                   "train_loss": float(np.mean(self._losses[-self.every:]))}
            if lr is not None:
                rec["lr"] = float(lr)
            self._metrics.write(json.dumps(rec) + "\n")
            self._metrics.flush()
            self._scalars(global_step, {"train_loss": rec["train_loss"], **({"lr": lr} if lr is not None else {})},
                          "step/")

    def epoch(self, rec: dict, global_step: int, tensorboard: bool = True):
        """Write one epoch record (a dict with an ``epoch`` key) to metrics.jsonl and TensorBoard
        (``tensorboard=False``: metrics.jsonl only, e.g. the records a resumed run rewrites)."""
        if not self.is_root:
            return
        self._metrics.write(json.dumps(rec) + "\n")
        self._metrics.flush()
        if tensorboard:
            self._scalars(global_step, {k: v for k, v in rec.items() if k != "roles"}, "epoch/")

    def summary(self, summary: dict, model=None):
        """Write summary.json (and model.keras when ``model`` is given); closes the files."""
        if not self.is_root:
            return
        with open(os.path.join(self.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if model is not None:
            model.save(os.path.join(self.dir, "model.keras"))
        self.close()

    def close(self):
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def epoch_records(metrics: list) -> list:
    """The per-epoch lines of a metrics.jsonl (step lines dropped)."""
    return [m for m in metrics if m.get("kind") != "step"]


def new_run_id(cfg) -> str:
    """``run.id`` or ``<run.name>-<UTC time>`` (callers broadcast it so every rank agrees)."""
    return cfg.run.id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
