"""SGC's compression cost against gradient size on this CPU: the CPU side of the GPU sweep of
``scripts/gpu_step_reference.py --sweep`` (docs/benchmarks/gpu_step_h200.md).

    .venv/bin/python scripts/compression_cost_sweep.py [--numel 10000 ... 64000000] [--reps 5]

For one float32 tensor of each size and density 1 % and 0.1 % it prints ``base_s`` of
:func:`hgsgc.perfmodel.measure_compression_s` for SGC (2-bit values, delay 1, the exchange on a
world of one: selection, quantisation, encoding and decoding of the rank's own payload), in CPU
time with one TensorFlow thread (``time.process_time``: a dedicated core's time whatever the load).
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, nargs="+", default=[10_000, 100_000, 1_000_000, 4_000_000, 16_000_000, 64_000_000])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from hgsgc.runtime import apply_defaults

    apply_defaults()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from hgsgc import Compression
    from hgsgc import perfmodel as pm

    print(f"one TensorFlow thread, CPU time (time.process_time), reps={a.reps}; load {open('/proc/loadavg').read().split()[:3]}")
    print("| numel | density | SGC compression ms (CPU) |")
    print("|---|---|---|")
    for n in a.numel:
        for d in (0.01, 0.001):
            r = pm.measure_compression_s(Compression.sgc(density=d, bits=2, delay=1), [(n,)], reps=a.reps,
                                         clock=time.process_time)
            print(f"| {n} | {d} | {r['base_s'] * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
    main()
