"""Rank argv[1] gets signal argv[2] (SIGTERM / SIGUSR1) while it loads the config, long before
the runner's step agreement exists (as a Slurm preemption during TensorFlow's import, the data
check or layout: auto's measurements): the job must still checkpoint and exit 75 on every rank.
The rest of argv is the ``hgsgc train`` command line."""
import os
import signal
import sys

import hgsgc.config as config
from hgsgc.cli import main
from hgsgc.faults import world_rank

target, signame = int(sys.argv[1]), sys.argv[2]
real = config.load_config


def load(*a, **k):
    if world_rank() == target:
        os.kill(os.getpid(), getattr(signal, signame))
    return real(*a, **k)


config.load_config = load
sys.exit(main(["train"] + sys.argv[3:]))
