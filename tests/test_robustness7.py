"""Robustness (session 7): edges of what landed in session 7 (compression.buckets, the Hourglass
boundary message probe, hgsgc plan's bounded fc_workers search). Exact values, no wall clock."""
import os
import shutil

import numpy as np
import pytest

from conftest import mpi_cases

MPI_CASES = mpi_cases("tests/mpi/check_boundary_probe.py", ranks=[4], timeout=300)


def _tiny_split():
    import tensorflow as tf

    from hgsgc.hourglass.split import split_model

    inp = tf.keras.Input((6, 6, 1))
    z = tf.keras.layers.Conv2D(4, 3, activation="relu")(inp)
    z = tf.keras.layers.Flatten(name="flatten")(z)
    out = tf.keras.layers.Dense(3)(tf.keras.layers.Dense(8, activation="relu")(z))
    return split_model(tf.keras.Model(inp, out), "flatten")


def test_fc_fit_of_a_huge_cluster_concatenates_at_most_64_micro_batches(monkeypatch):
    """hgsgc plan --nodes 100000 on an Hourglass model measured the FC rank on N - 1 = 99999 CONV
    ranks' micro-batches at once (a 37 GiB array for alexnet_small: MemoryError traceback). The
    linear fit fc_call_s + rows fc_row_s needs two sizes: 1 and at most FC_FIT_MAX_CONVS parts."""
    from hgsgc.hourglass import costmodel

    split = _tiny_split()
    x = np.random.default_rng(0).random((8, 6, 6, 1)).astype(np.float32)
    parts = []
    real = np.concatenate

    def counting(arrays, *a, **k):
        arrays = list(arrays)
        parts.append(len(arrays))
        return real(arrays, *a, **k)

    monkeypatch.setattr(np, "concatenate", counting)
    got = costmodel.measure_pipeline_stages(split, x, micro_batches=2, max_convs_per_fc=99999, repeats=1)
    assert costmodel.FC_FIT_MAX_CONVS == 64
    assert max(parts) == 64 and parts.count(64) == 2 * 2  # activations and labels, warm-up + 1 timed call
    assert set(got) == {"conv_fwd_mb_s", "conv_bwd_mb_s", "fc_call_s", "fc_row_s"} and min(got.values()) >= 0
    parts.clear()
    costmodel.measure_pipeline_stages(split, x, micro_batches=2, max_convs_per_fc=3, repeats=1)
    assert max(parts) == 3 and parts.count(3) == 2 * 2    # small clusters: N - 1 parts, as before


def _identity(comp, fc=None):
    run = {"world_size": 2, "layout": "data_parallel", "model": "tiny", "parameters": {"w:0": [3]},
           "compression": comp.to_dict()}
    if fc is not None:
        run.update(layout="hourglass", fc_compression=fc.to_dict())
    return run


def test_a_run_resumes_with_another_bucket_count(tmp_path):
    """compression.buckets only schedules the allgathers (bit for bit one fused payload): a
    preempted run resubmitted with compression.buckets=4 was refused ('written by a different
    run', the two 12-key dicts differing in buckets only). It resumes now, from a checkpoint of
    this session (buckets=1) and from an older one without the key; a real change is still refused."""
    import dataclasses

    from hgsgc import checkpoint as ckpt
    from hgsgc.compression import Compression

    sgc, fc = Compression.sgc(0.01), Compression.topk(0.01)
    d = str(tmp_path)
    ckpt.save(d, 5, {"w": np.zeros(3)}, _identity(sgc, fc))
    old = _identity(sgc)
    del old["compression"]["buckets"]
    ckpt.save(str(tmp_path / "old"), 3, {"w": np.zeros(3)}, old)
    b4 = dataclasses.replace(sgc, buckets=4)
    assert ckpt.resolve(d, "auto", _identity(b4, dataclasses.replace(fc, buckets=2)))[0] == ckpt.step_dir(d, 5)
    assert ckpt.resolve(str(tmp_path / "old"), "auto", _identity(b4))[0] == ckpt.step_dir(str(tmp_path / "old"), 3)
    with pytest.raises(ckpt.CheckpointMismatch, match=r"density\": 0.01.*density\": 0.02"):
        ckpt.resolve(d, "auto", _identity(dataclasses.replace(b4, density=0.02), fc))
    with pytest.raises(ckpt.CheckpointMismatch, match="FC compression"):
        ckpt.resolve(d, "auto", _identity(b4, Compression.topk(0.05, buckets=2)))


