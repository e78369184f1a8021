#!/usr/bin/env python
"""Benchmark hgsgc's custom bit-packing kernels against the pure-TensorFlow reference.

For each width, packs ``--n`` random values (and unpacks the result) with both backends, each
wrapped in its own ``tf.function`` and warmed up, timing the two side by side in every repeat
(custom, then reference) and reporting the median wall time per call. The printed ratio is
``speed(custom) / speed(reference) = median time(reference) / median time(custom)``; every
output is also checked bit for bit against the other backend.

Usage: python scripts/bench_ops.py [--n 1000000] [--widths 2 20] [--repeats 15]
"""
import argparse
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hgsgc import ops  # noqa: E402


def median_seconds(fns, arg, repeats):
    """Median wall time of each fn(arg), timed round-robin (side by side) ``repeats`` times."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            out = fn(arg)
            _ = out.numpy()  # make sure the result is materialized on the host
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="values per call")
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 20])
    parser.add_argument("--repeats", type=int, default=21, help="timed calls per backend")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    ops.load()  # fail loudly if the custom kernels are not built
    print(
        f"hgsgc bit packing: custom kernel vs pure-TF reference, n={args.n}, "
        f"median of {args.repeats} side-by-side repeats (tf.function, warmed up)"
    )
    print(
        f"TensorFlow {tf.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPU cores, {platform.machine()}, "
        "load average %.1f %.1f %.1f at start" % os.getloadavg()
    )
    print()
    header = f"{'op':<7}{'width':>6}{'custom ms':>12}{'reference ms':>14}{'custom/reference speed':>25}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(args.seed)
    for width in args.widths:
        n = args.n
        values = tf.constant(
            rng.integers(0, 2**width, size=n, dtype=np.uint64).astype(np.uint32).view(np.int32)
        )
        spec_v = tf.TensorSpec([n], tf.int32)
        spec_p = tf.TensorSpec([ops.packed_length(n, width)], tf.uint8)
        pack_c = tf.function(lambda x, w=width: ops.pack_bits(x, w, backend="custom"), input_signature=[spec_v])
        pack_r = tf.function(lambda x, w=width: ops.pack_bits_reference(x, w), input_signature=[spec_v])
        unpack_c = tf.function(
            lambda p, w=width, k=n: ops.unpack_bits(p, w, k, backend="custom"), input_signature=[spec_p]
        )
        unpack_r = tf.function(
            lambda p, w=width, k=n: ops.unpack_bits_reference(p, w, k), input_signature=[spec_p]
        )

        packed = pack_c(values)
        if not np.array_equal(packed.numpy(), pack_r(values).numpy()):
            raise SystemExit(f"pack mismatch between backends at width {width}")
        for fn in (unpack_c, unpack_r):
            if not np.array_equal(fn(packed).numpy(), values.numpy()):
                raise SystemExit(f"unpack mismatch at width {width}")

        for name, fns, arg in (("pack", (pack_c, pack_r), values), ("unpack", (unpack_c, unpack_r), packed)):
            for fn in fns:  # warm-up
                fn(arg).numpy()
            t_custom, t_ref = median_seconds(fns, arg, args.repeats)
            print(
                f"{name:<7}{width:>6}{t_custom * 1e3:>12.3f}{t_ref * 1e3:>14.3f}"
                f"{t_ref / t_custom:>24.1f}x"
            )


if __name__ == "__main__":
    main()
