"""fc_workers: auto and layout: auto share ONE link probe (hgsgc.hourglass.costmodel.link_inputs):
under mpirun with 2, 3 and 4 ranks (tests/mpi/check_hourglass_auto.py, in the batched launch of each rank count)
the probe is run, reported identically on every rank, fed to the model, and the choice follows
hgsgc.perfmodel.predict_hourglass on the fixed inputs of the script; the config value
hourglass.link_bandwidth_mbps is only an explicit override (no probe)."""
import json
import os

import pytest

from conftest import mpi_cases
from hgsgc.hourglass.costmodel import CostInputs, stage_times


# one case per rank count in the batched launch, after its other cases (the Layout starts its
# own Horovod; session 14: 3 launches fewer)
MPI_CASES = mpi_cases("tests/mpi/check_hourglass_auto.py", "{tmp}", ranks=[2, 3, 4], timeout=600, tmp=True,
                      own_horovod=True)


@pytest.fixture(scope="module", params=[2, 3, 4])
def result(request, mpi_batch):
    res = dict(mpi_batch.result(request.param, "tests/mpi/check_hourglass_auto.py", "{tmp}"))
    res["out_dir"] = mpi_batch.tmpdir(request.param, "tests/mpi/check_hourglass_auto.py", "{tmp}")
    return res


