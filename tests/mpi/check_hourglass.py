"""Run under mpirun: every multi-rank property of the Hourglass layout; rank 0 prints one JSON line.

Usage: ``check_hourglass.py [RUN_DIR]``. For each FC-rank count in LAYOUTS[world size]:

* dense: two Hourglass steps (momentum SGD, no compression) next to a single-process reference
  taking the same steps on the concatenated CONV batches; max weight errors after each step;
  byte counters after the two steps;
* sparse: four steps with SGC (delay 2) on the CONV ranks and top-k on the FC ranks; spread of
  the role's weights across the role's ranks after each step; byte counters;
* evaluation through the split next to the reference model's evaluation.

With 4 ranks also ``fc_workers=auto``; with 3 ranks (and RUN_DIR given) one short real
``hgsgc.hourglass.train.run`` writing RUN_DIR. tests/test_hourglass.py asserts on the numbers.
"""
import json
import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
from mpi4py import MPI  # noqa: E402

import hgsgc  # noqa: E402
from hgsgc.hourglass import HourglassTrainer, Layout, split_model  # noqa: E402
from hgsgc.models import build_model  # noqa: E402

world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
LAYOUTS = {2: [1], 3: [1], 4: [1], 5: [2]}  # C+F: 1+1, 2+1, 3+1, (2+1)+2 uneven
B = 6  # examples per CONV rank
LR, MOM = 0.1, 0.9
res = {"layouts": {}}
# (act codec, grad codec, micro-batches): lossless sparse, and every lossy codec
CODEC_CASES = [("sparse", "sparse", 2), ("fp16", "fp16", 1), ("q8", "q8", 1), ("q4", "q4", 2),
               ("sparse+q8", "sparse+q8", 1), ("sparse+q4", "sparse+q4", 2), ("sparse+fp16", "q8", 1)]


def batch(step, conv_index):
    g = np.random.default_rng([1000 + step, conv_index])
    return g.random((B, 28, 28, 1), dtype=np.float32), g.integers(0, 10, B).astype(np.int32)


def flat(vs):
    return np.concatenate([v.numpy().ravel() for v in vs])


def spread(comm, w):
    allw = comm.allgather(w)
    return float(max(np.max(np.abs(x - allw[0])) for x in allw))


def sgd():
    return tf.keras.optimizers.legacy.SGD(LR, momentum=MOM)


