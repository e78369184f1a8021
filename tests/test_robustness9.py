"""Session 9 break-it tests (brk9): what landed this session, used as a user or an MPI job would.

* ``hgsgc bench`` ``cells_from``: a committed results JSON whose cells do not fit the spec (a failed
  cell, cells at another host count / bandwidth, cells of another configuration) is refused with one
  error naming the file, the cell and the fix, never read into a silently wrong table.
"""
import json

import pytest

from conftest import mpi_cases
from hgsgc import bench

MPI_CASES = mpi_cases("tests/mpi/brk9_ef_matrix.py", ranks=[3], timeout=400)


# ------------------------------------------------------------------ hgsgc bench cells_from
def _ok_cell(method, step_s, config="configs/cifar10_vgg16/dense.yaml", hosts=4, bw="100mbit"):
    return {"method": method, "role": "other", "status": "ok", "hosts": hosts, "bandwidth": bw,
            "bandwidth_mbit": float(bw[:-4]) if bw.endswith("mbit") else 1000.0, "config": config,
            "mean_step_time_s": step_s, "eval_time_s": 2.0, "time_per_epoch_s": step_s and step_s * 10,
            "final_test_accuracy": 0.5, "load_before": [3.0, 1.0, 1.0], "error": None,
            "bytes_sent_per_step_per_rank": 1000.0, "iface_tx_bytes_per_step_per_rank": 1100.0,
            "compression_ratio": 10.0}


def _cells_spec(tmp_path, cells, **extra):
    path = tmp_path / "stored.json"
    path.write_text(json.dumps({"name": "stored", "cells": cells}))
    return str(path), dict({
        "name": "cf", "hosts": [4], "bandwidths": ["100mbit"], "compute_only": False,
        "out_dir": str(tmp_path / "out"), "runs_dir": str(tmp_path / "runs"), "cells_from": str(path),
        "methods": [{"name": "fp16", "config": "configs/cifar10_vgg16/dense.yaml", "role": "dense"},
                    {"name": "topk", "config": "configs/cifar10_vgg16/dense.yaml", "role": "baseline"}]},
        **extra)


def test_cells_from_reads_the_matching_cells(tmp_path):
    """The good case still works: both cells read, with their stored step times."""
    path, spec = _cells_spec(tmp_path, [_ok_cell("fp16", 0.7), _ok_cell("topk", 0.08)])
    res = bench.run_matrix(bench.load_spec(spec), log=lambda s: None)
    assert [(c["method"], c["mean_step_time_s"]) for c in res["cells"]] == [("fp16", 0.7), ("topk", 0.08)]


def test_cells_from_refuses_a_failed_cell(tmp_path):
    """A stored cell that failed gave a table with a '**failed**' row and a time-to-target of
    ``{'error': "'bandwidth_mbit'"}`` (or a KeyError): now one SpecError naming file, cell, fix."""
    bad = dict(_ok_cell("topk", None), status="failed", error="timeout after 600 s")
    path, spec = _cells_spec(tmp_path, [_ok_cell("fp16", 0.7), bad])
    with pytest.raises(bench.SpecError, match=r"\(topk\)\.cells: cell topk .*in " + path.replace(".", r"\.")
                       + r" failed \(timeout after 600 s\).*rerun it or name another cell"):
        bench.load_spec(spec)


@pytest.mark.parametrize("where", [{"hosts": 8}, {"bw": "10mbit"}])
def test_cells_from_refuses_cells_of_other_hosts_or_bandwidths(tmp_path, where):
    """The spec's hosts / bandwidths were ignored: cells measured on 8 hosts or at 10 Mbit/s were
    read into a '4 hosts, 100mbit' spec silently. Now: one error naming what the file has."""
    path, spec = _cells_spec(tmp_path, [_ok_cell("fp16", 0.7, **where), _ok_cell("topk", 0.08, **where)])
    with pytest.raises(bench.SpecError, match=r"\(fp16\)\.cells: no cell fp16 on 4 hosts at 100mbit in "
                       + path.replace(".", r"\.") + r" \(it has fp16 on: (8 hosts at 100mbit|4 hosts at 10mbit)\)"):
        bench.load_spec(spec)


