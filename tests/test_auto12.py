"""Session 12: ``layout: auto``'s shorter start-up (docs/hourglass.md "Session 12").

* One rank per machine measures the per-rank figures (:func:`hgsgc.hourglass.auto.measuring_ranks`);
  the machine's other ranks take them; the choice still follows the performance model on the
  inputs (fixed, rank-dependent measurements, fake machines of 2 ranks; mpirun, 2-5 ranks).
* The link probe runs on disjoint pairs at once (:func:`hgsgc.hourglass.costmodel.probe_link_pairs`):
  its estimate on a mocked link of fixed alpha and rate, and for real under mpirun.
* The probes' bytes are reported (``startup["probe_bytes"]``) and the bench's interface bytes per
  step are given without them too (:func:`hgsgc.bench.auto_probe_columns`).
"""
import json
import types

import numpy as np
import pytest

from hgsgc.hourglass import auto, costmodel


# ------------------------------------------------------------------------------------------
# the schedule of the pair probe and who measures for whom
def test_pair_rounds_cover_every_rank_once_per_round():
    assert costmodel.pair_rounds(1) == []
    assert costmodel.pair_rounds(2) == [[(0, 1)]]
    assert costmodel.pair_rounds(3) == [[(0, 1)], [(0, 2)]]
    assert costmodel.pair_rounds(4) == [[(0, 1), (2, 3)]]
    assert costmodel.pair_rounds(5) == [[(0, 1), (2, 3)], [(0, 4)]]
    for n in range(2, 12):
        rounds = costmodel.pair_rounds(n)
        assert len(rounds) == (1 if n % 2 == 0 else 2)
        for pairs in rounds:  # no rank in two pairs of one round
            flat = [r for p in pairs for r in p]
            assert len(flat) == len(set(flat))
        assert {r for pairs in rounds for p in pairs for r in p} == set(range(n))


def test_measuring_ranks_is_the_first_rank_of_each_machine():
    assert auto.measuring_ranks([0, 0, 1, 0, 1]) == [0, 0, 2, 0, 2]
    assert auto.measuring_ranks([0, 1, 2, 3]) == [0, 1, 2, 3]           # one rank per host: all measure
    assert auto.measuring_ranks([0, 0, 0, 0]) == [0, 0, 0, 0]           # the emulator: one turn, not 4
    assert auto.measuring_ranks([0, 0, 1, 1], one_per_machine=False) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------
# the pair probe on a mocked link of fixed alpha and rate
class FakeComm:
    """Rank ``rank`` of ``size``; its Send / Recv advance the fake clock by ``alpha + bytes / beta``
    (``slow``: the round trips, counted per message size from 0, whose Send takes 10x longer);
    allgather returns this rank's value and ``others`` for the rest."""

    def __init__(self, rank, size, clock, alpha, beta, slow=(), others=None):
        self.rank, self.size, self.clock, self.alpha, self.beta = rank, size, clock, alpha, beta
        self.slow, self.others = set(slow), others or {}
        self.sends = {}
        self.sent = 0

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Barrier(self):
        pass

    def Send(self, buf, dest, tag):
        k = self.sends.setdefault(buf.nbytes, 0)
        self.sends[buf.nbytes] = k + 1
        self.sent += buf.nbytes
        self.clock.t += (10.0 if (buf.nbytes, k) in self.slow else 1.0) * (self.alpha + buf.nbytes / self.beta)

    def Recv(self, buf, source, tag):
        self.clock.t += self.alpha + buf.nbytes / self.beta

    def allgather(self, x):
        return [x if r == self.rank else self.others.get(r, []) for r in range(self.size)]


def _fake_clock(monkeypatch):
    clock = types.SimpleNamespace(t=100.0)
    monkeypatch.setattr(costmodel, "time", types.SimpleNamespace(perf_counter=lambda: clock.t))
    return clock


@pytest.mark.parametrize("first", [True, False])
def test_pair_probe_estimates_a_fixed_rate_link(monkeypatch, first):
    clock = _fake_clock(monkeypatch)
    alpha, beta, big = 60e-6, 12.5e6, 1 << 20        # 60 us, 100 Mbit/s, the default 1 MiB
    # one disturbed round trip of each size (10x the send): the medians ignore it
    # one-way = half the round trip = alpha + s / beta: alpha + 8 / beta and B / ((B - 8) / beta)
    want_a, want_b = alpha + 8 / beta, big / ((big - 8) / beta)
    # the pair's first rank computes the estimate; the second gets it through the allgather
    others = {} if first else {0: [[0, 1, want_a, want_b]]}
    comm = FakeComm(0 if first else 1, 2, clock, alpha, beta, slow={(8, 2), (big, 1)}, others=others)
    got = costmodel.probe_link_pairs(comm)
    assert got["alpha_s"] == pytest.approx(want_a, rel=1e-9)
    assert got["beta_Bps"] == pytest.approx(want_b, rel=1e-9) and got["beta_Bps"] == pytest.approx(beta, rel=1e-5)
    assert got["pairs"] == [[0, 1, pytest.approx(want_a, rel=1e-9), pytest.approx(want_b, rel=1e-9)]]
    assert got["scheme"] == "disjoint pairs at once" and got["rounds"] == 1
    per_pair = 21 * 8 + 4 * big                        # warm-up + 20 small, warm-up + 3 big
    assert comm.sent == per_pair == got["bytes_sent_per_rank"][comm.rank]
    assert got["bytes_sent_per_rank"] == [per_pair, per_pair]


