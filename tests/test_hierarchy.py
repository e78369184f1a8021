"""Tree and node hierarchies: schedules and formulas (single process), the TF merge against the
numpy reference, and every multi-rank property under mpirun with 2, 3, 4, 5, 6 and 8 ranks."""
import math

import numpy as np
import pytest
import tensorflow as tf

import reference_tree as rt
from conftest import mpi_cases
from hgsgc import hierarchy as hier
from hgsgc.compression import HIERARCHIES, Compression


# ------------------------------------------------------------------------------------------------
# Schedules, formulas, host layouts (no MPI)


def _simulate(plan):
    """Run a plan on sets of contributing ranks; check every merge's loss is kept exactly once.

    Returns the final set of contributors per rank.
    """
    state = {r: (r,) for r in range(plan.n)}  # contributing ranks, a multiset as a sorted tuple
    for j, rnd in enumerate(plan.rounds):
        # messages are consistent: r sends to d iff d receives from r
        for r in range(plan.n):
            for d in plan.step(j, r).sends:
                assert r in plan.step(j, d).recvs, (j, r, d)
            for s in plan.step(j, r).recvs:
                assert r in plan.step(j, s).sends, (j, r, s)
        new, absorbed = dict(state), {}
        for r in range(plan.n):
            st = plan.step(j, r)
            if st.op == "adopt":
                new[r] = state[st.recvs[0]]
            elif st.op == "merge":
                parts = [state[r]] + [state[s] for s in st.recvs]
                result = tuple(sorted(x for p in parts for x in p))
                new[r] = result
                acc = absorbed.setdefault(result, {"parts": {}, "requant": 0})
                for p, a in zip(parts, st.absorb):
                    acc["parts"][p] = acc["parts"].get(p, 0) + int(a)
                acc["requant"] += int(st.absorb_requant)
        for result, acc in absorbed.items():
            assert acc["requant"] == 1, (j, result, acc)          # one rank keeps the rounding
            assert all(c == 1 for c in acc["parts"].values()), (j, result, acc)  # and each drop
        state = new
    return state


@pytest.mark.parametrize("n", list(range(1, 34)) + [64, 100])
def test_tree_plan_reduces_everything_once_and_matches_formulas(n):
    plan = hier.tree_plan(n)
    final = _simulate(plan)
    for r in range(n):
        assert final[r] == tuple(range(n))    # every rank's contribution exactly once, everywhere
    rounds = 0 if n == 1 else math.ceil(math.log2(n)) + (0 if n & (n - 1) == 0 else 1)
    assert len(plan.rounds) == rounds == hier.tree_rounds(n)
    P = 37
    for r in range(n):
        c = plan.costs(r, P)
        f = hier.tree_cost(n, r, P)
        assert {k: c[k] for k in f} == f
        got = (c["bytes_sent"], c["bytes_received"], c["messages"], c["rounds"])
        assert got == rt.tree_cost(n, r, P)
    busiest = max(plan.costs(r, P)["bytes_sent"] for r in range(n))
    assert busiest <= (int(math.log2(n)) + 2) * P if n > 1 else busiest == 0


LAYOUTS = [[1], [2], [1, 1], [2, 1], [1, 3], [3, 2], [1, 3, 2], [3, 1, 4], [4, 4], [2, 2, 2, 2],
           [5, 1, 1, 1, 1, 1], [1] * 7, [3] * 5, [2, 3, 4, 5, 6]]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "-".join(map(str, s)))
def test_node_plan_reduces_everything_once_and_matches_formulas(sizes):
    hosts = hier.hosts_from_sizes(sizes)
    plan = hier.node_plan(hosts)
    n = sum(sizes)
    final = _simulate(plan)
    for r in range(n):
        assert final[r] == tuple(range(n))
    big = max(sizes) > 1
    assert len(plan.rounds) == hier.tree_rounds(len(sizes)) + 2 * big
    P = 11
    inter = 0
    for r in range(n):
        c = plan.costs(r, P)
        f = hier.node_cost(hosts, r, P)
        assert {k: c[k] for k in f} == f
        got = (c["bytes_sent"], c["bytes_received"], c["messages"], c["rounds"])
        assert got == rt.node_cost(hosts, r, P)
        inter += c["inter_bytes_sent"]
    # only the leaders' tree crosses hosts: a tree over len(sizes) ranks
    assert inter == sum(hier.tree_cost(len(sizes), i, P)["bytes_sent"] for i in range(len(sizes)))


def test_node_sizes_override_and_validation(monkeypatch):
    assert hier.parse_node_sizes("4", 10) == [4, 4, 2]
    assert hier.parse_node_sizes(3, 6) == [3, 3]
    assert hier.parse_node_sizes("3,2,1", 6) == [3, 2, 1]
    assert hier.parse_node_sizes([1, 2], 3) == [1, 2]
    for bad in ("0", "3,2", "a", [0, 3]):
        with pytest.raises(ValueError):
            hier.parse_node_sizes(bad, 3)
    monkeypatch.setenv(hier.ENV_RANKS_PER_NODE, "2,1")
    assert hier.discover_hosts([0, 1, 2]) == [[0, 1], [2]]
    assert hier.discover_hosts([0, 1, 2], node_sizes=[1, 2]) == [[0], [1, 2]]
    with pytest.raises(ValueError):
        hier.node_plan([[0, 1], [1, 2]])


def test_hierarchies_are_valid_settings():
    assert HIERARCHIES == ("allgather", "tree", "node")
    for h in HIERARCHIES:
        assert Compression.sgc(0.01, hierarchy=h).hierarchy == h
    with pytest.raises(ValueError, match="hierarchy"):
        Compression.sgc(0.01, hierarchy="ring")