for F in LAYOUTS[n]:
    out = {}
    # ---- dense: equality with one single-process SGD step on the union of the batches ----
    split = split_model(build_model("tiny", seed=3))
    layout = Layout(world, F)
    C = layout.n_conv
    tr = HourglassTrainer(layout, split, B, sgd())
    ref = split_model(build_model("tiny", seed=3))
    ref_opt = sgd()
    ref_vars = ref.trunk_variables if layout.is_conv else ref.head_variables
    w0 = flat(ref_vars)
    errs = []
    for step in range(2):
        if layout.is_conv:
            tr.train_step(*batch(step, layout.role_index))
        else:
            tr.train_step()
        xs, ys = zip(*[batch(step, c) for c in range(C)])
        x, y = np.concatenate(xs), np.concatenate(ys)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, ref.model(x, training=True), from_logits=True))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.model.trainable_variables),
                                    ref.model.trainable_variables))
        errs.append(float(np.max(np.abs(tr.role_weights() - flat(ref_vars)))))
    out["max_err_per_step"] = errs
    out["moved"] = float(np.max(np.abs(flat(ref_vars) - w0)))  # equality must not be trivial
    out["dense_bytes"] = tr.snapshot()
    # evaluation through the split == the reference model on the same examples
    ge = np.random.default_rng([7, 7])
    xe, ye = ge.random((23, 28, 28, 1), dtype=np.float32), ge.integers(0, 10, 23).astype(np.int32)
    bounds = np.linspace(0, len(xe), C + 1).astype(int)
    if layout.is_conv:
        i = layout.role_index
        el, ea = tr.evaluate(xe[bounds[i]:bounds[i + 1]], ye[bounds[i]:bounds[i + 1]], batch_size=4)
    else:
        el, ea = tr.evaluate()
    logits = ref.model(xe, training=False)
    out["eval"] = [el, ea]
    out["eval_ref"] = [float(np.mean(tf.keras.losses.sparse_categorical_crossentropy(ye, logits, from_logits=True))),
                       float(np.mean(np.argmax(logits, 1) == ye))]
    out.update(role=layout.role, n_conv=C, n_fc=layout.n_fc, my_fc=layout.my_fc, my_convs=layout.my_convs,
               features=split.features, d_conv=int(sum(np.prod(v.shape) for v in split.trunk_variables)),
               d_fc=int(sum(np.prod(v.shape) for v in split.head_variables)),
               conv_shapes=[list(v.shape) for v in split.trunk_variables],
               fc_shapes=[list(v.shape) for v in split.head_variables],
               process_set_ranks=list(layout.process_set.ranks))

    # ---- fp16 on the wire: one step, close to the fp32 reference, half the p2p bytes ----
    split = split_model(build_model("tiny", seed=3))
    tr16 = HourglassTrainer(layout, split, B, sgd(), wire_dtype="float16")
    ref16 = split_model(build_model("tiny", seed=3))
    ref16_vars = ref16.trunk_variables if layout.is_conv else ref16.head_variables
    if layout.is_conv:
        tr16.train_step(*batch(0, layout.role_index))
    else:
        tr16.train_step()
    xs, ys = zip(*[batch(0, c) for c in range(C)])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            np.concatenate(ys), ref16.model(np.concatenate(xs), training=True), from_logits=True))
    sgd().apply_gradients(zip(tape.gradient(loss, ref16.model.trainable_variables),
                              ref16.model.trainable_variables))
    out["fp16_err"] = float(np.max(np.abs(tr16.role_weights() - flat(ref16_vars))))
    out["fp16_bytes"] = tr16.snapshot()

    # ---- pipelined boundary exchange (3 micro-batches of 2): the same step, 3x the messages ----
    split = split_model(build_model("tiny", seed=3))
    trp = HourglassTrainer(layout, split, B, sgd(), micro_batches=3)
    if layout.is_conv:
        trp.train_step(*batch(0, layout.role_index))
    else:
        trp.train_step()
    out["pipelined_err"] = float(np.max(np.abs(trp.role_weights() - flat(ref16_vars))))
    out["pipelined_vs_fp16_ref_moved"] = float(np.max(np.abs(flat(ref16_vars) - w0)))
    out["pipelined_bytes"] = trp.snapshot()
    out["pipelined_loss"] = trp.train_loss()

    # ---- boundary codecs: one step each; decoded tensors within the codec's bound, the step
    # equal to the single-process step on the decoded tensors, byte counts = the formulas ----
    from hgsgc.hourglass.boundary import BoundaryCodec

    codec_out = {}
    for act_c, grad_c, M in CODEC_CASES:
        split = split_model(build_model("tiny", seed=3))
        trc = HourglassTrainer(layout, split, B, sgd(), act_codec=act_c, grad_codec=grad_c,
                               micro_batches=M, record=True, codec_seed=11)
        if layout.is_conv:
            trc.train_step(*batch(0, layout.role_index))
        else:
            trc.train_step()
        rec = world.allgather((layout.rank, trc.recorded))
        ac, gc = BoundaryCodec.parse(act_c), BoundaryCodec.parse(grad_c)
        f = split.features
        A = {r: np.concatenate([t for _, t in sorted(d["a"], key=lambda z: z[0])]) for r, d in rec if "a" in d}
        Gd = {r: np.concatenate([t for _, t in sorted(d["g_dec"], key=lambda z: z[0])]) for r, d in rec if "g_dec" in d}
        Ad, G = {}, {}
        for r, d in rec:
            for key, dst in (("a_dec", Ad), ("g", G)):
                for c, lo, t in d.get(key, []):
                    dst.setdefault(c, {})[lo] = t
        Ad = {c: np.concatenate([v[k] for k in sorted(v)]) for c, v in Ad.items()}
        G = {c: np.concatenate([v[k] for k in sorted(v)]) for c, v in G.items()}
        edges = np.linspace(0, B, M + 1).astype(int)
        act_ratio, grad_ratio, act_len, grad_len = 0.0, 0.0, {}, {}
        for c in range(C):
            a_len = g_len = 0
            for lo, hi in zip(edges[:-1], edges[1:]):
                a, ad, g, gd = A[c][lo:hi], Ad[c][lo:hi], G[c][lo:hi], Gd[c][lo:hi]
                mask = a != 0
                act_ratio = max(act_ratio, float(np.max(np.abs(ad - a) / np.maximum(ac.error_bound(a), 1e-30)
                                                        * (np.abs(ad - a) > 0))))
                gm = np.where(mask, g, 0) if gc.sparse else g
                bound = gc.error_bound(g, mask if gc.sparse else None)
                grad_ratio = max(grad_ratio, float(np.max(np.abs(gd - gm) / np.maximum(bound, 1e-30)
                                                          * (np.abs(gd - gm) > 0))))
                nnz = int(np.count_nonzero(mask))
                a_len += ac.length(hi - lo, f, nnz)
                g_len += gc.length(hi - lo, f, nnz, masked=True)
            act_len[c], grad_len[c] = a_len, g_len
        # reference: SGD on the decoded tensors (trunk: dA as decoded; head: activations as decoded)
        refc = split_model(build_model("tiny", seed=3))
        xs, ys = zip(*[batch(0, c) for c in range(C)])
        if layout.is_conv:
            grads = None
            for c in range(C):
                with tf.GradientTape() as tape:
                    out_c = refc.trunk(xs[c], training=True)
                gcur = tape.gradient(out_c, refc.trunk_variables,
                                     output_gradients=tf.constant(Gd[c].reshape(out_c.shape)))
                grads = gcur if grads is None else [u + v for u, v in zip(grads, gcur)]
            sgd().apply_gradients(zip([g / C for g in grads], refc.trunk_variables))
            ref_w = flat(refc.trunk_variables)
        else:
            a_all = np.concatenate([Ad[c] for c in range(C)]).reshape((-1,) + split.boundary_shape)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                    np.concatenate(ys), refc.head(a_all, training=True), from_logits=True))
            sgd().apply_gradients(zip(tape.gradient(loss, refc.head_variables), refc.head_variables))
            ref_w = flat(refc.head_variables)
        snap = trc.snapshot()
        me = layout.rank
        codec_out[f"{act_c}/{grad_c}/M{M}"] = {
            "act_err_over_bound": act_ratio, "grad_err_over_bound": grad_ratio,
            "step_err_vs_decoded_ref": float(np.max(np.abs(trc.role_weights() - ref_w))),
            "step_err_vs_lossless": float(np.max(np.abs(trc.role_weights() - flat(ref16_vars)))),
            "lossless": ac.lossless and gc.lossless,
            "bytes": snap,
            "expected_act_bytes": act_len.get(me, 0) if layout.is_conv else sum(act_len[c] for c in layout.my_convs),
            "expected_grad_bytes": grad_len.get(me, 0) if layout.is_conv else sum(grad_len[c] for c in layout.my_convs),
            "fp32_boundary_bytes": 4 * B * f,
        }
    out["codecs"] = codec_out

    # ---- sparse: SGC with delay 2 on CONV ranks, top-k on FC ranks ----
    split = split_model(build_model("tiny", seed=4))  # same layout, a new model and trainer
    tr = HourglassTrainer(layout, split, B, sgd(), compression=hgsgc.Compression.sgc(0.05, bits=2, delay=2),
                          fc_compression=hgsgc.Compression.topk(0.1))
    spreads = []
    for step in range(4):
        if layout.is_conv:
            tr.train_step(*batch(10 + step, layout.role_index))
        else:
            tr.train_step()
        spreads.append(spread(layout.role_comm, tr.role_weights()))
    out["sparse_spreads"] = spreads
    out["sparse_bytes"] = tr.snapshot()
    out["train_loss"] = tr.train_loss()
    # ---- SGC among FC ranks (error feedback, delay 2), dense CONV exchange ----
    if F > 1:
        split = split_model(build_model("tiny", seed=6))
        trf = HourglassTrainer(layout, split, B, sgd(), fc_compression=hgsgc.Compression.sgc(0.1, bits=2, delay=2))
        fspreads = []
        for step in range(4):
            if layout.is_conv:
                trf.train_step(*batch(20 + step, layout.role_index))
            else:
                trf.train_step()
            fspreads.append(spread(layout.role_comm, trf.role_weights()))
        out["fc_sgc_spreads"] = fspreads
        out["fc_sgc_bytes"] = trf.snapshot()
    res["layouts"][str(F)] = out

