"""CPU time per training step of each thread of this process, from ``/proc``.

What the bench (``hgsgc bench``, hgsgc/bench.py) records per cell, so the performance model can be
given the CPU that Horovod's background thread and Open MPI's threads take on the rank's core in
*that* run (issue 10). CPU seconds of a thread are far less sensitive to the machine's load than
wall time: a thread waiting for a core accrues none, so the figure is what the thread needed, not
how long it waited.

For every thread ``/proc/<pid>/task/<tid>/stat`` gives ``utime`` + ``stime`` (fields 14 and 15,
clock ticks: 10 ms at 100 Hz, too coarse for a few ms per step over 40 steps) and
``/proc/<pid>/task/<tid>/schedstat`` the time on a CPU in nanoseconds (first field, the
scheduler's ``sum_exec_runtime``). Both are recorded; ``cpu_s`` is the nanosecond one where the
kernel has it (``CONFIG_SCHED_INFO``), else the ticks'.

**Thread names do not tell the threads apart** (checked under mpirun, Horovod 0.28 / Open MPI 4.1
here: every thread's ``comm`` is ``python``: TensorFlow's pools, Horovod's background thread and
Open MPI's threads inherit the process name; none calls ``pthread_setname_np``). So the threads are
grouped by when they appeared and where they wait (:class:`ThreadGroups`), as ``gdb``'s
backtraces of a training rank showed them (``thread apply all bt``, 2 ranks, session 8):

* ``main``: the thread whose tid is the pid (Python, TensorFlow's eager executor);
* ``hvd_background``: the first thread ``hvd.init()`` starts (the lowest new tid: the kernel
  hands out ids in increasing order until they wrap at ``pid_max``): Horovod's background thread
  (``horovod::common::...BackgroundThreadLoop``: negotiation, the fused collectives, Open MPI's
  polling inside them). If MPI is not initialised yet, this thread calls ``MPI_Init``, so
  Open MPI's threads come after it;
* ``mpi``: the other threads that appeared during ``hvd.init()``, and the threads that already
  existed then and wait in ``poll`` / ``epoll_wait`` (``wchan`` ``poll_schedule_timeout*`` /
  ``do_epoll_wait``): Open MPI's progress thread (a libevent loop in ``libopen-pal``, ``poll``)
  and PMIx's (a libevent loop in ``libpmix``, ``epoll_wait``). ``hgsgc train`` initialises MPI
  through mpi4py before ``hvd.init()``, so these two exist before it;
* ``other``: TensorFlow's Eigen pools (they wait on a futex) and anything started later.

Each thread's ``comm`` and ``wchan`` (when the groups are taken) are recorded beside it, so the
grouping can be checked in the results.
"""
import os
from typing import Dict, Iterable, List, Optional, Tuple

GROUPS = ("main", "hvd_background", "mpi", "other")
HVD_MPI = ("hvd_background", "mpi")  # the threads hvd.init() started: Horovod + Open MPI


def parse_stat(text: str) -> Tuple[str, int, int]:
    """``(comm, utime, stime)`` of one ``/proc/.../stat`` line (ticks).

    ``comm`` is between the first ``(`` and the *last* ``)``: it may hold spaces and parentheses.
    Raises ValueError on a malformed line."""
    a, b = text.find("("), text.rfind(")")
    if a < 0 or b < a:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}")
    rest = text[b + 1:].split()
    # rest[0] is field 3 (state); utime / stime are fields 14 / 15
    if len(rest) < 13:
        raise ValueError(f"not a /proc stat line (too few fields): {text[:80]!r}")
    return text[a + 1:b], int(rest[11]), int(rest[12])


def parse_schedstat(text: str) -> int:
    """Nanoseconds on a CPU (first field of ``/proc/.../schedstat``).

    Raises ValueError / IndexError on a malformed line."""
    return int(text.split()[0])