def test_exchanger_state_continues_bit_for_bit_under_another_bucket_count():
    """What the resume above relies on: an Exchanger's state tree saved with one fused payload,
    loaded into one with buckets=3, gives the same next averages and residuals bit for bit as
    continuing with one payload (2-bit SGC, fused error-feedback kernel)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hgsgc.communicator import Exchanger
    from hgsgc.compression import Compression

    hvd.init()
    shapes = [(40, 30), (17,), (3, 3, 2, 5), (6, 50), (90, 7)]
    names = [f"r7_t{i}" for i in range(len(shapes))]

    def xs(seed):
        g = np.random.default_rng(seed)
        return [tf.constant(g.standard_normal(s).astype(np.float32)) for s in shapes]

    first = Exchanger(Compression.sgc(0.05))
    for seed in (1, 2):
        first.exchange(xs(seed), names)
    state = first.state_dict()
    state = {k: ({n: np.array(a) for n, a in v.items()} if isinstance(v, dict) and k != "stats" else v)
             for k, v in state.items()}
    again = Exchanger(Compression.sgc(0.05, buckets=3))
    again.load_state_dict(state)
    a, b = first.exchange(xs(3), names), again.exchange(xs(3), names)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u.numpy(), v.numpy())
    for n, s in zip(names, shapes):
        np.testing.assert_array_equal(first.memory.residual(n, (int(np.prod(s)),)).numpy(),
                                      again.memory.residual(n, (int(np.prod(s)),)).numpy())
    # the counters continue too: 2 fused exchanges restored, then one in 2 groups
    assert first.stats.snapshot()["messages"] == 3 and again.costs(shapes)["messages"] == 2
    assert again.stats.snapshot()["messages"] == 2 + 2


@pytest.mark.mpi
@pytest.mark.slow
def test_resume_with_buckets_3_from_a_fused_run_is_bit_exact_on_3_ranks(tmp_path):
    """End to end, 3 ranks, DGC (momentum correction + error feedback): a run checkpointed at
    step 3 with one fused allgather, resumed with compression.buckets=3, ends with every rank's
    state bit for bit the uninterrupted fused run's (only the message counters differ)."""
    import subprocess

    from ckpt_compare import compare
    from conftest import MPIRUN, PY, ROOT

    base = ["configs/fashion_mnist_dense.yaml", "model.name=tiny", "data.train_limit=2000",
            "data.test_limit=200", "train.epochs=2", "train.max_steps_per_epoch=5", "train.progress=false",
            "train.deterministic=true", "checkpoint.keep=20", "train.threads=1",
            "compression.method=dgc", "compression.density=0.05"]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")

    def train(run_id, extra):
        cmd = (MPIRUN + ["-np", "3", "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", PY, "-m", "hgsgc.cli",
                         "train"] + base + [f"run.out_dir={tmp_path}", f"run.id={run_id}"] + extra)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p

    train("a", ["checkpoint.every_steps=3"])
    a = tmp_path / "a" / "checkpoints"
    os.makedirs(tmp_path / "b" / "checkpoints")
    shutil.copytree(a / "step-00000003", tmp_path / "b" / "checkpoints" / "step-00000003")
    p = train("b", ["compression.buckets=3"])
    assert "resuming from" in p.stdout and "(step 3)" in p.stdout, p.stdout[-2000:]
    n, diffs = compare(str(a / "step-00000010"), str(tmp_path / "b" / "checkpoints" / "step-00000010"))
    assert n >= 30 and diffs, (n, diffs)
    assert {d.rsplit("/", 1)[-1] for d in diffs} <= {"messages", "rounds"}, diffs


