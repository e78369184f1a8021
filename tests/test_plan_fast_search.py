"""``hgsgc plan --nodes N``: the best fc_workers by the bounded scan (plan.best_fc_workers) equals
the exhaustive scan over F = 1 .. N/2 on fixed inputs, and for large N it simulates a fraction
of the candidates (counted, never timed). The numpy scan of ``hgsgc plan``
(plan.best_fc_workers_fast, session 8) returns exactly what the bounded and exhaustive scans
return, and its bound terms (plan.role_post_s) equal perfmodel.role_exchange's exactly."""
import dataclasses

import numpy as np
import pytest

from hgsgc import costs

from hgsgc import perfmodel as pm
from hgsgc import plan as plan_mod

BASE = dict(batch_size=32, t_conv=361e-6, t_fc=183e-6, act_bytes=87.1, grad_bytes=75.1, codec_s=2.4e-6,
            alpha=250e-6, beta=11.75e6, bidir_factor=0.5, cycle_s=1e-3, dp_payload=34132.0,
            conv_payload=3528.0, fc_payload=4505640.0, dp_algorithm="allgather", conv_algorithm="allgather",
            fc_algorithm="ring", micro_batches=2, conv_fwd_mb_s=2.97e-3, conv_bwd_mb_s=4.58e-3,
            fc_call_s=3.45e-3, fc_row_s=81.7e-6, boundary_msg_s=0.2e-3)
COST_CONV = {"base_s": 2e-3, "per_payload_s": 0.1e-3}
COST_FC = {"base_s": 0.0, "per_payload_s": 0.0}
VARIANTS = {
    "alexnet_like": {},
    "cheap_fc_exchange": dict(fc_payload=1e4, fc_algorithm="allgather"),
    "fast_link": dict(beta=1.25e9, alpha=20e-6),
    "heavy_head": dict(fc_row_s=900e-6, fc_call_s=0.0, fc_payload=2e5),
    "one_micro_batch": dict(micro_batches=1, conv_fwd_mb_s=0.0, conv_bwd_mb_s=0.0, fc_call_s=0.0, fc_row_s=0.0),
    "updates": dict(t_update_conv=2e-3, t_update_fc=6e-3, fc_payload=3e5, delay=4),
}


def _at(n, **kw):
    inp = pm.LayoutInputs(world_size=n, **{**BASE, **kw})
    return lambda F: pm.with_role_compression(inp, F, COST_CONV, COST_FC)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bounded_scan_equals_the_exhaustive_scan(variant):
    for n in list(range(2, 70)) + [97, 128, 255, 256]:
        at = _at(n, **VARIANTS[variant])
        assert plan_mod.best_fc_workers(at, n) == plan_mod.best_fc_workers(at, n, exhaustive=True), (variant, n)


def test_large_n_simulates_a_fraction_of_the_candidates():
    for variant in sorted(VARIANTS):
        at = _at(1024, **VARIANTS[variant])
        fast, full = {}, {}
        assert plan_mod.best_fc_workers(at, 1024, stats=fast) == plan_mod.best_fc_workers(
            at, 1024, exhaustive=True, stats=full)
        assert full["predicted"] == full["candidates"] == 512 and full["bounds"] == 0
        assert fast["predicted"] + fast["bounds"] < 512 // 3, (variant, fast)


def test_cpu_share_falls_back_to_the_exhaustive_scan():
    n = 8
    inp = pm.LayoutInputs(world_size=n, machine_of=(0,) * n, machine_cores=(2.0,), **BASE)
    at = lambda F: pm.with_role_compression(inp, F, COST_CONV, COST_FC)  # noqa: E731
    st = {}
    assert plan_mod.best_fc_workers(at, n, stats=st) == plan_mod.best_fc_workers(at, n, exhaustive=True)
    assert st == {"predicted": 4, "bounds": 0, "candidates": 4}
    assert plan_mod.best_fc_workers(at, 1) is None


