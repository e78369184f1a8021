"""Smoke tests of the emulated bandwidth-limited cluster (scripts/cluster/, docs/cluster.md).

They need root and network namespaces. CI runs as root, so a machine that cannot create
namespaces FAILS these tests (with the reason) instead of skipping them. Each test uses its own
prefix (hgct + 6 hex digits) and tears its cluster down in a finalizer, even on failure.
"""
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_DIR = os.path.join(ROOT, "scripts", "cluster")
sys.path.insert(0, ROOT)
from hgsgc.cluster import CLUSTER_SH, ClusterError, EmulatedCluster, cluster_sh  # noqa: E402

BENCH_NET = ipaddress.ip_network("198.18.0.0/15")

# Framing overhead, measured with scripts/cluster/measure_overhead.py on the default cluster
# (100mbit tbf, one MSS per skb, MTU 1500; see docs/cluster.md): the interface tx_bytes of a host
# exceeded the formula bytes (n-1)*p per allgather / p per ring Sendrecv by 5.3-6.1 % for payloads
# of 64 kB..10 MB on 2, 3 and 4 hosts (Ethernet+IP+TCP headers, 66 bytes per 1448-byte segment
# = 4.6 %, plus pure ACKs and Open MPI's fragment headers), plus the fixed bytes of one mpirun
# with an empty payload (launch, wire-up, barriers, finalize): 3.5-6.5 kB per host on 2 hosts.
# The bounds leave room for run-to-run variation (TCP ACK timing) without hiding a doubled count.
OVERHEAD_BOUND = 0.10
FIXED_BYTES = 64 * 1024
# every data frame carries at least Ethernet+IP+TCP headers (54 bytes per <= 1460 payload bytes):
# traffic that bypassed the emulated link (shared memory, loopback) could not reach this floor
FRAMING_FLOOR = 0.03


def _prefix():
    return "hgct" + uuid.uuid4().hex[:6]


def _netns():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _root_links():
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(": ")[1].split("@")[0] for line in out.splitlines() if ": " in line}


def _leftovers(prefix):
    """Namespaces and root-namespace links of this prefix (there must be none after down)."""
    return sorted(n for n in _netns() | _root_links() if n.startswith(prefix + "-"))


NO_NETNS = ("cannot bring up the emulated cluster (needs root and network namespaces; CI runs as "
            "root, so this is a failure, not a skip): ")


def _no_refusal(r):
    """Fail clearly when cluster.sh refused to create namespaces (exit 2, 'cannot create')."""
    if r.returncode == 2 and "cannot create network namespaces" in r.stderr:
        pytest.fail(NO_NETNS + r.stderr.strip(), pytrace=False)
    return r


def _bring_up(request, n, **kw):
    c = EmulatedCluster(n, prefix=_prefix(), **kw)
    request.addfinalizer(lambda: cluster_sh("down", "--prefix", c.prefix, check=False))
    try:
        c.up()
    except ClusterError as e:
        pytest.fail(NO_NETNS + str(e), pytrace=False)
    return c


@pytest.fixture
def cluster2(request):
    return _bring_up(request, 2)


@pytest.mark.mpi
def test_interface_counters_match_formula_bytes(cluster2):
    p = 1_000_000
    nb, delta = cluster2.netbench(p, rounds=3, warmup=1, mode="both", python=sys.executable)
    assert nb["world_size"] == 2 and nb["payload_bytes"] == p
    # 2 ranks: allgather sends (n-1)*p = p per call, the ring Sendrecv p per call; 4 calls each
    assert nb["modes"]["allgather"]["bytes_sent_per_rank_per_round"] == p
    assert nb["modes"]["sendrecv"]["bytes_sent_per_rank_per_round"] == p
    sent, received = nb["bytes_sent_per_rank_total"], nb["bytes_received_per_rank_total"]
    assert sent == received == 8 * p
    assert set(delta) == {f"{cluster2.prefix}-h0", f"{cluster2.prefix}-h1"}
    for host, d in delta.items():
        for measured, formula in ((d["tx_bytes"], sent), (d["rx_bytes"], received)):
            assert formula * (1 + FRAMING_FLOOR) <= measured, (host, d, formula)
            assert measured <= formula * (1 + OVERHEAD_BOUND) + FIXED_BYTES, (host, d, formula)


