"""Session 9 audit: (A) every compressor's state reaches the checkpoint and comes back bit for bit
in a fresh process; (B) every entry point (custom loop, ``model.fit``, the gradient tape)
trains alike and counts the same bytes, and refuses bad input with the same message.

What existed before (not repeated here): ``hgsgc train`` resume bit-exactness for SGC delay 4
(3 ranks; 2 ranks via SIGTERM), DGC and PowerSGD (2 and 3 ranks), Hourglass q8 / sparse+q4 with
one FC rank (tests/test_reliability_mpi.py, slow); DGC resumed with another bucket count
(tests/test_robustness7.py); in-process ``hgsgc_state()`` round trips for DGC velocity,
TernGrad's random-number step, delay anchors, PowerSGD factors (tests/test_arch.py,
tests/test_optimizer.py); ``model.fit`` + Horovod's broadcast callback with delay
(tests/mpi/check_reliability_traps.py); hgsgc tape == Horovod tape at density 1
(tests/mpi/check_exchange.py).

Part A runs tests/mpi/check_state9.py twice per rank count: ``full`` (K steps, checkpoint, M
more steps, checkpoint) and ``resume`` (a fresh mpirun job restoring checkpoint K and taking the
same M steps); every leaf of every rank's final state must be equal byte for byte.

Part B runs tests/mpi/check_entry9.py on 1 and 2 ranks: the three entry points must agree bit
for bit (no op order differs between them: each computes the same local gradient and hands the
same list to the same Exchanger, then the same legacy SGD update; DGC through the tape keeps the
momentum in the tape's velocity and applies with momentum 0, exactly what the optimizer path
does internally), and count the same bytes.
"""
import numpy as np
import pytest

from ckpt_compare import compare
from conftest import mpi_cases, mpirun

import hgsgc
from hgsgc import checkpoint as ckpt
from hgsgc import costs

K, M = 6, 4  # delay 4: the checkpoint after step 6 is mid-way between the syncs of steps 4 and 8

# the state each case must carry (hgsgc_state keys with a non-empty value)
EXPECT = {
    "sgc_2bit": {"residuals"}, "sgc_2bit_exact_tree": {"residuals"}, "sgc_buckets3": {"residuals"},
    "sgc_delay4_lr_warmup": {"residuals", "anchors"},
    "dgc": {"residuals", "velocity"}, "dgc_dense_vectors": {"residuals", "velocity"},
    "terngrad": set(), "powersgd": {"residuals", "powersgd_q"}, "efsignsgd": {"residuals"},
    "localsgd4": {"anchors"}, "sgc_nonfinite_skip": {"residuals"},
    "tape_dgc": {"residuals", "velocity"},
}

# 3 ranks (an odd count: the tree's unpaired rank, uneven buckets): the cases whose exchange
# depends on the rank count (CPU is scarce: the others run on 2 ranks only)
CASES = {2: sorted(EXPECT), 3: ["sgc_2bit_exact_tree", "sgc_buckets3", "sgc_delay4_lr_warmup",
                                 "dgc_dense_vectors", "powersgd"]}
_RUNS = {}
# waiting ranks yield their core (Open MPI busy-polls otherwise): on 2 loaded cores this cut a
# 2-rank launch from 122 s to 24 s of wall time and 20 s to 11 s of CPU (load 45-55)
YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def _result(np_, args, timeout=400):
    """``conftest.mpi_result`` with :data:`YIELD`: the JSON of the script's ``RESULT`` line."""
    import json

    p = mpirun(np_, args, timeout=timeout, env=YIELD)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(line[0][7:])
    assert out["size"] == np_
    return out


# the 2-rank entry-point check runs in the suite's batched launch of 2 ranks (tests/conftest.py,
# ``mpi_batch``; session 14). The resume check's ``full`` runs keep launches of their own: in the
# batched launch, after the other cases, EF-SignSGD's ``full`` run was not bit-exact with its resume
# in a fresh process (a case before it leaves process state that changes the arithmetic; not
# pinned down), and "bit-exact in a fresh process" is what this module checks
MPI_CASES = mpi_cases("tests/mpi/check_entry9.py", ranks=[2], timeout=400)