@pytest.mark.mpi
@pytest.mark.parametrize("np_,bad", [(3, 2), (3, 0), (4, 1)])
def test_boundary_probe_failing_on_one_rank_ends_the_job(run_mpi, np_, bad):
    """layout: auto's boundary probe with a bad sample on one rank only: that rank raises before
    any message while rank 0 waits for it or the others wait at the next pair's barrier; the job
    ends (MPI_Abort from the CLI's error path) with one line naming the rank, within the timeout."""
    p = run_mpi(np_, ["tests/mpi/probe_fail_one_rank.py", str(bad)], timeout=120)
    assert p.returncode != 0
    assert f"hgsgc: error on rank {bad}: ValueError: probe_boundary needs a, g float32" in p.stderr, p.stderr[-2000:]
    assert "UNREACHABLE" not in p.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("np_,bad", [(2, 1), (3, 1), (3, 0), (4, 3)])
def test_layout_auto_boundary_callable_failing_on_one_rank_ends_the_job(run_mpi, np_, bad):
    """A user's own Layout(world, "auto", cost=..., boundary=...) without the CLI's run_guarded:
    the collective boundary callable raises on one rank while the others are inside the probe.
    It hung until mpirun's timeout before (the traceback printed, no rank ended); now that rank
    prints one line and aborts the job."""
    p = run_mpi(np_, ["tests/mpi/probe_fail_one_rank.py", str(bad), "layout"], timeout=120)
    assert p.returncode != 0
    assert (f"hgsgc: error on rank {bad}: ValueError: probe_boundary needs a, g float32" in p.stderr
            and 'in the collective boundary= callable of Layout(..., "auto")' in p.stderr), p.stderr[-2000:]
    assert "UNREACHABLE" not in p.stdout


@pytest.mark.mpi
def test_boundary_probe_on_4_ranks_pairs_rank_0_with_every_rank(mpi_batch):
    """tests/mpi/check_boundary_probe.py (run by its own test with 2 and 3 ranks) on 4 ranks."""
    from hgsgc.hourglass import costmodel

    res = mpi_batch.result(4, "tests/mpi/check_boundary_probe.py")
    assert res["size"] == 4
    for key in ("fp32/fp32", "sparse+q8/sparse+q8"):
        ps = [r["probes"][key] for r in res["ranks"]]
        assert all(p == ps[0] for p in ps) and [q[0] for q in ps[0]["pairs"]] == [1, 2, 3]
        m = costmodel.boundary_message_inputs(ps[0], 300.0, 250.0, 2e-6, 1e-4, 12.5e6)
        assert m["boundary_msg_s"] == max(p[2] for p in m["per_pair"]) and len(m["per_pair"]) == 3
    assert all("probe_boundary" in r["bad_input_error"] for r in res["ranks"])


@pytest.mark.parametrize("buckets", [1, 4])
def test_costs_of_an_exchange_without_a_sparse_tensor_match_the_counters(buckets):
    """Exchanger.costs counted one allgather for an exchange that makes none: every tensor of
    rank < 2 with dense_vectors (e.g. only biases / batch-norm parameters trained), or every
    tensor empty (costs 2 messages vs the counters' 1, 1 vs 0). The formula now equals the
    counters; with sparse tensors it is unchanged (one message per bucket group)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hgsgc.communicator import Exchanger
    from hgsgc.compression import SparseCompression

    hvd.init()
    for shapes, dv, messages in (([(5,), (7,), (3,)], True, 1), ([(0,), (0, 3)], False, 0),
                                 ([(5,), (0,), (4, 3)], True, 2), ([(4, 3), (2,)], False, min(buckets, 2))):
        ex = Exchanger(SparseCompression(0.01, method="sgc", bits=2, dense_vectors=dv, buckets=buckets))
        g = np.random.default_rng(0)
        ex.exchange([tf.constant(g.standard_normal(s).astype(np.float32)) for s in shapes],
                    [f"r7c_{i}" for i in range(len(shapes))])
        st, c = ex.stats.snapshot(), ex.costs(shapes)
        assert st["messages"] == c["messages"] == messages, (shapes, st, c)
        assert (st["bytes_sent"], st["payload_bytes"]) == (c["bytes_sent"], c["payload_bytes"])
