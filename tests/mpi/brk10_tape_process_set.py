"""brk10: ``DistributedGradientTape(..., process_set=PS, nonfinite="skip")`` on a process set that
leaves world rank 0 out (as the Hourglass FC ranks are): ranks 1..n-1 exchange SGC gradients, a NaN
on the last rank skips the call on every rank of the set (zeros, skipped 1 on each), the calls around
it equal a run without it, world rank 0 takes no part and is not blocked. Rank 0 prints the RESULT
(it gathers the set's records through a world allgather_object at the end)."""
import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

hvd.init(process_sets="dynamic")
import hgsgc  # noqa: E402
from horovod.tensorflow.functions import allgather_object  # noqa: E402

rank, size = hvd.rank(), hvd.size()
ps = hvd.add_process_set(list(range(1, size)))
rec = {"rank": rank}
if rank != 0:
    def run(calls, tag):
        vs = [tf.Variable(tf.zeros((6, 4)), name=f"{tag}_w"), tf.Variable(tf.zeros((5,)), name=f"{tag}_b")]
        outs, tape = [], None

        @tf.function
        def step(c1, c2):
            with tf.GradientTape() as t:
                loss = tf.reduce_sum(vs[0] * c1) + tf.reduce_sum(vs[1] * c2)
            dt = hgsgc.DistributedGradientTape(t, compression=hgsgc.Compression.sgc(0.25, bits=32, selector="exact"),
                                               process_set=ps, nonfinite="skip")
            step.tape = dt
            return dt.gradient(loss, vs)
        for call in calls:
            rng = np.random.default_rng(100 * call + rank)
            c1 = rng.normal(size=(6, 4)).astype(np.float32)
            c2 = rng.normal(size=(5,)).astype(np.float32)
            if call == 2 and rank == size - 1:
                c1[3, 1] = np.nan
            outs.append([g.numpy() for g in step(tf.constant(c1), tf.constant(c2))])
        return outs, step.tape.skipped_steps
    a, a_skip = run([1, 2, 3], "p")
    b, b_skip = run([1, 3], "p")
    rec.update(o1=all(np.array_equal(x, y) for x, y in zip(a[0], b[0])),
               o3=all(np.array_equal(x, y) for x, y in zip(a[2], b[1])),
               o2_zero=all(not np.any(x) for x in a[1]), skipped=[a_skip, b_skip])
allrecs = allgather_object(rec)
if rank == 0:
    print("RESULT " + json.dumps({"size": size, "ranks": allrecs}), flush=True)