def _state_runs(np_, tmp_path_factory):
    """``full`` then ``resume`` of the cases of ``np_`` ranks (cached per rank count)."""
    if np_ not in _RUNS:
        out = tmp_path_factory.mktemp(f"state9_{np_}")
        for mode in ("full", "resume"):
            res = _result(np_, ["tests/mpi/check_state9.py", mode, str(out), str(K), str(M),
                                   ",".join(CASES[np_])], timeout=400)
            assert res["mode"] == mode and res["cases"] == CASES[np_]
        _RUNS[np_] = out
    return _RUNS[np_]


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_every_compressor_resumes_bit_exact_in_a_fresh_process(np_, tmp_path_factory):
    """K = 6 steps, checkpoint, M = 4 steps in the same process vs. restore checkpoint 6 in a
    new mpirun job and take the same 4 steps: every leaf of every rank's final state (weights,
    Keras slots and iterations, hgsgc state tree, the skipped-step and byte counters the
    process reports) is equal byte for byte, for every compressor."""
    out = _state_runs(np_, tmp_path_factory)
    bad = {}
    for case in CASES[np_]:
        keys = EXPECT[case]
        full = ckpt.step_dir(str(out / "full" / case), K + M)
        resumed = ckpt.step_dir(str(out / "resumed" / case), K + M)
        n, diffs = compare(full, resumed, skip=())
        if diffs:
            bad[case] = diffs[:6]
        man = ckpt.read_manifest(full)
        assert man["world_size"] == np_
        for r in range(np_):
            st = ckpt.load_rank(full, man, r)
            hs = st["tape"] if case.startswith("tape") else st["optimizer"]["hgsgc"]
            present = {k for k in ("residuals", "velocity", "powersgd_q", "anchors") if hs.get(k)}
            assert present == keys, (case, r, present)
            assert hs["stats"]["exchanges"] > 0 and "rng_step" in hs
            assert case.startswith("tape") or "skipped_steps" in hs
        # not vacuous: the model moved between the checkpoint and the end, on every rank
        _, moved = compare(ckpt.step_dir(str(out / "full" / case), K), full, skip=("/observed",))
        assert sum("/model/" in d for d in moved) >= np_, (case, moved)
    assert not bad, bad


@pytest.mark.mpi
def test_state_at_the_checkpoint_is_what_the_next_steps_need(tmp_path_factory):
    """Mid-delay and mid-warm-up checkpoints hold the in-between state: local step 6 of delay 4
    (two local steps after the sync of step 4, anchors != weights), the learning-rate
    schedule's iteration 6 of 8, TernGrad's random-number step, one skipped NaN step."""
    out = _state_runs(2, tmp_path_factory)
    p = ckpt.step_dir(str(out / "full" / "sgc_delay4_lr_warmup"), K)
    st = ckpt.load_rank(p, ckpt.read_manifest(p), 0)
    hs = st["optimizer"]["hgsgc"]
    assert hs["local_step"] == 6 and int(st["optimizer"]["keras"][0]) == 6
    assert any(not np.array_equal(a, w) for a, w in zip(hs["anchors"], st["model"]))
    p = ckpt.step_dir(str(out / "full" / "terngrad"), K)
    assert ckpt.load_rank(p, ckpt.read_manifest(p), 1)["optimizer"]["hgsgc"]["rng_step"] == K
    p = ckpt.step_dir(str(out / "full" / "sgc_nonfinite_skip"), K + M)
    for r in range(2):
        assert ckpt.load_rank(p, ckpt.read_manifest(p), r)["observed"]["skipped"] == 1



