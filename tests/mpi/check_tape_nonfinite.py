"""``hgsgc.DistributedGradientTape(..., nonfinite=...)`` under mpirun; prints ``RESULT {json}`` on rank 0.

Gradients are chosen exactly: the loss is ``sum(v1 * c1) + sum(v2 * c2)``, so the gradient is
``(c1, c2)``, a per-rank constant; the last rank's second call has a NaN in ``c1``.

For each compression (``none``: dense, checked on the average; ``sgc`` and ``topk``: compressed,
one allreduce of the verdict before the exchange) and each mode (eager and inside a
``tf.function``):

* ``skip``: calls (g1, NaN, g3) give (o1, 0, o3) on every rank, with o1 and o3 exactly what a
  separate tape sequence (g1, g3) gives, the residual state equal to that sequence's, and
  ``skipped_steps`` 1 on every rank (0 for the sequence without the NaN);
* ``raise``: the NaN call raises on every rank (no hang) and leaves the residuals as after g1;
* ``off`` (the default) for SGC: the NaN enters the residual and the third call's average is
  non-finite on every rank (what the guard exists to prevent: the test is not vacuous).
"""
import json

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hgsgc

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {"size": size}

SHAPES = [(6, 4), (5,)]


def grads_for(call):
    """Exact per-rank gradients of call ``call`` (1, 2 or 3); call 2 on the last rank has a NaN."""
    rng = np.random.default_rng(1000 * call + rank)
    gs = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    if call == 2 and rank == size - 1:
        gs[0][1, 2] = np.nan
    return gs


def run(comp, mode, calls, graph):
    """Fresh variables (so a fresh exchanger); returns (outputs per call, state, skipped, errors)."""
    vs = [tf.Variable(tf.zeros(s)) for s in SHAPES]

    def one(c1, c2):
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(vs[0] * c1) + tf.reduce_sum(vs[1] * c2)
        tape = hgsgc.DistributedGradientTape(t, compression=comp, nonfinite=mode)
        return tape.gradient(loss, vs), tape

    fn = tf.function(lambda c1, c2: one(c1, c2)[0]) if graph else None
    outs, errors, tape = [], [], None
    for call in calls:
        c1, c2 = (tf.constant(g) for g in grads_for(call))
        try:
            if graph:
                outs.append([g.numpy() for g in fn(c1, c2)])
            else:
                res, tape = one(c1, c2)
                outs.append([g.numpy() for g in res])
        except tf.errors.InvalidArgumentError as e:
            outs.append(None)
            errors.append("NaN/Inf gradient on some rank" in str(e) and "nonfinite=raise" in str(e))
    probe = hgsgc.DistributedGradientTape(tf.GradientTape(), compression=comp, nonfinite=mode)
    from hgsgc.optimizer import _tape_exchanger
    probe.exchanger = _tape_exchanger(probe._comp, probe._process_set, vs, None)
    state = probe.hgsgc_state()
    return outs, state, probe.skipped_steps, errors


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def same_state(a, b):
    ra, rb = a.get("residuals") or {}, b.get("residuals") or {}
    # residual names carry the variable names, which differ between the two runs' variables:
    # compare in creation order
    va, vb = [np.asarray(ra[k]) for k in sorted(ra)], [np.asarray(rb[k]) for k in sorted(rb)]
    return len(va) == len(vb) and all(np.array_equal(x, y) for x, y in zip(va, vb))


def everyone(flag):
    """True on every rank iff ``flag`` holds on every rank."""
    v = hvd.allreduce(tf.constant([1.0 if flag else 0.0]), op=hvd.Min, name=f"all_{everyone.n}")
    everyone.n += 1
    return bool(v.numpy()[0] > 0.5)


everyone.n = 0

COMPS = {"none": hgsgc.Compression.none,
         "sgc": hgsgc.Compression.sgc(0.25, bits=32, selector="exact"),
         "topk": hgsgc.Compression.topk(0.25)}
for name, comp in COMPS.items():
    for graph in (False, True):
        tag = f"{name}_{'graph' if graph else 'eager'}"
        a_out, a_state, a_skip, _ = run(comp, "skip", [1, 2, 3], graph)
        b_out, b_state, b_skip, _ = run(comp, "skip", [1, 3], graph)
        zeros = a_out[1] is not None and all(not np.any(g) for g in a_out[1])
        rec = {"o1": same(a_out[0], b_out[0]), "o2_zero": zeros, "o3": same(a_out[2], b_out[1]),
               "finite": all(np.all(np.isfinite(g)) for o in a_out for g in o),
               "state": same_state(a_state, b_state), "skipped": a_skip, "skipped_clean": b_skip,
               "state_has_count": a_state.get("skipped_steps") == a_skip}
        if name == "none":  # exact numpy reference: the average of every rank's gradient
            per_rank = []
            for r in range(size):
                rng = np.random.default_rng(3000 + r)  # grads_for(3) on rank r
                per_rank.append([rng.normal(size=s).astype(np.float32) for s in SHAPES])
            want = [np.mean([g[i] for g in per_rank], axis=0, dtype=np.float32)
                    for i in range(len(SHAPES))]
            rec["o3_vs_numpy"] = max(float(np.max(np.abs(x - w))) for x, w in zip(a_out[2], want))
        r_out, r_state, _, r_err = run(comp, "raise", [1, 2], graph)
        _, g1_state, _, _ = run(comp, "raise", [1], graph)
        rec["raise_errors"] = r_err
        rec["raise_state"] = same_state(r_state, g1_state)
        rec["all_ranks_ok"] = everyone(all(v for k, v in rec.items()
                                           if isinstance(v, bool)) and r_err == [True])
        out[tag] = rec

# the default, off: the NaN poisons SGC's residual, so the next average is non-finite everywhere
o_out, _, o_skip, _ = run(COMPS["sgc"], "off", [1, 2, 3], False)
out["off_sgc"] = {"third_finite": bool(all(np.all(np.isfinite(g)) for g in o_out[2])),
                  "skipped": o_skip}

# a bad mode: one clear error
try:
    hgsgc.DistributedGradientTape(tf.GradientTape(), nonfinite="ignore")
    out["bad_mode"] = None
except ValueError as e:
    out["bad_mode"] = str(e)

if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
