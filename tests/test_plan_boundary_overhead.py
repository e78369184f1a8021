"""``hgsgc plan``'s boundary-codec overhead line: with few rows per boundary message the q8 / q4
per-feature scales (``4 f`` bytes per message) and the sparse bitmap make a codec send MORE bytes
than fp32. Real overhead (the encoders send exactly the formula's bytes), reported in one line with
the largest ``hourglass.micro_batches`` that pays off. Exact byte counts, no wall clock."""
import numpy as np
import pytest

from hgsgc import perfmodel as pm
from hgsgc import plan as plan_mod
from hgsgc.hourglass.boundary import BoundaryCodec
from hgsgc.hourglass.costmodel import boundary_bytes

F = 3136            # alexnet_small's boundary features (flatten)
B = 32              # per-rank batch


@pytest.mark.parametrize("spec,rows,want", [("fp32", 1, 4 * F), ("fp16", 1, 2 * F), ("q8", 1, 4 * F + F),
                                            ("q4", 1, 4 * F + F // 2), ("q8", 2, 4 * F + 2 * F),
                                            ("q4", 2, 4 * F + F)])
def test_the_encoders_send_the_formula_bytes(spec, rows, want):
    """Not a bug of the formula: a one-row q8 message IS 5 f bytes (the scales, 4 f, ride along)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, F)).astype(np.float32)
    c = BoundaryCodec.parse(spec)
    assert c.length(rows, F) == want
    assert len(c.encode(x, rng)) == want


def test_one_row_per_micro_batch_q8_and_q4_cost_more_than_fp32():
    nz = np.ones((B, F), bool)
    # fp32: 4 f + 4 (label) per example out, 4 f back
    assert boundary_bytes("fp32", "fp32", nz, B) == (4 * F + 4, 4 * F)
    q8 = plan_mod.boundary_overhead("q8", "q8", nz, B)
    # q8, M = b: (4 f + f) per one-row message; break-even: (4 M' f + b f) / b < 4 f <=> M' < 3 b / 4 = 24
    assert q8["act"] == {"codec": "q8", "bytes": 5 * F + 4, "fp32_bytes": 4 * F + 4,
                         "ratio": (5 * F + 4) / (4 * F + 4), "micro_batches": B, "break_even_micro_batches": 23}
    assert q8["grad"] == {"codec": "q8", "bytes": 5 * F, "fp32_bytes": 4 * F, "ratio": 1.25,
                          "micro_batches": B, "break_even_micro_batches": 23}
    # q4: (4 M' f + b f / 2) / b < 4 f <=> M' < 7 b / 8 = 28 (f even)
    q4 = plan_mod.boundary_overhead("q4", "q4", nz, B)
    assert q4["grad"]["bytes"] == 4 * F + F / 2 and q4["grad"]["ratio"] == 1.125
    assert q4["act"]["break_even_micro_batches"] == q4["grad"]["break_even_micro_batches"] == 27
    # the break-even itself: 24 micro-batches (8 of 2 rows, 16 of 1) send exactly fp32's bytes: not more
    assert boundary_bytes("q8", "q8", nz, 24) == (4 * F + 4, 4 * F)
    assert plan_mod.boundary_overhead("q8", "q8", nz, 24) == {"act": None, "grad": None}
    # 25: (100 f + 32 f) / 32 = 4.125 f
    assert plan_mod.boundary_overhead("q8", "fp32", nz, 25)["act"]["bytes"] == 4.125 * F + 4
    assert plan_mod.boundary_overhead("q8", "fp32", nz, 25)["grad"] is None
    for spec in ("fp32", "fp16"):
        assert plan_mod.boundary_overhead(spec, spec, nz, B) == {"act": None, "grad": None}
    assert plan_mod.boundary_overhead("q8", "q4", nz, 16) == {"act": None, "grad": None}


def test_sparse_bitmap_overhead_at_full_density():
    nz = np.ones((4, 16), bool)     # b 4, f 16, every activation non-zero
    o = plan_mod.boundary_overhead("sparse+q8", "sparse+q8", nz, 4)
    # one row: bitmap 2 + scales 64 + 16 codes + 4 label = 86 > 68; back: 64 + 16 = 80 > 64
    assert (o["act"]["bytes"], o["act"]["fp32_bytes"], o["grad"]["bytes"], o["grad"]["fp32_bytes"]) == (86, 68, 80, 64)
    # M' = 3 (rows 1, 1, 2): (82 + 82 + 100 + 16) / 4 = 70 (act), (80 + 80 + 96) / 4 = 64 (grad, equal):
    # neither below fp32; M' = 2 (rows 2, 2): 54 and 48
    assert boundary_bytes("sparse+q8", "sparse+q8", nz, 3) == (70, 64)
    assert o["act"]["break_even_micro_batches"] == o["grad"]["break_even_micro_batches"] == 2
    # a codec that never pays off at full density: sparse+fp32 (bitmap on top of 4 bytes a value)
    s = plan_mod.boundary_overhead("sparse+fp32", "fp32", nz, 4)
    assert s["act"]["bytes"] == (2 + 64 + 4) and s["act"]["break_even_micro_batches"] is None
    assert s["grad"] is None


def test_format_line():
    nz = np.ones((B, F), bool)
    assert plan_mod.format_boundary_overhead({"act": None, "grad": None}, B) is None
    line = plan_mod.format_boundary_overhead(plan_mod.boundary_overhead("q8", "fp32", nz, B), B)
    assert line == ("hourglass boundary: MORE bytes than fp32: act_codec q8 sends 15684.0 B/example, 1.25x "
                    "fp32's 12548.0 (M 32: 1 row(s) per message, each message carries its own per-feature "
                    "scales / bitmap); hourglass.micro_batches <= 23 makes it smaller")
    never = plan_mod.format_boundary_overhead(plan_mod.boundary_overhead("fp32", "sparse+fp32", np.ones((4, 16), bool), 4), 4)
    assert never is None  # gradients of sparse+ carry no bitmap: 4 nnz = fp32's bytes
    never = plan_mod.format_boundary_overhead(plan_mod.boundary_overhead("sparse+fp32", "fp32", np.ones((4, 16), bool), 4), 4)
    assert never.endswith("act_codec sparse+fp32 sends 70.0 B/example, 1.03x fp32's 68.0 (M 4: 1 row(s) per message, "
                          "each message carries its own per-feature scales / bitmap); no smaller micro_batches makes "
                          "it smaller: use fp32 or fp16")


def test_format_plan_prints_the_line_under_the_hourglass_inputs():
    inp = pm.LayoutInputs(world_size=4, batch_size=B, t_conv=3e-4, t_fc=2e-4, act_bytes=5 * F + 4, grad_bytes=5 * F,
                          codec_s=1e-6, alpha=2.5e-4, beta=1e6, dp_payload=1.0, conv_payload=1.0, fc_payload=1.0,
                          micro_batches=B)
    over = plan_mod.boundary_overhead("q8", "q8", np.ones((B, F), bool), B)
    res = {"inputs": {"config": "fixed", "parameters": 1, "batch_size": B, "nodes": 4, "bandwidth_bit_s": 1e8,
                      "beta_Bps": 1e6, "alpha_s": 2.5e-4, "bidir_factor": 1.0, "cycle_s": 1e-3, "compute_s": 0.05},
           "hourglass": {"split_layer": "fc1", "features": F, "act_codec": "q8", "grad_codec": "q8",
                         "density_of_nonzero_activations": 1.0, "update_s": 0.0, "fc_method": "none",
                         "boundary_overhead": over},
           "hourglass_inputs": inp.to_dict(), "rows": []}
    lines = plan_mod.format_plan(res).splitlines()
    assert lines[1].startswith("hourglass inputs:")
    assert lines[2].startswith("hourglass boundary: MORE bytes than fp32: act_codec q8 sends 15684.0 B/example")
    assert "; grad_codec q8 sends 15680.0 B/example, 1.25x fp32's 12544.0" in lines[2]
    res["hourglass"]["boundary_overhead"] = plan_mod.boundary_overhead("q8", "q8", np.ones((B, F), bool), 16)
    assert not any(l.startswith("hourglass boundary") for l in plan_mod.format_plan(res).splitlines())
