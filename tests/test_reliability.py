"""Checkpoint module (single process): round trips, atomicity, refusal of other runs, I/O errors.

Multi-rank behaviour (bit-exact resume, preemption, faults) is in test_reliability_mpi.py.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conftest import PY, ROOT
from hgsgc import checkpoint as ckpt

RUN = {"world_size": 1, "layout": "data_parallel", "model": "tiny",
       "parameters": {"w:0": [3, 4], "b:0": [4]}, "compression": {"method": "sgc", "delay": 4}}

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_]


def _same(a, b):
    """Exact structural + bitwise equality of two state trees."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (np.ndarray, np.generic)):
        return (type(a) is type(b) and a.dtype == b.dtype and np.shape(a) == np.shape(b)
                and np.asarray(a).tobytes() == np.asarray(b).tobytes())
    if isinstance(a, float):
        return isinstance(b, float) and a.hex() == b.hex()
    return type(a) is type(b) and a == b


arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)))
leaves = st.one_of(arrays, st.integers(), st.floats(allow_nan=True), st.booleans(), st.none(),
                   st.text(max_size=8))
trees = st.recursive(leaves, lambda ch: st.one_of(
    st.lists(ch, max_size=4), st.dictionaries(st.text(max_size=6), ch, max_size=4),
    st.tuples(ch, ch)), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_tree_round_trip_is_exact(tree):
    """Property: any tree of arrays (all dtypes, empty and 0-d included), ints, floats (NaN,
    inf, -0.0), bools, None and strings survives save/load bit for bit."""
    back = ckpt.tree_from_bytes(ckpt.tree_to_bytes(tree))
    assert _same(tree, back)


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=6), arrays, min_size=1, max_size=4),
       st.integers(0, 10**12))
def test_checkpoint_round_trip_on_disk(tmp_path_factory, state, step):
    d = str(tmp_path_factory.mktemp("ck"))
    path = ckpt.save(d, step, {"opt": state, "step": step}, RUN)
    assert ckpt.latest(d) == path
    man = ckpt.verify(path, hashes=True)
    assert man["step"] == step and man["world_size"] == 1 and man["run"] == RUN
    assert _same(ckpt.load_rank(path, man, 0), {"opt": state, "step": step})