def test_fc_workers_to_list_keeps_its_answer():
    at = _at(1024)
    fcs = plan_mod.fc_workers_to_list(at, 1024)
    assert fcs[:4] == [1, 2, 3, 4]
    best = plan_mod.best_fc_workers(at, 1024, exhaustive=True)
    assert fcs == ([1, 2, 3, 4] if best in (1, 2, 3, 4) else [1, 2, 3, 4, best])
    assert dataclasses.replace(at(1), boundary_msg_s=0.0).boundary_msg_s == 0.0


# ------------------------------------------------------------------------------------------
# The numpy scan (plan.best_fc_workers_fast) against the old paths
MORE_VARIANTS = {
    "tree_conv_node_fc": dict(conv_algorithm="tree", fc_algorithm="node", fc_payload=3e4),
    "big_allgather_fc": dict(fc_algorithm="allgather", fc_payload=2e6, fc_row_s=400e-6),
    "small_ring_fc": dict(fc_payload=1000.0, fc_row_s=600e-6, conv_algorithm="ring", conv_payload=20000.0),
    "no_cycle_no_alpha": dict(cycle_s=0.0, alpha=0.0, bidir_factor=1.0, fc_payload=5e4),
    "conv_buckets": dict(conv_buckets=(3000, 28, 500), fc_algorithm="allgather", fc_payload=4e4,
                         fc_buckets=(39000, 1000)),   # compression.buckets: 3 and 2 allgathers
}
ALL_VARIANTS = {**VARIANTS, **MORE_VARIANTS}


def _inp(n, **kw):
    return pm.LayoutInputs(world_size=n, **{**BASE, **kw})


@pytest.mark.parametrize("variant", sorted(ALL_VARIANTS))
def test_fast_scan_equals_the_old_scans_small_n(variant):
    for n in list(range(1, 70)) + [97, 128, 255, 256, 1000]:
        inp = _inp(n, **ALL_VARIANTS[variant])
        at = lambda F: pm.with_role_compression(inp, F, COST_CONV, COST_FC)  # noqa: E731
        fast, old = {}, {}
        got = plan_mod.best_fc_workers_fast(inp, n, COST_CONV, COST_FC, stats=fast)
        assert got == plan_mod.best_fc_workers(at, n, stats=old) == plan_mod.best_fc_workers(at, n, exhaustive=True), \
            (variant, n)
        if n >= 4:  # no more predictions than the old bounded scan
            assert fast["predicted"] <= old["predicted"] and fast["candidates"] == n // 2, (variant, n, fast, old)


@pytest.mark.parametrize("variant", sorted(ALL_VARIANTS))
def test_fast_scan_equals_the_old_scan_where_numpy_evaluates_both_roles(variant):
    # N >= 2 VECTOR_FROM_RANKS: every C = N - F >= 4096, F >= 4096 for the upper half
    for n in (8192, 8193, 9001, 12000):
        inp = _inp(n, **ALL_VARIANTS[variant])
        at = lambda F: pm.with_role_compression(inp, F, COST_CONV, COST_FC)  # noqa: E731
        assert plan_mod.best_fc_workers_fast(inp, n, COST_CONV, COST_FC) == plan_mod.best_fc_workers(at, n), (variant, n)


def test_fast_scan_equals_the_exhaustive_scan_at_8192():
    for variant in ("heavy_head", "tree_conv_node_fc"):
        inp = _inp(8192, **ALL_VARIANTS[variant])
        at = lambda F: pm.with_role_compression(inp, F, COST_CONV, COST_FC)  # noqa: E731
        assert plan_mod.best_fc_workers_fast(inp, 8192, COST_CONV, COST_FC) == \
            plan_mod.best_fc_workers(at, 8192, exhaustive=True), variant


def test_fast_scan_cpu_share_and_tiny_worlds():
    n = 8
    inp = pm.LayoutInputs(world_size=n, machine_of=(0,) * n, machine_cores=(2.0,), **BASE)
    at = lambda F: pm.with_role_compression(inp, F, COST_CONV, COST_FC)  # noqa: E731
    st = {}
    assert plan_mod.best_fc_workers_fast(inp, n, COST_CONV, COST_FC, stats=st) == \
        plan_mod.best_fc_workers(at, n, exhaustive=True)
    assert st == {"predicted": 4, "bounds": 0, "candidates": 4}
    assert plan_mod.best_fc_workers_fast(_inp(1), 1, COST_CONV, COST_FC) is None
    assert plan_mod.best_fc_workers_fast(_inp(2), 2, COST_CONV, COST_FC) == 1
    assert plan_mod.best_fc_workers_fast(_inp(3), 3, COST_CONV, COST_FC) == 1


