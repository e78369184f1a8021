"""compression.index_coding: elias_fano is the default (session 10; it was fixed before).

* Every entry point agrees: the config of a sparse method (``hgsgc train``, ``hgsgc plan``, ``layout:
  auto``'s model, the Hourglass CONV and FC sides), ``Compression.topk/sgc/dgc``, ``SparseCompression``,
  ``TopKCodec``; the bytes each charges are the Elias-Fano formula (tests/reference.py, written
  independently of hgsgc); ``fixed`` stays selectable everywhere and is accepted with any method
  (committed bench specs pin it for every cell).
* Resume across codings: the coding is lossless and stateless, so a checkpoint of either coding (and
  one written before the setting existed) resumes under the other; ``hgsgc train`` on 2 and 3 ranks,
  checkpointed with ``fixed`` at step 6 and resumed with the default, ends at step 10 with every rank's
  state bit for bit that of the uninterrupted ``fixed`` run (only the byte counters differ).
* A coding that differs ACROSS RANKS of one job (one rank left at the default, another passing
  ``fixed``) still stops every rank with one error naming the setting and both values.
"""
import math
import os
import shutil
import subprocess

import numpy as np
import pytest

import reference as ref
from hgsgc import checkpoint as ckpt
from hgsgc.compression import DEFAULT_INDEX_CODING, Compression, SparseCompression
from hgsgc.compression.codec import TopKCodec
from hgsgc.config import (ConfigError, compression_from_config, fc_compression_from_config, load_config,
                          resolved_index_coding)

EF = "elias_fano"
SGC = "configs/fashion_mnist_sgc.yaml"
DENSE = "configs/fashion_mnist_dense.yaml"
HOURGLASS = "configs/cifar10_vgg16/hourglass_sgc.yaml"
SHAPES = [(40, 30), (17,), (3, 3, 2, 5), (90, 7), (3136, 512)]


def _formula(shapes, density, bits, coding):
    return sum(ref.payload_length(math.prod(s), ref.k_for(math.prod(s), density), bits, coding) for s in shapes)


# ------------------------------------------------------------------ every entry point agrees
def test_the_library_settings_default_to_elias_fano_and_fixed_stays_selectable():
    assert DEFAULT_INDEX_CODING == EF
    for s in (Compression.sgc(0.005), Compression.topk(0.01), Compression.dgc(0.01),
              SparseCompression(0.01), Compression.sgc(0.005, hierarchy="tree", delay=4)):
        assert s.index_coding == EF and s.codec().index_coding == EF and s.to_dict()["index_coding"] == EF
    assert TopKCodec(0.01, 2).index_coding == EF
    for s, bits in ((Compression.sgc(0.005), 2), (Compression.topk(0.01), 32), (Compression.dgc(0.01), 32)):
        assert s.payload_bytes(SHAPES) == _formula(SHAPES, s.density, bits, EF)
        fixed = type(s)(**dict(s.to_dict(), index_coding="fixed"))
        assert fixed.payload_bytes(SHAPES) == _formula(SHAPES, s.density, bits, "fixed")
        assert s.payload_bytes(SHAPES) < fixed.payload_bytes(SHAPES)


@pytest.mark.parametrize("method,bits", [("sgc", 2), ("topk", 32), ("dgc", 32)])
def test_a_config_of_a_sparse_method_gets_elias_fano_without_asking(method, bits):
    """compression.method=sgc (or topk, dgc) and nothing else: the run's config says elias_fano, the
    setting codes with it, hgsgc plan's candidates and their byte figures follow it."""
    from hgsgc import perfmodel as pm
    from hgsgc.plan import method_row, plan_candidates

    cfg = load_config(SGC, [f"compression.method={method}", "compression.delay=1"])
    assert cfg.compression.index_coding == EF == resolved_index_coding(cfg.compression)
    comp = compression_from_config(cfg.compression)
    assert comp.index_coding == EF and comp.payload_bytes(SHAPES) == _formula(SHAPES, 0.005, bits, EF)
    zero = {"base_s": 0.0, "per_payload_s": 0.0}
    for label, c in plan_candidates(cfg):
        if isinstance(c, SparseCompression):
            assert c.index_coding == EF, label
            row = method_row(label, c, SHAPES, 4, pm.link_for("100mbit"), 0.01, zero, 0.005)
            assert row["payload_bytes"] == _formula(SHAPES, c.density, c.bits, EF), label
    # fixed stays selectable: the setting, and plan's sparse candidates with it
    cfg = load_config(SGC, [f"compression.method={method}", "compression.delay=1", "compression.index_coding=fixed"])
    assert compression_from_config(cfg.compression).payload_bytes(SHAPES) == _formula(SHAPES, 0.005, bits, "fixed")
    assert {c.index_coding for _, c in plan_candidates(cfg) if isinstance(c, SparseCompression)} == {"fixed"}


def test_the_hourglass_conv_and_fc_sides_and_layout_auto_get_it_too():
    cfg = load_config(HOURGLASS, ["hourglass.fc_method=sgc"])
    assert compression_from_config(cfg.compression).index_coding == EF          # CONV side
    assert fc_compression_from_config(cfg).index_coding == EF                   # FC side
    # a dense CONV side with a sparse FC side (the FC ranks code top-k payloads)
    cfg = load_config(HOURGLASS, ["compression.method=fp16", "compression.momentum_correction=false",
                                  "hourglass.fc_method=topk"])
    assert cfg.compression.index_coding == EF and fc_compression_from_config(cfg).index_coding == EF
    cfg = load_config(HOURGLASS, ["layout=auto", "hourglass.fc_method=sgc", "compression.index_coding=fixed"])
    assert compression_from_config(cfg.compression).index_coding == "fixed"
    assert fc_compression_from_config(cfg).index_coding == "fixed"


