"""Run under mpirun (2-5 ranks): one short training run, either ``layout: auto`` or the explicit
layout it is compared with; rank 0 prints one ``RESULT {...}`` JSON line,
tests/test_hourglass_auto_same_run.py compares an auto run with the explicit one (two launches).

Usage: ``check_hourglass_auto_same.py MODE LAYOUT RUN_DIR``

* ``MODE`` ``auto``: ``hgsgc.train.run`` with ``layout=auto`` (the real start-up measurement:
  turns, Horovod on ``COMM_SELF`` and over the world, the probes). ``LAYOUT`` ``data_parallel``
  or ``hourglass`` forces the choice after the real measurement and model (the decision only:
  ``hgsgc.perfmodel.choose_layout`` runs, then its ``layout`` / ``fc_workers`` are overridden),
  so that both branches are tested on any machine; ``natural`` keeps the model's choice.
* ``MODE`` ``explicit``: ``hgsgc.train.run`` with ``layout=LAYOUT`` (``hourglass``: 1 FC rank and the
  same boundary codecs and micro-batches; ``data_parallel``: without them, as that layout requires).

Every rank reports what the training ran with: the TF thread pools, its CPU affinity, the
Horovod / Open MPI / TF environment, and rank 0 the run's ``config.json`` (and whether
``load_config`` accepts it again), ``metrics.jsonl`` records and ``summary.json`` (whose
``thread_cpu`` has every rank's threads per group during the timed steps). The threads of the
process after the run are not compared: that list varies between two identical launches (a
thread ending while it is read: 7 against 8 threads on one rank of two data-parallel runs).
"""
import json
import os
import sys

from mpi4py import MPI  # noqa: F401  (before TensorFlow / Horovod, as hgsgc train does)

from hgsgc.config import load_config  # noqa: E402

mode, layout, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
#: Open MPI variables that name this launch (its job id, session folder, daemon address): they
#: differ between any two launches
LAUNCH_SPECIFIC = ("OMPI_MCA_orte_precondition_transports", "OMPI_MCA_orte_local_daemon_uri",
                   "OMPI_MCA_orte_hnp_uri", "OMPI_MCA_orte_jobfam_session_dir", "OMPI_MCA_ess_base_jobid")
world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()

# vgg16 draws its initial weights from the global seed (tiny / alexnet_small seed their own), so a
# random draw of the start-up measurement that were left in the chosen run would show here
common = ["data.format=cifar10", "model.name=vgg16", "model.width=0.0625", "train.epochs=2",
          "train.max_steps_per_epoch=3", "train.batch_size=8", "train.progress=false",
          "train.log_every_steps=1", "data.train_limit=400", "data.test_limit=96",
          "compression.method=sgc", "compression.density=0.05", "compression.delay=1",
          "checkpoint.at_end=false", f"run.out_dir={out_dir}", "run.id=run", "run.seed=7"]
# the Hourglass-only settings (layout: data_parallel refuses them: hgsgc.config.HOURGLASS_ONLY_KEYS)
hourglass_only = ["hourglass.act_codec=sparse+q8", "hourglass.grad_codec=sparse+q8", "hourglass.micro_batches=2"]
if mode == "auto":
    overrides = common + hourglass_only + ["layout=auto"]
    if layout != "natural":
        from hgsgc import perfmodel

        real = perfmodel.choose_layout

        def forced(*a, **k):
            rep = real(*a, **k)
            rep["layout"] = layout
            rep["fc_workers"] = 1 if layout == "hourglass" else None
            return rep

        perfmodel.choose_layout = forced
else:
    overrides = common + [f"layout={layout}"] + (hourglass_only + ["hourglass.fc_workers=1"]
                                                  if layout == "hourglass" else [])
cfg = load_config(None, overrides)

from hgsgc.train import run  # noqa: E402

lines = []
summary = run(cfg, log=lines.append)

import tensorflow as tf  # noqa: E402

mine = {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("HOROVOD_", "OMPI_MCA_", "HGSGC_", "TF_"))
                and k not in LAUNCH_SPECIFIC},
        "layout": summary["layout"]}
ranks = world.gather(mine, root=0)
if rank == 0:
    d = os.path.join(out_dir, summary["run_id"])
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(d, "metrics.jsonl")) as f:
        metrics = [json.loads(ln) for ln in f if ln.strip()]
    with open(os.path.join(d, "summary.json")) as f:
        written = json.load(f)
    try:  # the run's config.json is a configuration hgsgc train accepts again
        load_config(os.path.join(d, "config.json"))
        reloads = True
    except Exception as exc:  # reported to the test, which names it
        reloads = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps({"size": n, "ranks": ranks, "config": config, "metrics": metrics,
                                  "summary": written, "config_reloads": reloads,
                                  "log": [ln for ln in lines if ln.startswith("layout auto")]}), flush=True)
