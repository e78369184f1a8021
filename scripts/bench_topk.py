"""Exact vs sampled-threshold top-k: time per call, side by side in one run, and agreement.

    .venv/bin/python scripts/bench_topk.py [--numel 1605632] [--density 0.005] [--threads 1]

Prints a Markdown table: median time of each selector inside a warmed-up tf.function over
``--repeats`` calls, the ratio exact/sampled, how many of the calls re-selected (fallback), and
whether the indices matched exact top-k on every call.
"""
import argparse
import time

import numpy as np
import tensorflow as tf


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--numel", type=int, nargs="+", default=[1605632, 131072, 25600])
    p.add_argument("--density", type=float, default=0.005)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    from hgsgc.compression.sparsify import exact_topk, num_selected, sampled_threshold_topk

    print(f"threads={a.threads} density={a.density} repeats={a.repeats}\n")
    print("| numel | k | exact (ms) | sampled (ms) | exact/sampled | identical indices |")
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for numel in a.numel:
        k = num_selected(numel, a.density)
        xs = [tf.constant((rng.standard_normal(numel) * rng.exponential(1, numel)).astype(np.float32))
              for _ in range(4)]
        fe = tf.function(lambda x: exact_topk(x, k)[0])
        fs = tf.function(lambda x, s: sampled_threshold_topk(x, k, seed=s)[0])
        same = True
        te, ts = [], []
        for r in range(a.repeats):
            x = xs[r % len(xs)]
            seed = tf.constant([r, 3])
            t0 = time.perf_counter(); ie = fe(x).numpy(); te.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); is_ = fs(x, seed).numpy(); ts.append(time.perf_counter() - t0)
            same &= np.array_equal(ie, is_)
        me, ms = np.median(te[1:]) * 1e3, np.median(ts[1:]) * 1e3
        print(f"| {numel} | {k} | {me:.2f} | {ms:.2f} | {me / ms:.2f} | {same} |")


if __name__ == "__main__":
    main()
