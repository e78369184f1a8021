"""Atomic, multi-rank checkpoints of the full training state (no pickle).

Layout on disk (one folder per checkpoint, every rank writes its own file)::

    <dir>/step-00000120/rank-00000.npz     rank 0's state tree
    <dir>/step-00000120/rank-00001.npz     rank 1's (residuals, anchors ... differ per rank)
    <dir>/step-00000120/manifest.json      written LAST, by rank 0, after every rank's file is
                                           durable: format, step, world size, the run's
                                           identity (model, parameter shapes, compression,
                                           layout) and each file's byte count and SHA-256

A checkpoint is *complete* exactly when its ``manifest.json`` exists and every file it lists has
the recorded size and SHA-256. Every file is written to a temporary name in the same folder,
flushed, ``fsync``-ed, renamed over its final name (``os.replace``, atomic on POSIX), and the
folder is ``fsync``-ed; so a writer killed at any point leaves either no manifest (the folder is
ignored and the previous checkpoint is used) or a complete checkpoint.

State trees are nested ``dict`` (string keys) / ``list`` / ``tuple`` of numpy arrays, numpy
scalars and Python ``int``/``float``/``bool``/``str``/``None``. They are stored with
:func:`numpy.savez` (arrays, bit-exact, any numeric dtype) plus a JSON description of the tree
(``__tree__``), and read with ``numpy.load(allow_pickle=False)``: loading a checkpoint never
unpickles anything, so a tampered file cannot run code. Object arrays are refused at save.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

FORMAT = "hgsgc-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (the message names the path and the cause).

    ``all_ranks`` is True when every rank raises the same error at the same point (agreed through
    a collective), so the command line prints it once.
    """

    all_ranks = False


class CheckpointMismatch(CheckpointError):
    """A checkpoint belongs to a different run (rank count, model, compression or layout);
    the message names every field that differs, with both values."""


# ---------------------------------------------------------------------------------------------
# state trees <-> npz

def _spec(node, arrays: Dict[str, np.ndarray], path: str):
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if not isinstance(k, str):
                raise TypeError(f"checkpoint state {path or '<root>'}: dict keys must be str, "
                                f"got {k!r} ({type(k).__name__})")
            out[k] = _spec(v, arrays, f"{path}/{k}")
        return {"t": "dict", "v": out}
    if isinstance(node, (list, tuple)):
        return {"t": "list" if isinstance(node, list) else "tuple",
                "v": [_spec(v, arrays, f"{path}/{i}") for i, v in enumerate(node)]}
    if node is None or isinstance(node, (bool, str)):
        return {"t": "py", "v": node}
    if isinstance(node, int):
        return {"t": "int", "v": str(node)}  # exact at any size
    if isinstance(node, float):
        return {"t": "float", "v": node.hex()}  # exact, NaN and inf included
    if hasattr(node, "numpy") and not isinstance(node, np.ndarray):  # tf.Tensor / tf.Variable
        node = node.numpy()
    if isinstance(node, (np.ndarray, np.generic)):
        arr = np.asarray(node)
        if arr.dtype.hasobject:
            raise TypeError(f"checkpoint state {path}: object arrays cannot be stored without "
                            f"pickle; convert to a numeric array")
        key = f"a{len(arrays)}"
        arrays[key] = arr
        return {"t": "scalar" if isinstance(node, np.generic) else "array", "k": key}
    raise TypeError(f"checkpoint state {path or '<root>'}: unsupported leaf type "
                    f"{type(node).__name__}; use numpy arrays, int, float, bool, str or None")


def _unspec(spec, arrays):
    t = spec["t"]
    if t == "dict":
        return {k: _unspec(v, arrays) for k, v in spec["v"].items()}
    if t in ("list", "tuple"):
        items = [_unspec(v, arrays) for v in spec["v"]]
        return items if t == "list" else tuple(items)
    if t == "py":
        return spec["v"]
    if t == "int":
        return int(spec["v"])
    if t == "float":
        return float.fromhex(spec["v"])
    if t == "array":
        return arrays[spec["k"]]
    if t == "scalar":
        return arrays[spec["k"]][()]
    raise CheckpointError(f"unknown node type {t!r} in checkpoint tree")


def tree_to_bytes(tree) -> bytes:
    """Serialise a state tree to the bytes of an ``.npz`` file (no pickle).

    Raises:
        TypeError: a leaf that cannot be stored without pickle (object arrays, other classes).
    """
    arrays: Dict[str, np.ndarray] = {}
    spec = _spec(tree, arrays, "")
    meta = np.frombuffer(json.dumps(spec).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, __tree__=meta, **arrays)
    return buf.getvalue()


def tree_from_bytes(data: bytes, what: str = "checkpoint file"):
    """Inverse of :func:`tree_to_bytes`; never unpickles.

    Raises:
        CheckpointError: not an hgsgc state file (or it is corrupt).
    """
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        spec = json.loads(arrays.pop("__tree__").tobytes().decode())
        return _unspec(spec, arrays)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{what} is not a readable hgsgc state file: "
                              f"{type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# atomic files