def test_layout_addresses_and_qdiscs(cluster2):
    pre = cluster2.prefix
    counters = cluster2.counters()
    assert sorted(counters) == [f"{pre}-h0", f"{pre}-h1"]
    for i in range(2):
        ns, hif, pif = f"{pre}-h{i}", f"{pre}-e{i}", f"{pre}-p{i}"
        assert counters[ns]["interface"] == hif and counters[ns]["address"] == f"198.18.0.{10 + i}"
        for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
            assert isinstance(counters[ns][key], int)
        # bandwidth limited in both directions: the host's egress and its bridge port's egress
        for netns, dev in ((ns, hif), (f"{pre}-sw", pif)):
            q = subprocess.run(["tc", "-n", netns, "qdisc", "show", "dev", dev],
                               capture_output=True, text=True, check=True).stdout
            assert "tbf" in q and "rate 100Mbit" in q, (netns, dev, q)
    # no address outside 198.18.0.0/15 (loopback aside), no IPv6, nothing in the root namespace
    for ns in (f"{pre}-h0", f"{pre}-h1", f"{pre}-sw"):
        out = json.loads(subprocess.run(["ip", "-n", ns, "-j", "addr", "show"], capture_output=True,
                                        text=True, check=True).stdout)
        for link in out:
            for a in link.get("addr_info", []):
                addr = ipaddress.ip_address(a["local"])
                assert addr.is_loopback or addr in BENCH_NET, (ns, link["ifname"], a)
                assert addr.version == 4 or addr.is_loopback, (ns, link["ifname"], a)
    assert not [n for n in _root_links() if n.startswith(pre + "-")]
    hostfile = open(cluster2.hostfile).read().split("\n")
    assert [ln for ln in hostfile if ln] == [f"{pre}-h0 slots=1", f"{pre}-h1 slots=1"]


