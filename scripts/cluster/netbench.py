#!/usr/bin/env python3
"""Network micro-benchmark for the emulated cluster (mpi4py).

For a payload of P bytes per rank it runs R timed rounds (after W warm-up rounds) of

* ``allgather``: ``comm.Allgather`` of P bytes per rank; every rank sends and receives
  (n-1)*P bytes per round (ring, Bruck and recursive doubling all move that much);
* ``sendrecv``: a ring shift with ``comm.Sendrecv``: rank r sends P bytes to r+1 and receives P
  bytes from r-1; every rank sends and receives P bytes per round (0 when n == 1).

Rank 0 prints one JSON object with the formula bytes (per round and in total, warm-up included)
and the measured time per round (the slowest rank's time, each round starts after a barrier).

    cluster.sh mpirun -- .venv/bin/python scripts/cluster/netbench.py --size 1MB --rounds 5

Sizes accept a plain byte count or a suffix: kB/MB/GB (10^3..), KiB/MiB/GiB (2^10..).
"""
import argparse
import json
import os
import re
import socket
import statistics
import sys

import numpy as np

MPI = None  # mpi4py.MPI, imported in main(): importing this module must not initialise MPI

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 1048576, 1MB, 1MiB, 64kB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def formula(mode, n, p):
    """(bytes sent, bytes received) per rank per round."""
    if n == 1:
        return 0, 0
    if mode == "allgather":
        return (n - 1) * p, (n - 1) * p
    if mode == "sendrecv":
        return p, p
    if mode == "allreduce":  # ring / Rabenseifner volume (Open MPI's choice for large buffers)
        return 2 * (n - 1) * p // n, 2 * (n - 1) * p // n
    raise ValueError(mode)


def run_mode(comm, mode, p, rounds, warmup):
    n, r = comm.Get_size(), comm.Get_rank()
    send = np.random.default_rng(r).integers(0, 256, size=p, dtype=np.uint8)
    if mode == "allgather":
        recv = np.empty(n * p, dtype=np.uint8)

        def op():
            comm.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])
    elif mode == "allreduce":  # a sum of float32 (p // 4 of them), as Horovod's fused allreduce
        vals = np.full(p // 4, r + 1, dtype=np.float32)
        out = np.empty_like(vals)

        def op():
            comm.Allreduce([vals, MPI.FLOAT], [out, MPI.FLOAT], op=MPI.SUM)
    else:
        recv = np.empty(p, dtype=np.uint8)
        dst, src = (r + 1) % n, (r - 1) % n

        def op():
            comm.Sendrecv([send, MPI.BYTE], dest=dst, sendtag=7, recvbuf=[recv, MPI.BYTE],
                          source=src, recvtag=7)

    times = []
    barriers = 0
    for i in range(warmup + rounds):
        comm.Barrier()
        barriers += 1
        t0 = MPI.Wtime()
        op()
        t1 = MPI.Wtime()
        if i >= warmup:
            times.append(t1 - t0)
    # check the data actually arrived (allgather: block j comes from rank j)
    if mode == "allgather" and p:
        for j in range(n):
            expect = np.random.default_rng(j).integers(0, 256, size=p, dtype=np.uint8)
            if not np.array_equal(recv[j * p:(j + 1) * p], expect):
                raise RuntimeError(f"rank {r}: allgather block {j} is wrong")
    elif mode == "allreduce" and p // 4:
        if not np.all(out == n * (n + 1) // 2):
            raise RuntimeError(f"rank {r}: allreduce sum is wrong")
    elif mode == "sendrecv" and p:
        expect = np.random.default_rng((r - 1) % n).integers(0, 256, size=p, dtype=np.uint8)
        if not np.array_equal(recv, expect):
            raise RuntimeError(f"rank {r}: sendrecv payload from rank {(r - 1) % n} is wrong")
    return times, barriers


def summarize(mode, n, p, rounds, warmup, all_times, barriers):
    sent, recvd = formula(mode, n, p)
    per_round = [max(ts[i] for ts in all_times) for i in range(rounds)]  # the slowest rank
    out = {
        "bytes_sent_per_rank_per_round": sent,
        "bytes_received_per_rank_per_round": recvd,
        "calls": warmup + rounds,
        "bytes_sent_per_rank_total": sent * (warmup + rounds),
        "bytes_received_per_rank_total": recvd * (warmup + rounds),
        "barriers": barriers,
    }
    if per_round:
        med = statistics.median(per_round)
        out["time_per_round_s"] = {
            "mean": statistics.fmean(per_round), "median": med,
            "min": min(per_round), "max": max(per_round), "all": per_round,
        }
        # per-rank send rate: what each rank's link carries (payload only, no framing)
        out["throughput_mbit_s_per_rank"] = sent * 8 / med / 1e6 if med > 0 else None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1MB"), help="payload bytes per rank")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per mode")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones")
    ap.add_argument("--mode", choices=["allgather", "sendrecv", "allreduce", "both"], default="both")
    ap.add_argument("--out", help="also write the JSON here (rank 0)")
    ap.add_argument("--pin", action="store_true",
                    help="each rank on core (rank %% cores) (as hgsgc bench's pin: true): emulated hosts "
                         "share one machine, and Open MPI binds each host's rank 0 to the same core")
    args = ap.parse_args(argv)
    if args.pin:  # before MPI starts its threads (they inherit the mask)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from hgsgc.runtime import pin_to_core

        pin_to_core({**os.environ, "HGSGC_PIN_CORES": "1"})
    global MPI
    from mpi4py import MPI
    if args.rounds < 0 or args.warmup < 0 or args.size < 0:
        ap.error("--rounds, --warmup and --size must be >= 0")

    comm = MPI.COMM_WORLD
    n, r = comm.Get_size(), comm.Get_rank()
    modes = ["allgather", "sendrecv"] if args.mode == "both" else [args.mode]
    hosts = comm.gather(MPI.Get_processor_name() + "/" + socket.gethostname(), root=0)
    result = {
        "world_size": n,
        "payload_bytes": args.size,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "modes": {},
    }
    total_sent = total_recv = 0
    for mode in modes:
        times, barriers = run_mode(comm, mode, args.size, args.rounds, args.warmup)
        all_times = comm.gather(times, root=0)
        if r == 0:
            s = summarize(mode, n, args.size, args.rounds, args.warmup, all_times, barriers)
            result["modes"][mode] = s
            total_sent += s["bytes_sent_per_rank_total"]
            total_recv += s["bytes_received_per_rank_total"]
    if r == 0:
        result["bytes_sent_per_rank_total"] = total_sent
        result["bytes_received_per_rank_total"] = total_recv
        result["processes"] = hosts
        text = json.dumps(result)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