def _fsync_dir(path: str):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes):
    """Write ``data`` to ``path`` atomically: temporary file, fsync, rename, fsync the folder.

    On failure the temporary file is removed and ``path`` (if it existed) is untouched.

    Raises:
        OSError: the folder is not writable, the disk is full, ... (the caller wraps it).
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def step_dir(directory: str, step: int) -> str:
    """The folder of checkpoint ``step`` in ``directory``: ``<directory>/step-NNNNNNNN`` (8 digits
    or more)."""
    return os.path.join(directory, f"step-{int(step):08d}")


def rank_file(rank: int) -> str:
    """The file name of ``rank``'s state in a checkpoint folder: ``rank-RRRRR.npz``."""
    return f"rank-{int(rank):05d}.npz"


def _io_error(action, path, exc, previous, what=""):
    prev = (f"the previous checkpoint {previous} is intact" if previous
            else "no earlier checkpoint was affected")
    return CheckpointError(f"cannot {action} {path}{' ' + what if what else ''}: {exc.strerror or exc} "
                           f"(errno {exc.errno}); {prev}. Fix: make checkpoint.dir writable, free "
                           f"disk space, or point checkpoint.dir elsewhere")


# ---------------------------------------------------------------------------------------------
# finding and checking checkpoints

def read_manifest(path: str) -> dict:
    """The manifest of checkpoint folder ``path``.

    Raises:
        CheckpointError: no manifest (incomplete checkpoint), unreadable, or another format.
    """
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, "rb") as f:
            man = json.loads(f.read().decode())
    except (FileNotFoundError, NotADirectoryError):
        if os.path.isfile(path):
            raise CheckpointError(f"checkpoint.resume={path} is a file: give the checkpoint's folder "
                                  f"({os.path.dirname(os.path.abspath(path))})") from None
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint {path} does not exist: check checkpoint.resume (a "
                                  f"checkpoint folder such as <checkpoint.dir>/step-00000100, or auto "
                                  f"or never)") from None
        if list_checkpoints(path):  # the checkpoint.dir itself, not one of its step folders
            newest = latest(path)
            raise CheckpointError(
                f"checkpoint.resume={path} is the checkpoint folder, not one checkpoint: give one of "
                f"its step folders ({f'the newest complete one is {newest}' if newest else 'none is complete'}"
                f"), or checkpoint.dir={path} with checkpoint.resume=auto") from None
        raise CheckpointError(f"{path} has no {MANIFEST}: the checkpoint is incomplete "
                              f"(its writer stopped half-way)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {mpath}: {exc}") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise CheckpointError(f"{mpath} is not an {FORMAT} manifest")
    why = _malformed(man)
    if why:  # hand-edited, or written by another tool: a KeyError on rank 0 alone before
        raise CheckpointError(f"{mpath} is damaged ({why}): not a manifest hgsgc wrote; remove "
                              f"the folder {path} or resume from another checkpoint")
    return man


def _malformed(man: dict) -> Optional[str]:
    """What is wrong with a manifest's structure (``files``, ``step``, ``world_size``, ``run``),
    or None."""
    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    files = man.get("files")
    if not isinstance(files, dict) or not files:
        return "'files' is not a non-empty mapping of file name to bytes and sha256"
    for name, info in files.items():
        if not (isinstance(info, dict) and count(info.get("bytes")) and isinstance(info.get("sha256"), str)):
            return f"'files' entry {name!r} lacks its byte count or sha256"
    if not count(man.get("step")) or not count(man.get("world_size")) or man["world_size"] < 1:
        return "'step' or 'world_size' is not a count"
    if not isinstance(man.get("run", {}), dict):
        return "'run' is not a mapping"
    return None


def verify(path: str, manifest: Optional[dict] = None, hashes: bool = False) -> dict:
    """Check that every file of checkpoint ``path`` exists with its recorded size (and SHA-256
    if ``hashes``). Returns the manifest.

    Raises:
        CheckpointError: naming the missing or damaged file.
    """
    man = manifest if manifest is not None else read_manifest(path)
    for name, info in man["files"].items():
        fp = os.path.join(path, name)
        try:
            size = os.path.getsize(fp)
        except OSError:
            raise CheckpointError(f"checkpoint {path}: {name} is missing") from None
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} has {size} bytes, the manifest "
                                  f"says {info['bytes']}")
        if hashes:
            with open(fp, "rb") as f:
                if _sha256(f.read()) != info["sha256"]:
                    raise CheckpointError(f"checkpoint {path}: {name} fails its SHA-256 check")
    return man


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(step, folder)`` of every checkpoint folder (complete or not), newest first."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for n in names:
        m = _STEP_RE.match(n)
        if m and os.path.isdir(os.path.join(directory, n)):
            out.append((int(m.group(1)), os.path.join(directory, n)))
    return sorted(out, reverse=True)