# ------------------------------------------------------------------------- B. entry points
@pytest.mark.mpi
def test_model_differing_across_ranks_fails_alike_through_the_tape():
    """Rank 1's model is wider: through DistributedOptimizer every rank stops at the first step
    with one line naming the variable and both shapes (tests/test_reliability_traps.py); through
    DistributedGradientTape it said 'InvalidArgumentError: ... Input to reshape is a tensor with
    59 values, but the requested shape has 58' (an internal node, once per rank; with other sizes
    the averages could be silently wrong). Now the same line as the optimizer's."""
    p = mpirun(2, ["tests/mpi/state9_mismatch.py", "tape"], timeout=120, env=YIELD)
    assert p.returncode != 0 and "UNREACHABLE" not in p.stdout, p.stdout[-2000:]
    got = [ln for ln in p.stderr.splitlines() if "hgsgc: error" in ln]
    # the optimizer path's line for this model (``state9_mismatch.py optimizer`` prints it too)
    assert got == ["hgsgc: error (all 2 ranks): ValueError: gradient of variable 'dense/kernel:0': "
                   "shape [4, 5] float32 on rank 0 but 'dense/kernel:0' has shape [4, 6] float32 on "
                   "rank 1: every rank must build the same model (same sizes and dtypes)"], p.stderr[-3000:]


ENTRY_SHAPES = [(6, 8), (8,), (8, 3), (3,)]
ENTRY_STEPS = 4


@pytest.fixture(scope="module", params=[1, 2])
def entries(request, mpi_batch):
    if request.param == 1:  # one rank: a launch of its own
        return _result(1, ["tests/mpi/check_entry9.py"])
    return mpi_batch.result(request.param, "tests/mpi/check_entry9.py")