def test_cells_from_reads_only_the_spec_hosts_and_bandwidths(tmp_path):
    """A file with cells at two bandwidths: a spec naming one of them reads only that one."""
    cells = [_ok_cell("fp16", 0.7), _ok_cell("topk", 0.08), _ok_cell("fp16", 5.0, bw="10mbit"),
             _ok_cell("topk", 0.5, bw="10mbit")]
    path, spec = _cells_spec(tmp_path, cells, bandwidths=["10mbit"])
    res = bench.run_matrix(bench.load_spec(spec), log=lambda s: None)
    assert [(c["method"], c["bandwidth"], c["mean_step_time_s"]) for c in res["cells"]] == [
        ("fp16", "10mbit", 5.0), ("topk", "10mbit", 0.5)]


def test_cells_from_refuses_cells_of_another_configuration(tmp_path):
    """A results JSON of another spec (the cell ran another config file) was read silently."""
    path, spec = _cells_spec(tmp_path, [_ok_cell("fp16", 0.7),
                                        _ok_cell("topk", 0.08, config="configs/ptb_lstm/dense.yaml")])
    with pytest.raises(bench.SpecError, match=r"\(topk\)\.cells: cell topk in " + path.replace(".", r"\.")
                       + r" ran configs/ptb_lstm/dense\.yaml, not configs/cifar10_vgg16/dense\.yaml"):
        bench.load_spec(spec)


# ------------------------------------------------------------------ compression differing across ranks
@pytest.mark.mpi
@pytest.mark.parametrize("np_,entry,field", [(2, "optimizer", "index_coding"), (3, "tape", "density"),
                                             (2, "optimizer", "momentum")])
def test_a_compression_that_differs_across_ranks_stops_every_rank_naming_it(np_, entry, field):
    """hgsgc.DistributedOptimizer / DistributedGradientTape built with another compression on one
    rank (index_coding elias_fano there, or another density) ended in an internal
    'HgsgcDecodeAccumulate: payload of rank 1: entry 2 has index 3 (indices must be strictly
    ascending)' or a Reshape error on each rank (and a payload of equal length could decode to a
    wrong average). The first step's cross-rank check now compares the compression settings too:
    one line naming the setting, both values and the ranks. ``momentum`` (session 13): DGC's
    correction momentum, taken from the wrapped SGD, was not compared by the optimizer (0.9 and 0.8
    trained silently; the tape compared its ``momentum=``)."""
    from conftest import mpirun

    p = mpirun(np_, ["tests/mpi/brk9_mixed_compression.py", entry, field], timeout=240)
    assert p.returncode != 0 and "UNREACHABLE" not in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    got = [ln for ln in p.stderr.splitlines() if "hgsgc: error" in ln]
    assert len(got) == 1, p.stderr[-3000:]
    want = {"index_coding": "index_coding 'fixed' on rank 0 but 'elias_fano' on rank ",
            "density": "density 0.5 on rank 0 but 0.25 on rank ",
            "momentum": "momentum 0.9 on rank 0 but 0.8 on rank "}[field] + f"{np_ - 1}"
    assert f"compression differs between ranks: {want}" in got[0], got[0]
    assert "pass the same compression on every rank" in got[0], got[0]


# ------------------------------------------------------------------ Elias-Fano index coding (held)
@pytest.mark.mpi
def test_elias_fano_equals_fixed_for_every_sparse_method_and_hierarchy_on_3_ranks(mpi_batch):
    """Top-k (fp32 and 2-bit), DGC and SGC (2-bit and fp32) over allgather with buckets=2, tree and
    node (uneven emulated hosts 2+1), numel 1 / 5 / 17 / 1001, density 0.05 and 1.0 (k == numel):
    with elias_fano every average and residual equals fixed coding's bit for bit, with the C++
    kernels and with the pure-TF reference alike, on every rank; payload bytes are the formula
    (wire.payload_length per tensor, per exchange); the flat allgather sends (n - 1) P. DGC's
    warm-up of sparsity through the optimizer (k changes between steps): the same weights with
    either coding and payload bytes = the sum over steps of each step's formula."""
    out = mpi_batch.result(3, "tests/mpi/brk9_ef_matrix.py")
    steps = 2
    for per_rank in out["ranks"]:
        assert len(per_rank) == 7
        warm = per_rank.pop()  # DGC warm-up through the optimizer: density 0.25, 0.0625, 0.01, 0.01
        assert warm["case"] == ["dgc_warmup"] and warm["diff"] == 0.0, warm
        assert warm["payload"] == warm["P"] and warm["P"]["elias_fano"] < warm["P"]["fixed"], warm
        for c in per_rank:
            method, bits, hier, buckets, density = c["case"]
            assert c["diff"] == {"custom/fixed": 0.0, "custom/elias_fano": 0.0, "reference/fixed": 0.0,
                                 "reference/elias_fano": 0.0}, c
            assert c["spread"] == 0.0, c
            for key, got in c["payload"].items():
                assert got == steps * c["P"][key.split("/")[1]], (c["case"], key, got, c["P"])
            if hier == "allgather":
                for key, got in c["sent"].items():
                    assert got == steps * 2 * c["P"][key.split("/")[1]], (c["case"], key, got)
            if density == 1.0 or bits == 2:
                assert c["P"]["elias_fano"] < c["P"]["fixed"], c