# ------------------------------------------------------------------------------------------------
# The TF merge against the numpy reference (ties included)


@pytest.mark.parametrize("bits", [2, 32])
@pytest.mark.parametrize("nparts", [2, 3])
def test_merge_equals_reference(bits, nparts):
    g = np.random.default_rng(3)
    numel, k = 50, 7
    for trial in range(20):
        parts = []
        for _ in range(nparts):
            idx = np.sort(g.choice(numel, k, replace=False)).astype(np.int32)
            if trial % 2:   # integer values: many ties in |sum|, broken towards the lower index
                vals = g.integers(-3, 4, k).astype(np.float32)
            else:
                vals = g.standard_normal(k).astype(np.float32)
            parts.append((idx, vals))
        want = rt.merge(parts, k, bits)
        got = hier.merge([(tf.constant(i), tf.constant(v)) for i, v in parts], k, numel, bits)
        np.testing.assert_array_equal(got[1].numpy(), want[0])
        np.testing.assert_array_equal(got[2].numpy(), want[1])
        np.testing.assert_array_equal(got[3].numpy(), want[2])
        np.testing.assert_array_equal(got[5].numpy(), want[4])
        # the merge's loss: sum of parts - kept (what the residual rules hand out)
        loss = sum(c.numpy()[got[5].numpy()].sum() for c in got[4])
        kept_err = (got[6].numpy() - got[2].numpy())
        assert np.all(np.abs(kept_err) <= want[6] + 1e-6)     # documented re-quantization bound
        total = sum(v.sum() for _, v in parts)
        assert abs(total - (got[2].numpy().sum() + kept_err.sum() + loss)) < 1e-4


def test_reference_conserves_mass():
    g = np.random.default_rng(0)
    for n, hierarchy, hosts in [(5, "tree", None), (6, "node", [[0], [1, 2, 3], [4, 5]])]:
        inputs = [[g.standard_normal(40).astype(np.float32)] for _ in range(n)]
        out = rt.exchange(inputs, 0.1, 2, hierarchy, hosts)
        a = np.sum([out["compensated"][r][0] for r in range(n)], 0)
        e = np.sum([out["residuals"][r][0] for r in range(n)], 0)
        assert np.max(np.abs(a - n * out["avg"][0] - e)) < 1e-5


# ------------------------------------------------------------------------------------------------
# Under mpirun


# 2-5 ranks: 5 has three tree levels as 8 does, 3 and 5 are not powers of two. Session 13 dropped
# 6 and 8 (their own launches of 6 and 8 TF + Horovod processes on the CI's 2 cores: 40 and 60 s)
MPI_CASES = mpi_cases("tests/mpi/check_hierarchy.py", ranks=[2, 3, 4, 5], timeout=600)


@pytest.fixture(scope="module", params=[2, 3, 4, 5])
def result(request, mpi_batch):
    return mpi_batch.result(request.param, "tests/mpi/check_hierarchy.py")


CHECKED = ("tree_bits2", "tree_bits32", "node_bits2", "node_mpi_split")


@pytest.mark.mpi
def test_tree_and_node_equal_numpy_reference(result):
    for key in CHECKED:
        r = result[key]
        assert r["support_equal"], key                  # the same selected indices, every step
        # values: the same arithmetic, float rounding only (far inside the documented
        # re-quantization bound, which is reported as max_bound)
        assert r["max_value_err"] < 1e-5, (key, r["max_value_err"])
        assert r["max_value_err"] <= r["max_bound"] + 1e-5
        assert r["max_resid_err"] < 1e-5, (key, r["max_resid_err"])


@pytest.mark.mpi
def test_identical_result_on_every_rank(result):
    for key in CHECKED:
        assert result[key]["identical"], key


@pytest.mark.mpi
def test_residual_mass_identity(result):
    # sum_r a_r == n * applied average + sum_r residual_r, on hgsgc's own outputs
    for key in CHECKED:
        r = result[key]
        assert r["max_mass_err"] <= 1e-6 * max(1.0, r["mass_scale"]) * result["size"], (key, r)


@pytest.mark.mpi
def test_byte_counts_equal_formulas(result):
    n = result["size"]
    for key in CHECKED:
        r = result[key]
        assert r["bytes_equal_formula"], (key, r.get("bytes_mismatch"))
        for st in r["per_rank_stats"]:
            assert st["exchanges"] == 1
    # the tree's busiest rank moves (floor(log2 n) + 2) P at most; the allgather (n - 1) P
    P = result["tree_bits2"]["costs"]["payload_bytes"]
    busiest = max(st["bytes_sent"] for st in result["tree_bits2"]["per_rank_stats"])
    assert busiest <= (int(math.log2(n)) + 2) * P
    assert result["node_mpi_split"]["hosts"] == [list(range(n))]   # one machine: one host


@pytest.mark.mpi
def test_density_one_fp32_equals_dense_allreduce(result):
    for h in ("tree", "node"):
        assert result[f"density1_{h}_vs_allreduce"] < 1e-6, h


@pytest.mark.mpi
@pytest.mark.parametrize("result", [3], indirect=True)  # the check script runs it with 3 ranks
def test_optimizer_with_tree_keeps_ranks_identical(result):
    assert "optimizer_tree_spreads" in result
    spreads = result["optimizer_tree_spreads"]
    assert result["optimizer_tree_exchanges"] == 2
    assert spreads[1] == 0.0 and spreads[3] == 0.0, spreads   # right after each sync (delay 2)
    assert spreads[0] > 0.0 and spreads[2] > 0.0, spreads
