"""perfmodel.measure_compression_s's ``per_payload_s`` (session 14): what one more rank's payload
costs a sparse exchange, timed on the path the exchange runs. With the allgather that is one more
row of the fused decode-and-add kernel (``codec.decode_sum`` -> ``kernels.decode_accumulate``), one
call per tensor on ``[1, P]`` and ``[R, P]`` buffers holding every tensor's payload at its byte
offset, the slope between the two; with the
tree, one merge round of every tensor at once (``hierarchy.merge_received``)."""
import numpy as np
import pytest

from hgsgc import hierarchy, perfmodel
from hgsgc.compression import Compression, kernels, wire
from hgsgc.compression.sparsify import num_selected

SHAPES = [(40, 30), (90, 7), (13,)]


@pytest.mark.parametrize("coding", ["fixed", "elias_fano"])
def test_allgather_per_payload_is_one_kernel_row_per_tensor(monkeypatch, coding):
    calls = []
    real = kernels.decode_accumulate

    def spy(gathered, numel, k, bits, offset=0, backend=None, index_coding="fixed", divisor=1):
        calls.append((tuple(int(d) for d in gathered.shape), numel, k, bits, offset, index_coding, divisor))
        return real(gathered, numel, k, bits, offset=offset, backend=backend, index_coding=index_coding,
                    divisor=divisor)

    monkeypatch.setattr(kernels, "decode_accumulate", spy)
    import hgsgc.compression.codec as codec_mod

    pure_tf = []
    real_decode = codec_mod.decode
    monkeypatch.setattr(codec_mod, "decode", lambda *a, **k: pure_tf.append(a) or real_decode(*a, **k))
    comp = Compression.sgc(0.05, bits=2, index_coding=coding)
    out = perfmodel.measure_compression_s(comp, SHAPES, reps=1)
    numels = [int(np.prod(s)) for s in SHAPES]
    ks = [num_selected(m, 0.05) for m in numels]
    lens = [wire.payload_length(m, k, 2, coding) for m, k in zip(numels, ks)]
    offsets = list(np.cumsum([0] + lens[:-1]))
    # the one-rank exchange (base) runs its own decode_sum calls first; the per-payload graphs'
    # calls are the last 2 len(SHAPES): 1 row, then PER_PAYLOAD_ROWS rows, each traced once
    mine = calls[-2 * len(SHAPES):]
    assert mine == [((r, sum(lens)), m, k, 2, int(o), coding, 1)
                    for r in (1, perfmodel.PER_PAYLOAD_ROWS) for m, k, o in zip(numels, ks, offsets)]
    assert out["per_payload_s"] >= 0 and pure_tf == []  # no pure-TF decode on the allgather's path


def test_tree_per_payload_is_one_merge_round_of_every_tensor(monkeypatch):
    """One call of hierarchy.merge_received (traced once): this rank's aggregate of every tensor
    (K = sum of k entries) and one received payload of P bytes (the formula), in the layout of
    every tensor."""
    calls = []
    real = hierarchy.merge_received

    def spy(agg, received, lay):
        calls.append((int(agg[0].shape[0]), int(agg[1].shape[0]), [int(p.shape[0]) for p, _ in received],
                      lay.T, lay.K, lay.P, lay.bits, lay.coding))
        return real(agg, received, lay)

    monkeypatch.setattr(hierarchy, "merge_received", spy)
    comp = Compression.sgc(0.05, bits=2, index_coding="fixed", hierarchy="tree")
    out = perfmodel.measure_compression_s(comp, SHAPES, reps=1)
    numels = [int(np.prod(s)) for s in SHAPES]
    ks = [num_selected(m, 0.05) for m in numels]
    P = sum(wire.payload_length(m, k, 2, "fixed") for m, k in zip(numels, ks))
    assert calls == [(sum(ks), sum(ks), [P], len(SHAPES), sum(ks), P, 2, "fixed")]
    assert out["per_payload_s"] > 0


@pytest.mark.parametrize("t_one, t_many, want", [(2.0e-3, 6.0e-3, 0.5e-3), (3.0e-3, 2.5e-3, 0.0)])
def test_allgather_per_payload_is_the_slope_between_1_and_R_rows(monkeypatch, t_one, t_many, want):
    """per_payload_s = (t_R - t_1) / (R - 1) of the medians of the 1-row and R-row timings (the
    output's allocation, once per exchange, cancels), never below 0 (noise): the medians come
    from ``_timed_median`` in the order base, 1 row, R rows."""
    got = iter([7.0e-3, t_one, t_many])
    monkeypatch.setattr(perfmodel, "_timed_median", lambda fn, reps, clock=None: (fn(), next(got))[1])
    out = perfmodel.measure_compression_s(Compression.sgc(0.05, bits=2), SHAPES, reps=3)
    assert perfmodel.PER_PAYLOAD_ROWS == 9
    assert out == {"base_s": 7.0e-3, "per_payload_s": want}
