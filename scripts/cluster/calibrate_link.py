#!/usr/bin/env python3
"""Calibrate the alpha-beta link model of hgsgc/perfmodel.py on the emulated cluster.

For each bandwidth, on 2 emulated hosts, runs netbench.py's ring ``Sendrecv`` (with 2 hosts both
ranks send to each other at once: a pairwise exchange) at several payload sizes, once with Open
MPI's default TCP BTL flags (its emulated-RDMA ``put`` protocol) and once without ``put``
(``--mca btl_tcp_flags send,inplace,need-ack,need-csum``), and fits ``t = alpha + P / beta`` by
least squares on the median round times. Reported per bandwidth: ``alpha_s``, ``beta_Bps``,
``efficiency = 8 beta / rate`` (no put) and ``bidir_factor = beta(put) / beta(no put)``, with the
load average before and after every run. Needs root. Writes JSON (``--out``)::

    sudo .venv/bin/python scripts/cluster/calibrate_link.py --bandwidths 10mbit 100mbit \\
        --out docs/benchmarks/link_calibration.json
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated import EmulatedCluster  # noqa: E402
from netbench import parse_size  # noqa: E402

NO_PUT = ["--mca", "btl_tcp_flags", "send,inplace,need-ack,need-csum"]


def _load():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def fit(points):
    """Least-squares ``t = a + x / beta`` over ``[(x bytes, t s), ...]``: ``(a, beta)``."""
    n = len(points)
    sx = sum(x for x, _ in points)
    sy = sum(t for _, t in points)
    sxx = sum(x * x for x, _ in points)
    sxy = sum(x * t for x, t in points)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    a = (sy - slope * sx) / n
    return a, 1.0 / slope


def parse_rate(text):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from hgsgc.perfmodel import parse_rate as pr

    return pr(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidths", nargs="+", default=["10mbit", "100mbit"])
    ap.add_argument("--sizes", nargs="+", default=["0", "256kB", "1MB", "2MB"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix", default="hgcal")
    ap.add_argument("--out", default=None)
    ap.add_argument("--mode", choices=["sendrecv", "allreduce"], default="sendrecv",
                    help="allreduce: MPI_Allreduce of a float32 buffer of the given size (what Horovod's "
                         "fused allreduce runs; on 2 ranks Rabenseifner's halves: pairwise too)")
    ap.add_argument("--pin", action="store_true", help="each rank on its own core (netbench.py --pin)")
    args = ap.parse_args(argv)
    mode = args.mode
    out = {"hosts": 2, "mode": "sendrecv (pairwise with 2 hosts)" if mode == "sendrecv" else
           "allreduce (MPI_Allreduce, float32 sum, 2 hosts)", "rounds": args.rounds, "pinned": args.pin, "cells": []}
    for bw in args.bandwidths:
        rate = parse_rate(bw)
        res = {"bandwidth": bw, "rate_bit_s": rate}
        with EmulatedCluster(2, bw, args.prefix) as c:
            for label, mpi in (("put", []), ("no_put", NO_PUT)):
                pts, runs = [], []
                for size in map(parse_size, args.sizes):
                    l0 = _load()
                    nb, _ = c.netbench(size, rounds=args.rounds, mode=mode, mpi_args=mpi,
                                       extra_args=["--pin"] if args.pin else [])
                    med = nb["modes"][mode]["time_per_round_s"]["median"]
                    # the fit is on the bytes each rank sends (allreduce on 2 ranks: the buffer)
                    pts.append((nb["modes"][mode]["bytes_sent_per_rank_per_round"], med))
                    runs.append({"size": size, "median_s": med,
                                 "all_s": nb["modes"][mode]["time_per_round_s"]["all"],
                                 "load_before": l0, "load_after": _load()})
                    print(json.dumps({"bandwidth": bw, "flags": label, **runs[-1]}), flush=True)
                a, beta = fit(pts)
                res[label] = {"alpha_s": a, "beta_Bps": beta, "mbit_s": beta * 8 / 1e6, "runs": runs}
        res["efficiency"] = res["no_put"]["beta_Bps"] * 8 / rate
        res["bidir_factor"] = res["put"]["beta_Bps"] / res["no_put"]["beta_Bps"]
        out["cells"].append(res)
        print(json.dumps({k: v for k, v in res.items() if k not in ("put", "no_put")} |
                         {"alpha_put_s": res["put"]["alpha_s"], "alpha_no_put_s": res["no_put"]["alpha_s"]}),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
