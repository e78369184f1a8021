#!/usr/bin/env python3
"""Where one merge round of SGC's tree exchange spends its CPU (issue 10, session 17).

On 8 emulated hosts at 100 Mbit/s and 1 Gbit/s the tree's delay-1 step was 1.54-1.75x its
allgather's, with ~30 ms more TensorFlow CPU per rank and step (docs/benchmarks.md "Session 17").
This times, in one process, the parts of :func:`hgsgc.hierarchy.merge_received` on a model's
tensors at the configured density, bits and index coding (the partner's payload: every tensor's
top-k rolled by half its length, as ``hgsgc.perfmodel`` times the tree's per-payload cost):

* ``decode``: :func:`hgsgc.hierarchy._decode_all` of the partner's payload;
* ``union_sum``: the sorted union of both index sets and the summed values (``hierarchy._union_sum``);
* ``select``: the per-tensor top-k of the sum (``hierarchy._select_top``: one descending sort by
  tensor and magnitude);
* ``encode``: :func:`hgsgc.hierarchy._encode_all` of the kept entries;
* ``merge_round``: the whole :func:`~hgsgc.hierarchy.merge_received` call (``--backend``: with
  the union, sum and top-k in the C++ op ``HgsgcSparseMergeSelect`` or in pure TF; the parts
  above are the pure-TF ones).

Each part is its own ``tf.function`` (no autograph), two warm-up calls, then the median of
``--reps`` calls; also the process CPU seconds per call (``time.process_time``), since the
parts run on TensorFlow's thread pools. Prints ms per part; ``--out`` writes JSON.

Usage::

    python scripts/profile_tree_merge.py configs/cifar10_vgg16/sgc.yaml compression.index_coding=fixed \\
        [--reps 30] [--threads 2] [--out F.json]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _time(fn, reps):
    fn()
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    wall.sort()
    cpu.sort()
    return wall[len(wall) // 2], cpu[len(cpu) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2, help="TensorFlow intra-op threads (2: an emulated host's rank)")
    ap.add_argument("--backend", choices=["auto", "custom", "reference"], default="auto",
                    help="compression kernels (hgsgc.ops.set_compression_backend): the merge round's "
                         "union + sum + top-k in the C++ op (custom, session 17) or in pure TF (reference)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)

    import numpy as np

    from hgsgc.config import compression_from_config, load_config
    from hgsgc.loop import setup_threads

    cfg = load_config(a.config, a.overrides)
    setup_threads(a.threads)
    from hgsgc import ops

    ops.set_compression_backend(a.backend)
    import tensorflow as tf

    from hgsgc import hierarchy
    from hgsgc.compression import as_compression, kernels
    from hgsgc.compression.sparsify import exact_topk, num_selected
    from hgsgc.tasks import make_task

    comp = as_compression(compression_from_config(cfg.compression))
    tf.keras.utils.set_random_seed(cfg.run.seed)
    model = make_task(cfg).build_model()
    rng = np.random.default_rng(0)
    tensors = [tf.constant(rng.standard_normal(v.shape).astype(np.float32)) for v in model.trainable_variables]
    items = []
    for t in tensors:
        numel = int(np.prod(t.shape))
        k = num_selected(numel, comp.density)
        idx, vals = exact_topk(tf.reshape(t, [-1]), k)
        payload, q = kernels.sparse_encode(idx, vals, numel, comp.bits, index_coding=comp.index_coding)
        pidx, pvals = exact_topk(tf.roll(tf.reshape(t, [-1]), numel // 2 + 1, 0), k)
        partner = kernels.sparse_encode(pidx, pvals, numel, comp.bits, index_coding=comp.index_coding)[0]
        items.append((payload, idx, q, numel, k, partner))
    lay = hierarchy.exchange_layout([(it[3], it[4], int(it[0].shape[0])) for it in items], comp.bits,
                                    comp.index_coding)
    base = np.concatenate([[0], np.cumsum([it[3] for it in items])[:-1]]).astype(np.int64)
    agg = (tf.concat([tf.cast(it[1], tf.int64) + int(b) for it, b in zip(items, base)], 0),
           tf.concat([it[2] for it in items], 0))
    partner = tf.concat([it[5] for it in items], 0)
    decoded = hierarchy._decode_all(partner, lay, "")
    union = tf.unique(tf.sort(tf.concat([agg[0], decoded[0]], 0))).y
    merged = hierarchy.merge_received(agg, [(partner, "")], lay)

    @tf.function(autograph=False)
    def decode():
        g, v = hierarchy._decode_all(partner, lay, "")
        return tf.reduce_sum(v) + tf.cast(tf.reduce_sum(g), tf.float32)

    @tf.function(autograph=False)
    def union_sum():
        return tf.reduce_sum(hierarchy._union_sum([agg, decoded])[2])

    total = tf.random.normal(tf.shape(union))

    @tf.function(autograph=False)
    def select():
        return tf.reduce_sum(hierarchy._select_top(union, total, lay))

    new_idx, kept = merged[1], merged[6]

    @tf.function(autograph=False)
    def encode():
        p, q = hierarchy._encode_all(new_idx, kept, lay)
        return tf.reduce_sum(tf.cast(p, tf.int32)) + tf.cast(tf.reduce_sum(q), tf.int32)

    @tf.function(autograph=False)
    def merge_round():
        m = hierarchy.merge_received(agg, [(partner, "")], lay)
        return tf.reduce_sum(m[2]) + tf.cast(tf.reduce_sum(m[1]), tf.float32)

    out = {"config": a.config, "overrides": a.overrides, "threads": a.threads, "reps": a.reps, "backend": a.backend,
           "tensors": len(items), "K": int(lay.K), "payload_bytes": int(lay.P), "union": int(union.shape[0]),
           "parts_ms": {}}
    print(f"{len(items)} tensors, K = {lay.K} kept entries, payload {lay.P} B, union {int(union.shape[0])} entries; "
          f"{a.threads} TF threads, median of {a.reps}")
    for name, fn in (("decode", decode), ("union_sum", union_sum), ("select", select), ("encode", encode),
                     ("merge_round", merge_round)):
        w, c = _time(lambda: fn().numpy(), a.reps)
        out["parts_ms"][name] = {"wall": 1e3 * w, "cpu": 1e3 * c}
        print(f"{name:12s} wall {1e3 * w:7.2f} ms   cpu {1e3 * c:7.2f} ms", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