def parse_schedstat_wait(text: str) -> int:
    """Nanoseconds runnable but waiting for a CPU (second field of ``/proc/.../schedstat``: the
    time other threads or processes had the core)."""
    return int(text.split()[1])  # ValueError / IndexError on a malformed line


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread ended between listdir and open
        return None


def task_dir(proc: str = "/proc", pid: Optional[int] = None) -> str:
    """``<proc>/<pid>/task``, the folder of process ``pid``'s threads (default: this process)."""
    return os.path.join(proc, str(pid if pid is not None else os.getpid()), "task")


def tids(proc: str = "/proc", pid: Optional[int] = None) -> List[int]:
    """The thread ids of process ``pid`` (default: this process), ascending.

    Raises:
        OSError: :func:`task_dir` cannot be listed (no ``/proc``: not Linux)."""
    return sorted(int(t) for t in os.listdir(task_dir(proc, pid)) if t.isdigit())


def snapshot(proc: str = "/proc", pid: Optional[int] = None) -> Dict[int, dict]:
    """``{tid: {"comm", "ticks", "ns", "wait_ns"}}`` of every thread now (``ticks``: utime + stime
    in clock ticks; ``ns``, ``wait_ns``: nanoseconds, None without schedstat). A thread that ends
    while it is read is left out.

    Raises:
        OSError: ``<proc>/<pid>/task`` cannot be listed (no ``/proc``: not Linux)."""
    d = task_dir(proc, pid)
    out = {}
    for t in tids(proc, pid):
        st = _read(os.path.join(d, str(t), "stat"))
        if st is None:
            continue
        try:
            comm, ut, stt = parse_stat(st)
        except ValueError:
            continue
        ss = _read(os.path.join(d, str(t), "schedstat"))
        try:
            ns, wait = (parse_schedstat(ss), parse_schedstat_wait(ss)) if ss else (None, None)
        except (ValueError, IndexError):
            ns = wait = None
        out[t] = {"comm": comm, "ticks": ut + stt, "ns": ns, "wait_ns": wait}
    return out


def is_event_loop_wchan(w: Optional[str]) -> bool:
    """A thread sleeping in ``poll`` / ``select`` / ``epoll_wait`` (an event loop: Open MPI's and
    PMIx's progress threads; TensorFlow's pool threads wait on a futex instead)."""
    return bool(w) and ("poll" in w or "select" in w)


def wchan(tid: int, proc: str = "/proc", pid: Optional[int] = None) -> Optional[str]:
    """The kernel function thread ``tid`` sleeps in (``/proc/.../wchan``; ``"0"`` while it runs),
    or None when it cannot be read (the thread ended)."""
    w = _read(os.path.join(task_dir(proc, pid), str(tid), "wchan"))
    return w.strip() if w is not None else None


class ThreadGroups:
    """Which group each thread is in: call :meth:`before_init` just before ``hvd.init()`` and
    :meth:`after_init` just after it (see the module docstring)."""

    def __init__(self, proc: str = "/proc", pid: Optional[int] = None):
        self.proc, self.pid = proc, pid
        self.main = int(pid if pid is not None else os.getpid())
        self._before: Optional[set] = None
        self.hvd: List[int] = []  # tids that appeared during hvd.init(), ascending
        self.wchan: Dict[int, Optional[str]] = {}
        self.mpi_before: List[int] = []

    def before_init(self) -> None:
        """The threads that exist before ``hvd.init()`` (none known without a readable
        ``/proc/<pid>/task``: then every thread but the main one is ``other``)."""
        try:
            self._before = set(tids(self.proc, self.pid))
        except OSError:  # no /proc (macOS) or hidden: measure nothing, never stop the training
            self._before = None

    def after_init(self) -> None:
        """The threads ``hvd.init()`` started and the event-loop threads before it (see the
        module docstring); a no-op without a readable ``/proc/<pid>/task``."""
        try:
            now = tids(self.proc, self.pid)
        except OSError:
            return
        self.hvd = sorted(t for t in now if self._before is not None and t not in self._before)
        self.wchan = {t: wchan(t, self.proc, self.pid) for t in now}
        # threads of Open MPI / PMIx started before hvd.init (MPI initialised by mpi4py first)
        self.mpi_before = sorted(t for t in now if t not in self.hvd and t != self.main
                                 and is_event_loop_wchan(self.wchan.get(t)))

    def group(self, tid: int) -> str:
        """``tid``'s group: one of :data:`GROUPS` (``other`` for threads not seen at ``after_init``)."""
        if tid == self.main:
            return "main"
        if self.hvd and tid == self.hvd[0]:
            return "hvd_background"
        if tid in self.hvd or tid in self.mpi_before:
            return "mpi"
        return "other"


