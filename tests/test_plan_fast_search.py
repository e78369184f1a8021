"""``hgsgc plan --nodes N``: the best fc_workers by the bounded scan (plan.best_fc_workers) equals
the exhaustive scan over F = 1 .. N/2 on fixed inputs, and for large N it simulates a fraction
of the candidates (counted, never timed)."""
import dataclasses

import pytest

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
