"""Only rank 1 gets a bad override (as when a config file differs on one node): every rank must
end with exit code 2 and rank 0 must print the error once, naming rank 1; no rank may hang."""
import os
import sys

from hgsgc.cli import main
from hgsgc.faults import world_rank

CFG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "fashion_mnist.yaml")
over = ["compression.density=0"] if world_rank() == 1 else []
sys.exit(main(["train", CFG, "train.epochs=1"] + over))