class StepCPU:
    """CPU per timed step of every thread, accumulated over windows of timed steps.

    ``start()`` before a run of timed steps, ``stop(n)`` after them (``n`` steps); windows add up
    (epochs; steps that retrace a graph are left out by stopping before and starting after them).
    A thread that started inside a window counts from 0; one that ended inside it is lost (its
    CPU is not in ``/proc`` any more) and counted in ``threads_ended``; one that both started
    and ended inside a window is not seen at all (Horovod's and Open MPI's threads live as long
    as the process; a thread id reused inside one window, after the kernel's ids wrapped at
    ``pid_max``, would be taken for the old thread). Without a readable
    ``/proc/<pid>/task`` (not Linux, or hidden) nothing is measured and :attr:`unavailable` says
    why; the training goes on (``hgsgc train`` then writes no ``thread_cpu``)."""

    def __init__(self, groups: ThreadGroups, proc: str = "/proc", pid: Optional[int] = None,
                 clock=None):
        import time

        self.groups, self.proc, self.pid = groups, proc, pid
        self.clock = clock or time.perf_counter
        self.steps = 0
        self.window_s = 0.0
        self.threads_ended = 0
        self.per_tid: Dict[int, dict] = {}
        self._open: Optional[Tuple[Dict[int, dict], float]] = None
        #: why nothing more is measured (``"<task dir>: <OSError>"``), or None
        self.unavailable: Optional[str] = None

    def _snapshot(self) -> Optional[Dict[int, dict]]:
        try:
            return snapshot(self.proc, self.pid)
        except OSError as exc:  # no /proc/<pid>/task (macOS) or hidden: stop measuring, train on
            self.unavailable = f"{task_dir(self.proc, self.pid)}: {exc}"
            self._open = None
            return None

    def start(self) -> None:
        """Open a window (a no-op once ``/proc`` could not be read: :attr:`unavailable`)."""
        if self.unavailable is not None:
            return
        a = self._snapshot()
        if a is not None:
            self._open = (a, self.clock())

    @property
    def running(self) -> bool:
        """True while a window is open (between :meth:`start` and :meth:`stop`)."""
        return self._open is not None

    def stop(self, steps: int) -> None:
        """Close the open window of ``steps`` timed steps and add it (a no-op without one; a
        window whose end cannot be read from ``/proc`` is left out, steps and all)."""
        if self._open is None:
            return
        a, t0 = self._open
        b = self._snapshot()
        if b is None:
            return
        self.window_s += self.clock() - t0
        self._open = None
        self.steps += int(steps)
        self.threads_ended += sum(1 for t in a if t not in b)
        for t, y in b.items():
            x = a.get(t, {"ticks": 0, "ns": 0, "wait_ns": 0})
            acc = self.per_tid.setdefault(t, {"comm": y["comm"], "ticks": 0, "ns": 0, "wait_ns": 0})
            acc["comm"] = y["comm"]
            acc["ticks"] += y["ticks"] - x["ticks"]
            for k in ("ns", "wait_ns"):
                if acc[k] is not None and y.get(k) is not None and x.get(k) is not None:
                    acc[k] += y[k] - x[k]
                else:
                    acc[k] = None

    def result(self, tick_s: Optional[float] = None) -> dict:
        """Per step: every thread's and every group's CPU seconds (``cpu_s_per_step``: from
        schedstat's nanoseconds where every thread of the group has them, else from the ticks;
        ``stat_cpu_s_per_step``: utime + stime; ``runqueue_wait_s_per_step``: schedstat's time runnable
        but without a CPU, None without schedstat), the groups' comms, and the window."""
        tick = tick_s if tick_s is not None else 1.0 / os.sysconf("SC_CLK_TCK")
        n = max(self.steps, 1)
        threads = []
        groups = {g: {"threads": 0, "comms": [], "ticks": 0, "ns": 0, "wait_ns": 0} for g in GROUPS}
        for t in sorted(self.per_tid):
            v = self.per_tid[t]
            g = self.groups.group(t)
            threads.append({"tid": t, "comm": v["comm"], "group": g,
                            "wchan_at_init": self.groups.wchan.get(t),
                            "stat_cpu_s_per_step": v["ticks"] * tick / n,
                            "cpu_s_per_step": (v["ns"] / 1e9 if v["ns"] is not None else v["ticks"] * tick) / n,
                            "runqueue_wait_s_per_step": v["wait_ns"] / 1e9 / n if v["wait_ns"] is not None else None})
            acc = groups[g]
            acc["threads"] += 1
            if v["comm"] not in acc["comms"]:
                acc["comms"].append(v["comm"])
            acc["ticks"] += v["ticks"]
            acc["ns"] = None if acc["ns"] is None or v["ns"] is None else acc["ns"] + v["ns"]
            acc["wait_ns"] = None if acc["wait_ns"] is None or v["wait_ns"] is None else acc["wait_ns"] + v["wait_ns"]
        out_groups = {}
        for g, acc in groups.items():
            out_groups[g] = {"threads": acc["threads"], "comms": acc["comms"],
                             "stat_cpu_s_per_step": acc["ticks"] * tick / n,
                             "cpu_s_per_step": (acc["ns"] / 1e9 if acc["ns"] is not None
                                                else acc["ticks"] * tick) / n,
                             "runqueue_wait_s_per_step": acc["wait_ns"] / 1e9 / n if acc["wait_ns"] is not None else None,
                             "source": "schedstat" if acc["ns"] is not None else "stat"}
        return {"steps": self.steps, "window_s": self.window_s, "tick_s": tick,
                "threads_ended": self.threads_ended, "groups": out_groups,
                "hvd_mpi_cpu_s_per_step": sum(out_groups[g]["cpu_s_per_step"] for g in HVD_MPI),
                "threads": threads}