def test_dense_methods_accept_fixed_and_refuse_an_explicit_elias_fano():
    for method in ("none", "fp16", "powersgd", "terngrad"):
        cfg = load_config(DENSE, [f"compression.method={method}"])
        assert cfg.compression.index_coding is None  # nothing to code
        assert load_config(DENSE, [f"compression.method={method}", "compression.index_coding=fixed"])
        with pytest.raises(ConfigError, match="compression.index_coding='elias_fano' is invalid: codes the "
                                              "indices of top-k payloads: needs method topk, sgc or dgc"):
            load_config(DENSE, [f"compression.method={method}", "compression.index_coding=elias_fano"])
    with pytest.raises(ConfigError, match="compression.index_coding='delta'.*elias_fano \\(default\\) or fixed"):
        load_config(SGC, ["compression.index_coding=delta"])


# ------------------------------------------------------------------ resume across codings
def _run(coding):
    return {"world_size": 2, "model": "tiny", "compression": Compression.sgc(0.01, delay=4, index_coding=coding).to_dict()}


def test_a_checkpoint_of_either_coding_resumes_under_the_other(tmp_path):
    """Also one written before index_coding existed (its compression dict lacks the key)."""
    assert "index_coding" in ckpt.SCHEDULE_ONLY_SETTINGS
    old = _run("fixed")
    del old["compression"]["index_coding"]
    for name, saved, now in (("fixed", _run("fixed"), _run(EF)), ("ef", _run(EF), _run("fixed")),
                             ("before_s9", old, _run(EF))):
        d = str(tmp_path / name)
        ckpt.save(d, 6, {"w": np.arange(3.0)}, saved)
        assert ckpt.resolve(d, "auto", now)[0] == ckpt.step_dir(d, 6)
        assert ckpt.describe_differences(saved, now) == []
    # any other compression setting still refuses, naming the key
    d = str(tmp_path / "density")
    ckpt.save(d, 6, {"w": np.arange(3.0)}, _run("fixed"))
    other = dict(_run(EF), compression=Compression.sgc(0.02, delay=4).to_dict())
    with pytest.raises(ckpt.CheckpointMismatch, match='compression differs in density: 0.01 in the checkpoint, '
                                                       '0.02 in this run'):
        ckpt.resolve(d, "auto", other)


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_train_checkpointed_with_fixed_resumes_with_the_default_bit_exact(np_, tmp_path):
    """hgsgc train, SGC delay 4 (2-bit, the checkpoint at step 6 falls between the syncs of steps 4
    and 8): run a with compression.index_coding=fixed for 10 steps (checkpoints at 6 and 10); run b
    starts from a's step-6 checkpoint with no coding given (the default, elias_fano). Every leaf of
    every rank's step-10 state (weights, optimizer slots, residuals, anchors, counters) equals a's bit
    for bit, except the byte counters: b sent elias_fano payloads for its 4 steps."""
    from ckpt_compare import compare
    from conftest import MPIRUN, PY, ROOT

    base = [SGC, "model.name=tiny", "data.train_limit=2000", "data.test_limit=200", "train.epochs=2",
            "train.max_steps_per_epoch=5", "train.progress=false", "train.deterministic=true",
            "checkpoint.keep=20", "train.threads=1", "compression.density=0.05"]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", OMPI_MCA_mpi_yield_when_idle="1")

    def train(run_id, extra):
        cmd = (MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", "-x",
                         "OMPI_MCA_mpi_yield_when_idle", PY, "-m", "hgsgc.cli", "train"] + base
               + [f"run.out_dir={tmp_path}", f"run.id={run_id}"] + extra)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return p

    a_out = train("a", ["compression.index_coding=fixed", "checkpoint.every_steps=6"])
    assert "'index_coding': 'fixed'" in a_out.stdout, a_out.stdout[-2000:]
    a = tmp_path / "a" / "checkpoints"
    os.makedirs(tmp_path / "b" / "checkpoints")
    shutil.copytree(a / "step-00000006", tmp_path / "b" / "checkpoints" / "step-00000006")
    p = train("b", [])
    assert "resuming from" in p.stdout and "(step 6)" in p.stdout, p.stdout[-2000:]
    assert "'index_coding': 'elias_fano'" in p.stdout, p.stdout[-2000:]
    n, diffs = compare(str(a / "step-00000010"), str(tmp_path / "b" / "checkpoints" / "step-00000010"))
    assert n >= 20 * np_, n
    assert diffs and {d.rsplit("/", 1)[-1] for d in diffs} <= {"payload_bytes", "bytes_sent", "bytes_received"}, diffs


# ------------------------------------------------------------------ ranks that disagree
@pytest.mark.mpi
@pytest.mark.parametrize("np_,entry", [(2, "optimizer"), (3, "tape")])
def test_one_rank_passing_fixed_against_the_default_stops_every_rank_naming_it(np_, entry):
    """The other ranks leave index_coding out (the default, elias_fano); the last rank passes fixed:
    the first step's cross-rank check names the setting, both values and the ranks (one line)."""
    from conftest import mpirun

    p = mpirun(np_, ["tests/mpi/brk9_mixed_compression.py", entry, "index_coding_default"], timeout=240,
               env={"OMPI_MCA_mpi_yield_when_idle": "1"})
    assert p.returncode != 0 and "UNREACHABLE" not in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    got = [ln for ln in p.stderr.splitlines() if "hgsgc: error" in ln]
    assert len(got) == 1, p.stderr[-3000:]
    assert (f"compression differs between ranks: index_coding 'elias_fano' on rank 0 but 'fixed' on rank "
            f"{np_ - 1}: pass the same compression on every rank") in got[0], got[0]
