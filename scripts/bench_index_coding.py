#!/usr/bin/env python
"""Micro-benchmark: fixed-width vs Elias-Fano index coding in the fused SGC kernels, side by side.

For every trainable tensor of a model (default ``alexnet_small``, the Fashion-MNIST bench model)
at ``--density`` with ``--bits``-bit values, one process times the two kernels the exchange runs
per tensor, with ``compression.index_coding`` = fixed and = elias_fano:

* compress: ``kernels.compress_into`` (compensate + top-k + encode + residual update in place);
* decode-accumulate of ``--ranks`` gathered payloads: ``kernels.decode_accumulate``.

Each callable is a ``tf.function``, traced and warmed up once, then timed ``--repeats`` times
round-robin (fixed, elias_fano, fixed, ...); the median is reported, summed over the model's
tensors (the per-step cost), with the payload bytes of both codings. The decoded sums of both
codings are checked equal first. ``/proc/loadavg`` is recorded before and after (the machine is
shared): a benchmark, not a test.

Usage: nice -n 10 python scripts/bench_index_coding.py [--model alexnet_small] [--density 0.005]
       [--bits 2] [--ranks 2] [--repeats 41] [--json out.json]
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hgsgc.compression import kernels, wire  # noqa: E402
from hgsgc.compression.sparsify import num_selected  # noqa: E402
from hgsgc.models import build_model  # noqa: E402

CODINGS = ("fixed", "elias_fano")


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="alexnet_small")
    ap.add_argument("--density", type=float, default=0.005)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--json")
    a = ap.parse_args()
    load0 = loadavg()
    model = build_model(a.model, seed=0)
    rng = np.random.default_rng(0)
    rows = []
    for v in model.trainable_variables:
        numel = int(math.prod(v.shape))
        k = num_selected(numel, a.density)
        g = tf.constant(rng.standard_normal(numel).astype(np.float32))
        res = {c: tf.Variable(rng.standard_normal(numel).astype(np.float32) * 0.01) for c in CODINGS}
        comp = {c: tf.function(lambda x, c=c: kernels.compress_into(x, res[c], k, a.bits, seed=3,
                                                                   backend="custom", index_coding=c))
                for c in CODINGS}
        others = [tf.constant(rng.standard_normal(numel).astype(np.float32)) for _ in range(a.ranks)]
        gathered = {c: tf.stack([kernels.compress(x, None, k, a.bits, seed=r, backend="custom",
                                                  index_coding=c)[0] for r, x in enumerate(others)])
                    for c in CODINGS}
        dec = {c: tf.function(lambda x, c=c: kernels.decode_accumulate(x, numel, k, a.bits,
                                                                      backend="custom", index_coding=c))
               for c in CODINGS}
        np.testing.assert_array_equal(dec["fixed"](gathered["fixed"]).numpy(),
                                      dec["elias_fano"](gathered["elias_fano"]).numpy())
        for c in CODINGS:  # warm-up (trace)
            comp[c](g)
            dec[c](gathered[c])
        t = {(op, c): [] for op in ("compress", "decode") for c in CODINGS}
        for _ in range(a.repeats):
            for c in CODINGS:
                t0 = time.perf_counter()
                comp[c](g).numpy()
                t[("compress", c)].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                dec[c](gathered[c]).numpy()
                t[("decode", c)].append(time.perf_counter() - t0)
        row = {"tensor": v.name, "numel": numel, "k": k,
               **{f"payload_{c}": wire.payload_length(numel, k, a.bits, c) for c in CODINGS},
               **{f"{op}_{c}_us": 1e6 * statistics.median(x) for (op, c), x in t.items()}}
        rows.append(row)
        print(f"{v.name:22s} numel {numel:9d} k {k:6d} payload {row['payload_fixed']:6d} -> "
              f"{row['payload_elias_fano']:6d} B  compress {row['compress_fixed_us']:8.1f} / "
              f"{row['compress_elias_fano_us']:8.1f} us  decode({a.ranks}) {row['decode_fixed_us']:8.1f} / "
              f"{row['decode_elias_fano_us']:8.1f} us", flush=True)
    tot = {key: sum(r[key] for r in rows) for key in rows[0] if key.endswith("_us") or key.startswith("payload_")}
    out = {"model": a.model, "density": a.density, "bits": a.bits, "ranks": a.ranks, "repeats": a.repeats,
           "loadavg_before": load0, "loadavg_after": loadavg(), "tensors": rows, "total": tot}
    print("TOTAL per step: payload %d -> %d B; compress %.1f -> %.1f us; decode(%d) %.1f -> %.1f us; "
          "load %s -> %s" % (tot["payload_fixed"], tot["payload_elias_fano"], tot["compress_fixed_us"],
                             tot["compress_elias_fano_us"], a.ranks, tot["decode_fixed_us"],
                             tot["decode_elias_fano_us"], load0, out["loadavg_after"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