def latest(directory: str, below: Optional[int] = None, damaged: Optional[list] = None) -> Optional[str]:
    """The newest COMPLETE checkpoint folder in ``directory`` (None if there is none), of a step
    below ``below`` if given.

    Folders without a manifest, or whose files do not match it, are skipped: a write killed
    half-way never hides the previous checkpoint. ``damaged``: a list that receives
    ``(folder, why)`` for each skipped folder that HAS a manifest but a file missing or of another
    size (damage after completion, not an interrupted write), newest first.
    """
    for step, path in list_checkpoints(directory):
        if below is not None and step >= below:
            continue
        try:
            man = read_manifest(path)
        except CheckpointError:
            continue  # no manifest: its writer stopped half-way (or a manifest hgsgc did not write)
        try:
            verify(path, man)
        except CheckpointError as exc:
            # the manifest is written last, after every rank's file is durable: a file missing or
            # of another size under a manifest is damage after the checkpoint completed
            if damaged is not None:
                damaged.append((path, str(exc).replace(f"checkpoint {path}: ", "")))
            continue
        return path
    return None


def _with_added_defaults(saved, current):
    """``saved`` (a compression identity) with each setting it lacks but ``current`` has set to
    that setting's default: a checkpoint written before a setting existed (e.g.
    ``momentum_masking``, ``dense_vectors``) ran with its default, so the same run resumes."""
    if not (isinstance(saved, dict) and isinstance(current, dict)) or set(current) <= set(saved):
        return saved
    import dataclasses

    from hgsgc.compression import _registered_settings

    for cls in _registered_settings():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if set(fields) != set(current):
            continue
        out = dict(saved)
        for name in set(current) - set(saved):
            if fields[name].default is not dataclasses.MISSING:
                out[name] = fields[name].default
        return out
    return saved


#: Compression settings that change how the payload is scheduled or coded on the wire, never a
#: value or the state, so a run resumes with another value of them (not compared on resume):
#: ``buckets`` (the allgather split into groups is bit for bit one fused payload,
#: tests/test_buckets.py) and ``index_coding`` (fixed-width or Elias-Fano indices: lossless,
#: stateless, training bit for bit the same, tests/test_index_coding.py; a checkpoint written
#: with ``fixed``, the default until session 10, resumes under the default ``elias_fano``,
#: tests/test_index_coding_default.py). Across the ranks of one job they must still agree
#: (hgsgc.faults.check_same_signature compares every setting).
SCHEDULE_ONLY_SETTINGS = ("buckets", "index_coding")


#: identity entries added after checkpoints without them were written: not compared when the
#: checkpoint lacks them. ``data_order``: what the global step is a position in (session 8).
ADDED_IDENTITY_KEYS = ("data_order",)


def data_order(seed: int, batch_size: int, steps_per_epoch: int) -> dict:
    """The identity entry of the data order (the checkpoint's step is a position in it): a run
    resumed with another ``run.seed``, ``train.batch_size``, ``data.train_limit`` or
    ``train.max_steps_per_epoch`` would continue at that step of a different order."""
    return {"seed": int(seed), "batch_size": int(batch_size), "steps_per_epoch": int(steps_per_epoch)}


def describe_differences(saved: dict, current: dict) -> List[str]:
    """Human-readable differences between two run identities (``manifest["run"]``); the
    compressions' :data:`SCHEDULE_ONLY_SETTINGS` are not compared."""
    labels = {"world_size": "rank count", "model": "model", "parameters": "parameter shapes",
              "compression": "compression", "layout": "layout", "roles": "Hourglass roles",
              "fc_compression": "FC compression",
              "data_order": "data order (run.seed, train.batch_size, steps per epoch)"}
    diffs = []
    for key in sorted(set(saved) | set(current)):
        if key in ADDED_IDENTITY_KEYS and key not in saved:
            continue  # a checkpoint written before the key existed
        a, b = saved.get(key), current.get(key)
        if key in ("compression", "fc_compression"):
            a = _with_added_defaults(a, b)
            if isinstance(a, dict) and isinstance(b, dict):
                a, b = ({k: v for k, v in d.items() if k not in SCHEDULE_ONLY_SETTINGS} for d in (a, b))
        if json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True):
            continue
        label = labels.get(key, key)
        if key == "parameters" and isinstance(a, dict) and isinstance(b, dict):
            names = sorted(set(a) | set(b))
            bad = [f"{n}: {a.get(n, 'absent')} vs {b.get(n, 'absent')}" for n in names
                   if a.get(n) != b.get(n)][:3]
            diffs.append(f"{label} differ ({'; '.join(bad)})")
        else:
            whole = (f"{label}: checkpoint {json.dumps(a, sort_keys=True)}, "
                     f"this run {json.dumps(b, sort_keys=True)}")
            if key in ("compression", "fc_compression") and isinstance(a, dict) and isinstance(b, dict):
                # a dozen settings each: name the ones that differ first
                keys = [k for k in sorted(set(a) | set(b)) if a.get(k, "absent") != b.get(k, "absent")]
                named = "; ".join(f"{k}: {json.dumps(a.get(k, 'absent'))} in the checkpoint, "
                                  f"{json.dumps(b.get(k, 'absent'))} in this run" for k in keys[:3])
                whole = f"{label} differs in {named}{' ...' if len(keys) > 3 else ''} ({whole})"
            diffs.append(whole)
    return diffs