def combine_ranks(per_rank: Iterable[Optional[dict]]) -> Optional[dict]:
    """Every rank's :meth:`StepCPU.result` (rank order) and, per group, the mean and the max over
    ranks of ``cpu_s_per_step``; ``hvd_mpi_cpu_s_per_step``: mean / max over ranks of Horovod's
    background thread + Open MPI's threads. None when no rank measured."""
    ranks = [r for r in per_rank if r is not None]
    if not ranks:
        return None
    groups = {}
    for g in GROUPS:
        vals = [r["groups"][g]["cpu_s_per_step"] for r in ranks]
        waits = [r["groups"][g].get("runqueue_wait_s_per_step") for r in ranks]
        groups[g] = {"mean_cpu_s_per_step": sum(vals) / len(vals), "max_cpu_s_per_step": max(vals),
                     "mean_runqueue_wait_s_per_step": (sum(waits) / len(waits)
                                                       if all(w is not None for w in waits) else None),
                     "threads": [r["groups"][g]["threads"] for r in ranks],
                     "comms": sorted({c for r in ranks for c in r["groups"][g]["comms"]})}
    hm = [r["hvd_mpi_cpu_s_per_step"] for r in ranks]
    return {"steps": [r["steps"] for r in ranks], "groups": groups,
            "hvd_mpi_cpu_s_per_step": {"mean": sum(hm) / len(hm), "max": max(hm)},
            "ranks": ranks}