def test_elias_fano_on_a_tensor_of_more_than_2_24_entries():
    """numel = 2^24 + 3 (indices past float32's exact integers, l = 22 low bits): the fused C++
    compress and the pure-TF reference give the same payload bytes, of the formula's length, and
    both decoders give back the same entries (decode_accumulate of two copies = 2 x the entries).
    (Bit offsets: the C++ code keeps them in int64 / uint64; H = k + ((numel-1) >> l) < 3k and
    k l < 2^31 for every numel < 2^31, so no 32-bit overflow there; the pure-TF reference's int32
    positions would need k >= 2^31 / 3 entries.)"""
    import numpy as np
    import tensorflow as tf

    from hgsgc.compression import kernels, wire

    numel, k = (1 << 24) + 3, 3
    g = np.zeros(numel, np.float32)
    want = np.array([7, (1 << 24) + 1, (1 << 24) + 2])
    g[want] = [3.0, -5.0, 4.0]
    assert wire.ef_low_bits(numel, k) == 22
    p_c, _ = kernels.compress(g, None, k, 32, backend="custom", index_coding="elias_fano")
    p_r, _ = kernels.compress(g, None, k, 32, backend="reference", index_coding="elias_fano")
    assert p_c.shape[0] == wire.payload_length(numel, k, 32, "elias_fano") == 9 + 1 + 12  # ceil(3*22/8) + ceil((3 + 4)/8) + 4k
    assert np.array_equal(p_c.numpy(), p_r.numpy())
    idx, vals = wire.decode(p_c, numel, k, 32, "elias_fano")
    assert idx.numpy().tolist() == want.tolist() and vals.numpy().tolist() == [3.0, -5.0, 4.0]
    rows = tf.stack([p_c, p_r])
    for backend in ("custom", "reference"):
        s = kernels.decode_accumulate(rows, numel, k, 32, backend=backend, index_coding="elias_fano").numpy()
        assert np.flatnonzero(s).tolist() == want.tolist() and s[want].tolist() == [6.0, -10.0, 8.0]


# ------------------------------------------------------------------ resume with another compression setting
def test_resume_with_another_compression_setting_is_refused_naming_the_key(tmp_path):
    """A checkpoint written with one compression setting, resumed with another, is refused
    (hgsgc train, 2 ranks, by hand: 'CheckpointMismatch: ... compression: checkpoint {13 keys},
    this run {13 keys}' - the one key that differs was left to the reader to find). The message
    now names it: 'compression differs in density: 0.01 in the checkpoint, 0.02 in this run'.
    (Found with index_coding fixed -> elias_fano; since session 10 the coding, lossless and
    stateless, is one of checkpoint.SCHEDULE_ONLY_SETTINGS and such a resume is allowed:
    tests/test_index_coding_default.py.)"""
    import numpy as np

    from hgsgc import checkpoint as ckpt
    from hgsgc.compression import Compression

    for saved, now in ((0.01, 0.02), (0.02, 0.01)):
        d = str(tmp_path / str(saved))
        run = {"world_size": 2, "model": "tiny", "compression": Compression.dgc(saved).to_dict()}
        ckpt.save(d, 3, {"w": np.zeros(3)}, run)
        other = dict(run, compression=Compression.dgc(now).to_dict())
        with pytest.raises(ckpt.CheckpointMismatch) as ei:
            ckpt.resolve(d, "auto", other)
        msg = str(ei.value)
        assert f'compression differs in density: {saved} in the checkpoint, {now} in this run' in msg, msg
        assert "compression: checkpoint {" in msg  # the whole settings still follow
        assert ckpt.resolve(d, "auto", run)[0] == ckpt.step_dir(d, 3)
