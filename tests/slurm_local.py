"""A single-node Slurm on localhost from Debian's packages, for tests (no systemd needed).

``with local_slurm(tmp) as env:`` starts ``munged`` (as the munge user, its own socket),
``slurmctld -D`` and ``slurmd -D`` with a generated ``slurm.conf`` in ``tmp`` (``SlurmctldHost``
and ``NodeName`` = ``hostname -s``, ``proctrack/linuxproc``, ``task/none``: no cgroups), waits until
the node is idle and yields an environment with ``SLURM_CONF`` set. On the way out (also when the
body fails) it stops the three daemons by PID: SIGTERM, then SIGKILL after 10 s.
"""
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scontrol")


def missing_tools():
    return [t for t in NEEDED if not shutil.which(t)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: ``AuthInfo`` ``cred_expire`` (slurm.conf(5)): the job credential's lifetime, which "also controls how
#: long a requeued job must wait before starting again" (default 120 s: the preemption test's
#: requeued job sat idle for two minutes of the suite). 30 s still covers a batch launch on the
#: loaded CI machine (seconds).
CRED_EXPIRE_S = 30


def write_conf(d, host, cpus, munge_dir):
    ctl, node = _free_port(), _free_port()
    conf = f"""ClusterName=hgsgctest
SlurmctldHost={host}
SlurmctldPort={ctl}
SlurmdPort={node}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_dir}/munge.sock,cred_expire={CRED_EXPIRE_S}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdTimeout=30
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""
    path = os.path.join(d, "slurm.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


@contextlib.contextmanager
def local_slurm(d, cpus=4, timeout=60):
    d = str(d)
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    # munged runs as the munge user, who may not traverse d (pytest's folders are 0700 root):
    # its socket, key copy and logs live in a folder of their own under /tmp
    m = tempfile.mkdtemp(prefix="hgsgc-munge-")
    os.chmod(m, 0o755)
    shutil.copy("/etc/munge/munge.key", os.path.join(m, "munge.key"))
    for path in (m, os.path.join(m, "munge.key")):
        shutil.chown(path, "munge", "munge")
    os.chmod(os.path.join(m, "munge.key"), 0o400)
    conf = write_conf(d, host, cpus, m)
    env = dict(os.environ, SLURM_CONF=conf)
    procs = []
    logs = []
    try:
        # setpriv execs munged in place, so the PID we hold is munged's own
        procs.append(subprocess.Popen(
            ["setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "munged", "-F", "-f",
             f"--socket={m}/munge.sock", f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid",
             f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        for _ in range(100):
            if os.path.exists(f"{m}/munge.sock"):
                break
            time.sleep(0.1)
        for daemon in ("slurmctld", "slurmd"):
            log = open(os.path.join(d, daemon + ".out"), "w")
            logs.append(log)
            procs.append(subprocess.Popen([daemon, "-D", "-f", conf], env=env, stdout=log, stderr=subprocess.STDOUT))
        t0 = time.time()
        state = ""
        while time.time() - t0 < timeout:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}: see {d}/*.log, {d}/*.out")
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            state = r.stdout.strip()
            if state in ("idle", "mixed"):
                break
            time.sleep(0.3)
        else:
            raise RuntimeError(f"Slurm node not idle after {timeout} s (sinfo: {state!r}); see {d}/*.log")
        yield env
    finally:
        _stop(procs[::-1])
        for f in logs:
            f.close()
        for f in ("munged.log",):
            if os.path.exists(os.path.join(m, f)):
                shutil.copy(os.path.join(m, f), os.path.join(d, f))
        shutil.rmtree(m, ignore_errors=True)


def wait_job(env, job_id, timeout):
    """Wait until the job leaves the queue; returns ``scontrol show job`` state text (or '')."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        r = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], env=env, capture_output=True, text=True)
        if not r.stdout.strip():
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", str(job_id)], env=env)
        raise TimeoutError(f"job {job_id} still queued/running after {timeout} s")
    r = subprocess.run(["scontrol", "show", "job", str(job_id)], env=env, capture_output=True, text=True)
    return r.stdout