def test_no_pickle_object_arrays_refused_and_not_loaded(tmp_path):
    with pytest.raises(TypeError, match="object arrays"):
        ckpt.tree_to_bytes({"x": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(TypeError, match="unsupported leaf type set"):
        ckpt.tree_to_bytes({"x": {1, 2}})
    # a crafted .npz holding a pickled object array is refused at load (allow_pickle=False)
    import io

    buf = io.BytesIO()
    np.savez(buf, __tree__=np.frombuffer(json.dumps({"t": "array", "k": "a0"}).encode(), np.uint8),
             a0=np.array([object()], dtype=object))
    with pytest.raises(ckpt.CheckpointError, match="not a readable hgsgc state file"):
        ckpt.tree_from_bytes(buf.getvalue())


def test_manifest_written_last_and_incomplete_folders_ignored(tmp_path):
    d = str(tmp_path)
    first = ckpt.save(d, 10, {"w": np.arange(4.0)}, RUN)
    # a writer killed half-way through step 20: its rank file is there, the manifest is not
    os.makedirs(ckpt.step_dir(d, 20))
    with open(os.path.join(ckpt.step_dir(d, 20), "rank-00000.npz"), "wb") as f:
        f.write(b"PK\x03\x04 half a file")
    assert ckpt.latest(d) == first
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.read_manifest(ckpt.step_dir(d, 20))
    # a manifest whose file was truncated afterwards does not count either
    second = ckpt.save(d, 30, {"w": np.arange(5.0)}, RUN)
    fp = os.path.join(second, "rank-00000.npz")
    with open(fp, "r+b") as f:
        f.truncate(10)
    assert ckpt.latest(d) == first
    man = ckpt.read_manifest(second)
    with pytest.raises(ckpt.CheckpointError, match="has 10 bytes"):
        ckpt.verify(second, man)


def test_corrupt_rank_file_fails_sha256(tmp_path):
    path = ckpt.save(str(tmp_path), 1, {"w": np.arange(64.0)}, RUN)
    fp = os.path.join(path, "rank-00000.npz")
    data = bytearray(open(fp, "rb").read())
    data[-40] ^= 0xFF  # same size, one flipped byte
    open(fp, "wb").write(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="SHA-256"):
        ckpt.load_rank(path, ckpt.read_manifest(path), 0)


def test_keep_prunes_old_checkpoints(tmp_path):
    d = str(tmp_path)
    for s in (1, 2, 3, 4):
        ckpt.save(d, s, {"s": s}, RUN, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(d)] == [4, 3]


@pytest.mark.parametrize("field,value,words", [
    ("world_size", 3, ["rank count: checkpoint 1, this run 3"]),
    ("model", "alexnet_small", ['model: checkpoint "tiny", this run "alexnet_small"']),
    ("compression", {"method": "dgc", "delay": 1}, ["compression: checkpoint", '"method": "sgc"',
                                                    '"method": "dgc"']),
    ("parameters", {"w:0": [3, 5], "b:0": [4]}, ["parameter shapes differ (w:0: [3, 4] vs [3, 5])"]),
    ("layout", "hourglass", ['layout: checkpoint "data_parallel", this run "hourglass"']),
])
def test_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path, field, value, words):
    d = str(tmp_path)
    ckpt.save(d, 5, {"w": np.zeros(3)}, RUN)
    other = dict(RUN, **{field: value})
    with pytest.raises(ckpt.CheckpointMismatch) as ei:
        ckpt.resolve(d, "auto", other)
    for w in words:
        assert w in str(ei.value), str(ei.value)
    assert ckpt.resolve(d, "auto", RUN)[0] == ckpt.step_dir(d, 5)
    assert ckpt.resolve(d, "never", other) is None
    assert ckpt.resolve(str(tmp_path / "empty"), "auto", RUN) is None


def test_unwritable_folder_is_a_clear_error_and_previous_checkpoint_intact(tmp_path):
    d = tmp_path / "ck"
    first = ckpt.save(str(d), 1, {"w": np.arange(3.0)}, RUN)
    before = {f: open(os.path.join(first, f), "rb").read() for f in os.listdir(first)}
    # the folder is replaced by a file: nothing can be created under it (also as root)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ckpt.CheckpointError, match=r"cannot create checkpoint folder .*Fix: make "
                                                    r"checkpoint.dir writable"):
        ckpt.save(str(blocker / "sub"), 2, {"w": np.arange(3.0)}, RUN)
    # inside the same folder: the new checkpoint's folder name is taken by a file
    (d / "step-00000002").write_text("not a folder")
    with pytest.raises(ckpt.CheckpointError, match=r"cannot create checkpoint folder .*"
                                                    r"the previous checkpoint .*step-00000001 is intact"):
        ckpt.save(str(d), 2, {"w": np.arange(3.0)}, RUN)
    os.unlink(d / "step-00000002")
    if os.geteuid() != 0:  # permissions bind only non-root users
        os.chmod(d, 0o500)
        try:
            with pytest.raises(ckpt.CheckpointError, match="previous checkpoint .* is intact"):
                ckpt.save(str(d), 2, {"w": np.arange(3.0)}, RUN)
        finally:
            os.chmod(d, 0o700)
    assert ckpt.latest(str(d)) == first
    assert {f: open(os.path.join(first, f), "rb").read() for f in os.listdir(first)} == before


FULL_DISK = r"""
import resource, signal, sys, os
import numpy as np
from hgsgc import checkpoint as ckpt
d = sys.argv[1]
run = {"world_size": 1}
first = ckpt.save(d, 1, {"w": np.arange(10.0)}, run)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # writes past the limit fail with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # a "full disk": 4 KiB per file
try:
    ckpt.save(d, 2, {"w": np.arange(100000.0)}, run)
except ckpt.CheckpointError as exc:
    print("ERROR", exc)
print("LATEST", ckpt.latest(d))
print("LEFT", sorted(os.listdir(ckpt.step_dir(d, 2))))
"""


