import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
PY = sys.executable
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]

# Every MPI job the tests start (through mpirun() below or their own subprocess) runs with the
# Open MPI setting `hgsgc` itself applies before MPI starts (hgsgc/runtime.py): the progress loop
# yields the core while it waits. Without it, 3-5 ranks oversubscribed on 2 cores busy-poll each
# other's cores away (a 2-rank launch took 122 s instead of 24 s at load ~50, st9, session 9).
# A value already in the environment wins, as in hgsgc.runtime.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


def load_script(*parts):
    """Import a file under ``scripts/`` (not a package) as a module, e.g.
    ``load_script("cluster", "perfmodel_validation.py")``."""
    import importlib.util

    path = os.path.join(ROOT, "scripts", *parts)
    spec = importlib.util.spec_from_file_location(os.path.splitext(parts[-1])[0], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mpirun(np_, args, timeout=300, env=None):
    """Run ``args`` (a python script and its arguments) under mpirun with np_ ranks."""
    e = dict(os.environ)
    e.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    cmd = MPIRUN + ["-np", str(np_), "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL",
                    "-x", "OMPI_MCA_mpi_yield_when_idle"]
    for k in (env or {}):
        cmd += ["-x", k]
    cmd += [PY] + list(args)
    # its own process group: on a timeout the whole job goes, ranks included (subprocess.run
    # would SIGKILL mpirun alone, and its ranks went on, orphaned, burning CPU for the rest of
    # the suite: one 3-rank check_state9.py rank ran 27 min after its test's timeout, session 14)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=ROOT,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _end_group(p)
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _end_group(p, grace_s=10):
    """SIGTERM to ``p``'s process group (mpirun forwards it to its ranks), SIGKILL to the group
    after ``grace_s`` seconds; returns ``p``'s output ``(stdout, stderr)``."""
    import signal

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return p.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def mpi_result(np_, args, timeout=400):
    """Run a tests/mpi script under mpirun; return the JSON of its ``RESULT {...}`` line.

    Fails the test with the run's output when it exits non-zero or prints no result, and checks
    that the result reports ``np_`` ranks.
    """
    import json

    p = mpirun(np_, args, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(line[0][7:])
    assert out["size"] == np_ and ("ranks" not in out or len(out["ranks"]) == np_)
    return out


@pytest.fixture
def run_mpi():
    return mpirun


# ------------------------------------------------------------------ several checks, one launch
# A launch costs every rank a TensorFlow + Horovod import (~6-7 s of CPU per rank, 13-27 s of wall
# time for 2-4 ranks on the CI's 2 cores), more than many checks take. So the RESULT-line checks
# of tests/mpi run batched: a test module lists its cases in ``MPI_CASES`` (``mpi_cases(...)``);
# the first test that needs a result for ``np_`` ranks starts ONE mpirun launch of
# tests/mpi/run_many.py with every collected module's cases for ``np_`` ranks, each case run as
# ``__main__`` with its own arguments and its own timeout, and its RESULT asserted by the tests of
# its module exactly as with its own launch. A case that fails ends the launch (no hangs): it and
# the cases after it fail their tests, naming the case and showing the output.


def mpi_cases(script, *args, ranks, timeout=300, tmp=None, dynamic=False, own_horovod=False):
    """Cases for ``MPI_CASES``: ``script`` (path from the repository root) with ``args`` under
    mpirun with each rank count in ``ranks``. ``timeout``: seconds for this case alone. ``tmp``:
    the case gets a fresh directory in place of ``"{tmp}"`` in ``args``; a callable is called with
    that directory (a ``pathlib.Path``) before the launch. ``dynamic``: the script calls
    ``hvd.init(process_sets="dynamic")``; such cases run in their own launch, which starts Horovod
    that way. ``own_horovod``: the script shuts the launch's Horovod down and starts its own (the
    Hourglass ``Layout``, static process sets); such cases run after every other case of the
    launch, so no other case meets their Horovod."""
    return [dict(np=np_, script=script, args=tuple(args), timeout=timeout, tmp=tmp, dynamic=dynamic,
                 own_horovod=own_horovod) for np_ in ranks]


def _case_key(script, args):
    return " ".join((os.path.basename(script),) + tuple(args))


class MpiBatch:
    """Runs the collected modules' ``MPI_CASES`` per (rank count, dynamic) in one launch each."""

    def __init__(self, session, tmp_path_factory):
        self.session, self.tmp = session, tmp_path_factory
        self.runs = {}  # (np, dynamic) -> (results by key, tmp dirs by key, output, returncode)

    def _cases(self, np_, dynamic):
        seen, cases = set(), []
        for item in self.session.items:
            mod = getattr(item, "module", None)
            for c in getattr(mod, "MPI_CASES", ()):
                key = _case_key(c["script"], c["args"])
                if c["np"] == np_ and c["dynamic"] == dynamic and key not in seen:
                    seen.add(key)
                    cases.append(c)
        return sorted(cases, key=lambda c: c.get("own_horovod", False))  # stable: theirs last

    def _run(self, np_, dynamic):
        import json

        cases, specs, dirs = self._cases(np_, dynamic), [], {}
        for c in cases:
            key = _case_key(c["script"], c["args"])
            args = list(c["args"])
            if c["tmp"] is not None:
                d = self.tmp.mktemp(f"np{np_}_" + os.path.basename(c["script"])[:-3])
                if callable(c["tmp"]):
                    c["tmp"](d)
                dirs[key] = str(d)
                args = [a.replace("{tmp}", str(d)) for a in args]
            specs.append({"key": key, "argv": [c["script"]] + args, "timeout": c["timeout"]})
        argv = ["tests/mpi/run_many.py"] + (["--dynamic"] if dynamic else []) + [json.dumps(specs)]
        try:
            p = mpirun(np_, argv, timeout=sum(s["timeout"] for s in specs) + 60)
            out, rc = p.stdout + "\n--- stderr ---\n" + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = f"{e.stdout}\n--- stderr ---\n{e.stderr}\nthe launch timed out", None
        log = self.tmp.getbasetemp() / f"mpi_batch_np{np_}{'_dynamic' if dynamic else ''}.log"
        log.write_text(out)  # the whole launch's output, for a look after the run
        results = {}
        lines = p.stdout.splitlines() if rc is not None else []
        # a non-zero exit that no case owns (no ``CASE ... ERROR|TIMEOUT`` line: e.g. a crash at
        # the end of the process) fails every case, as it failed each launch before
        owned = rc == 0 or any(ln.startswith("CASE ") and (" ERROR " in ln or " TIMEOUT " in ln)
                               for ln in lines)
        for line in lines if owned else ():
            for s in specs:
                head = f"CASE {s['key']} RESULT "
                if line.startswith(head):
                    results[s["key"]] = json.loads(line[len(head):])
        self.runs[(np_, dynamic)] = (results, dirs, out, rc, [s["key"] for s in specs])

    def result(self, np_, script, *args):
        """The RESULT JSON of ``script args`` under ``np_`` ranks (failing the test with the
        launch's output when it has none); checks it reports ``np_`` ranks."""
        case = [c for item in self.session.items for c in getattr(getattr(item, "module", None), "MPI_CASES", ())
                if c["np"] == np_ and _case_key(c["script"], c["args"]) == _case_key(script, args)]
        assert case, f"{_case_key(script, args)} with {np_} ranks is not in the module's MPI_CASES"
        group = (np_, case[0]["dynamic"])
        if group not in self.runs:
            self._run(*group)
        results, dirs, out, rc, keys = self.runs[group]
        key = _case_key(script, args)
        if key not in results:
            pytest.fail(f"no RESULT for {key!r} on {np_} ranks (launch of {keys}, exit {rc}):\n"
                        + out[-6000:], pytrace=False)
        res = results[key]
        assert res["size"] == np_ and ("ranks" not in res or len(res["ranks"]) == np_)
        return res

    def tmpdir(self, np_, script, *args):
        """The directory the case got for ``"{tmp}"`` (after :meth:`result`)."""
        key = _case_key(script, args)
        return next(run[1][key] for (n, _), run in self.runs.items() if n == np_ and key in run[1])


@pytest.fixture(scope="session")
def mpi_batch(request, tmp_path_factory):
    return MpiBatch(request.session, tmp_path_factory)
