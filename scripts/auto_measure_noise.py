#!/usr/bin/env python3
"""How noisy ``layout: auto``'s per-rank compute figures are within one process (issue 11,
session 17): the same figures ``hgsgc.hourglass.auto.choose`` measures on a machine's first rank
(:func:`hgsgc.hourglass.auto.measure` and :func:`hgsgc.hourglass.costmodel.measure_pipeline_stages`),
taken ``--rounds`` times in ONE process for each ``--repeats`` value (timed calls per figure,
median; auto uses 5), on the configured model and its first training batch.

Comparing the within-process spread of a figure with its spread between launches
(``scripts/auto_prediction_spread.py`` on several auto runs) says whether more timed calls
would steady it (within-process noise) or not (the launch itself: thread placement, memory).

Prints one line per figure and ``--repeats``: median, min, max, max/min over the rounds (seconds;
``t_conv``, ``t_fc``, ``fc_row_s`` per example). One process, ``train.threads`` TensorFlow
threads; run it on a quiet machine, alone.

Usage::

    python scripts/auto_measure_noise.py configs/cifar10_vgg16/hourglass_sgc.yaml model.name=alexnet \\
        hourglass.act_codec=sparse+q8 hourglass.grad_codec=sparse+q8 hourglass.micro_batches=2 \\
        --ranks 4 --rounds 9 --repeats 5 25 [--out F.json]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FIGURES = ("t_conv", "t_fc", "codec_s", "cpu_parallelism", "conv_fwd_mb_s", "conv_bwd_mb_s", "fc_call_s", "fc_row_s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--ranks", type=int, default=4, help="world size whose F = 1 candidate sets the FC fit's K "
                                                          "(max_convs_per_fc = ranks - 1, as auto)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeats", type=int, nargs="+", default=[5, 25])
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.rounds < 2 or a.ranks < 2 or min(a.repeats) < 1:
        ap.error("--rounds >= 2, --ranks >= 2 and --repeats >= 1 each")

    import numpy as np

    from hgsgc.config import load_config
    from hgsgc.hourglass import auto
    from hgsgc.hourglass.costmodel import configured_codecs, measure_pipeline_stages
    from hgsgc.hourglass.split import split_model
    from hgsgc.loop import setup_threads
    from hgsgc.tasks import make_task

    cfg = load_config(a.config, a.overrides)
    setup_threads(cfg.train.threads)
    import tensorflow as tf

    tf.keras.utils.set_random_seed(cfg.run.seed)
    task = make_task(cfg)
    split = split_model(task.build_model(), cfg.hourglass.split_layer)
    batches, _ = task.train_data(0, 1, 0)
    x = np.asarray(next(iter(batches))[0], dtype=np.float32)
    h = cfg.hourglass
    act, grad = configured_codecs(h)
    out = {"config": a.config, "overrides": a.overrides, "ranks": a.ranks, "rounds": a.rounds,
           "threads": cfg.train.threads, "per_repeats": {}}
    for reps in a.repeats:
        rows = []
        for _ in range(a.rounds):
            m = auto.measure(split, x, act, grad, repeats=reps, micro_batches=int(h.micro_batches))
            m.update(measure_pipeline_stages(split, x, int(h.micro_batches), a.ranks - 1, repeats=reps))
            rows.append({k: float(m[k]) for k in FIGURES})
        stats = {}
        for k in FIGURES:
            v = [r[k] for r in rows]
            lo, hi = min(v), max(v)
            stats[k] = {"values": v, "median": float(np.median(v)), "min": lo, "max": hi,
                        "max_over_min": hi / lo if lo > 0 else None}
            mo = f"{hi / lo:.2f}" if lo > 0 else "-"
            print(f"repeats {reps:3d} {k:16s} median {np.median(v):.4g}  min {lo:.4g}  max {hi:.4g}  max/min {mo}",
                  flush=True)
        out["per_repeats"][str(reps)] = stats
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
