"""Fashion-MNIST from IDX files (Debian package ``dataset-fashion-mnist``), sharded by rank.

Files: ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`` under ``path`` (default
``/usr/share/datasets/fashion-mnist``). IDX format (LeCun et al.): big-endian magic
``0x0000 08 NDIM``, NDIM uint32 sizes, then uint8 data.
"""
from __future__ import annotations

import gzip
import os
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from hgsgc.data.errors import DataError
from hgsgc.data.sharding import rank_indices

DEFAULT_PATH = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


NUM_CLASSES = 10  # Fashion-MNIST labels are 0..9


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (optionally gzip-compressed) into a uint8 array of its shape.

    Raises:
        DataError: missing file, bad magic number, or size mismatch.
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            if len(head) != 4 or head[0] != 0 or head[1] != 0 or head[2] != 0x08:
                raise DataError(f"{path}: not an unsigned-byte IDX file (magic {head.hex()})")
            ndim = head[3]
            dims = struct.unpack(">" + "I" * ndim, f.read(4 * ndim))
            data = np.frombuffer(f.read(), dtype=np.uint8)
    except FileNotFoundError:
        raise DataError(f"data file not found: {path}") from None
    except (OSError, EOFError, struct.error, zlib.error) as exc:  # zlib: a damaged .gz
        raise DataError(f"{path}: cannot read IDX data ({exc})") from None
    if data.size != int(np.prod(dims)):
        raise DataError(f"{path}: header says {dims} = {int(np.prod(dims))} bytes, file has {data.size}")
    return data.reshape(dims)


def _find(path: str, stem: str) -> str:
    for name in (stem + ".gz", stem):
        p = os.path.join(path, name)
        if os.path.exists(p):
            return p
    raise DataError(f"data file {stem}[.gz] not found under {path}: install the Debian package "
                    f"dataset-fashion-mnist (make install) or set data.path=DIR")


@dataclass
class Dataset:
    """Images float32 ``[N, 28, 28, 1]`` scaled to [0, 1] and labels int32 ``[N]``."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_fashion_mnist(path: str = DEFAULT_PATH, train_limit: int = 0, test_limit: int = 0) -> Dataset:
    """Load the four IDX files; ``*_limit > 0`` keeps the first that many examples.

    Raises:
        DataError: a file is missing or malformed.
    """
    files = {k: _find(path, stem) for k, stem in FILES.items()}
    arrays = {k: read_idx(f) for k, f in files.items()}
    for split in ("train", "test"):
        xi, yi = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if xi.shape[0] != yi.shape[0]:
            raise DataError(f"{path}: {split} has {xi.shape[0]} images but {yi.shape[0]} labels")
        if xi.ndim != 3 or yi.ndim != 1:
            raise DataError(f"{files[f'{split}_images']}: expected images [N, 28, 28] and labels [N], "
                            f"got {xi.shape} and {yi.shape}")
        if xi.shape[1:] != (28, 28):  # the model's input layer is 28x28x1
            raise DataError(f"{files[f'{split}_images']}: images are {xi.shape[1]}x{xi.shape[2]}, "
                            f"Fashion-MNIST's are 28x28: not Fashion-MNIST (data.format=fashion_mnist); "
                            f"point data.path at the Fashion-MNIST files")
        if yi.size and int(yi.max()) >= NUM_CLASSES:
            raise DataError(f"{files[f'{split}_labels']}: label {int(yi.max())} outside 0..{NUM_CLASSES - 1} "
                            f"(corrupt file? reinstall dataset-fashion-mnist)")

    def prep(x, y, limit):
        if limit:
            x, y = x[:limit], y[:limit]
        return (x.astype(np.float32) / 255.0)[..., None], y.astype(np.int32)

    xtr, ytr = prep(arrays["train_images"], arrays["train_labels"], train_limit)
    xte, yte = prep(arrays["test_images"], arrays["test_labels"], test_limit)
    return Dataset(xtr, ytr, xte, yte)


def epoch_batches(n_examples: int, batch_size: int, rank: int, size: int, epoch: int, seed: int):
    """Index batches of one rank for one epoch.

    The same seeded permutation on every rank; rank ``r`` takes positions ``r, r + size, ...``;
    every rank gets the same number of full batches, ``n_examples // (size * batch_size)``, so
    collectives stay matched (the remainder of the permutation is skipped this epoch).

    Returns:
        int64 array ``[steps, batch_size]`` of example indices.
    """
    steps = n_examples // (size * batch_size)
    mine = rank_indices(n_examples, rank, size, seed, epoch)[: steps * batch_size]
    return mine.reshape(steps, batch_size)


def shard(n_examples: int, rank: int, size: int) -> np.ndarray:
    """Contiguous evaluation shard of rank ``rank``: indices ``[rank*N/size, (rank+1)*N/size)``."""
    bounds = np.linspace(0, n_examples, size + 1).astype(np.int64)
    return np.arange(bounds[rank], bounds[rank + 1])
