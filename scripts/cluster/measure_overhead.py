#!/usr/bin/env python3
"""Measure, on the emulated cluster, how the interface counters compare with the formula bytes.

For each host count and payload size it runs netbench.py (one mode at a time) and reads the
interface counters before and after the whole mpirun. The run with --size 0 gives the fixed
bytes of one mpirun (launch, wire-up, barriers, finalize); the overhead of the others is
(tx - fixed) / formula - 1. Needs root; prints one JSON line per run and a table at the end.

    sudo .venv/bin/python scripts/cluster/measure_overhead.py --hosts 2 3 4 --sizes 0 64kB 1MB 10MB
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated import EmulatedCluster  # noqa: E402
from netbench import parse_size  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[2])
    ap.add_argument("--sizes", nargs="+", default=["0", "64kB", "1MB", "10MB"])
    ap.add_argument("--modes", nargs="+", default=["allgather", "sendrecv"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--prefix", default="hgcm")
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--mpi-args", default="", help="extra mpirun arguments, one string")
    args = ap.parse_args()
    rows = []
    for n in args.hosts:
        with EmulatedCluster(n, args.bandwidth, args.prefix, offload=args.offload) as c:
            for mode in args.modes:
                fixed = None
                for size in map(parse_size, args.sizes):
                    nb, d = c.netbench(size, rounds=args.rounds, mode=mode,
                                       mpi_args=args.mpi_args.split())
                    tx = [v["tx_bytes"] for v in d.values()]
                    rx = [v["rx_bytes"] for v in d.values()]
                    f = nb["bytes_sent_per_rank_total"]
                    if size == 0:
                        fixed = max(tx)
                    m = nb["modes"][mode]
                    row = {"hosts": n, "mode": mode, "size": size, "formula_per_rank": f,
                           "tx": tx, "rx": rx, "fixed": fixed,
                           "overhead_min": (min(tx) - (fixed or 0)) / f - 1 if f else None,
                           "overhead_max": (max(tx) - (fixed or 0)) / f - 1 if f else None,
                           "ratio_raw_max": max(tx) / f if f else None,
                           "median_round_s": m.get("time_per_round_s", {}).get("median"),
                           "mbit_s": m.get("throughput_mbit_s_per_rank"),
                           "dropped": sum(v["tx_dropped"] + v["rx_dropped"] for v in d.values())}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\n{'n':>2} {'mode':<9} {'size':>9} {'formula/rank':>12} {'max tx':>10} {'fixed':>7} "
          f"{'ovh min%':>8} {'ovh max%':>8} {'raw max%':>8} {'Mbit/s':>7}")
    for r in rows:
        pct = (lambda x: f"{100 * x:8.2f}" if x is not None else f"{'-':>8}")
        print(f"{r['hosts']:>2} {r['mode']:<9} {r['size']:>9} {r['formula_per_rank']:>12} "
              f"{max(r['tx']):>10} {r['fixed'] or 0:>7} {pct(r['overhead_min'])} "
              f"{pct(r['overhead_max'])} {pct(r['ratio_raw_max'] - 1 if r['ratio_raw_max'] else None)} "
              f"{(r['mbit_s'] or 0):7.1f}")


if __name__ == "__main__":
    main()
