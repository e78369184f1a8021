"""Silent-divergence traps under mpirun; prints ``RESULT {json}`` on rank 0.

* delay anchors follow the initial weights however they arrive: Horovod's
  ``BroadcastGlobalVariablesCallback`` inside ``model.fit`` (it broadcasts after the first batch,
  i.e. after one local step from different initial weights), and the Horovod TF2 custom-loop
  pattern that broadcasts ``model.variables`` and ``opt.variables()`` after the first step;
* ``Compression.fp16``: a sum over ranks beyond the float16 range, average within it;
* an ``IndexedSlices`` gradient whose static shape is unknown (out of ``tf.cond`` in a
  ``tf.function``);
* NaN/Inf on one rank: the step is skipped on every rank, residuals untouched (delay 1); with
  delay 3 the local step is skipped on the rank that saw it and the sync leaves every rank with
  the same finite weights (the mean of the ranks' local trajectories).
"""
import json

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvdk
import numpy as np
import tensorflow as tf

import hgsgc
from hgsgc.communicator import Exchanger

hvd.init()
rank, size = hvd.rank(), hvd.size()
out = {"size": size}


def spread(variables):
    """max over variables of (max over ranks - min over ranks), exactly."""
    worst = 0.0
    for v in variables:
        g = hvd.allgather(tf.reshape(v, [1, -1]), name=f"spread_{v.name}_{spread.calls}").numpy()
        worst = max(worst, float(np.max(g.max(0) - g.min(0))))
    spread.calls += 1
    return worst


spread.calls = 0


def model_for(seed):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=(6,)),
                                tf.keras.layers.Dense(5, activation="relu"),
                                tf.keras.layers.Dense(3)])


rng = np.random.default_rng(100 + rank)  # different data per rank
x = rng.normal(size=(48, 6)).astype(np.float32)
y = rng.integers(0, 3, size=48)

# 1. model.fit + BroadcastGlobalVariablesCallback with delay 3: different initial weights per rank
for tag, comp in (("sgc", hgsgc.Compression.sgc(0.5, bits=32, delay=3, selector="exact")),
                  ("localsgd", hgsgc.Compression.localsgd(3))):
    model = model_for(seed=rank)  # deliberately different on every rank
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                                     compression=comp)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,  # 6 steps: syncs at 3 and 6
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    out[f"fit_{tag}_spread"] = spread(model.trainable_variables)

# 2. Horovod's TF2 custom loop: broadcast model and optimizer variables after the first step
model = model_for(seed=rank)
opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1),
                                 compression=hgsgc.Compression.sgc(0.5, bits=32, delay=2,
                                                                   selector="exact"))
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def step(xb, yb):
    with tf.GradientTape() as tape:
        loss = loss_fn(yb, model(xb, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))


for i in range(4):
    step(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
    if i == 0:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables(), root_rank=0)
out["loop_broadcast_after_first_step_spread"] = spread(model.trainable_variables)

# 3. fp16: every rank holds 40000 (+ rank): the sum exceeds 65504, the average does not
ex = Exchanger(hgsgc.Compression.fp16)
val = np.array([40000.0 + rank, -40000.0 - rank, 1.5, 0.0], np.float32)
avg = ex.exchange([tf.constant(val)], ["fp16_trap"])[0].numpy()
want = np.mean([np.array([40000.0 + r, -40000.0 - r, 1.5, 0.0], np.float32) for r in range(size)], 0)
out["fp16_avg"] = avg.tolist()
out["fp16_want"] = want.tolist()
out["fp16_finite"] = bool(np.all(np.isfinite(avg)))

# 4. IndexedSlices with unknown static shape (tf.cond inside tf.function)
emb_model = tf.keras.Sequential([tf.keras.layers.Embedding(7, 3, embeddings_initializer="ones")])
emb_model.build((None, 2))
e_opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(1.0),
                                   compression=hgsgc.Compression.topk(1.0, selector="exact"))


@tf.function
def emb_step(ids, flag):
    emb = emb_model.trainable_variables[0]

    def grad_a():
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(tf.gather(emb, ids))
        return t.gradient(loss, emb)

    def grad_b():
        with tf.GradientTape() as t:
            loss = 2.0 * tf.reduce_sum(tf.gather(emb, ids))
        return t.gradient(loss, emb)

    g = tf.cond(flag, grad_a, grad_b)
    e_opt.apply_gradients([(g, emb)])
    return tf.constant(True)


try:
    emb_step(tf.constant([rank % 7, 3]), tf.constant(True))
    got = emb_model.trainable_variables[0].numpy()
    want = np.ones((7, 3), np.float32)
    for r in range(size):
        for i in (r % 7, 3):
            want[i] -= 1.0 / size
    out["indexed_slices_max_err"] = float(np.max(np.abs(got - want)))
    out["indexed_slices_error"] = None
except Exception as exc:  # reported, the test fails on it
    out["indexed_slices_error"] = f"{type(exc).__name__}: {exc}"[:300]

