"""Preemption (SIGTERM / SIGUSR1), agreement among ranks, and errors reported once.

Preemption: a Slurm job about to be stopped gets ``SIGTERM`` (or, with
``#SBATCH --signal=USR1@60``, ``SIGUSR1`` a minute earlier). Any rank may receive it, at any
moment of a step. :class:`StepAgreement` turns "some rank got a signal" into "every rank stops
after the same step": a signal handler only sets a flag; after every step each rank contributes
its flags to a non-blocking ``MPI_Iallreduce(MAX)`` and reads the result of the previous step's
reduction, so all ranks see the same flags after the same step (one step after the signal at
most) and the check costs no synchronous round trip. The runner then writes a checkpoint and
exits with :data:`PREEMPTED_EXIT` (75, ``EX_TEMPFAIL``: "try again later"), the status the Slurm
template requeues on.

Errors: :func:`run_guarded` (used by ``hgsgc train``) prints a failure once: an error every rank
raised at the same point (an agreed checkpoint error, a data error on every rank) is printed by
rank 0 alone; an error on some ranks only is printed once, by the lowest-numbered of the ranks
that failed first (the others, which learnt of an earlier failure, stay quiet), which then aborts
the MPI job so ranks waiting in a collective do not hang.

Stalls: Horovod's stall inspector ends the job when a rank stops issuing collectives
(:func:`configure_stall_check`); :func:`wait_for_peers` does the same for point-to-point waits
(the Hourglass boundary exchange), raising :class:`StallError` naming the peer that never sent.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Optional

import numpy as np

PREEMPTED_EXIT = 75  # EX_TEMPFAIL (sysexits.h): the job should be requeued
SIGNALS = ("SIGTERM", "SIGUSR1")
FLAG_SIGNAL, FLAG_TIMED = 0, 1


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is written; exit status 75."""

    def __init__(self, step: int, signame: str, path: Optional[str]):
        super().__init__(PREEMPTED_EXIT)
        self.step, self.signame, self.path = step, signame, path


#: a signal caught by :func:`catch_early_signals` before a :class:`StepAgreement` existed
_EARLY = {"signum": 0, "old": {}}


def announce_signal(signum: int, rank: Optional[int] = None,
                    then: str = "; every rank checkpoints after the step the ranks agree on, then exits 75"):
    """Write ``hgsgc: rank R: SIGNAME received<then>`` to stderr at once (``os.write``: safe inside a
    signal handler, unbuffered, so a Slurm job log shows when each rank got the signal, before the
    agreed checkpoint's line). ``rank`` defaults to the launcher's (:func:`world_rank`)."""
    try:
        name = signal.Signals(signum).name
        r = world_rank() if rank is None else rank
        os.write(2, f"hgsgc: rank {r}: {name} received{then}\n".encode())
    except Exception:  # a closed stderr must not turn a preemption into a crash
        pass


def catch_early_signals():
    """Record SIGTERM / SIGUSR1 from now on, before a runner's :class:`StepAgreement` exists.

    ``hgsgc train`` calls it first: start-up (TensorFlow's import, the config, the data check,
    ``layout: auto``'s measurements; minutes for a large JPEG tree) ran with the default
    handlers, so a preemption signal then killed the rank (mpirun exit 138 / 143, which the Slurm
    template does not requeue). The first agreement takes the recorded signal, so every rank
    checkpoints after the first step and exits 75 (:func:`release_early_signals` restores the
    previous handlers).
    """
    def handler(signum, frame):
        _EARLY["signum"] = max(_EARLY["signum"], int(signum))
        announce_signal(signum)

    for name in SIGNALS:
        sig = getattr(signal, name)
        try:
            old = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            continue
        _EARLY["old"].setdefault(sig, old)


