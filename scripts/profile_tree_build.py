"""Where the ``hierarchy="tree"`` exchange's first step goes: trace, first call, steady call.

One rank under ``mpirun -np N`` each; every rank builds VGG-16's trainable shapes (the CIFAR-10
config: ``width`` 0.25 by default), wraps ``Exchanger.exchange`` of an SGC setting in a
``tf.function`` and times (1) tracing (``get_concrete_function``), (2) the first call (graph
optimisation by grappler + executor creation + one exchange), (3) the mean of ``--steps`` later
calls; it counts the ops of the traced graph. Rank 0 prints one ``PROFILE {json}`` line and, with
``--dump PATH``, saves every rank's averages and residuals of every step (``PATH.rank{r}.npz``) to
compare two implementations bit for bit.

    mpirun -np 4 .venv/bin/python scripts/profile_tree_build.py --hierarchy tree
"""
import argparse
import json
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hierarchy", default="tree")
    ap.add_argument("--model", default="vgg16")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--index-coding", default="fixed")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tensors", type=int, default=0, help="first N tensors only (0: all)")
    ap.add_argument("--no-grappler", action="store_true")
    ap.add_argument("--dump", default="")
    args = ap.parse_args()

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.no_grappler:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    import horovod.tensorflow as hvd

    import hgsgc
    from hgsgc.communicator import Exchanger
    from hgsgc.models import build_model

    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    model = build_model(args.model, width=args.width, input_shape=(32, 32, 3))
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    if args.tensors:
        shapes = shapes[:args.tensors]
    names = [f"t{i}" for i in range(len(shapes))]
    ex = Exchanger(hgsgc.Compression.sgc(args.density, bits=args.bits, hierarchy=args.hierarchy,
                                         index_coding=args.index_coding))
    fn = tf.function(lambda xs: ex.exchange(xs, names))

    def grads(step):
        g = np.random.default_rng([step, rank])
        return [tf.constant(g.standard_normal(s).astype(np.float32)) for s in shapes]

    t0 = time.perf_counter()
    conc = fn.get_concrete_function(grads(0))
    t_trace = time.perf_counter() - t0
    gdef = conc.graph.as_graph_def()
    n_ops = len(gdef.node) + sum(len(f.node_def) for f in gdef.library.function)
    types = {}
    for nd in gdef.node:
        types[nd.op] = types.get(nd.op, 0) + 1
    hvd.allreduce(tf.zeros([1]), name="sync0")
    outs, resids = [], []
    t0 = time.perf_counter()
    out = fn(grads(0))
    t_first = time.perf_counter() - t0
    outs.append([o.numpy() for o in out])
    resids.append([ex.memory.residual(nm, s).numpy() for nm, s in zip(names, shapes)])
    ts = []
    for s in range(1, args.steps + 1):
        x = grads(s)
        t0 = time.perf_counter()
        out = fn(x)
        _ = [o.numpy() for o in out]
        ts.append(time.perf_counter() - t0)
        outs.append([o.numpy() for o in out])
        resids.append([ex.memory.residual(nm, sh).numpy() for nm, sh in zip(names, shapes)])
    if args.dump:
        np.savez(f"{args.dump}.rank{rank}.npz",
                 **{f"out_{s}_{i}": o for s, os_ in enumerate(outs) for i, o in enumerate(os_)},
                 **{f"res_{s}_{i}": r for s, rs in enumerate(resids) for i, r in enumerate(rs)})
    stats = ex.stats.snapshot()
    allt = hvd.allgather_object({"trace": t_trace, "first": t_first, "steady": float(np.mean(ts)),
                                 "ops": n_ops})
    if rank == 0:
        top = sorted(types.items(), key=lambda kv: -kv[1])[:12]
        print("PROFILE " + json.dumps({
            "n": n, "hierarchy": args.hierarchy, "tensors": len(shapes),
            "numel": int(sum(np.prod(s) for s in shapes)), "grappler": not args.no_grappler,
            "trace_s": max(a["trace"] for a in allt), "first_call_s": max(a["first"] for a in allt),
            "steady_ms": 1000 * max(a["steady"] for a in allt),
            "ops_rank0": allt[0]["ops"], "ops_max": max(a["ops"] for a in allt),
            "top_ops_rank0": top, "payload_bytes": stats.get("payload_bytes"),
            "bytes_sent_rank0": stats.get("bytes_sent")}), flush=True)


if __name__ == "__main__":
    main()