def test_fast_scan_counts_at_a_million_nodes():
    """The 2 sqrt(N) schedules of the bound and one prediction per m-group that raises the best:
    1,997 schedules for 500,000 candidates (was: inputs and two exchanges built for each; at
    10,000,000 nodes 6,322 schedules, 6,320 predictions)."""
    st = {}
    n = 1_000_000
    assert plan_mod.best_fc_workers_fast(_inp(n), n, COST_CONV, COST_FC, stats=st) == 250_000
    assert st == {"candidates": 500_000, "bounds": 1997, "predicted": 1996}


def _ks():
    ks = set(range(4096, 4700)) | {10 ** 5, 10 ** 6 + 1, 9_999_999, 5_000_000, 2 ** 24 - 1, 2 ** 24 + 1}
    for e in range(12, 25):
        ks |= {2 ** e - 1, 2 ** e, 2 ** e + 1}
    rng = np.random.default_rng(0)
    ks |= set(int(k) for k in rng.integers(4096, 10 ** 7, 300))
    return np.array(sorted(k for k in ks if k >= 2), dtype=np.int64)


#: one payload inside each band of Open MPI's last decision band (>= 4096 ranks): allreduce
#: nonoverlapping < 2048 <= segmented_ring < 16384 <= recursive_doubling < 32768 <= rabenseifner;
#: allgatherv bruck < 4096 <= neighbor
@pytest.mark.parametrize("algorithm,payload", [("ring", 1000.0), ("ring", 2048.0), ("ring", 9000.0),
                                               ("ring", 20000.0), ("ring", 4505640.0), ("allgather", 100.0),
                                               ("allgather", 3528.0), ("allgather", 4096.0), ("allgather", 1e6),
                                               ("tree", 3528.0), ("node", 1e5)])
def test_role_post_s_equals_role_exchange_exactly(algorithm, payload):
    inp = _inp(10, cycle_s=3e-3, alpha=1.7e-4, bidir_factor=0.5)
    cost = {"base_s": 2e-3, "per_payload_s": 3e-7}
    ks = np.concatenate([np.arange(0, 40), _ks()])
    got = plan_mod.role_post_s(inp, ks, payload, algorithm, 3, cost, 1.5e-3)
    want = []
    for k in ks:
        ex = pm.role_exchange(inp, int(k), payload, algorithm, 3, pm.compression_at(cost, int(k), algorithm))
        want.append(1.5e-3 + ex["compression_s"] + ex["wire_s"] + ex["coordination_s"])
    assert got.tolist() == want


def test_ompi_choice_is_fixed_from_vector_from_ranks():
    """role_post_s asks Open MPI's decision once, at VECTOR_FROM_RANKS: every larger size gets the
    same algorithm for every message size (the tables' last bands)."""
    sizes = [0, 1, 127, 128, 255, 256, 511, 512, 1023, 1024, 2047, 2048, 4095, 4096, 8191, 8192, 16383, 16384,
             32767, 32768, 65535, 65536, 131071, 131072, 262143, 262144, 1048575, 1048576, 1e7]
    for n in (4096, 4097, 8191, 8192, 65537, 10 ** 6, 10 ** 7, 2 ** 40):
        for B in sizes:
            assert costs.ompi_allreduce_algorithm(n, B) == costs.ompi_allreduce_algorithm(plan_mod.VECTOR_FROM_RANKS, B)
            assert costs.ompi_allgatherv_algorithm(n, B) == \
                costs.ompi_allgatherv_algorithm(plan_mod.VECTOR_FROM_RANKS, B)
    with pytest.raises(ValueError, match="unknown exchange algorithm"):
        plan_mod.role_post_s(_inp(4), [5000], 1.0, "mesh", 1, COST_CONV, 0.0)