def release_early_signals(late: bool = False):
    """Undo :func:`catch_early_signals` (the handlers before it; a pending signal is dropped).

    ``late=True`` (``hgsgc train`` as a command, at the end of the run): install
    :func:`_late_handler` instead, which announces and ignores SIGTERM / SIGUSR1 for the rest of
    the process (MPI's finalize, TensorFlow's teardown: ~0.7 s). Restoring the default handlers
    there let a preemption signal that arrived just after the run's end kill the rank (mpirun exit
    138), so Slurm marked a finished job FAILED."""
    for sig, old in _EARLY["old"].items():
        try:
            signal.signal(sig, _late_handler if late else old)
        except (ValueError, TypeError):
            pass
    _EARLY["old"], _EARLY["signum"] = {}, 0


def _late_handler(signum, frame):
    """SIGTERM / SIGUSR1 after the run ended: one line on stderr, nothing else to do."""
    announce_signal(signum, then=" after the run ended (its results are written): ignored")


class StepAgreement:
    """Signal flags and timed checkpoints agreed among all ranks after each step.

    Args:
        comm: an mpi4py communicator of all ranks (a ``Dup`` of ``COMM_WORLD``; None for one
            process). Every rank must call :meth:`after_step` once per step, in step order.
        every_minutes: rank 0's clock asks for a timed checkpoint this often (0 = never).
        install: install the SIGTERM / SIGUSR1 handlers (restored by :meth:`close`).

    ``after_step()`` returns ``(signal_name or None, timed: bool)``, identical on every rank.
    """

    def __init__(self, comm=None, every_minutes: float = 0.0, install: bool = True):
        self.comm = comm
        self.every_s = float(every_minutes) * 60.0
        self.flags = np.zeros(2, np.int32)
        self._last_time = time.monotonic()
        self._pending = None
        self._recv = np.zeros(2, np.int32)
        self._old = {}
        self.signal_received = 0
        self._rank = comm.Get_rank() if comm is not None else None  # no MPI call in the handler
        if install and _EARLY["signum"]:  # a signal during start-up (catch_early_signals)
            self.flags[FLAG_SIGNAL] = self.signal_received = _EARLY["signum"]
            _EARLY["signum"] = 0
        if install:
            for name in SIGNALS:
                sig = getattr(signal, name)
                try:
                    self._old[sig] = signal.signal(sig, self._handler)
                except ValueError:  # not the main thread
                    pass

    def _handler(self, signum, frame):
        self.flags[FLAG_SIGNAL] = max(int(self.flags[FLAG_SIGNAL]), int(signum))
        self.signal_received = int(signum)
        announce_signal(signum, self._rank)

    def _local(self):
        out = self.flags.copy()
        rank0 = self.comm is None or self.comm.Get_rank() == 0
        if rank0 and self.every_s > 0 and time.monotonic() - self._last_time >= self.every_s:
            out[FLAG_TIMED] = 1
            self._last_time = time.monotonic()
        return out

    def after_step(self):
        """Agree on flags (a collective; call once per step on every rank)."""
        if self.comm is None or self.comm.Get_size() == 1:
            agreed = self._local()
        else:
            from mpi4py import MPI

            agreed = np.zeros(2, np.int32)
            if self._pending is not None:
                self._pending.Wait()
                agreed = self._recv.copy()
            self._send = self._local()
            self._recv = np.zeros(2, np.int32)
            self._pending = self.comm.Iallreduce(self._send, self._recv, op=MPI.MAX)
        sig = int(agreed[FLAG_SIGNAL])
        name = signal.Signals(sig).name if sig else None
        return name, bool(agreed[FLAG_TIMED])

    def drain(self):
        """Finish the outstanding reduction (call on every rank before leaving the loop)."""
        if self._pending is not None:
            self._pending.Wait()
            self._pending = None

    def close(self):
        self.drain()
        for sig, old in self._old.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old = {}


_WORLD = None


def world_comm():
    """A ``Dup`` of ``COMM_WORLD`` for the runners' agreements and checkpoints (collective on the
    first call; None for a single process or without MPI). Separate from Horovod's and the
    Hourglass point-to-point communicators, so these collectives never interleave with theirs."""
    global _WORLD
    if _WORLD is None:
        _WORLD = _dup_world()
    return _WORLD or None


def _dup_world():
    """``COMM_WORLD.Dup()`` (collective), or False for a single process or without MPI."""
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Dup() if MPI.COMM_WORLD.Get_size() > 1 else False
    except Exception:  # pragma: no cover - no MPI
        return False


