"""Run several ``tests/mpi`` check scripts one after another in ONE mpirun launch (CI time).

Usage (under mpirun): ``run_many.py [--dynamic] CASES_JSON`` where ``CASES_JSON`` is a JSON list of
``{"key": str, "argv": [script, arg, ...], "timeout": seconds}``. Every rank runs every case in the
given order, each as ``__main__`` with its own ``sys.argv`` (``runpy.run_path``), exactly as a launch
of that script alone would, except that the process, TensorFlow and Horovod are already started:
a launch costs every rank a TensorFlow + Horovod import (~6-7 s of CPU) and several launches of
small checks cost more than the checks (tests/conftest.py, ``mpi_batch``).

Rank 0 prints, per case, ``CASE <key> RESULT {json}`` (the script's own ``RESULT`` line) or
``CASE <key> ERROR <traceback>``; after a case that ends normally, also ``CASE <key> SECONDS
<wall seconds of the case>``. A case that raises on any rank ends the whole job with exit 1
(the remaining cases report nothing; an error on one rank must not leave the others waiting); a
case that runs past its timeout ends the job the same way, naming the case (``CASE <key>
TIMEOUT``). Between cases the Keras session, the mixed-precision policy, grappler's options and
the environment variables are reset; MPI is started by mpi4py before Horovod (a Layout's Horovod shutdown leaves
it running, as in a launch of that script alone); with
``--dynamic`` Horovod starts with dynamic process sets (what the brk11 scripts ask for) and every
process set a case added is removed after it.
"""
import io
import json
import os
import runpy
import sys
import threading
import time
import traceback

import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
# The scripts set the same one-thread pools first thing; once TensorFlow has started a second
# call raises, so after the first case the setters only check the value is the one in force.
_set_intra, _set_inter = (tf.config.threading.set_intra_op_parallelism_threads,
                          tf.config.threading.set_inter_op_parallelism_threads)


def _same_or_raise(getter, setter):
    def set_threads(num):
        if num != getter():
            setter(num)  # raises: TensorFlow is initialised
    return set_threads


tf.config.threading.set_intra_op_parallelism_threads = _same_or_raise(
    tf.config.threading.get_intra_op_parallelism_threads, _set_intra)
tf.config.threading.set_inter_op_parallelism_threads = _same_or_raise(
    tf.config.threading.get_inter_op_parallelism_threads, _set_inter)

import horovod.tensorflow as hvd  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Tee(io.TextIOBase):
    """stdout that passes everything through and keeps the script's ``RESULT`` lines."""

    def __init__(self, out):
        self.out, self.buf, self.results = out, "", []

    def write(self, s):
        self.out.write(s)
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            if line.startswith("RESULT "):
                self.results.append(line[7:])
        return len(s)

    def flush(self):
        self.out.flush()


def _watchdog(key, timeout, done):
    if not done.wait(timeout):
        sys.__stdout__.write(f"CASE {key} TIMEOUT after {timeout} s\n")
        sys.__stdout__.flush()
        os._exit(1)


def main():
    args = sys.argv[1:]
    dynamic = args[:1] == ["--dynamic"]
    if dynamic:
        args = args[1:]
    cases = json.loads(args[0])
    # MPI started by mpi4py, as in a launch of one check script (they import it before Horovod):
    # then Horovod does not own MPI and its shutdown does not finalize it, so a case whose
    # Hourglass Layout shuts the launch's Horovod down and starts its own (``own_horovod`` cases,
    # run last) keeps MPI, as it does alone
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()  # hvd.rank() raises once an own_horovod case shut Horovod down
    if dynamic:
        hvd.init(process_sets="dynamic")
    else:
        hvd.init()
    from horovod.common import process_sets as hps

    real_out = sys.stdout
    # grappler's options are process-wide: check_hierarchy.py turns the meta optimizer off, and the
    # cases after it ran without grappler (session 14: check_state9.py's EF-SignSGD run then was not
    # bit-exact with its resume in a fresh process); each case starts from the launch's options
    grappler = tf.config.optimizer.get_experimental_options()
    for case in cases:
        key, argv = case["key"], list(case["argv"])
        script = argv[0] if os.path.isabs(argv[0]) else os.path.join(ROOT, argv[0])
        done = threading.Event()
        threading.Thread(target=_watchdog, args=(key, float(case["timeout"]), done), daemon=True).start()
        tee = _Tee(real_out)
        t0 = time.perf_counter()
        sys.argv = [script] + argv[1:]
        saved_path, saved_env = list(sys.path), dict(os.environ)
        sys.path.insert(0, os.path.dirname(script))
        sys.stdout = tee
        try:
            runpy.run_path(script, run_name="__main__")
        except BaseException as e:  # noqa: B036  (SystemExit 0 is a normal end)
            if not (isinstance(e, SystemExit) and e.code in (0, None)):
                sys.stdout = real_out
                print(f"CASE {key} ERROR (rank {rank}) "
                      + traceback.format_exc().replace("\n", "\\n"), flush=True)
                os._exit(1)
        finally:
            sys.stdout = real_out
            sys.path[:] = saved_path
            if dict(os.environ) != saved_env:  # a case's variables (e.g. HGSGC_RANKS_PER_NODE) end with it
                os.environ.clear()
                os.environ.update(saved_env)
        done.set()
        if tee.results:
            print(f"CASE {key} RESULT {tee.results[-1]}", flush=True)
        if rank == 0:  # where a launch's time goes (the mpi_batch_np*.log in pytest's basetemp)
            print(f"CASE {key} SECONDS {time.perf_counter() - t0:.1f}", flush=True)
        tf.keras.backend.clear_session()
        tf.keras.mixed_precision.set_global_policy("float32")
        if tf.config.optimizer.get_experimental_options() != grappler:
            tf.config.optimizer.set_experimental_options(
                {**{k: not v if isinstance(v, bool) else v
                    for k, v in tf.config.optimizer.get_experimental_options().items() if k not in grappler},
                 **grappler})
        if dynamic:
            for pid in sorted(hps._basics._get_process_set_ids_and_ranks()):
                if pid:
                    hps.remove_process_set(hps._temp_process_set_object(pid))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
