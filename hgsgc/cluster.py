"""Python handle on the emulated cluster (scripts/cluster/cluster.sh) for tests and benchmarks.

    from hgsgc.cluster import EmulatedCluster

    with EmulatedCluster(n=3, bandwidth="100mbit", prefix="hgb1") as c:   # up ... down (always)
        before = c.counters()
        res = c.mpirun([sys.executable, "-m", "hgsgc", "train", "configs/x.yaml"])
        traffic = c.delta(before, c.counters())   # {host: {"tx_bytes": ..., "rx_bytes": ...}}

Needs root (cluster.sh refuses with exit code 2 otherwise; this module raises ClusterError).
Use a prefix of your own per test/benchmark so that runs cannot tear each other down.
"""
import json
import os
import signal
import subprocess

# cluster.sh and netbench.py stay scripts (run as subprocesses, never imported); they live in the
# source tree's scripts/cluster/ (an editable install, as scripts/install.sh makes)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_DIR = os.path.join(ROOT, "scripts", "cluster")
CLUSTER_SH = os.path.join(CLUSTER_DIR, "cluster.sh")
NETBENCH = os.path.join(CLUSTER_DIR, "netbench.py")


class ClusterError(RuntimeError):
    def __init__(self, msg, returncode=None, stdout="", stderr=""):
        super().__init__(msg)
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cluster_sh(*args, check=True, timeout=120, env=None, **kw):
    """Run cluster.sh with args; returns CompletedProcess (text, stdout/stderr captured).

    cluster.sh runs in its own process group: on a timeout or an interrupt (Ctrl-C in pytest)
    the whole group (mpirun included) gets SIGINT, like Ctrl-C in a terminal, so that `run`
    tears its cluster down; SIGKILL follows if it does not finish within 20 s.
    """
    argv = ["bash", CLUSTER_SH, *map(str, args)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, start_new_session=True, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # TimeoutExpired, KeyboardInterrupt
            for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    pass
            raise
    p = subprocess.CompletedProcess(argv, proc.returncode, out, err)
    if check and p.returncode != 0:
        raise ClusterError(f"cluster.sh {' '.join(map(str, args))} failed (exit {p.returncode}): "
                           f"{p.stderr.strip() or p.stdout.strip()}", p.returncode, p.stdout, p.stderr)
    return p


class EmulatedCluster:
    def __init__(self, n, bandwidth="100mbit", prefix="hgc", latency=None, offload=False):
        self.n, self.bandwidth, self.prefix = n, bandwidth, prefix
        self.latency, self.offload = latency, offload
        self.hostfile = self.agent = None
        self._up = False

    def up(self):
        args = ["up", self.n, "--bandwidth", self.bandwidth, "--prefix", self.prefix]
        if self.latency:
            args += ["--latency", self.latency]
        if self.offload:
            args.append("--offload")
        p = cluster_sh(*args)
        self._up = True
        for line in p.stdout.splitlines():
            key, _, val = line.partition(" ")
            if key == "hostfile":
                self.hostfile = val
            elif key == "agent":
                self.agent = val
        return self

    def down(self):
        cluster_sh("down", "--prefix", self.prefix)
        self._up = False

    def __enter__(self):
        try:
            return self.up()
        except BaseException:
            cluster_sh("down", "--prefix", self.prefix, check=False)
            raise

    def __exit__(self, *exc):
        self.down()
        return False

    def mpirun(self, args, check=True, timeout=600, **kw):
        """cluster.sh mpirun -- ARGS (mpirun options first, then the program)."""
        return cluster_sh("mpirun", "--prefix", self.prefix, "--", *args, check=check,
                          timeout=timeout, **kw)

    def counters(self):
        """{host namespace: {interface, address, tx_bytes, rx_bytes, tx_packets, ...}}"""
        return json.loads(cluster_sh("counters", "--prefix", self.prefix).stdout)

    @staticmethod
    def delta(before, after):
        keys = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets", "tx_dropped", "rx_dropped")
        return {h: {k: after[h][k] - before[h][k] for k in keys} for h in after}

    def netbench(self, size, rounds=5, warmup=1, mode="both", python=None, mpi_args=(), extra_args=()):
        """Run netbench.py over the cluster (``extra_args``: more netbench options, e.g. ``--pin``);
        returns (its JSON, counter deltas per host)."""
        import sys
        py = python or sys.executable
        before = self.counters()
        p = self.mpirun([*mpi_args, py, NETBENCH, "--size", str(size), "--rounds", str(rounds),
                         "--warmup", str(warmup), "--mode", mode, *extra_args])
        after = self.counters()
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise ClusterError(f"netbench printed no JSON: {p.stdout!r} {p.stderr!r}")
        return json.loads(lines[-1]), self.delta(before, after)