@pytest.mark.mpi
def test_every_entry_point_gives_the_same_weights_and_bytes(entries):
    """Custom tf.function loop, model.fit and DistributedGradientTape (delay 1 only)
    from the same seed and data: the same weights bit for bit on every rank, the same byte
    counters, and those counters equal the payload formula."""
    from hgsgc.compression import Compression as C

    comps = {"none": C.none, "sgc": C.sgc(0.2), "sgc_delay2": C.sgc(0.2, delay=2),
             "sgc_delay3": C.sgc(0.2, delay=3),
             "dgc": C.dgc(0.2, local_clip_norm=1.0),
             "terngrad": C.terngrad(), "powersgd": C.powersgd(rank=1)}
    n = entries["size"]
    ranks = entries["ranks"]
    assert sorted(ranks[0]) == sorted(comps)
    for name, comp in comps.items():
        want_entries = {"loop", "fit"} | ({"tape"} if comp.delay == 1 else set())
        ref_w, ref_s, _ = ranks[0][name]["loop"]
        for r in range(n):
            got = ranks[r][name]
            assert set(got) == want_entries, (name, set(got))
            for entry, (w, s, _) in got.items():
                assert w == ref_w, f"{name}: {entry} on rank {r} differs from loop on rank 0"
                assert s == ref_s, (name, entry, r, s, ref_s)
            # fit's validation ran on the synced weights: the same loss on every rank
            assert got["fit"][2]["val_loss"] == ranks[0][name]["fit"][2]["val_loss"], name
        exchanges = -(-ENTRY_STEPS // comp.delay)  # with delay 3: the sync at 3 and the pending one
        assert ref_s["exchanges"] == exchanges, (name, ref_s)
        if comp.compressed:
            assert ref_s["payload_bytes"] == exchanges * comp.payload_bytes(ENTRY_SHAPES), (name, ref_s)
        else:
            d = sum(int(np.prod(s)) for s in ENTRY_SHAPES)
            assert ref_s["dense_bytes"] == exchanges * costs.dense_bytes(n, d)


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type and text are what is compared
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("kwargs,words", [
    ({"compression": "fast"}, "compression='fast' is not supported: use hgsgc.Compression.none"),
    ({"compression": "powersgd_as_dict"}, "is not supported: use hgsgc.Compression.none"),
    ({"op": "sum"}, "op must be hvd.Average"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor is not supported"),
    ({"num_groups": 2}, "groups/num_groups are not supported"),
    ({"groups": [[0]]}, "groups/num_groups are not supported"),
])
def test_bad_arguments_fail_alike_through_optimizer_and_tape(kwargs, words):
    """The same exception type and text from hgsgc.DistributedOptimizer (custom loops and
    model.fit share it) and hgsgc.DistributedGradientTape, naming the argument."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    kw = dict(kwargs)
    if kw.get("op") == "sum":
        kw["op"] = hvd.Sum
    if kw.get("compression") == "powersgd_as_dict":
        kw["compression"] = hgsgc.Compression.powersgd(2).to_dict()
    opt_err = _error(lambda: hgsgc.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(0.1), **kw))
    with tf.GradientTape() as t:
        pass
    tape_err = _error(lambda: hgsgc.DistributedGradientTape(t, **kw))
    assert opt_err is not None and opt_err == tape_err, (opt_err, tape_err)
    assert words in opt_err[1], opt_err


# ------------------------------------------------------------------------- A. through hgsgc train
@pytest.mark.mpi
def test_train_resumed_mid_sparsity_warmup_is_bit_exact(tmp_path):
    """``hgsgc train``, 2 ranks, DGC with compression.warmup_steps=8 (densities 0.25, 0.25,
    0.0625, 0.0625, then 0.05): checkpoint after step 3 (mid-way through the second warm-up
    stage), resumed in a new job, must set the density the schedule gives for step 3 again
    (the resumed process starts from the configured 0.05) and end with every rank's state equal
    to the uninterrupted run's bit for bit. The byte counters prove the schedule ran: 3 steps of
    payload at 0.25, 0.25, 0.0625."""
    import os
    import shutil
    import subprocess

    from conftest import MPIRUN, PY, ROOT
    from hgsgc.compression import Compression

    base = ["configs/fashion_mnist_dense.yaml", "model.name=tiny", "data.train_limit=1000",
            "data.test_limit=100", "train.epochs=2", "train.max_steps_per_epoch=5",
            "train.progress=false", "train.deterministic=true", "checkpoint.keep=20",
            "train.threads=1", "compression.method=dgc", "compression.density=0.05",
            "compression.warmup_steps=8"]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", **YIELD)

    def train(run_id, extra):
        cmd = (MPIRUN + ["-np", "2", "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", "-x",
                         "OMPI_MCA_mpi_yield_when_idle", PY, "-m",
                         "hgsgc.cli", "train"] + base + [f"run.out_dir={tmp_path}", f"run.id={run_id}"]
               + extra)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p

    train("a", ["checkpoint.every_steps=3"])
    a = tmp_path / "a" / "checkpoints"
    os.makedirs(tmp_path / "b" / "checkpoints")
    shutil.copytree(a / "step-00000003", tmp_path / "b" / "checkpoints" / "step-00000003")
    p = train("b", [])
    assert "(step 3)" in p.stdout, p.stdout[-2000:]
    n, diffs = compare(str(a / "step-00000010"), str(tmp_path / "b" / "checkpoints" / "step-00000010"))
    assert n >= 20 and not diffs, (n, diffs[:10])
    man = ckpt.read_manifest(str(a / "step-00000003"))
    st = ckpt.load_rank(str(a / "step-00000003"), man, 0)
    shapes = [tuple(s) for s in man["run"]["parameters"].values()]
    assert len(shapes) == len(st["model"]) and all(isinstance(s, tuple) for s in shapes)
    want = sum(Compression.dgc(d).payload_bytes(shapes) for d in (0.25, 0.25, 0.0625))
    assert st["optimizer"]["hgsgc"]["stats"]["payload_bytes"] == want
    assert len(st["optimizer"]["hgsgc"]["velocity"]) == len(shapes)
