"""``hgsgc`` command line: ``hgsgc train CONFIG [key=value ...]``, ``hgsgc report RUN_DIR``.

Under ``mpirun``/``srun`` every rank runs the same command. A configuration error stops every
rank with one line (printed by rank 0 after one allgather in which the ranks agree on the
outcome of loading the config) and exit code 2 before training starts, as does a config that
loads on every rank but differs between ranks (a file or override not the same on every node;
only ``NODE_LOCAL_KEYS`` such as ``data.path`` may differ); an error every
rank raises alike is printed once (``hgsgc: error (all N ranks): ...``, exit 1); an error on some
ranks is printed once too (``hgsgc: error on rank R: ...`` or ``on ranks R,S: ...``, by the
lowest-numbered rank that failed first) and aborts the whole MPI job (exit 1), so a failure on
one rank never leaves the others hanging in a collective. Preemption (SIGTERM / SIGUSR1)
writes a checkpoint and exits 75 on every rank (docs/reliability.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback


def run_guarded(fn, *args, **kwargs):
    """Call ``fn``; if it raises, print the error once for the whole job and end every rank.

    An error every rank raises alike (e.g. a data error, an agreed checkpoint error) is printed
    once by rank 0 and every rank exits 1; an error on some ranks only is printed once, by the
    lowest-numbered rank that failed first (``hgsgc: error on rank R: ...`` / ``on ranks R,S:
    ...``), which then calls ``MPI.COMM_WORLD.Abort(1)`` so ranks blocked in a collective waiting
    for it end too (:func:`hgsgc.faults.report_error`).
    ``SystemExit`` passes through (preemption exits with status 75 on every rank).
    Set ``HGSGC_DEBUG=1`` for the full traceback.

    Returns:
        ``fn``'s return value when it does not raise.
    """
    from hgsgc.faults import error_comm, report_error

    comm = error_comm()  # collective Dup before fn runs, on every rank
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if os.environ.get("HGSGC_DEBUG"):
            traceback.print_exc()
        code = report_error(exc, comm)
        raise SystemExit(code)


def cmd_train(args) -> int:
    from hgsgc.faults import catch_early_signals, release_early_signals

    catch_early_signals()  # a preemption signal during start-up: checkpoint after a step, exit 75
    try:
        return _train(args)
    finally:  # as a command (not main([...]) in a caller's process): ignore late signals
        release_early_signals(late=getattr(args, "as_command", False))


def _train(args) -> int:
    from hgsgc.config import ConfigError, load_config
    from hgsgc.faults import error_comm, one_line

    # Every rank loads the configuration, then all agree on the outcome in one allgather that
    # every rank reaches whether its load failed or not (so a config error on some ranks only,
    # e.g. a file missing on one node, cannot hang the others). Rank 0 prints each distinct
    # error once, naming the ranks, and every rank returns 2 after the agreement, so mpirun
    # cannot end rank 0 before it has printed.
    comm = error_comm()  # collective Dup of COMM_WORLD (None for a single process)
    cfg, err, mine = None, None, None
    try:
        cfg = load_config(args.config, args.overrides)
        mine = _comparable_config(cfg)
    except ConfigError as exc:
        err = str(exc)
    except Exception as exc:  # a bug in loading: still agreed, so no rank waits forever
        err = one_line(exc)
    got = comm.allgather((err, mine)) if comm is not None else [(err, mine)]
    errs = [e for e, _ in got]
    if not any(e is not None for e in errs):  # valid on every rank, but the same everywhere?
        differs = _config_disagreement([c for _, c in got])
        errs = [differs] * len(got) if differs else errs
    if any(e is not None for e in errs):
        if comm is None or comm.Get_rank() == 0:
            for text in _config_error_lines(errs):
                print(text, file=sys.stderr, flush=True)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    def go():
        from mpi4py import MPI  # noqa: F401  (initialise MPI with thread support before horovod)
        from hgsgc.train import run

        run(cfg, log=lambda s: print(s, flush=True))

    run_guarded(go)
    return 0


#: keys that may differ between ranks (node-local paths and rank 0's console): every other
#: setting changes what a rank computes or sends, so ranks that disagree on it fail in a
#: collective or, worse, train diverging replicas without a word
NODE_LOCAL_KEYS = ("data.path", "train.threads", "train.progress", "train.progress_interval_s")


def _comparable_config(cfg) -> dict:
    """``{dotted key: JSON text}`` of ``cfg`` without :data:`NODE_LOCAL_KEYS`."""
    import dataclasses
    import json

    out = {}

    def walk(node, prefix):
        for f in dataclasses.fields(node):
            v = getattr(node, f.name)
            if dataclasses.is_dataclass(v):
                walk(v, prefix + f.name + ".")
            elif prefix + f.name not in NODE_LOCAL_KEYS:
                out[prefix + f.name] = json.dumps(v, sort_keys=True, default=str)
    walk(cfg, "")
    return out


def _config_disagreement(configs) -> "str | None":
    """One line naming the keys (at most 3) whose values differ between ranks (``configs[r]``:
    rank r's :func:`_comparable_config`), or None when all agree."""
    diffs = []
    for key in configs[0]:
        by_value = {}
        for r, c in enumerate(configs):
            by_value.setdefault(c.get(key), []).append(r)
        if len(by_value) > 1:
            diffs.append(f"{key}: " + ", ".join(
                f"{v} on rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}" for v, rs in by_value.items()))
    if not diffs:
        return None
    more = f" (and {len(diffs) - 3} more keys)" if len(diffs) > 3 else ""
    return (f"the configuration differs between ranks ({'; '.join(diffs[:3])}{more}): give every rank "
            f"the same config file and overrides")


def _config_error_lines(errs) -> list:
    """``hgsgc: config error: ...`` once per distinct message; ``errs[r]`` is rank r's (or None).

    The ranks are named only when not every rank reported that message."""
    seen = {}
    for r, e in enumerate(errs):
        if e is not None:
            seen.setdefault(e, []).append(r)
    out = []
    for e, ranks in seen.items():
        who = "" if len(ranks) == len(errs) else (
            " on rank" + ("s " if len(ranks) > 1 else " ") + ",".join(map(str, ranks)))
        out.append(f"hgsgc: config error{who}: {e}")
    return out


def cmd_report(args) -> int:
    from hgsgc.report import report

    try:
        print(report(args.run_dirs, out_dir=args.out))
    except (FileNotFoundError, ValueError) as exc:
        if isinstance(exc, FileNotFoundError) and exc.errno is not None:  # the output folder
            print(f"hgsgc: report: cannot write the report into {args.out or args.run_dirs[0]}: "
                  f"{exc.strerror} (errno {exc.errno})", file=sys.stderr)
        else:
            print(f"hgsgc: report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --out an existing file, a read-only folder, a full disk
        where = f"--out {args.out}" if args.out else args.run_dirs[0]
        print(f"hgsgc: report: cannot write the report into {where}: {exc.strerror or exc} "
              f"(errno {exc.errno}): give --out a writable folder", file=sys.stderr)
        return 2
    return 0


def cmd_bench(args) -> int:
    from hgsgc.bench import main as bench_main

    return bench_main(args.spec, out=args.out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hgsgc", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a configured experiment (run under mpirun/srun)")
    t.add_argument("config", help="YAML config, e.g. configs/fashion_mnist.yaml")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.epochs=3")
    t.set_defaults(func=cmd_train)
    r = sub.add_parser("report", help="tables and PNG plots from one or more run directories")
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    r.add_argument("--out", default=None, help="where report.md and the PNGs go (default: first RUN_DIR)")
    r.set_defaults(func=cmd_report)
    b = sub.add_parser("bench", help="side-by-side benchmark matrix on the emulated cluster (root)")
    b.add_argument("spec", help="bench spec YAML, e.g. configs/bench/smoke.yaml")
    b.add_argument("--out", default=None, help="output name: docs/benchmarks/NAME.{json,md,png}")
    b.set_defaults(func=cmd_bench)
    pl = sub.add_parser("plan", help="rank methods and layouts by predicted step time (hgsgc/plan.py)")
    pl.add_argument("config", help="YAML config (model, batch size, density)")
    pl.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.name=tiny")
    pl.add_argument("--nodes", type=int, required=True, help="ranks, one per host")
    pl.add_argument("--bandwidth", required=True, help="link rate per host, e.g. 10gbit, 100mbit")
    pl.add_argument("--compute-ms", type=float, default=None, help="compute step in ms (default: measured here)")
    pl.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement")
    pl.add_argument("--tuned", action="store_true",
                    help="no Open MPI TCP put penalty on pairwise exchanges (a tuned cluster)")
    pl.add_argument("--steps-to-target", default=None, help="JSON {method: steps or null} from quality curves")
    pl.add_argument("--json", default=None, help="also write the plan as JSON here")
    pl.set_defaults(func=lambda a: __import__("hgsgc.plan", fromlist=["plan_main"]).plan_main(a))
    args = p.parse_args(argv)
    # Horovod / Open MPI settings hgsgc chooses (docs/benchmarks/step_profile.md); only where the
    # environment has none, and before anything initialises MPI
    from hgsgc.runtime import apply_defaults, pin_to_core

    apply_defaults()
    pin_to_core()  # HGSGC_PIN_CORES=1 only (benchmark cells)
    args.as_command = argv is None  # the console script / python -m hgsgc.cli (sys.argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