# 5. NaN/Inf: rank 1's gradient is NaN at the 2nd step; skip mode skips it on every rank
for mode in ("skip", "raise"):
    model = model_for(seed=7)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                                     compression=hgsgc.Compression.topk(0.3, selector="exact"))
    opt.hgsgc_set_nonfinite(mode)

    @tf.function
    def nstep(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    rec = {}
    try:
        for i in range(3):
            xb = x[8 * i:8 * i + 8].copy()
            if i == 1 and rank == min(1, size - 1):
                xb[0, 0] = np.nan
            before_w = [v.numpy().copy() for v in model.trainable_variables]
            before_r = {k: v.copy() for k, v in opt.hgsgc_state()["residuals"].items()}
            nstep(xb, y[8 * i:8 * i + 8])
            if i == 1:
                rec["weights_unchanged"] = all(np.array_equal(a, v.numpy()) for a, v in
                                               zip(before_w, model.trainable_variables))
                after_r = opt.hgsgc_state()["residuals"]
                rec["residuals_unchanged"] = all(np.array_equal(before_r[k], after_r[k]) for k in before_r)
                rec["iterations_after_skip"] = int(opt.iterations.numpy())
        state = opt.hgsgc_state()
        rec["residuals_finite"] = all(bool(np.all(np.isfinite(r))) for r in state["residuals"].values())
        rec["weights_finite"] = all(bool(np.all(np.isfinite(v.numpy()))) for v in model.trainable_variables)
        rec["skipped"] = opt.hgsgc_skipped_steps
        rec["spread"] = spread(model.trainable_variables)
        rec["error"] = None
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rec["error_names_setting"] = "NaN/Inf gradient (faults.nonfinite=raise)" in str(exc)
    out[f"nonfinite_{mode}"] = rec

# 5a. the same with a dense exchange (Compression.none): the check runs on the average, which
# carries rank 1's NaN to every rank, so the traced step holds no extra allreduce: the number of
# Horovod allreduce ops is the same with faults.nonfinite=skip as with off


def allreduce_ops(fn, *args):
    return sum("Allreduce" in op.type for op in fn.get_concrete_function(*args).graph.get_operations())


for mode in ("skip", "off"):
    model = model_for(seed=7)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                                     compression=hgsgc.Compression.none)
    opt.hgsgc_set_nonfinite(mode)

    @tf.function
    def dense_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    rec = {}
    try:
        for i in range(3):
            xb = x[8 * i:8 * i + 8].copy()
            if i == 1 and rank == min(1, size - 1) and mode == "skip":
                xb[0, 0] = np.nan
            before_w = [v.numpy().copy() for v in model.trainable_variables]
            dense_step(xb, y[8 * i:8 * i + 8])
            if i == 1:
                rec["weights_unchanged"] = all(np.array_equal(a, v.numpy()) for a, v in
                                               zip(before_w, model.trainable_variables))
                rec["iterations_after_skip"] = int(opt.iterations.numpy())
        rec["allreduce_ops"] = allreduce_ops(dense_step, xb, y[16:24])
        rec["skipped"] = opt.hgsgc_skipped_steps
        rec["weights_finite"] = all(bool(np.all(np.isfinite(v.numpy()))) for v in model.trainable_variables)
        rec["spread"] = spread(model.trainable_variables)
        rec["error"] = None
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    out[f"nonfinite_dense_{mode}"] = rec

# the compressed exchange keeps its 4-byte allreduce(op=Min): one more allreduce op than off
for mode in ("skip", "off"):
    model = model_for(seed=7)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1),
                                     compression=hgsgc.Compression.topk(0.3, selector="exact"))
    opt.hgsgc_set_nonfinite(mode)

    @tf.function
    def topk_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    topk_step(x[:8], y[:8])
    out[f"nonfinite_topk_{mode}_allreduce_ops"] = allreduce_ops(topk_step, x[:8], y[:8])

# 5b. NaN/Inf with delay 3 (local SGD): the rank that saw it skips that local step (its update
# and the local-step counter's schedule are kept: the sync still comes after 3 calls on every
# rank); the sync averages each rank's accepted updates, so every rank leaves it with the same
# finite weights, equal to the mean of the ranks' local trajectories (numpy/Keras reference)
victim = min(1, size - 1)
for tag, comp in (("localsgd", hgsgc.Compression.localsgd(3)),
                  ("sgc", hgsgc.Compression.sgc(0.5, bits=32, delay=3, selector="exact"))):
    model = model_for(seed=7)
    ref = model_for(seed=7)
    opt = hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                                     compression=comp)
    opt.hgsgc_set_nonfinite("skip")
    ref_opt = tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9)

    @tf.function
    def dstep(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    rec = {}
    try:
        for i in range(3):
            xb = x[8 * i:8 * i + 8].copy()
            if i == 1 and rank == victim:
                xb[0, 0] = np.inf
            else:  # the reference applies every step this rank accepts
                with tf.GradientTape() as tape:
                    loss = loss_fn(y[8 * i:8 * i + 8], ref(xb, training=True))
                ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables),
                                            ref.trainable_variables))
            dstep(xb, y[8 * i:8 * i + 8])
        local = np.concatenate([v.numpy().ravel() for v in ref.trainable_variables])
        want = hvd.allgather(tf.constant(local[None].astype(np.float64)), name=f"ref_{tag}").numpy().mean(0)
        got = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
        state = opt.hgsgc_state()
        rec["skipped"] = hvd.allgather(tf.constant([opt.hgsgc_skipped_steps]), name=f"sk_{tag}").numpy().tolist()
        rec["local_step"] = int(state["local_step"])
        rec["spread"] = spread(model.trainable_variables)
        rec["max_err_vs_mean_of_local_trajectories"] = float(np.max(np.abs(got - want)))
        rec["finite"] = bool(np.all(np.isfinite(got))) and all(
            bool(np.all(np.isfinite(a))) for a in state["anchors"]) and all(
            bool(np.all(np.isfinite(r))) for r in state.get("residuals", {}).values())
        rec["error"] = None
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    out[f"nonfinite_delay3_{tag}"] = rec

# 6. an hgsgc compression given to stock Horovod's DistributedOptimizer
model = model_for(seed=3)
stock = hvdk.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1),
                                  compression=hgsgc.Compression.sgc(0.1))
model.compile(optimizer=stock, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
try:
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    out["stock_horovod_error"] = None
except Exception as exc:
    out["stock_horovod_error"] = f"{type(exc).__name__}: {exc}"[-600:]

if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