def test_full_disk_is_a_clear_error_and_previous_checkpoint_intact(tmp_path):
    p = subprocess.run([PY, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "ERROR checkpoint failed on rank 0: cannot write" in out and "rank-00000.npz: File too large (errno 27)" in out, out
    assert f"the previous checkpoint {ckpt.step_dir(str(tmp_path), 1)} is intact" in out
    assert f"LATEST {ckpt.step_dir(str(tmp_path), 1)}" in out
    assert "LEFT []" in out  # the temporary file was removed, no manifest


def test_preemption_flags_agree_in_one_process(capfd):
    import signal

    from hgsgc.faults import StepAgreement

    ag = StepAgreement(None, every_minutes=0.0)
    try:
        assert ag.after_step() == (None, False)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ag.after_step() == ("SIGUSR1", False)
    finally:
        ag.close()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    # announced on stderr when it arrives (a job log shows each rank's receipt)
    assert capfd.readouterr().err == ("hgsgc: rank 0: SIGUSR1 received; every rank checkpoints after "
                                      "the step the ranks agree on, then exits 75\n")


def test_config_checkpoint_and_fault_keys_validated():
    from hgsgc.config import ConfigError, load_config

    cfg = load_config(None, ["checkpoint.every_steps=5", "checkpoint.resume=never",
                             "faults.nonfinite=raise", "faults.stall_timeout_s=30"])
    assert cfg.checkpoint.every_steps == 5 and cfg.faults.nonfinite == "raise"
    # YAML reads an unquoted off as false: both spellings mean off
    assert load_config(None, ["faults.nonfinite=off"]).faults.nonfinite == "off"
    assert load_config(None, ["faults.nonfinite='off'"]).faults.nonfinite == "off"
    for bad, words in (("checkpoint.keep=0", "checkpoint.keep"),
                       ("faults.nonfinite=ignore", "faults.nonfinite"),
                       ("checkpoint.every_minutes=-1", "checkpoint.every_minutes")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, [bad])


def test_sparsity_warmup_shorter_than_delay_is_refused():
    """Warm-up stages last warmup_steps // 4 steps; with fewer steps than the delay a stage may
    see no synchronization, so its density never reaches an exchange: refused, naming the fix."""
    from hgsgc.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"compression.warmup_steps=8 .*delay=4.*warmup_steps >= 16"):
        load_config(None, ["compression.method=sgc", "compression.delay=4",
                           "compression.warmup_steps=8"])
    cfg = load_config(None, ["compression.method=sgc", "compression.delay=4",
                             "compression.warmup_steps=16"])
    from hgsgc.train import density_schedule

    sched = density_schedule(cfg.compression)
    # every stage of >= delay consecutive steps holds a sync step (a multiple of the delay)
    stage = [sched(s) for s in range(16)]
    for dens in set(stage):
        steps = [s + 1 for s, x in enumerate(stage) if x == dens]  # local step after the step
        assert any(s % 4 == 0 for s in steps), (dens, steps)


def test_timed_checkpoint_flag_follows_rank0_clock(monkeypatch):
    """checkpoint.every_minutes: rank 0's clock raises the flag once per period (fake clock)."""
    from hgsgc import faults

    now = [1000.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: now[0])
    ag = faults.StepAgreement(None, every_minutes=2.0, install=False)
    assert ag.after_step() == (None, False)
    now[0] += 119.0
    assert ag.after_step() == (None, False)
    now[0] += 1.0
    assert ag.after_step() == (None, True)   # 120 s after the start
    assert ag.after_step() == (None, False)  # the period restarts
    now[0] += 120.0
    assert ag.after_step() == (None, True)


@pytest.mark.parametrize("bitgen", [np.random.PCG64, np.random.MT19937])
def test_boundary_codec_generator_state_round_trips_through_a_checkpoint(bitgen):
    """The Hourglass stochastic-rounding generator: its state survives the checkpoint tree (no
    pickle), the restored generator draws the same numbers, and the q4 codec's payload with it is
    byte-identical; another bit generator's state is refused naming both."""
    from hgsgc.hourglass.boundary import BoundaryCodec, generator_state, set_generator_state

    rng = np.random.Generator(bitgen(7))
    rng.random(13)  # advance (PCG64 also caches a 32-bit half after an odd uint32 draw)
    rng.integers(0, 2**32, 3, dtype=np.uint32)
    saved = generator_state(rng)
    data = ckpt.tree_to_bytes({"rng": saved})
    back = ckpt.tree_from_bytes(data)["rng"]
    x = np.random.default_rng(1).standard_normal((6, 5)).astype(np.float32)
    codec = BoundaryCodec.parse("sparse+q4")
    want = codec.encode(np.maximum(x, 0), rng)
    other = np.random.Generator(bitgen(99))
    set_generator_state(other, back)
    assert codec.encode(np.maximum(x, 0), other).tobytes() == want.tobytes()
    assert other.random(5).tobytes() == rng.random(5).tobytes()
    wrong = np.random.Generator(np.random.Philox(0))
    with pytest.raises(ValueError, match=f"{bitgen.__name__}.*Philox"):
        set_generator_state(wrong, back)


def test_wait_for_peers_deadline_names_the_pending_peer():
    """One process: a receive nobody sends raises StallError naming its peer and the setting
    once the deadline passes; completed requests return; a timeout of 0 is a plain Waitall."""
    from mpi4py import MPI

    from hgsgc.faults import StallError, wait_for_peers

    comm = MPI.COMM_SELF
    buf = np.zeros(3)
    send = comm.Isend(np.arange(3.0), dest=0, tag=5)
    wait_for_peers([comm.Irecv(buf, source=0, tag=5), send], [0, 0], "x", 30.0)
    assert buf.tolist() == [0.0, 1.0, 2.0]
    never = comm.Irecv(np.zeros(1), source=0, tag=6)
    with pytest.raises(StallError, match=r"waited 0.2 s for activations \(step 3\); rank 0 did "
                       r"not answer: .*\(faults.stall_timeout_s=0.1\)") as e:
        wait_for_peers([never], [0], "activations (step 3)", 0.2, setting_s=0.1)
    assert e.value.peers == [0]
    never.Cancel()
    never.Wait()
    wait_for_peers([comm.Isend(np.zeros(1), dest=0, tag=7), comm.Irecv(np.zeros(1), source=0, tag=7)],
                   [0, 0], "y", 0)


def test_error_lines_group_ranks_and_leave_out_consequences():
    """report_error's printer: one line per distinct message with its ranks; a stall that waited
    only for ranks that failed themselves is a consequence and is left out; a Horovod stall
    shutdown names the ranks that reported nothing."""
    from hgsgc.faults import _error_lines

    stall0 = "StallError: waited 6 s for activations; rank 0 did not answer"
    stall2 = "StallError: waited 9 s for activation gradients; rank 2 did not answer"
    assert _error_lines({2: stall0, 1: stall2}, 3, {2: [0], 1: [2]}) == \
        [f"hgsgc: error on rank 2: {stall0}"]
    assert _error_lines({0: stall2, 1: stall2}, 3, {0: [2], 1: [2]}) == \
        [f"hgsgc: error on ranks 0,1: {stall2}"]
    assert _error_lines({0: "E: a", 1: "E: a", 2: "E: b"}, 3) == \
        ["hgsgc: error on ranks 0,1: E: a", "hgsgc: error on rank 2: E: b"]
    assert _error_lines({0: "E: a", 1: "E: a"}, 2) == ["hgsgc: error (all 2 ranks): E: a"]
    hvd = "UnknownError: Horovod has been shut down. [Op:HorovodAllreduce]"
    assert _error_lines({0: hvd, 2: hvd}, 3) == [
        f"hgsgc: error on ranks 0,2: {hvd} [no error from rank 1: it stopped issuing collectives "
        f"(Horovod's stall inspector, faults.stall_timeout_s) or failed first]"]


def test_nonfinite_warning_printed_by_lowest_rank_of_the_process_set():
    """The NaN/Inf skip warning is printed by the lowest world rank of the optimizer's process
    set, so the Hourglass FC ranks (a set without world rank 0) warn too, once per set."""
    import horovod.tensorflow as hvd
    from hgsgc.optimizer import _lead_rank

    assert _lead_rank(hvd.ProcessSet([3, 1, 2])) == 1
    assert _lead_rank(hvd.ProcessSet([0, 2])) == 0
    assert _lead_rank(hvd.global_process_set) == 0