def check_compatible(manifest: dict, run: dict, path: str = "checkpoint"):
    """Refuse a checkpoint of another run.

    Args:
        manifest: the checkpoint's manifest (its ``run`` entry is compared).
        run: this run's identity: ``world_size``, ``model``, ``parameters`` (name -> shape),
            ``compression`` (settings dict), ``layout`` and any other JSON values.

    Raises:
        CheckpointMismatch: naming every field that differs, with both values.
    """
    diffs = describe_differences(manifest.get("run", {}), run)
    if diffs:
        raise CheckpointMismatch(f"{path} was written by a different run: {'; '.join(diffs)}. "
                                 f"Resume with the original settings, or start afresh with "
                                 f"checkpoint.resume=never or another checkpoint.dir")


# ---------------------------------------------------------------------------------------------
# multi-rank save / load (collective over an mpi4py communicator)

class _SoloComm:
    """A one-rank stand-in for an mpi4py communicator (single-process use and tests)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, x):
        return [x]

    def bcast(self, x, root=0):
        return x

    def Barrier(self):
        pass


def _comm(comm):
    return comm if comm is not None else _SoloComm()


def _agree(comm, local_error: Optional[str], what: str):
    """Every rank learns every rank's error; all raise the same CheckpointError if any failed."""
    errors = comm.allgather(local_error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, e = bad[0]
        more = f" (and {len(bad) - 1} other rank(s))" if len(bad) > 1 else ""
        err = CheckpointError(f"{what} failed on rank {r}{more}: {e}")
        err.all_ranks = True
        raise err


def save(directory: str, step: int, state, run: dict, comm=None, keep: int = 2,
         extra: Optional[dict] = None) -> str:
    """Write this rank's ``state`` tree into checkpoint ``step`` (a collective over ``comm``).

    Every rank writes ``rank-RRRRR.npz`` atomically; the ranks agree that all files are durable;
    rank 0 writes the manifest (atomically, last) and removes all but the newest ``keep``
    complete checkpoints (and incomplete ones older than the new one). A folder of ``step``
    without a manifest (a write that was killed) is emptied first, so no temporary file of it
    stays in the new checkpoint.

    Args:
        directory: checkpoint folder (created if missing; must be shared by all ranks).
        step: global step the state was taken after (the folder's name).
        state: this rank's state tree (see the module docstring for allowed leaves).
        run: the run identity checked on resume (:func:`check_compatible`).
        comm: mpi4py communicator of all ranks (None: single process).
        keep: complete checkpoints to keep (>= 1).
        extra: JSON-able values stored in the manifest (e.g. metrics so far).

    Returns:
        the checkpoint folder.

    Raises:
        CheckpointError: on every rank alike (``all_ranks``) if any rank could not write; the
            previous complete checkpoint is untouched.
        TypeError: a state leaf that cannot be stored without pickle.
    """
    comm = _comm(comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    previous, spare = None, None
    path = step_dir(directory, step)
    data = tree_to_bytes(state)  # TypeError before any I/O: same tree kinds on every rank
    err = None
    if rank == 0:
        previous = latest(directory)
        try:
            os.makedirs(directory, exist_ok=True)
            if os.path.exists(os.path.join(path, MANIFEST)):  # re-saving the same step
                try:
                    spare = _keep_spare(path)  # complete until the new manifest is durable
                except OSError as exc:  # never remove the step's manifest without a complete copy
                    raise _SpareError(exc, _spare_dir(path)) from None
                previous = spare
                os.unlink(os.path.join(path, MANIFEST))
                _fsync_dir(path)
            elif os.path.isdir(path):  # incomplete: a killed write's files (temporaries too)
                shutil.rmtree(path)
            os.makedirs(path, exist_ok=True)
        except _SpareError as exc:
            err = str(_io_error(f"keep a complete copy of {path} under", exc.spare, exc.cause, previous,
                                what="while re-saving it"))
        except OSError as exc:
            err = str(_io_error("create checkpoint folder", path, exc, previous))
    previous = comm.bcast(previous, root=0)
    _agree(comm, err, "checkpoint")
    info = None
    try:
        atomic_write(os.path.join(path, rank_file(rank)), data)
        info = {"bytes": len(data), "sha256": _sha256(data)}
        err = None
    except OSError as exc:
        err = str(_io_error("write", os.path.join(path, rank_file(rank)), exc, previous))
    infos = comm.allgather(info)
    _agree(comm, err, "checkpoint")
    if rank == 0:
        man = {"format": FORMAT, "step": int(step), "world_size": size,
               "created_unix": time.time(), "run": run, "extra": extra or {},
               "files": {rank_file(r): infos[r] for r in range(size)}}
        try:
            atomic_write(os.path.join(path, MANIFEST),
                         json.dumps(man, indent=1, sort_keys=True).encode())
            err = None
        except OSError as exc:
            err = str(_io_error("write", os.path.join(path, MANIFEST), exc, previous))
        if err is None:
            if spare:
                shutil.rmtree(spare, ignore_errors=True)
            _prune(directory, keep, int(step))
    err = comm.bcast(err if rank == 0 else None, root=0)
    _agree(comm, err if rank == 0 else None, "checkpoint")
    return path


class _SpareError(OSError):
    def __init__(self, cause: OSError, spare: str):
        super().__init__(cause.errno, cause.strerror)
        self.cause, self.spare = cause, spare


def _spare_dir(path: str) -> str:
    """The second name of checkpoint folder ``path``'s step: ``step-0`` + its digits."""
    head, name = os.path.split(path)
    return os.path.join(head, "step-0" + name[len("step-"):])


def _keep_spare(path: str) -> str:
    """Before a complete checkpoint folder is re-saved (the end-of-run checkpoint after a periodic
    one of the same step): the same files under a second name of the same step (``step-0`` +
    the digits: one more leading zero), as hard links (copies where the file system has none),
    manifest last. ``atomic_write`` replaces a name with a new file, so the linked old files stay
    intact; a kill before the new manifest is durable leaves the spare as a complete checkpoint
    of that step, where before only the checkpoint before it was left (none with keep=1).
    Returns the spare folder.

    Raises:
        OSError: the spare could not be made (what was made of it is removed); the caller then
            leaves ``path`` untouched and reports the error (a re-save without a complete copy
            could leave no checkpoint at all with ``keep=1``).
    """
    head = os.path.dirname(path)
    spare = _spare_dir(path)
    try:
        shutil.rmtree(spare, ignore_errors=True)
        os.makedirs(spare)
        names = sorted(n for n in os.listdir(path) if not n.startswith("."))
        for n in sorted(names, key=lambda n: n == MANIFEST):  # the manifest last
            try:
                os.link(os.path.join(path, n), os.path.join(spare, n))
            except OSError:
                shutil.copy2(os.path.join(path, n), os.path.join(spare, n))
        _fsync_dir(spare)
        _fsync_dir(head)
        return spare
    except OSError:
        shutil.rmtree(spare, ignore_errors=True)
        raise


def _prune(directory, keep, newest_step):
    complete = 0
    for step, path in list_checkpoints(directory):
        is_complete = os.path.exists(os.path.join(path, MANIFEST))
        if step > newest_step:
            continue  # never touch a newer folder (another writer)
        canonical = step_dir(directory, step)
        if path != canonical and os.path.exists(os.path.join(canonical, MANIFEST)):
            shutil.rmtree(path, ignore_errors=True)  # a spare of a re-save that completed
            continue
        if is_complete:
            complete += 1
            if complete <= keep:
                continue
        shutil.rmtree(path, ignore_errors=True)


def resolve(directory: str, resume: str, run: dict, comm=None,
            below: Optional[int] = None, log: Optional[Callable] = None) -> Optional[Tuple[str, dict]]:
    """Which checkpoint to resume from (rank 0 decides; every rank gets the same answer).

    Args:
        resume: ``"auto"`` (the newest complete checkpoint in ``directory``, or none),
            ``"never"``, or a checkpoint folder path (must be complete).
        run: this run's identity (compatibility check).
        log: rank 0 reports there each newer checkpoint ``auto`` passed over as damaged (a file
            missing or of another size under its manifest).

    Returns:
        ``(folder, manifest)`` or None to start afresh.

    Raises:
        CheckpointMismatch: the checkpoint is from another run (every rank alike).
        CheckpointError: an explicit path that is not a complete checkpoint; ``auto`` when the
            only complete-manifest checkpoints are damaged (starting afresh would lose the run).
    """
    comm = _comm(comm)
    answer = None
    if comm.Get_rank() == 0:
        try:
            if resume == "never":
                answer = ("none", None, None)
            else:
                damaged = []
                path = latest(directory, below, damaged) if resume == "auto" else resume
                if path is None and damaged:  # silently starting afresh would lose the run
                    where, why = damaged[0]
                    raise CheckpointError(
                        f"checkpoint {where} is damaged ({why}) and no older complete checkpoint is "
                        f"left in {directory}: resume: auto would silently start from step 0. Fix: "
                        f"restore the file, or delete the folder {where} to resume an older one (none "
                        f"here), or start afresh under a new run.id (or checkpoint.resume=never, which "
                        f"moves these checkpoints aside)")
                if path is not None and log is not None:
                    for where, why in damaged:
                        log(f"hgsgc: checkpoint {where} is damaged ({why}): resuming from an older one")
                if path is None:
                    answer = ("none", None, None)
                else:
                    man = verify(path)
                    check_compatible(man, run, path)
                    answer = ("ok", path, man)
        except CheckpointError as exc:
            answer = ("error", type(exc).__name__, str(exc))
    kind, a, b = comm.bcast(answer, root=0)
    if kind == "error":
        err = (CheckpointMismatch if a == "CheckpointMismatch" else CheckpointError)(b)
        err.all_ranks = True
        raise err
    if kind == "none":
        return None
    return a, b


def load_rank(path: str, manifest: dict, rank: int):
    """This rank's state tree from checkpoint ``path`` (SHA-256 checked, no pickle).

    Raises:
        CheckpointError: the file is missing, damaged or the checkpoint has no such rank.
    """
    name = rank_file(rank)
    info = manifest["files"].get(name)
    if info is None:
        raise CheckpointError(f"checkpoint {path} has no state for rank {rank} "
                              f"(written by {manifest['world_size']} ranks)")
    fp = os.path.join(path, name)
    try:
        with open(fp, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read {fp}: {exc}") from None
    if _sha256(data) != info["sha256"]:
        raise CheckpointError(f"checkpoint {path}: {name} fails its SHA-256 check (damaged)")
    return tree_from_bytes(data, fp)


def set_aside(directory: str, comm=None, log: Optional[Callable] = None) -> Optional[str]:
    """Move an earlier run's checkpoints out of the way before a ``resume: never`` run (collective).

    Rank 0 renames ``directory`` to ``directory.set-aside-<UTC time>`` (``-2``, ``-3`` ... if
    taken) when it holds any ``step-*`` folder, and logs it; every rank gets the new name, or the
    same CheckpointError (the rename failed). Why: training afresh beside the old checkpoints
    left them as the newest, so the next ``resume: auto`` (the Slurm requeue of this very job)
    resumed the earlier run's state without a word. Returns the new name, or None (nothing there).
    """
    comm = _comm(comm)
    answer = ("none", None)
    if comm.Get_rank() == 0:
        found = list_checkpoints(directory)
        if found:
            base = f"{directory.rstrip(os.sep)}.set-aside-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
            target, k = base, 1
            while os.path.exists(target):
                k += 1
                target = f"{base}-{k}"
            try:
                os.rename(directory, target)
                answer = ("ok", target)
                if log is not None:
                    log(f"hgsgc: checkpoint.resume=never: moved the {len(found)} earlier checkpoint folder(s) "
                        f"(newest step {found[0][0]}) from {directory} to {target}; this run starts afresh")
            except OSError as exc:
                answer = ("error", f"checkpoint.resume=never: cannot move the earlier checkpoints in "
                                   f"{directory} aside to {target} ({exc.strerror or exc}): move or delete "
                                   f"them, or use a new run.id")
    kind, value = comm.bcast(answer, root=0)
    if kind == "error":
        err = CheckpointError(value)
        err.all_ranks = True
        raise err
    return value if kind == "ok" else None


def _file_in_the_way(directory: str) -> Optional[str]:
    """The nearest existing ancestor of ``directory`` (itself included) if it is not a folder."""
    path = os.path.abspath(directory)
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return path if path and not os.path.isdir(path) else None


def check_folder(directory: str, comm=None):
    """Collective, before training: every rank can write into ``directory`` and sees the same
    folder as rank 0 (one shared file system). A checkpoint folder that is a file, unwritable, or
    node-local (``/tmp`` on each host) used to fail only at the first checkpoint, by default the
    one after the last step, losing the run's summary; a node-local folder that happened to
    exist on every host gave checkpoints whose other ranks' files rank 0 never sees, so
    ``resume: auto`` skipped them and started afresh.

    Creates ``directory`` (rank 0) and leaves no file behind; an empty folder this call created
    is removed again.

    Raises:
        CheckpointError: on every rank alike, naming the rank, the folder and the fix.
    """
    import secrets

    comm = _comm(comm)
    rank = comm.Get_rank()
    fix = "Fix: point checkpoint.dir at a writable folder on a file system every rank shares"
    created, err, token = False, None, None
    if rank == 0:
        try:
            if not os.path.isdir(directory):
                os.makedirs(directory)
                created = True
            token = secrets.token_hex(8)
            with open(os.path.join(directory, f".probe-{token}-rank-00000"), "wb"):
                pass
        except OSError as exc:
            blocker = _file_in_the_way(directory)
            if blocker:  # e.g. run.out_dir given a config file: name what the user set
                err = (f"cannot create checkpoint.dir {directory}: {blocker} is a file, not a folder "
                       f"(checkpoint.dir defaults to <run.out_dir>/<run.id>/checkpoints: check run.out_dir "
                       f"and checkpoint.dir)")
            else:
                err = (f"cannot write into checkpoint.dir {directory} ({exc.strerror or exc}, errno "
                       f"{exc.errno}). {fix}")
    token = comm.bcast(token, root=0)
    _agree(comm, err, "checking the checkpoint folder")
    mine = os.path.join(directory, f".probe-{token}-{rank_file(rank)[:-4]}")
    if rank != 0:
        if not os.path.exists(os.path.join(directory, f".probe-{token}-rank-00000")):
            err = (f"checkpoint.dir {directory} is not the folder rank 0 writes into (rank 0's "
                   f"file is not there: a node-local path such as /tmp, or a relative path from "
                   f"another working directory); the ranks' checkpoints could never be resumed. {fix}")
        else:
            try:
                with open(mine, "wb"):
                    pass
            except OSError as exc:
                err = (f"cannot write into checkpoint.dir {directory} ({exc.strerror or exc}, "
                       f"errno {exc.errno}). {fix}")
    try:
        _agree(comm, err, "checking the checkpoint folder")
    finally:
        try:
            os.unlink(mine)
        except OSError:
            pass
        comm.allgather(None)  # every rank removed its probe before rank 0 removes the folder
        if rank == 0 and created:
            try:
                os.rmdir(directory)
            except OSError:
                pass


def agree_on_error(comm, exc: Optional[BaseException], what: str):
    """Collective: if any rank's ``exc`` is set, every rank raises the same CheckpointError."""
    _agree(_comm(comm), None if exc is None else f"{type(exc).__name__}: {exc}", what)


__all__ = ["CheckpointError", "CheckpointMismatch", "FORMAT", "atomic_write", "check_compatible",
           "describe_differences", "check_folder", "latest", "list_checkpoints", "load_rank", "read_manifest",
           "resolve", "save", "step_dir", "tree_from_bytes", "tree_to_bytes", "verify",
           "agree_on_error"]


# ---------------------------------------------------------------------------------------------
# what a training rank saves: model, optimizer slots, the hgsgc state tree

def optimizer_state(opt) -> dict:
    """This rank's optimizer state: the Keras optimizer's weights (iterations, which drives the
    learning-rate schedule, hyperparameters and slots such as momentum) and, for an
    :func:`hgsgc.DistributedOptimizer`, its full ``hgsgc_state()`` tree (residuals, PowerSGD
    factors, delay anchors and local step, DGC velocity, exchange counters).
    """
    out = {"keras": [np.asarray(w) for w in opt.get_weights()]}
    if hasattr(opt, "hgsgc_state"):
        hs = dict(opt.hgsgc_state())
        # older optimizers kept some state outside hgsgc_state(): add it here
        vel = getattr(opt, "_hgsgc_velocity", None)
        if vel and "velocity" not in hs:
            hs["velocity"] = {k: v.numpy() for k, v in vel.items()}
        if "stats" not in hs and hasattr(opt, "hgsgc_stats"):
            hs["stats"] = opt.hgsgc_stats.snapshot()
        out["hgsgc"] = hs
    return out


def load_optimizer_state(opt, variables, state: dict):
    """Restore :func:`optimizer_state` output before the first step (slots and anchors are
    created for ``variables`` first, so nothing is left to lazy creation).

    Raises:
        CheckpointMismatch: the saved optimizer has a different number of weights.
    """
    import tensorflow as tf

    variables = list(variables)
    if hasattr(opt, "_create_all_weights"):
        opt._create_all_weights(variables)
    keras = state.get("keras", [])
    if len(keras) != len(opt.get_weights()):
        raise CheckpointMismatch(f"the checkpoint's optimizer has {len(keras)} weights, this "
                                 f"one {len(opt.get_weights())} (another optimizer or momentum)")
    if keras:
        opt.set_weights(keras)
    hs = state.get("hgsgc")
    if hs is None or not hasattr(opt, "load_hgsgc_state"):
        return
    if "anchors" in hs and getattr(opt, "_hgsgc_anchors", "x") is None \
            and hasattr(opt, "_hgsgc_build_delay"):
        opt._hgsgc_build_delay(variables)
    opt.load_hgsgc_state(hs)
    vel = getattr(opt, "_hgsgc_velocity", None)
    if "velocity" in hs and vel is not None:
        for name, arr in hs["velocity"].items():
            if name not in vel:
                vel[name] = tf.Variable(tf.zeros(arr.shape, tf.float32), trainable=False,
                                        name="hgsgc_velocity/" + name.replace(":", "_"))
            vel[name].assign(arr)
    if "stats" in hs and hasattr(opt, "hgsgc_stats"):
        for k, v in hs["stats"].items():
            if k in opt.hgsgc_stats.vars:
                opt.hgsgc_stats.vars[k].assign(int(v))


def model_state(model) -> list:
    """Every variable of ``model`` (trainable or not) as numpy arrays, in ``model.variables`` order."""
    return [v.numpy() for v in model.variables]


def load_model_state(model, arrays, what="model"):
    """Assign :func:`model_state` output back.

    Raises:
        CheckpointMismatch: a different number of variables or a shape differs (named).
    """
    vs = model.variables
    if len(vs) != len(arrays):
        raise CheckpointMismatch(f"the checkpoint's {what} has {len(arrays)} variables, this one "
                                 f"{len(vs)}")
    for v, a in zip(vs, arrays):
        if tuple(v.shape) != tuple(a.shape):
            raise CheckpointMismatch(f"{what} variable {v.name}: checkpoint shape {list(a.shape)}, "
                                     f"this run {v.shape.as_list()}")
        v.assign(a)


def parameter_shapes(variables) -> dict:
    """``{variable name: shape list}`` (a run-identity entry)."""
    out = {}
    for i, v in enumerate(variables):
        name = v.name if v.name not in out else f"{v.name}#{i}"
        out[name] = [int(x) for x in v.shape]
    return out


class Checkpointer:
    """The runners' checkpoint hooks: resume, periodic / timed / preemption checkpoints, the end.

    Used identically by the data-parallel and the Hourglass runner (every rank calls every
    method at the same point)::

        ck = Checkpointer(cfg.checkpoint, run_dir, identity, comm, log)
        saved = ck.resume(rank)                       # None, or this rank's state tree
        for each step ...:
            ck.after_step(global_step, state_fn)      # may raise faults.Preempted (exit 75)
        ck.finish(global_step, state_fn)              # at_end checkpoint; restores signals

    ``state_fn()`` returns this rank's state tree at the moment of the call.

    Args:
        settings: the ``checkpoint`` config section (dir, every_steps, every_minutes, at_end,
            keep, resume).
        run_dir: the run folder (default checkpoint folder: ``<run_dir>/checkpoints``).
        identity: this run's identity (:func:`check_compatible`).
        comm: mpi4py communicator of all ranks (:func:`hgsgc.faults.world_comm`).
    """

    def __init__(self, settings, run_dir: str, identity: dict, comm=None, log=print):
        from hgsgc.faults import StepAgreement

        self.s = settings
        self.dir = settings.dir or os.path.join(run_dir, "checkpoints")
        self.identity, self.comm, self.log = identity, comm, log
        self.rank = comm.Get_rank() if comm is not None else 0
        self.agreement = StepAgreement(comm, settings.every_minutes)
        self.last_saved = None

    def resume(self, end_step: Optional[int] = None, steps_per_epoch: Optional[int] = None):
        """This rank's saved state tree from the checkpoint ``resume`` selects, or None.

        ``resume: never`` in a folder that already holds checkpoints first moves them aside
        (:func:`set_aside`), so that a later ``resume: auto`` (a Slurm requeue) resumes this run,
        not the earlier one, and nothing is deleted. ``end_step``: the last step of this run
        (``train.epochs`` x ``steps_per_epoch``); a checkpoint past it is refused.

        Raises:
            CheckpointMismatch / CheckpointError: on every rank alike.
        """
        if self.s.resume == "never":
            set_aside(self.dir, self.comm, self.log if self.rank == 0 else None)
        check_folder(self.dir, self.comm)
        found = resolve(self.dir, self.s.resume, self.identity, self.comm,
                        log=self.log if self.rank == 0 else None)
        if found is not None and end_step is not None and int(found[1]["step"]) > int(end_step):
            path, step = found[0], int(found[1]["step"])
            need = (f" to at least {-(-step // int(steps_per_epoch))}" if steps_per_epoch else "")
            err = CheckpointError(
                f"checkpoint {path} is at step {step}, past the end of this run (step {int(end_step)}: "
                f"train.epochs x steps per epoch): resuming it would report the longer run's state as "
                f"this run's. Fix: raise train.epochs{need}, or start afresh with checkpoint.resume=never "
                f"(which moves these checkpoints aside) or a new run.id")
            err.all_ranks = True
            raise err
        while found is not None:
            path, man = found
            state, err = None, None
            try:
                state = load_rank(path, man, self.rank)
            except CheckpointError as exc:
                err = str(exc)
            bad = [(r, e) for r, e in enumerate(_comm(self.comm).allgather(err)) if e]
            if not bad:
                if self.rank == 0:
                    self.log(f"hgsgc: resuming from {path} (step {man['step']})")
                return state
            # a rank's file is damaged (SHA-256, unreadable): resume: auto takes the newest
            # complete checkpoint before it, as it skips incomplete ones; otherwise stop
            r, e = bad[0]
            older = (resolve(self.dir, "auto", self.identity, self.comm, below=int(man["step"]),
                             log=self.log if self.rank == 0 else None)
                     if self.s.resume == "auto" else None)
            if older is None:
                more = f" (and {len(bad) - 1} other rank(s))" if len(bad) > 1 else ""
                err = CheckpointError(f"resume from {path} failed on rank {r}{more}: {e}. Fix: delete the "
                                      f"folder {path} and resume with checkpoint.resume=auto (the newest "
                                      f"complete checkpoint before it), or start afresh with "
                                      f"checkpoint.resume=never (which moves these checkpoints aside)")
                err.all_ranks = True
                raise err
            if self.rank == 0:
                what = e.replace(f"checkpoint {path}: ", "").replace(" (damaged)", "")
                self.log(f"hgsgc: checkpoint {path} is damaged ({what} on rank {r}): resuming from an older one")
            found = older
        return None

    def restore(self, fn, what="checkpoint"):
        """Run ``fn()`` (assigning the loaded state) on every rank; if it fails on any rank,
        every rank raises the same CheckpointError."""
        err = None
        try:
            fn()
        except (CheckpointError, KeyError, ValueError, TypeError) as exc:
            err = exc
        agree_on_error(self.comm, err, f"restoring the {what}")

    def save(self, step: int, state_fn, extra=None) -> str:
        path = save(self.dir, step, state_fn(), self.identity, self.comm, keep=self.s.keep,
                    extra=extra)
        self.last_saved = step
        return path

    def after_step(self, step: int, state_fn, extra_fn=None):
        """Agree on signals and timers (a collective), then checkpoint if due; after a signal
        raise :class:`hgsgc.faults.Preempted` on every rank (exit status 75)."""
        from hgsgc.faults import Preempted

        signame, timed = self.agreement.after_step()
        every = self.s.every_steps
        if signame or timed or (every and step % every == 0):
            path = self.save(step, state_fn, extra_fn() if extra_fn else None)
            if signame:
                self.agreement.close()
                if self.rank == 0:
                    self.log(f"hgsgc: {signame} received: checkpoint of step {step} written to "
                             f"{path}; exiting with status 75 so the job is requeued")
                raise Preempted(step, signame, path)

    def finish(self, step: int, state_fn, extra=None):
        """The end-of-run checkpoint (``at_end``; replaces a checkpoint of the same step)."""
        self.agreement.drain()
        try:
            if self.s.at_end:
                self.save(step, state_fn, extra)
        finally:
            self.agreement.close()

    def close(self):
        self.agreement.close()