def configure_stall_check(timeout_s: float):
    """End the job when some rank stops issuing collectives for ``timeout_s`` seconds.

    Sets Horovod's stall inspector (read at ``hvd.init()``, so call this first): after
    ``timeout_s / 2`` seconds rank 0 warns which ranks have not submitted a pending collective
    ("Missing ranks: ..."), after ``timeout_s`` Horovod shuts down and every rank's pending
    collective raises, naming the tensor; :func:`run_guarded` then ends the job. ``0`` leaves
    Horovod's defaults (a warning after 60 s, no shutdown). Explicit ``HOROVOD_STALL_*``
    environment variables win.
    """
    if not timeout_s:
        return
    t = max(1, int(round(timeout_s)))
    os.environ.pop("HOROVOD_STALL_CHECK_DISABLE", None)
    os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, t // 2)))
    os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(t))


class StallError(RuntimeError):
    """A rank waited longer than ``faults.stall_timeout_s`` for a point-to-point message or a
    collective on a point-to-point communicator; the message names the peer rank(s) waited for.

    Attributes:
        peers: the ranks waited for (list of int), or None (a collective: unknown).
    """

    def __init__(self, message: str, peers=None):
        super().__init__(message)
        self.peers = None if peers is None else [int(p) for p in peers]


def wait_for_peers(requests, peers, what: str, timeout_s: float, statuses=None,
                   setting_s: Optional[float] = None, max_pause_s: float = 1e-3):
    """``MPI.Request.Waitall(requests, statuses)`` with a deadline.

    Args:
        requests: mpi4py requests (``Isend`` / ``Irecv`` / ``Iallreduce`` ...).
        peers: the rank each request waits for (same length), or None for a collective.
        what: what is awaited, for the message (e.g. ``"activations of micro-batch 0"``).
        timeout_s: seconds; ``<= 0`` waits without a deadline (plain ``Waitall``, MPI's own
            progress loop).
        statuses: optional ``MPI.Status`` list, filled as by ``Waitall``.
        setting_s: the ``faults.stall_timeout_s`` the deadline derives from, for the message
            (default ``timeout_s``).
        max_pause_s: longest sleep between two ``Testall`` polls. The pause doubles from 50 us
            up to it, so a wait costs a few percent of a core instead of MPI's busy poll, and
            adds at most ``max_pause_s`` of latency after the last message arrived.

    Raises:
        StallError: not every request completed within ``timeout_s`` seconds; names the ranks
            of the requests still pending (or says a rank did not join the collective) and the
            setting, not the waiting rank (so ranks waiting alike raise the same message, which
            :func:`report_error` prints once with their ranks). The requests are left pending
            (the caller ends the job).
    """
    from mpi4py import MPI

    if not timeout_s or timeout_s <= 0:
        MPI.Request.Waitall(requests, statuses)
        return
    deadline = time.monotonic() + float(timeout_s)
    pause = 0.0
    while not MPI.Request.Testall(requests, statuses):
        if time.monotonic() >= deadline:
            t = f"{float(timeout_s):g}"
            setting = f"faults.stall_timeout_s={float(setting_s or timeout_s):g}"
            if peers is None:
                raise StallError(f"waited {t} s for {what}: some rank did not join it "
                                 f"({setting}); ending the job")
            # a failed Testall modifies no request: Get_status tells which are still pending
            late = sorted({int(p) for r, p in zip(requests, peers) if not r.Get_status()})
            who = ", ".join(map(str, late)) or "?"
            raise StallError(f"waited {t} s for {what}; rank {who} did not answer: it has "
                             f"stopped or is stuck ({setting}); ending the job", late)
        time.sleep(pause)
        pause = min(max(2 * pause, 5e-5), max_pause_s)


# ---------------------------------------------------------------------------------------------
# errors: once, and never a hang

_ERR_COMM = None


def error_comm():
    """A ``Dup`` of ``COMM_WORLD`` for error reporting (collective on first call; None without MPI)."""
    global _ERR_COMM
    if _ERR_COMM is None:
        _ERR_COMM = _dup_world()
    return _ERR_COMM or None


