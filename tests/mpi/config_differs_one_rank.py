"""Rank 1 gets a valid override the other ranks do not (as when a config file differs on one
node): every rank must end with exit code 2 before training, rank 0 printing one line that names
the key and each rank's value; no rank may hang. Usage: ``config_differs_one_rank.py KEY=VALUE``."""
import os
import sys

from hgsgc.cli import main
from hgsgc.faults import world_rank

CFG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "fashion_mnist_sgc.yaml")
over = sys.argv[1:] if world_rank() == 1 else []
sys.exit(main(["train", CFG, "model.name=tiny", "train.epochs=1", "train.max_steps_per_epoch=2",
               "data.train_limit=200", "data.test_limit=50", "train.progress=false", "train.threads=1",
               "run.out_dir=" + os.environ.get("OUT_DIR", "runs")] + over))