def test_pair_probe_slowest_pair_counts_and_bytes_by_formula(monkeypatch):
    clock = _fake_clock(monkeypatch)
    # rank 0 of 5: rounds (0,1),(2,3) then (0,4); the other pairs' results come from allgather
    others = {2: [[2, 3, 5e-4, 1e6]], 4: []}
    comm = FakeComm(0, 5, clock, 1e-4, 1e7, others=others)
    got = costmodel.probe_link_pairs(comm, small_reps=4, big_bytes=4096, big_reps=2)
    assert [p[:2] for p in got["pairs"]] == [[0, 1], [0, 4], [2, 3]]
    assert got["alpha_s"] == 5e-4 and got["beta_Bps"] == 1e6          # the slowest pair
    per_pair = 5 * 8 + 3 * 4096
    assert got["bytes_sent_per_rank"] == [2 * per_pair, per_pair, per_pair, per_pair, per_pair]
    assert comm.sent == 2 * per_pair and got["rounds"] == 2
    assert "2 disjoint pairs" not in costmodel.describe_link({"source": "probe", **got})
    assert costmodel.describe_link({"source": "probe", **got}) == \
        "ping-pong probe on 3 disjoint pairs at once (2 rounds), slowest pair"


def test_pair_probe_refuses_one_rank():
    with pytest.raises(ValueError, match="probe_link_pairs needs at least 2 ranks, got 1"):
        costmodel.probe_link_pairs(FakeComm(0, 1, None, 0, 1))


# ------------------------------------------------------------------------------------------
# probe bytes: reported, and apart in the bench
def test_probe_bytes_per_rank():
    none = auto.probe_bytes({"source": "config"}, {"bytes_sent_per_rank": [10, 20, 30]}, 3)
    assert none == {"link_per_rank": [0, 0, 0], "boundary_per_rank": [10, 20, 30],
                    "total_per_rank": [10, 20, 30], "total": 60}
    hub = auto.probe_bytes({"source": "probe", "pairs": []}, None, 4)   # probe_link: by formula
    per_pair = 21 * 8 + 4 * (1 << 20)
    assert hub["link_per_rank"] == [3 * per_pair, per_pair, per_pair, per_pair] == \
        costmodel.probe_link_bytes_per_rank(4)
    assert hub["boundary_per_rank"] == [0] * 4 and hub["total"] == 6 * per_pair
    pairs = auto.probe_bytes({"source": "probe", "bytes_sent_per_rank": [5, 6]}, {"bytes_sent_per_rank": [1, 2]}, 2)
    assert pairs["total_per_rank"] == [6, 8] and pairs["total"] == 14


def test_bench_iface_without_the_probes():
    from hgsgc.bench import auto_probe_columns

    s = {"layout_choice": {"startup": {"probe_bytes": {"total_per_rank": [4e6, 1e6, 1e6, 1e6]}}}}
    got = auto_probe_columns(s, [9e6, 5e6, 5e6, 5e6], 30)
    assert got["auto_probe_bytes_per_rank"] == [4e6, 1e6, 1e6, 1e6]
    assert got["iface_tx_bytes_per_step_per_rank_without_probes"] == pytest.approx((24e6 - 7e6) / 4 / 30)
    assert auto_probe_columns({"layout": "hourglass"}, [1.0], 3) == {}    # not an auto run


def test_describe_startup_names_the_probe_bytes():
    st = auto.startup_record([{"phases_s": {"machines": 0.1, "link": 0.5}, "own_turn_s": 0.0}], [2.0])
    st["probe_bytes"] = auto.probe_bytes({"source": "probe", "bytes_sent_per_rank": [4_200_000, 4_200_000]},
                                         {"bytes_sent_per_rank": [300_000, 100_000]}, 2)
    line = auto.describe_startup(st)
    assert line.startswith("layout auto: start-up 2.00 s in all; ")
    assert "the probes sent 8.80 MB (link 8.40, boundary 0.40; per rank [4.5, 4.3] MB)" in line


