"""Run under mpirun with impossible Hourglass layouts; every rank must report every error.

Usage: ``hourglass_bad_layout.py CASE [CASE ...]``, cases run in order on every rank:

* ``world1`` (run with -np 1): ``Layout`` with a single rank;
* ``too_many_fc`` (-np 3): the main job ``hgsgc.hourglass.train.run`` with ``fc_workers=2``
  (2 FC ranks but only 1 CONV rank);
* ``no_boundary`` (any -np >= 2): ``split_model`` of a model without convolutions.

Like ``hgsgc train``, each exception prints ``hgsgc: error on rank R: Type: message`` on stderr.
The errors come before any collective, so no rank hangs; the rank exits 1 once every case has
raised, and prints ``NO ERROR`` and exits 0 if any case did not raise.
"""
import os
import sys

from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()


def world1():
    from hgsgc.hourglass import Layout

    Layout(MPI.COMM_WORLD, fc_workers=1)


def too_many_fc():
    from hgsgc.config import load_config
    from hgsgc.hourglass.train import run

    run(load_config(None, ["layout=hourglass", "hourglass.fc_workers=2", "model.name=tiny",
                           "train.threads=1", "run.out_dir=" + os.environ.get("TMPDIR", "/tmp")]),
        log=lambda s: None)


def no_boundary():
    import tensorflow as tf

    from hgsgc.hourglass import Layout, split_model

    model = tf.keras.Sequential([tf.keras.Input((28, 28, 1)), tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(16, name="d1"), tf.keras.layers.Dense(10)],
                                name="mlp")
    split_model(model)
    Layout(MPI.COMM_WORLD, fc_workers=1)  # never reached


CASES = {"world1": world1, "too_many_fc": too_many_fc, "no_boundary": no_boundary}
raised = 0
for case in sys.argv[1:]:
    try:
        CASES[case]()
    except Exception as exc:
        print(f"hgsgc: error on rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raised += 1
    else:
        print(f"rank {rank}: NO ERROR in {case}", flush=True)
sys.exit(1 if raised == len(sys.argv[1:]) and raised else 0)