def _best_by_hand(fixed, n, alpha, beta):
    """The F the model predicts fastest, recomputed here: throughput C b / T(F) of
    perfmodel.predict_hourglass for every F = 1 .. n/2 (ties: fewer FC ranks)."""
    inp = CostInputs(**{**fixed, "alpha": alpha, "bandwidth": beta})
    cands = [stage_times(inp, n, F) for F in range(1, n // 2 + 1)]
    best = cands[0]
    for c in cands[1:]:
        if c["throughput"] > best["throughput"] * (1 + 1e-9):
            best = c
    return best["fc_workers"], cands


@pytest.mark.mpi
def test_probe_is_run_and_identical_on_every_rank(result):
    n = result["size"]
    probes = [r["probe"] for r in result["ranks"]]
    p = probes[0]
    assert all(q == p for q in probes)                               # broadcast from rank 0
    assert p["source"] == "probe" and p["probe_bytes"] == [8, 1 << 20]
    assert [q[0] for q in p["pairs"]] == list(range(1, n))            # rank 0 <-> every other rank
    assert p["alpha_s"] == max(q[1] for q in p["pairs"]) > 0          # the slowest pair counts
    assert p["beta_Bps"] == min(q[2] for q in p["pairs"]) > 0
    # the override: no probe, beta = 250 Mbit/s in bytes per second, alpha 0, no pairs
    for r in result["ranks"]:
        assert r["override"] == {"source": "config", "alpha_s": 0.0, "beta_Bps": 250e6 / 8, "pairs": []}


@pytest.mark.mpi
def test_fc_workers_auto_reports_the_probe_and_follows_the_model(result):
    n = result["size"]
    fixed = result["ranks"][0]["fixed"]
    for key, want_F in (("auto_probe", None), ("auto_slow", 1), ("auto_fast", 2), ("auto_override", 1)):
        outs = [r[key] for r in result["ranks"]]
        rep = outs[0]["report"]
        assert all(o["report"] == rep for o in outs), key             # one report, broadcast
        lk, inp = rep["link"], rep["inputs"]
        # the probed (or injected / overriding) link is what the model was given
        assert inp["alpha"] == lk["alpha_s"] and inp["bandwidth"] == lk["beta_Bps"], key
        F, cands = _best_by_hand(fixed, n, lk["alpha_s"], lk["beta_Bps"])
        assert rep["fc_workers"] == F and all(o["n_fc"] == F for o in outs), key
        assert [c["step_s"] for c in rep["candidates"]] == pytest.approx([c["step_s"] for c in cands], rel=1e-12)
        roles = [o["role"] for o in outs]
        assert roles == ["conv"] * (n - F) + ["fc"] * F, key
        if n >= 4 and want_F is not None:   # with 2 or 3 ranks F = 1 is the only candidate
            assert F == want_F, key
        if n < 4:
            assert F == 1 and len(cands) == 1
    probe = result["ranks"][0]["auto_probe"]["report"]["link"]
    assert probe["source"] == "probe" and probe["alpha_s"] > 0 and probe["beta_Bps"] > 0
    assert len(probe["pairs"]) == n - 1
    assert result["ranks"][0]["auto_override"]["report"]["link"]["source"] == "config"
    assert result["ranks"][0]["auto_override"]["report"]["inputs"]["bandwidth"] == 100e6 / 8


@pytest.mark.mpi
def test_layout_auto_honours_the_override(result):
    if result["size"] != 3:
        return
    o = result["ranks"][0]["layout_auto_override"]
    assert all(r["layout_auto_override"] == o for r in result["ranks"])
    assert o["link"]["source"] == "config" and o["alpha"] == 0.0 and o["beta"] == 100e6 / 8


@pytest.mark.mpi
def test_machines_and_turns(result):
    """find_machines: every rank of this machine on one machine with its affinity's cores; with
    fake boot ids even and odd ranks apart. take_turns: ranks of one (fake) machine measured one
    after the other, never at once; a failing rank's error comes back, the others go on."""
    n = result["size"]
    ranks = result["ranks"]
    m = ranks[0]["machines"]
    assert all(r["machines"] == m for r in ranks)
    assert m["machine_of"] == [0] * n and m["how"] == ["boot_id"] * n
    assert m["machine_cores"] == [float(ranks[0]["affinity"])] and m["rank_cores"] == [r["affinity"] for r in ranks]
    fake = ranks[0]["machines_fake"]
    assert fake["machine_of"] == [r % 2 for r in range(n)]
    assert all(r["machines_fake"] == fake for r in ranks)
    assert ranks[1]["turn"] == {"interval": None, "error": "rank 1: ValueError: rank 1 fails on purpose"}
    for mach in (0, 1):
        iv = sorted(ranks[r]["turn"]["interval"] for r in range(n) if r % 2 == mach and r != 1)
        assert all(a[1] <= b[0] for a, b in zip(iv, iv[1:]))          # one after the other
        assert all(ranks[r]["turn"]["error"] is None for r in range(n) if r % 2 == mach and r != 1)


@pytest.mark.mpi
def test_layout_auto_measures_compression_update_and_share(result):
    """3 ranks, SGC on the tiny model's CONV ranks: the report's inputs carry the measured
    compression (whole model among n, trunk among C, head among F per prediction), the updates
    and the machines; the predictions are perfmodel's on exactly those inputs."""
    if result["size"] != 3:
        return
    from hgsgc import perfmodel as pm

    rep = result["ranks"][0]["layout_auto_report"]
    assert all(r["layout_auto_report"] == rep for r in result["ranks"])
    i, meas = rep["inputs"], rep["measured"]
    cost = meas["compression_cost"]
    assert i["machine_of"] == meas["machines"]["machine_of"] == [0, 0, 0]
    # the machine's cores as the ranks get them all computing at once (auto.effective_cores of
    # the measured slowdown), never more than its affinity cores
    tog = meas["together"]
    assert len(tog["trunk_pass_s"]) == 3 and min(tog["trunk_pass_s"]) > 0
    from hgsgc.hourglass.auto import TOGETHER_WINDOWS, effective_cores, slowdown_windows

    # every window of every rank recorded; the slowdown is the median window (auto.slowdown_windows)
    assert [len(w) for w in tog["trunk_pass_windows_s"]] == [TOGETHER_WINDOWS] * 3 == [tog["windows"]] * 3
    alone = [p["t_conv"] * 8 for p in meas["per_rank"]]
    cores, slow = effective_cores([0, 0, 0], meas["machines"]["machine_cores"], alone,
                                  tog["trunk_pass_windows_s"], i["cpu_parallelism"])
    sw = slowdown_windows([0, 0, 0], alone, tog["trunk_pass_windows_s"])
    assert tog["slowdown_per_window"] == sw["per_window"] and tog["slowdown_spread_per_machine"] == sw["spread"]
    # what a waiting rank burns (auto.measure_wait_cpu): one value per rank, the median in the inputs
    wc = meas["wait_cpu_cores_per_rank"]
    assert len(wc) == 3 and min(wc) >= 0 and i["wait_cpu_cores"] == sorted(wc)[1]
    assert i["machine_cores"] == tog["effective_cores"] == cores and tog["slowdown_per_machine"] == slow
    assert 0 < i["machine_cores"][0] <= meas["machines"]["machine_cores"][0]
    assert i["cpu_parallelism"] > 0 and i["t_update_conv"] > 0 and i["t_update_fc"] > 0
    per_rank = meas["per_rank"]
    assert len(per_rank) == 3
    for mkey, ikey in (("t_conv", "t_conv"), ("t_fc", "t_fc"), ("update_conv_s", "t_update_conv"),
                       ("update_fc_s", "t_update_fc"), ("cpu_parallelism", "cpu_parallelism")):
        assert i[ikey] == sorted(p[mkey] for p in per_rank)[1], ikey              # median of 3 ranks
    assert cost["dp"]["base_s"] > 0 and cost["conv"]["base_s"] > 0                 # SGC measured
    assert cost["fc"] == {"base_s": 0.0, "per_payload_s": 0.0}                      # dense FC: nothing
    assert i["dp_compression_s"] == pm.compression_at(cost["dp"], 3, i["dp_algorithm"])
    inp = pm.LayoutInputs(**i)
    again = pm.choose_layout(inp, inputs_at=lambda F: pm.with_role_compression(inp, F, cost["conv"], cost["fc"]))
    assert json.loads(json.dumps(again["predictions"])) == rep["predictions"]
    assert (rep["layout"], rep["fc_workers"]) == (again["layout"], again["fc_workers"])
    hg = rep["predictions"][1]
    # the Hourglass is predicted by the schedule of the stages measured per micro-batch, which
    # shares the CPU itself: the compression enters unscaled (perfmodel.pipeline_schedule)
    assert hg["model"] == "pipeline_schedule"
    assert hg["conv_exchange"]["compression_s"] == pytest.approx(
        pm.compression_at(cost["conv"], 2, i["conv_algorithm"]), rel=1e-12)
    for key in ("conv_fwd_mb_s", "conv_bwd_mb_s", "fc_call_s", "fc_row_s"):
        assert i[key] == sorted(p[key] for p in per_rank)[1], key                  # median of 3 ranks
    assert i["conv_fwd_mb_s"] > 0 and i["conv_bwd_mb_s"] >= 0 and i["fc_call_s"] + i["fc_row_s"] > 0


@pytest.mark.mpi
def test_run_writes_the_probe_to_summary(result):
    if result["size"] != 2:
        return
    with open(os.path.join(result["out_dir"], "auto", "summary.json")) as f:
        s = json.load(f)
    cm = s["hourglass"]["cost_model"]
    assert s["hourglass"]["fc_workers_setting"] == "auto" and s["hourglass"]["fc_workers"] == cm["fc_workers"] == 1
    lk = cm["link"]
    assert lk["source"] == "probe" and lk["alpha_s"] > 0 and lk["beta_Bps"] > 0 and len(lk["pairs"]) == 1
    assert cm["inputs"]["alpha"] == lk["alpha_s"] and cm["inputs"]["beta"] == lk["beta_Bps"]
    assert result["ranks"][0]["run"]["cost_model"] == cm               # what run() returned
    # fc_workers: auto measures and predicts as layout: auto does (compression, updates, CPU
    # share, the stages per micro-batch), choosing among the Hourglass candidates only
    from hgsgc import perfmodel as pm

    assert cm["setting"] == "fc_workers=auto" and cm["layout"] == "hourglass"
    assert [p["layout"] for p in cm["predictions"]] == ["data_parallel", "hourglass"]
    assert cm["choice"] == cm["predictions"][1] and cm["choice"]["model"] == "pipeline_schedule"
    i = cm["inputs"]
    assert i["conv_fwd_mb_s"] > 0 and i["t_update_conv"] > 0 and i["machine_of"] == [0, 0]
    inp = pm.LayoutInputs(**i)
    cc = cm["measured"]["compression_cost"]
    again = pm.predict_hourglass(pm.with_role_compression(inp, 1, cc["conv"], cc["fc"]), 1)
    assert json.loads(json.dumps(again)) == cm["choice"]
    log = "\n".join(result["ranks"][0]["run"]["log"])
    assert f"alpha {lk['alpha_s'] * 1e6:.1f} us, beta {lk['beta_Bps'] * 8 / 1e6:.1f} Mbit/s" in log
    assert "ping-pong probe rank 0 <-> 1 ranks" in log and "hourglass.fc_workers auto -> 1 FC ranks" in log


@pytest.mark.mpi
def test_layout_auto_runs_the_configured_task(result):
    """layout: auto builds the configured task's model and reads its data (a CIFAR-format vgg16
    here), runs the chosen layout and records the probe, the predictions and the choice."""
    if result["size"] != 2:
        return
    with open(os.path.join(result["out_dir"], "layout_auto", "summary.json")) as f:
        s = json.load(f)
    c = s["layout_choice"]
    assert s["layout_setting"] == "auto" and s["layout"] == c["layout"] in ("data_parallel", "hourglass")
    assert c["link"]["source"] == "probe" and c["inputs"]["alpha"] == c["link"]["alpha_s"] > 0
    assert c["inputs"]["beta"] == c["link"]["beta_Bps"] > 0 and c["inputs"]["world_size"] == 2
    assert c["inputs"]["batch_size"] == 8 and len(c["predictions"]) == 2           # DP + F = 1
    best = max(c["predictions"], key=lambda p: p["throughput"])
    assert (c["layout"], c["fc_workers"]) == (best["layout"], best["fc_workers"])
    assert s["model"] == "vgg16"
    assert result["ranks"][0]["layout_auto_run"]["choice"] == c


@pytest.mark.mpi
@pytest.mark.parametrize("np_,mode", [(2, "atexit"), (3, "close"), (4, "atexit")])
def test_a_rank_that_ends_early_does_not_end_the_others_process_sets(np_, mode):
    """The FC rank ends (Layout.close, or the exit hook) before the CONV ranks run 50 allreduces
    on their process set: every sum is right (before the fix: "Process set provided does not
    exist", as Horovod's shutdown on one rank stops every rank's process sets)."""
    from conftest import mpi_result

    res = mpi_result(np_, ["tests/mpi/check_hourglass_exit.py", mode], timeout=300)
    assert res["mode"] == mode and len(res["conv"]) == np_ - 1
    for r in res["conv"]:
        assert r["error"] is None and r["count"] == 50 and r["ok"], r