def world_rank() -> int:
    """This process's MPI rank from the launcher's environment (:func:`hgsgc.runtime.world_rank`)."""
    from hgsgc import runtime

    return runtime.world_rank()


def _abort(code: int):
    try:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(code)
    except Exception:  # pragma: no cover - no MPI: plain exit
        pass
    sys.exit(code)


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line; TensorFlow's "in user code:" traces (an error raised while
    tracing a ``tf.function``) are cut to their last line, the original error."""
    msg = str(exc)
    if "in user code:" in msg:
        last = [ln.strip() for ln in msg.splitlines() if ln.strip()]
        if last:
            return last[-1]
    return f"{type(exc).__name__}: {' '.join(msg.split()) if len(msg) < 2000 else msg}"


NOTICE_TAG = 7713  # "rank r failed with line L", on the error communicator


def _notices(comm):
    """Failure notices ``(rank, first, line, peers)`` that have arrived on ``comm`` so far."""
    from mpi4py import MPI

    out = []
    while comm.Iprobe(source=MPI.ANY_SOURCE, tag=NOTICE_TAG):
        out.append(tuple(comm.recv(source=MPI.ANY_SOURCE, tag=NOTICE_TAG)))
    return out


def _error_lines(failed, size, blamed=None, shutdown_hint=True):
    """One ``hgsgc: error ...`` line per distinct message, naming the ranks it came from.

    ``failed``: rank -> message; ``blamed``: rank -> the ranks its stall waited for (None: not a
    stall). A stall that waited only for ranks that failed themselves is a consequence, not a
    cause, and is left out (unless every message is such a one)."""
    blamed = blamed or {}
    causes = {r: ln for r, ln in failed.items()
              if not blamed.get(r) or not set(blamed[r]) <= set(failed)}
    seen = {}
    for r, line in sorted((causes or failed).items()):
        seen.setdefault(line, []).append(r)
    out = []
    for ln, ranks in seen.items():
        if len(ranks) == size:
            who = f"(all {size} ranks)"
        else:
            who = ("on rank " if len(ranks) == 1 else "on ranks ") + ",".join(map(str, ranks))
        text = f"hgsgc: error {who}: {ln}"
        quiet = [r for r in range(size) if r not in failed]
        if shutdown_hint and quiet and "Horovod has been shut down" in ln:
            text += (f" [no error from rank{'s' if len(quiet) > 1 else ''} "
                     f"{','.join(map(str, quiet))}: it stopped issuing collectives (Horovod's "
                     f"stall inspector, faults.stall_timeout_s) or failed first]")
        out.append(text)
    return out


def report_error(exc: BaseException, comm=None, grace_s: Optional[float] = None) -> int:
    """Print ``exc`` once for the whole job and end this rank; returns the exit code (1) when
    every rank failed alike (the caller exits), otherwise aborts the MPI job.

    * ``exc.all_ranks`` (agreed errors): rank 0 prints, all ranks meet at a barrier, exit 1.
    * otherwise the failing rank first looks for failure notices of other ranks that already
      arrived (it is then a *follower*: its error is most likely a consequence, e.g. a peer that
      waited for a rank that failed), sends its own notice ``(rank, first, line)`` to every rank,
      and waits up to ``grace_s`` (``$HGSGC_ERROR_GRACE_S``, default 3 s) in a non-blocking
      barrier:

      - every rank arrives (every rank failed): rank 0 prints each distinct message once with
        the ranks it came from; every rank exits 1;
      - not every rank arrives (some ranks are still running, blocked, or stalled): the
        lowest-numbered rank among those that failed first (no earlier notice), preferring one
        whose error is a cause (not a :class:`StallError` that waited only for ranks that failed
        too), prints one line per distinct message of the ranks it heard from (``hgsgc: error on
        ranks 0,2: ...``; such consequences left out; for a Horovod stall shutdown also the
        ranks that reported nothing) and calls
        ``MPI_Abort``, which ends every rank; the other failing ranks stay quiet and are ended by
        that abort (should none come within ``max(10, 3 grace)`` s, each prints its own line and
        aborts, so the job never hangs and never ends silently).
    """
    from mpi4py import MPI

    rank = world_rank()
    line = one_line(exc)
    comm = comm if comm is not None else error_comm()
    if comm is None:
        print(f"hgsgc: error: {line}", file=sys.stderr, flush=True)
        return 1
    if getattr(exc, "all_ranks", False):
        if comm.Get_rank() == 0:
            print(f"hgsgc: error (all {comm.Get_size()} ranks): {line}", file=sys.stderr, flush=True)
        comm.Barrier()
        return 1
    me, size = comm.Get_rank(), comm.Get_size()
    grace = float(os.environ.get("HGSGC_ERROR_GRACE_S", "3")) if grace_s is None else grace_s
    peers = getattr(exc, "peers", None)
    heard = _notices(comm)
    first = not heard
    sends = [comm.isend((me, first, line, peers), dest=r, tag=NOTICE_TAG)
             for r in range(size) if r != me]
    req = comm.Ibarrier()
    deadline = time.monotonic() + grace
    done = req.Test()
    while not done and time.monotonic() < deadline:
        time.sleep(0.02)
        done = req.Test()
    if done:  # every rank failed: every notice was sent before the barrier, so all arrive
        heard += [tuple(comm.recv(source=MPI.ANY_SOURCE, tag=NOTICE_TAG))
                  for _ in range(size - 1 - len(heard))]
        MPI.Request.Waitall(sends)
        if me == 0:
            failed = {r: ln for r, _, ln, _ in heard}
            failed[me] = line
            for text in _error_lines(failed, size, {r: p for r, _, _, p in heard}):
                print(text, file=sys.stderr, flush=True)
        comm.Barrier()
        return 1
    heard += _notices(comm)
    failed = {r: ln for r, _, ln, _ in heard}
    failed[me] = line
    blamed = {r: p for r, _, _, p in heard}
    blamed[me] = peers
    leaders = [r for r, f, _, _ in heard if f] + ([me] if first else [])
    # prefer a rank whose failure is a cause: not a stall waiting only for ranks that failed too
    causes = [r for r in leaders if not blamed.get(r) or not set(blamed[r]) <= set(failed)]
    if first and me == min(causes or leaders):
        for text in _error_lines(failed, size, blamed):
            print(text, file=sys.stderr, flush=True)
        _abort(1)
    # a follower (or a later first failure): the leader's MPI_Abort ends this process
    end = time.monotonic() + max(10.0, 3 * grace)
    while time.monotonic() < end:
        time.sleep(0.05)
    print(f"hgsgc: error on rank {rank}: {line}", file=sys.stderr, flush=True)
    _abort(1)
    return 1


# ---------------------------------------------------------------------------------------------
# gradient guards used by hgsgc.DistributedOptimizer

NONFINITE_MODES = ("off", "skip", "raise")


def densify(grads, variables):
    """Dense gradients with the variables' static shapes.

    ``tf.IndexedSlices`` become dense tensors, and a gradient whose static shape is unknown at
    trace time (e.g. ``IndexedSlices`` merged by ``tf.cond`` inside ``tf.function``, whose
    ``dense_shape`` is a tensor) is reshaped to its variable's shape, so the payload sizes that
    compression fixes at trace time are known. ``None`` passes through.

    Raises:
        ValueError: a gradient's known shape differs from its variable's (named).
    """
    import tensorflow as tf

    out = []
    for g, v in zip(grads, variables):
        if g is None:
            out.append(None)
            continue
        if isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        g = tf.convert_to_tensor(g)
        vshape = getattr(v, "shape", None)
        if vshape is not None and tf.TensorShape(vshape).is_fully_defined() \
                and not g.shape.is_fully_defined():
            if not g.shape.is_compatible_with(vshape):
                raise ValueError(f"gradient of {getattr(v, 'name', '?')} has shape {g.shape} but "
                                 f"the variable has shape {vshape}")
            g = tf.reshape(g, vshape)
        out.append(g)
    return out


def check_same_signature(names, tensors, process_set=None, what="gradient", settings=None, guard=None):
    """Collective (once, eagerly, at trace time): every rank passes the same names, shapes and
    dtypes (and the same compression ``settings``, a JSON-like dict such as
    ``Compression.to_dict()``, and the same ``guard``, e.g. ``{"nonfinite": "skip"}``: the
    non-finite guard adds a collective, so ranks that disagree on it would wait for each other in
    Horovod forever); otherwise every rank raises the same error naming the setting or the variable
    and both values.

    Without it, a shape that differs across ranks reaches the sparse allgather (whose rows may
    differ in length) and gives wrong averages or a hang, or Horovod's error names only its
    internal tensor; a compression that differs (another density, bits or index_coding on one
    rank) gave payloads of another length or layout: an internal decode / Reshape error on every
    rank, or, for payloads of equal length, a wrong average.

    Raises:
        ValueError: naming the first setting that differs (``compression differs between ranks:
            KEY V0 on rank 0 but V1 on rank R``; ``KEY differs between ranks: V0 on rank 0 but V1
            on rank R`` for a ``guard`` key), else the first variable that differs, the ranks and
            both shapes/dtypes.
    """
    import horovod.tensorflow as hvd
    import tensorflow as tf

    ps = process_set if process_set is not None else hvd.global_process_set
    sig = [(str(n), None if t is None else t.shape.as_list(), None if t is None else t.dtype.name)
           for n, t in zip(names, tensors)]
    with tf.init_scope():
        n = ps.size() if hasattr(ps, "size") and callable(ps.size) else hvd.size()
        if n <= 1:
            return
        from horovod.tensorflow.functions import allgather_object

        allsigs = allgather_object((sig, settings, guard), process_set=ps)
    allguards = [gd or {} for _, _, gd in allsigs]
    allsets = [st for _, st, _ in allsigs]
    allsigs = [sg for sg, _, _ in allsigs]
    for r, gd in enumerate(allguards[1:], start=1):
        for k in sorted(set(allguards[0]) | set(gd)):
            if allguards[0].get(k) != gd.get(k):
                raise ValueError(f"{k} differs between ranks: {allguards[0].get(k)!r} on rank 0 but "
                                 f"{gd.get(k)!r} on rank {r}: pass the same {k} mode on every rank")
    for r, st in enumerate(allsets[1:], start=1):
        if st != allsets[0]:
            a, b = allsets[0] or {}, st or {}
            keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)] or ["settings"]
            raise ValueError(f"compression differs between ranks: " + "; ".join(
                f"{k} {a.get(k)!r} on rank 0 but {b.get(k)!r} on rank {r}" for k in keys[:3])
                + ": pass the same compression on every rank")
    ref = allsigs[0]
    for r, s in enumerate(allsigs[1:], start=1):
        if len(s) != len(ref):
            raise ValueError(f"rank {r} passes {len(s)} {what}s but rank 0 passes {len(ref)}: "
                             f"every rank must build the same model")
        for (n0, sh0, dt0), (n1, sh1, dt1) in zip(ref, s):
            if n0 != n1 or sh0 != sh1 or dt0 != dt1:
                raise ValueError(f"{what} of variable {n0!r}: shape {sh0} {dt0} on rank 0 but "
                                 f"{n1!r} has shape {sh1} {dt1} on rank {r}: every rank must "
                                 f"build the same model (same sizes and dtypes)")


def all_finite(tensors):
    """Scalar bool tensor: every floating entry of ``tensors`` is finite (local, no collective)."""
    import tensorflow as tf

    checks = [tf.reduce_all(tf.math.is_finite(t)) for t in tensors
              if t is not None and t.dtype.is_floating]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)


def all_ranks_finite(tensors, process_set=None, name=None):
    """Scalar bool tensor, the same on every rank: no rank has a NaN/Inf entry (one 4-byte
    ``allreduce(op=Min)`` of the local verdict)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    ps = process_set if process_set is not None else hvd.global_process_set
    local = tf.cast(all_finite(tensors), tf.float32)
    agreed = hvd.allreduce(tf.reshape(local, [1]), op=hvd.Min, process_set=ps, name=name)
    return tf.greater(agreed[0], 0.5)
