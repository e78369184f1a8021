"""Does the first allgather bucket leave before the backward pass ends? (issue 10, session 12)

Runs ``hgsgc train`` with the TensorFlow profiler on rank 0 for a window of wall time, then reads
the trace's TF compute thread (one inter-op thread with ``train.threads=1``): per training step,
the time from the concatenation of the first bucket's payloads (``concat``: the dense layers' with
``compression.buckets=2``; its allgather is enqueued right after, an asynchronous Horovod op)
to the concatenation of the last bucket (``concat_1``: after the first convolution's gradient,
the last one of the backward pass). That is the window in which the first bucket's wire time can
hide behind the rest of the backward pass; the ops run in it are listed with their median time.

    mpirun -np 2 -x HGSGC_PIN_CORES=1 python scripts/trace_bucket_overlap.py OUT_DIR CONFIG \\
        compression.delay=1 compression.buckets=2 train.threads=1 train.max_steps_per_epoch=1500 ...
    python scripts/trace_bucket_overlap.py --analyse OUT_DIR

``TRACE_START`` / ``TRACE_SECONDS`` (environment, default 25 / 1.5): when rank 0 starts the
profiler after launch and for how long (past start-up and the first steps). No assertion: a
measurement tool; quote the load with its output. The model's first layer must be named
``conv1`` (alexnet_small): a step starts at its forward convolution.
"""
import glob
import os
import statistics
import sys
import threading
import time


def analyse(out_dir):
    """Print the per-step window (ms) and the ops in it, from the trace under ``out_dir``."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted(glob.glob(os.path.join(out_dir, "plugins", "profile", "*", "*.xplane.pb")))
    if not files:
        sys.exit(f"{out_dir}: no *.xplane.pb trace (run the training part first)")
    xs = xplane_pb2.XSpace()
    with open(files[-1], "rb") as f:
        xs.ParseFromString(f.read())
    plane = [p for p in xs.planes if p.name == "/host:CPU"][0]
    names = {k: v.name for k, v in plane.event_metadata.items()}
    lines = [ln for ln in plane.lines if ln.name.startswith("tf_Compute")]
    if len(lines) != 1:
        sys.exit(f"expected one TF compute thread (train.threads=1), found {len(lines)}")
    ln = lines[0]
    ev = sorted((ln.timestamp_ns + e.offset_ps // 1000, e.duration_ps // 1000, names.get(e.metadata_id, "?"))
                for e in ln.events)
    ev = [e for e in ev if not e[2].startswith("ExecutorState")]
    starts = [i for i, e in enumerate(ev) if e[2].startswith("alexnet_small/conv1/") and e[2].endswith(":_FusedConv2D")]
    windows, steps, inside = [], [], {}
    for i0, i1 in zip(starts, starts[1:]):
        seg = ev[i0:i1]
        steps.append((ev[i1][0] - ev[i0][0]) / 1e6)
        c0 = [k for k, e in enumerate(seg) if e[2].startswith("concat:")]
        c1 = [k for k, e in enumerate(seg) if e[2].startswith("concat_1:")]
        if c0 and c1:
            windows.append((seg[c1[0]][0] - seg[c0[0]][0]) / 1e6)
            for t, d, n in seg[c0[0] + 1:c1[0]]:
                inside.setdefault(n.split(":")[0], []).append(d / 1e6)
    if not windows:
        sys.exit("no step with both `concat` and `concat_1` (run with compression.buckets=2)")
    med = statistics.median
    print(f"{len(steps)} steps traced: step median {med(steps):.2f} ms (min {min(steps):.2f}); "
          f"window concat -> concat_1 median {med(windows):.2f} ms (min {min(windows):.2f}, "
          f"max {max(windows):.2f}) = {med(windows) / med(steps):.0%} of the step")
    for n, ds in sorted(inside.items(), key=lambda kv: -med(kv[1]))[:8]:
        print(f"  in the window: {n}  median {med(ds):.2f} ms")


def main(argv):
    if argv and argv[0] == "--analyse":
        return analyse(argv[1])
    out_dir, rest = argv[0], argv[1:]
    import tensorflow as tf

    if int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == 0:
        start, dur = float(os.environ.get("TRACE_START", "25")), float(os.environ.get("TRACE_SECONDS", "1.5"))

        def profile():
            time.sleep(start)
            tf.profiler.experimental.start(out_dir)
            time.sleep(dur)
            tf.profiler.experimental.stop()

        threading.Thread(target=profile, daemon=True).start()
    from hgsgc import cli

    return cli.main(["train", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
