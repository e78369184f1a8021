"""Session 9 audit: (A) every compressor's state reaches the checkpoint and comes back bit for bit
in a fresh process; (B) every entry point (custom loop, eager, ``model.fit``, the gradient tape)
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

Part B runs tests/mpi/check_entry9.py on 1 and 2 ranks: the four entry points must agree bit
for bit (no op order differs between them: each computes the same local gradient and hands the
same list to the same Exchanger, then the same legacy SGD update; DGC through the tape keeps the
momentum in the tape's velocity and applies with momentum 0, exactly what the optimizer path
does internally), and count the same bytes.
"""
import numpy as np
import pytest

from ckpt_compare import compare
from conftest import mpi_result, mpirun

import hgsgc
from hgsgc import checkpoint as ckpt
from hgsgc import costs

K, M = 6, 4  # delay 4: the checkpoint after step 6 is mid-way between the syncs of steps 4 and 8

# the state each case must carry (hgsgc_state keys with a non-empty value)
EXPECT = {
    "sgc_2bit": {"residuals"}, "sgc_2bit_exact_tree": {"residuals"}, "sgc_buckets3": {"residuals"},
    "sgc_delay4_lr_warmup": {"residuals", "anchors"}, "topk": {"residuals"},
    "dgc": {"residuals", "velocity"}, "dgc_dense_vectors": {"residuals", "velocity"},
    "terngrad": set(), "powersgd": {"residuals", "powersgd_q"}, "efsignsgd": {"residuals"},
    "localsgd4": {"anchors"}, "fp16": set(), "sgc_nonfinite_skip": {"residuals"},
    "tape_dgc": {"residuals", "velocity"}, "tape_powersgd": {"residuals", "powersgd_q"},
}

# 3 ranks (an odd count: the tree's unpaired rank, uneven buckets): the cases whose exchange
# depends on the rank count (CPU is scarce: the others run on 2 ranks only)
CASES = {2: sorted(EXPECT), 3: ["sgc_2bit_exact_tree", "sgc_buckets3", "sgc_delay4_lr_warmup",
                                 "dgc_dense_vectors", "terngrad", "powersgd", "sgc_nonfinite_skip"]}
_RUNS = {}


def _state_runs(np_, tmp_path_factory):
    """``full`` then ``resume`` of the cases of ``np_`` ranks (cached per rank count)."""
    if np_ not in _RUNS:
        out = tmp_path_factory.mktemp(f"state9_{np_}")
        for mode in ("full", "resume"):
            res = mpi_result(np_, ["tests/mpi/check_state9.py", mode, str(out), str(K), str(M),
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
    lines = {}
    for entry in ("tape", "optimizer"):
        p = mpirun(2, ["tests/mpi/state9_mismatch.py", entry], timeout=120)
        assert p.returncode != 0 and "UNREACHABLE" not in p.stdout, (entry, p.stdout[-2000:])
        got = [ln for ln in p.stderr.splitlines() if "hgsgc: error" in ln]
        assert len(got) == 1, (entry, p.stderr[-3000:])
        lines[entry] = got[0]
    assert "variable 'dense/kernel:0': shape [4, 5] float32 on rank 0" in lines["tape"], lines
    assert "shape [4, 6] float32 on rank 1" in lines["tape"], lines
    assert lines["tape"] == lines["optimizer"]


ENTRY_SHAPES = [(6, 8), (8,), (8, 3), (3,)]
ENTRY_STEPS = 4


@pytest.fixture(scope="module", params=[1, 2])
def entries(request):
    return mpi_result(request.param, ["tests/mpi/check_entry9.py"], timeout=400)


@pytest.mark.mpi
def test_every_entry_point_gives_the_same_weights_and_bytes(entries):
    """Custom tf.function loop, eager loop, model.fit and DistributedGradientTape (delay 1 only)
    from the same seed and data: the same weights bit for bit on every rank, the same byte
    counters, and those counters equal the payload formula."""
    from hgsgc.compression import Compression as C

    comps = {"none": C.none, "sgc": C.sgc(0.2), "sgc_delay2": C.sgc(0.2, delay=2),
             "dgc": C.dgc(0.2, local_clip_norm=1.0),
             "terngrad": C.terngrad(), "powersgd": C.powersgd(rank=1)}
    n = entries["size"]
    ranks = entries["ranks"]
    assert sorted(ranks[0]) == sorted(comps)
    for name, comp in comps.items():
        want_entries = {"loop", "eager", "fit"} | ({"tape"} if comp.delay == 1 else set())
        ref_w, ref_s = ranks[0][name]["loop"]
        for r in range(n):
            got = ranks[r][name]
            assert set(got) == want_entries, (name, set(got))
            for entry, (w, s) in got.items():
                assert w == ref_w, f"{name}: {entry} on rank {r} differs from loop on rank 0"
                assert s == ref_s, (name, entry, r, s, ref_s)
        exchanges = ENTRY_STEPS // comp.delay
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
