"""Compare two checkpoints' per-rank state bit for bit (used by the resume tests)."""
import json
import os
import sys

import numpy as np

from hgsgc import checkpoint as ckpt


def _leaves(tree, path=""):
    if isinstance(tree, dict):
        for k in sorted(tree):
            yield from _leaves(tree[k], f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}/{i}")
    else:
        yield path, tree


def compare(a_dir, b_dir, skip=("/loop",)):
    """Return (number of leaves compared, list of differing leaf paths) over every rank file."""
    ma, mb = ckpt.verify(a_dir, hashes=True), ckpt.verify(b_dir, hashes=True)
    assert ma["files"].keys() == mb["files"].keys()
    n, diffs = 0, []
    for r in range(ma["world_size"]):
        ta, tb = ckpt.load_rank(a_dir, ma, r), ckpt.load_rank(b_dir, mb, r)
        keep = lambda t: {k: v for k, v in _leaves(t) if not any(k.startswith(s) for s in skip)}  # noqa: E731
        la, lb = keep(ta), keep(tb)
        assert la.keys() == lb.keys(), (set(la) ^ set(lb))
        for k in la:
            x, y = la[k], lb[k]
            n += 1
            if isinstance(x, np.ndarray):
                if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                    diffs.append(f"rank {r}{k}")
            elif x != y:
                diffs.append(f"rank {r}{k}")
    return n, diffs


if __name__ == "__main__":
    print(json.dumps(compare(sys.argv[1], sys.argv[2])))