def test_agent_accepts_ssh_options(cluster2):
    pre = cluster2.prefix
    r = subprocess.run([cluster2.agent, "-x", "-T", "-o", "BatchMode=yes", "-p22", "-l", "root",
                        f"root@{pre}-h1", "ip", "-4", "-br", "addr", "show", "dev", f"{pre}-e1"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "198.18.0.11/24" in r.stdout, r
    r = subprocess.run([cluster2.agent, "-x", "198.18.0.10", "echo", "$0"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "/bin/sh", r  # a shell runs the command
    r = subprocess.run([cluster2.agent, "not-a-host", "true"], capture_output=True, text=True)
    assert r.returncode == 255 and "not part of emulated cluster" in r.stderr


@pytest.mark.parametrize("sub", ["up", "down", "counters", "mpirun", "run"])
def test_refuses_non_root_via_override(sub):
    pre = _prefix()
    argv = {"up": ["up", "2", "--prefix", pre],
            "down": ["down", "--prefix", pre],
            "counters": ["counters", "--prefix", pre],
            "mpirun": ["mpirun", "--prefix", pre, "--", "true"],
            "run": ["run", "2", "--prefix", pre, "--", "true"]}[sub]
    r = cluster_sh(*argv, check=False, env=dict(os.environ, HGSGC_CLUSTER_FAKE_UID="1000"))
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "must run as root (uid is 1000)" in lines[0], r.stderr
    assert not _leftovers(pre)


def test_refuses_real_non_root_user():
    setpriv = shutil.which("setpriv")
    if setpriv:
        cmd = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "bash", CLUSTER_SH,
               "up", "2", "--prefix", "hgctnobody"]
    else:
        cmd = ["su", "nobody", "-s", "/bin/bash", "-c", f"bash {CLUSTER_SH} up 2 --prefix hgctnobody"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd="/")
    assert r.returncode == 2, r
    assert "must run as root (uid is 65534)" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not _leftovers("hgctnobody")


def test_refuses_when_ip_netns_unusable(tmp_path):
    fake = tmp_path / "ip"
    fake.write_text('#!/bin/sh\necho "mount --make-shared /run/netns failed: Operation not permitted" >&2\n'
                    "exit 1\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    r = cluster_sh("up", "2", "--prefix", _prefix(), check=False, env=env)
    assert r.returncode == 2, r
    assert len(r.stderr.strip().splitlines()) == 1
    assert "'ip netns' is not usable here" in r.stderr and "Operation not permitted" in r.stderr


def test_latency_needs_netem(request):
    pre = _prefix()
    request.addfinalizer(lambda: cluster_sh("down", "--prefix", pre, check=False))
    r = _no_refusal(cluster_sh("up", "1", "--prefix", pre, "--latency", "5ms", check=False))
    if r.returncode == 0:  # a kernel with sch_netem: the delay must really be installed
        q = subprocess.run(["tc", "-n", f"{pre}-h0", "qdisc", "show", "dev", f"{pre}-e0"],
                           capture_output=True, text=True).stdout
        assert "netem" in q and "delay 5ms" in q, q
    else:
        assert r.returncode == 2, r
        assert "netem" in r.stderr and "--latency" in r.stderr, r.stderr
        assert not _leftovers(pre)


def test_down_removes_everything_and_is_idempotent():
    pre = _prefix()
    try:
        cluster_sh("up", "3", "--prefix", pre)
        assert {f"{pre}-h0", f"{pre}-h1", f"{pre}-h2", f"{pre}-sw"} <= _netns()
        # leftovers from a crashed run: a stray host namespace and a veth in the root namespace
        subprocess.run(["ip", "netns", "add", f"{pre}-h7"], check=True)
        subprocess.run(["ip", "link", "add", f"{pre}-e9", "type", "veth", "peer", "name", f"{pre}-p9"],
                       check=True)
    except ClusterError as e:
        pytest.fail(NO_NETNS + str(e), pytrace=False)
    finally:
        r = cluster_sh("down", "--prefix", pre, check=False)
    assert r.returncode == 0, r
    assert not _leftovers(pre)
    assert not os.path.exists(f"/tmp/hgsgc-cluster/{pre}")
    r = cluster_sh("down", "--prefix", pre, check=False)  # again: nothing to do, still fine
    assert r.returncode == 0 and not _leftovers(pre), r


@pytest.mark.mpi
def test_run_tears_down_when_the_program_fails():
    pre = _prefix()
    try:
        r = _no_refusal(cluster_sh("run", "2", "--prefix", pre, "--", "sh", "-c", "exit 3",
                                   check=False))
    finally:
        leftovers = _leftovers(pre)
        cluster_sh("down", "--prefix", pre, check=False)
    assert r.returncode == 3, r
    assert not leftovers


@pytest.mark.mpi
def test_run_tears_down_on_ctrl_c():
    pre = _prefix()
    # a runner started in the background (CI, nohup ... &) has SIGINT ignored, and a shell that
    # starts with SIGINT ignored cannot trap it: give the script a terminal's default disposition
    p = subprocess.Popen(["bash", CLUSTER_SH, "run", "2", "--prefix", pre, "--", "sleep", "120"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # wait (polling, bounded) until both ranks run inside their host namespaces
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and p.poll() is None:
            pids = [subprocess.run(["ip", "netns", "pids", f"{pre}-h{i}"], capture_output=True,
                                   text=True).stdout.split() for i in range(2)]
            if all(len(x) >= 2 for x in pids):  # the daemon and its rank on each host
                break
            time.sleep(0.1)
        else:
            if p.poll() is not None:
                _no_refusal(subprocess.CompletedProcess(p.args, p.returncode, *p.communicate()))
            pytest.fail(f"the ranks never started (exit code {p.poll()})", pytrace=False)
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        leftovers = _leftovers(pre)
        cluster_sh("down", "--prefix", pre, check=False)
    assert p.returncode == 130, (p.returncode, err)
    assert not leftovers, leftovers


@pytest.mark.mpi
def test_ranks_are_not_bound_to_one_core(cluster2, tmp_path):
    """Each emulated host is a one-slot node, so Open MPI's default binding (core, for <= 2 ranks)
    put the rank of every host on core 0; cluster.sh launches with ``--bind-to none``: each rank
    starts with every core this process may use, and HGSGC_PIN_CORES=1 pins rank r to its own core
    ``r % cores`` (different cores for the 2 ranks when the machine has 2 or more).

    Each rank writes its own file (the emulated hosts share this file system): two ranks printing
    to mpirun's forwarded stdout at once can land on one line (``{...}{...}``, seen once in CI)."""
    cores = sorted(os.sched_getaffinity(0))
    prog = ("import os, sys, json; m = sorted(os.sched_getaffinity(0)); from hgsgc.runtime import pin_to_core; "
            "c = pin_to_core(); r = int(os.environ['OMPI_COMM_WORLD_RANK']); "
            "open(os.path.join(sys.argv[1], 'rank%d.json' % r), 'w').write("
            "json.dumps({'rank': r, 'mask': m, 'pinned': c}))")
    env = dict(os.environ, HGSGC_PIN_CORES="1", PYTHONPATH=ROOT)
    p = cluster2.mpirun(["-np", "2", sys.executable, "-c", prog, str(tmp_path)], env=env, timeout=120)
    out = sorted((json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in out] == [0, 1], (p.stdout, p.stderr)
    assert all(r["mask"] == cores for r in out), out
    assert [r["pinned"] for r in out] == [cores[0], cores[1 % len(cores)]], out