# ---- fc_workers=auto: every rank gets the same, cost-model-consistent choice ----
if n == 4:
    from hgsgc.hourglass.costmodel import CostInputs, choose_fc_workers, measure_costs

    split = split_model(build_model("tiny", seed=5))
    layout = Layout(world, "auto", cost=lambda: measure_costs(split, 8, hgsgc.Compression.none,
                                                              hgsgc.Compression.none, 1000.0, repeats=2))
    rep = layout.cost_report
    res["auto"] = {"fc_workers": layout.n_fc, "report_choice": rep["fc_workers"],
                   "recomputed": choose_fc_workers(CostInputs(**rep["inputs"]), n)["fc_workers"],
                   "candidates": len(rep["candidates"])}

# ---- layout=auto: measured inputs, every rank gets the same choice, which follows the model ----
if n == 4:
    from hgsgc import perfmodel
    from hgsgc.config import load_config
    from hgsgc.hourglass.auto import choose

    cfg = load_config(None, ["layout=auto", "model.name=tiny", "train.batch_size=8",
                             "compression.method=sgc", "compression.density=0.05",
                             "hourglass.act_codec=sparse+q8", "hourglass.grad_codec=sparse+q8"])
    split = split_model(build_model("tiny", seed=5))
    xb = np.random.default_rng(3).random((8, 28, 28, 1), dtype=np.float32)
    rep = choose(world, split, xb, cfg)
    # recompute exactly as auto.choose does: the Hourglass candidates use per-F role compression
    # costs (with_role_compression), so the base inputs alone would predict other Hourglass times
    inp = perfmodel.LayoutInputs(**rep["inputs"])
    cc = rep["measured"]["compression_cost"]
    again = perfmodel.choose_layout(
        inp, inputs_at=lambda F: perfmodel.with_role_compression(inp, F, cc["conv"], cc["fc"]))
    res["layout_auto"] = {"layout": rep["layout"], "fc_workers": rep["fc_workers"],
                          "recomputed": [again["layout"], again["fc_workers"]],
                          "n_predictions": len(rep["predictions"]), "inputs": rep["inputs"]}

# ---- a short real run of the Hourglass main job ----
if n == 3 and len(sys.argv) > 1:
    from hgsgc.config import load_config
    from hgsgc.hourglass.train import run

    cfg = load_config(None, [
        "layout=hourglass", "model.name=tiny", "train.epochs=1", "train.max_steps_per_epoch=5",
        "train.batch_size=8", "train.threads=1", "train.progress=false", "data.train_limit=2000",
        "data.test_limit=300", f"run.out_dir={sys.argv[1]}", "run.id=hg", "hourglass.fc_workers=1",
        "compression.method=sgc", "compression.density=0.05", "compression.delay=2"])
    summary = run(cfg, log=lambda s: None)
    res["run_summary"] = summary

allres = world.allgather(res)
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "ranks": allres}))
