"""Run under mpirun (2, 3 or 4 ranks): the link probe of ``fc_workers: auto`` / ``layout: auto``;
rank 0 prints one ``RESULT {...}`` JSON line, tests/test_hourglass_auto_mpi.py asserts on it.

Usage: ``check_hourglass_auto.py RUN_DIR``.

* every rank: :func:`hgsgc.hourglass.costmodel.link_inputs` with the real ping-pong probe (what
  each rank got) and with the config override (no probe);
* ``Layout(world, "auto")`` (no Horovod) on FIXED cost inputs (every rank returns the same
  :class:`CostInputs`), with the default link (the real probe) and with injected links
  (a fixed probe result; the config override): the report and the choice of every rank;
* every rank: :func:`hgsgc.hourglass.costmodel.find_machines` (the real boot id; fake ones: even
  and odd ranks) and :func:`~hgsgc.hourglass.costmodel.take_turns` on the fake machines (rank 1
  fails on purpose);
* 3 ranks: ``layout: auto`` (:func:`hgsgc.hourglass.auto.choose`) with the config override
  (the whole report: measured compression, updates, machines);
* 2 ranks: a short real ``hgsgc.hourglass.train.run`` with ``fc_workers=auto`` writing RUN_DIR
  (its summary.json must carry the probed link), and a short ``layout=auto`` run of a
  CIFAR-format task (vgg16, width 1/16) through ``hgsgc.train.run``.
"""
import json
import sys

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
from mpi4py import MPI  # noqa: E402

from hgsgc.hourglass.costmodel import CostInputs, link_inputs  # noqa: E402
from hgsgc.hourglass.layout import Layout  # noqa: E402

world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
out = {}

# 1. the probe and the override, on every rank
out["probe"] = link_inputs(world)
out["override"] = link_inputs(world, 250.0)

# 2. fc_workers: auto on fixed inputs (the test recomputes the model on them)
FIXED = dict(t_conv=1e-3, t_fc=1e-3, batch_size=32, act_bytes=1000.0, grad_bytes=1000.0,
             conv_payload=1e5, fc_payload=7e6, bandwidth=0.0, conv_exchange="ring",
             fc_exchange="ring", codec_s=1e-5, micro_batches=1, cycle_s=0.005)
out["fixed"] = FIXED


def fixed_cost():
    return CostInputs(**FIXED)


def auto_layout(link=None):
    lay = Layout(world, "auto", cost=fixed_cost, link=link, init_horovod=False)
    return {"n_fc": lay.n_fc, "role": lay.role, "report": lay.cost_report}


out["auto_probe"] = auto_layout()                                   # default link: the probe
SLOW = {"alpha_s": 50e-6, "beta_Bps": 12.5e6, "pairs": [[p, 50e-6, 12.5e6] for p in range(1, n)]}
FAST = {"alpha_s": 1e-6, "beta_Bps": 1.25e10, "pairs": [[p, 1e-6, 1.25e10] for p in range(1, n)]}
out["auto_slow"] = auto_layout(lambda: link_inputs(world, probe=lambda c: SLOW))
out["auto_fast"] = auto_layout(lambda: link_inputs(world, probe=lambda c: FAST))
out["auto_override"] = auto_layout(lambda: link_inputs(world, 100.0))

# 2b. the CPU share's inputs: machines by boot id (the real one: every rank on this machine; fake
# ones: even / odd ranks), and measuring in turns (ranks of one machine never at once)
import os  # noqa: E402
import time  # noqa: E402

from hgsgc.hourglass.costmodel import find_machines, take_turns  # noqa: E402

out["machines"] = find_machines(world)
out["affinity"] = len(os.sched_getaffinity(0))
if len(sys.argv) > 1:
    fake = os.path.join(sys.argv[1], f"boot_{rank % 2}")
    with open(fake, "w") as f:
        f.write(f"fake-boot-{rank % 2}\n")
    world.Barrier()
    out["machines_fake"] = find_machines(world, boot_id_path=fake)

    def turn():
        if rank == 1:
            raise ValueError("rank 1 fails on purpose")
        t0 = time.monotonic()  # CLOCK_MONOTONIC: one clock for all processes of a Linux machine
        x = 0.0
        for i in range(20000):  # some work, so that an overlap would show
            x += i
        return [t0, time.monotonic()]

    res, err = take_turns(world, out["machines_fake"]["machine_of"], turn)
    out["turn"] = {"interval": res, "error": err}

# 3. layout: auto with the override (no probe)
if n == 3:
    from hgsgc.config import load_config
    from hgsgc.hourglass.auto import choose
    from hgsgc.hourglass.split import split_model
    from hgsgc.models import build_model

    cfg = load_config(None, ["layout=auto", "model.name=tiny", "train.batch_size=8",
                             "hourglass.link_bandwidth_mbps=100", "compression.method=sgc",
                             "compression.density=0.05"])
    split = split_model(build_model("tiny", seed=5))
    xb = np.random.default_rng(3).random((8, 28, 28, 1), dtype=np.float32)
    rep = choose(world, split, xb, cfg)
    out["layout_auto_override"] = {"link": rep["link"], "alpha": rep["inputs"]["alpha"],
                                   "beta": rep["inputs"]["beta"], "layout": rep["layout"]}
    out["layout_auto_report"] = rep

# 4. a short real run with fc_workers: auto
if n == 2 and len(sys.argv) > 1:
    from hgsgc.config import load_config
    from hgsgc.hourglass.train import run

    lines = []
    cfg = load_config(None, [
        "layout=hourglass", "model.name=tiny", "train.epochs=1", "train.max_steps_per_epoch=2",
        "train.batch_size=8", "train.threads=1", "train.progress=false", "data.train_limit=400",
        "data.test_limit=100", f"run.out_dir={sys.argv[1]}", "run.id=auto", "hourglass.fc_workers=auto"])
    summary = run(cfg, log=lines.append)
    out["run"] = {"cost_model": summary["hourglass"]["cost_model"], "fc_workers": summary["hourglass"]["fc_workers"],
                  "log": [ln for ln in lines if "cost model" in ln or "link" in ln]}

    # layout: auto end to end on a CIFAR-format task (the task's own data and model: vgg16)
    from hgsgc.train import run as run_any

    cfg = load_config(None, [
        "layout=auto", "data.format=cifar10", "model.name=vgg16", "model.width=0.0625",
        "train.epochs=1", "train.max_steps_per_epoch=2", "train.batch_size=8", "train.threads=1",
        "train.progress=false", "data.train_limit=400", "data.test_limit=100",
        f"run.out_dir={sys.argv[1]}", "run.id=layout_auto", "hourglass.act_codec=sparse+q8",
        "hourglass.grad_codec=sparse+q8", "compression.method=sgc", "compression.density=0.05"])
    summary = run_any(cfg, log=lines.append)
    out["layout_auto_run"] = {"layout": summary["layout"], "choice": summary["layout_choice"]}

ranks = world.gather(out, root=0)
if rank == 0:
    print("RESULT " + json.dumps({"size": n, "ranks": ranks}), flush=True)