#: Environment variable that makes ``hgsgc train`` wait, after its first (graph-tracing) step and
#: before its timed steps, until ``N`` processes have reached the same point: ``DIR:N[:TIMEOUT_S]``
#: (set by the bench for its ``compute_only_shared`` copies; see :func:`start_barrier`).
START_BARRIER_ENV = "HGSGC_START_BARRIER"


def parse_start_barrier(value: str) -> Tuple[str, int, float]:
    """``(directory, copies, timeout_s)`` of a :data:`START_BARRIER_ENV` value ``DIR:N[:TIMEOUT_S]``
    (timeout 600 s when not given). Raises ValueError naming the variable on a malformed value."""
    parts = value.rsplit(":", 2)
    try:
        if len(parts) == 3 and parts[1].isdigit():
            path, n, timeout = parts[0], int(parts[1]), float(parts[2])
        else:
            path, n = value.rsplit(":", 1)
            n, timeout = int(n), 600.0
    except ValueError:
        raise ValueError(f"{START_BARRIER_ENV}={value!r}: expected DIR:COPIES[:TIMEOUT_S], e.g. "
                         f"/tmp/barrier:4:600") from None
    if not path or n < 1 or not timeout > 0:
        raise ValueError(f"{START_BARRIER_ENV}={value!r}: expected a directory, COPIES >= 1 and "
                         f"TIMEOUT_S > 0, e.g. /tmp/barrier:4:600")
    return path, n, timeout


def start_barrier(value: Optional[str] = None, poll_s: float = 0.002) -> Optional[dict]:
    """Wait until ``COPIES`` processes have called this with the same directory (a file barrier).

    Why: the bench's ``compute_only_shared`` measurement runs ``n`` independent one-process
    trainings at once to measure the compute step of ``n`` emulated hosts sharing this machine's
    cores. Their start-up (import, data, graph tracing) takes seconds and differs between copies,
    while their timed steps take a fraction of a second, so without a barrier the copies' timed
    windows barely overlap and the "shared" step is close to the step alone (session 18: VGG-16,
    4 copies, 5-9 steps of ~55 ms inside 6-9 s of wall time). Called between the traced step and
    the first timed step, this lines the timed windows up.

    ``value``: ``DIR:COPIES[:TIMEOUT_S]`` (default: the :data:`START_BARRIER_ENV` variable; unset or
    empty: returns None at once). Each caller creates ``DIR/<host>-<pid>`` and polls ``DIR`` every
    ``poll_s`` seconds until it holds ``COPIES`` entries. Returns ``{"arrived_unix_s",
    "released_unix_s", "copies"}`` (``time.time()``). Raises TimeoutError naming the variable when
    the others do not arrive within ``TIMEOUT_S`` (a copy that failed), ValueError on a malformed
    value."""
    import socket
    import time

    value = os.environ.get(START_BARRIER_ENV, "") if value is None else value
    if not value:
        return None
    path, n, timeout = parse_start_barrier(value)
    os.makedirs(path, exist_ok=True)
    arrived = time.time()
    open(os.path.join(path, f"{socket.gethostname()}-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + timeout
    while True:
        k = len([f for f in os.listdir(path) if not f.startswith(".")])
        if k >= n:
            return {"arrived_unix_s": arrived, "released_unix_s": time.time(), "copies": n}
        if time.monotonic() > deadline:
            raise TimeoutError(f"{START_BARRIER_ENV}={value}: {k} of {n} processes reached the start of "
                               f"the timed steps within {timeout:g} s (another copy failed or is stuck; "
                               f"see its log)")
        time.sleep(poll_s)