# ------------------------------------------------------------------------------------------
# under mpirun: the real probes' bytes, and the choice on fixed inputs with one rank per machine
@pytest.fixture(scope="module", params=[2, 3, 4, 5])
def result(request):
    from conftest import mpi_result

    return mpi_result(request.param, ["tests/mpi/check_auto12.py"], timeout=600)


@pytest.mark.mpi
def test_pair_probe_under_mpirun(result):
    n, ranks = result["size"], result["ranks"]
    lk = ranks[0]["link"]
    assert all(r["link"] == lk for r in ranks)                          # identical on every rank
    rounds = costmodel.pair_rounds(n)
    assert [p[:2] for p in lk["pairs"]] == sorted([list(p) for ps in rounds for p in ps])
    assert lk["alpha_s"] == max(p[2] for p in lk["pairs"]) > 0
    assert lk["beta_Bps"] == min(p[3] for p in lk["pairs"]) > 0
    per_pair = 4 * 8 + 3 * (1 << 16)
    want = [per_pair * sum(1 for ps in rounds for p in ps if r in p) for r in range(n)]
    assert lk["bytes_sent_per_rank"] == want and lk["rounds"] == len(rounds)


@pytest.mark.mpi
def test_boundary_probe_bytes_under_mpirun(result):
    n, ranks = result["size"], result["ranks"]
    bd = ranks[0]["boundary"]
    assert all(r["boundary"] == bd for r in ranks)
    # fp32 both ways: 4 x 6 float32 activations + 4 int32 labels from rank 0, 4 x 6 float32
    # gradients back; 1 warm-up + 2 timed round trips per pair, rank 0 with each other rank
    assert bd["bytes_sent_per_rank"] == [3 * (n - 1) * (96 + 16)] + [3 * 96] * (n - 1)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["slow", "fast", "all_ranks"])
def test_choice_follows_the_model_with_one_rank_per_machine(result, case):
    from hgsgc import perfmodel as pm

    n, ranks = result["size"], result["ranks"]
    rep = ranks[0][case]["report"]
    assert all(r[case]["report"] == rep for r in ranks)
    machine_of = [r // 2 for r in range(n)]
    opm = case != "all_ranks"
    by = [2 * (r // 2) if opm else r for r in range(n)]
    meas = rep["measured"]
    assert meas["measured_by"] == by and meas["repeats"] == (5 if opm else 3)
    # who measured: the first rank of each fake machine (5 timed calls), or every rank (3)
    for r in range(n):
        calls = ranks[r][case]["calls"]
        reps = 5 if opm else 3
        assert calls == ([["measure", reps], ["stages", reps], ["compression", 3]] if by[r] == r else [])
    # each rank's figures are its measuring rank's (the fixed values depend on the rank)
    assert [p["t_conv"] for p in meas["per_rank"]] == pytest.approx([1e-4 * (1 + b) for b in by], rel=1e-12)
    assert [p["conv_fwd_mb_s"] for p in meas["per_rank"]] == pytest.approx([1e-3 * (1 + b) for b in by], rel=1e-12)
    i = rep["inputs"]
    assert i["t_conv"] == pytest.approx(float(np.median([1e-4 * (1 + b) for b in by])), rel=1e-12)
    assert i["act_bytes"] == pytest.approx(float(np.median([900.0 + b for b in by])), rel=1e-12)
    assert list(i["machine_of"]) == machine_of
    link = {"slow": (1e-3, 1.25e5), "fast": (1e-6, 1.25e10), "all_ranks": (1e-3, 1.25e5)}[case]
    assert (i["alpha"], i["beta"]) == link
    # the choice is perfmodel's on exactly these inputs
    cost = meas["compression_cost"]
    inp = pm.LayoutInputs(**i)
    again = pm.choose_layout(inp, inputs_at=lambda F: pm.with_role_compression(inp, F, cost["conv"], cost["fc"]))
    assert json.loads(json.dumps(again["predictions"])) == rep["predictions"]
    assert (rep["layout"], rep["fc_workers"]) == (again["layout"], again["fc_workers"])
    # the start-up record: the turns' parts on every rank (0 where the rank did not measure), probe bytes
    st = rep["startup"]
    for r, parts in enumerate(st["own_turn_parts_s"]):
        assert list(parts) == list(auto.OWN_TURN_PARTS)
        if by[r] != r:
            assert all(v == 0.0 for v in parts.values())
    pb = st["probe_bytes"]
    lk_bytes = [7 * r for r in range(n)] if case != "fast" else [0] * n   # the injected link results
    assert pb["link_per_rank"] == lk_bytes
    assert pb["total_per_rank"] == [a + b for a, b in zip(pb["link_per_rank"], pb["boundary_per_rank"])]
    assert pb["boundary_per_rank"][0] > 0 and all(b > 0 for b in pb["boundary_per_rank"])
