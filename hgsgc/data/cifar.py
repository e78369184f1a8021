"""CIFAR-10, binary version (Krizhevsky 2009): ``data_batch_1..5.bin`` and ``test_batch.bin``.

Each file is a sequence of 3,073-byte records: one label byte (0..9), then the 32x32 image as
1,024 red, 1,024 green and 1,024 blue bytes, each plane row-major. Training augmentation is the
usual one (He et al. 2016, Sec. 4.2): 4-pixel zero padding, a random 32x32 crop and a random
horizontal flip; images are normalised per channel, ``(x / 255 - mean) / std``.

The offline default (``scripts/install.sh``) is Fashion-MNIST written in this format (28x28
padded to 32x32, grey replicated to 3 channels): real images, but not CIFAR-10.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import numpy as np

from hgsgc.data.errors import DataError
from hgsgc.data.sharding import rank_indices, steps_per_epoch

RECORD_BYTES = 1 + 32 * 32 * 3
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
NUM_CLASSES = 10
# per-channel statistics of the CIFAR-10 training set
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def read_cifar_file(path: str):
    """Read one CIFAR-10 binary file.

    Returns:
        ``(images, labels)``: uint8 ``[N, 32, 32, 3]`` (HWC) and uint8 ``[N]``; ``images`` is a
        view on a read-only memory map (pages are read when an index touches them).

    Raises:
        DataError: missing, empty, truncated (size not a multiple of 3,073 bytes) or a label
            outside 0..9.
    """
    if not os.path.isfile(path):
        raise DataError(f"CIFAR-10 file not found: {path} (set data.path to the folder holding "
                        f"{', '.join(TRAIN_FILES + TEST_FILES)})")
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"{path}: empty file (expected 3,073-byte CIFAR-10 records): re-copy it")
    if size % RECORD_BYTES:
        raise DataError(f"{path}: truncated or not CIFAR-10 binary: {size} bytes is {size // RECORD_BYTES} "
                        f"records of {RECORD_BYTES} bytes plus {size % RECORD_BYTES} bytes: re-copy it")
    raw = np.memmap(path, dtype=np.uint8, mode="r").reshape(-1, RECORD_BYTES)
    labels = np.array(raw[:, 0])
    bad = np.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        raise DataError(f"{path}: record {int(bad[0])} has label {int(labels[bad[0]])} outside "
                        f"0..{NUM_CLASSES - 1}: not a CIFAR-10 file (CIFAR-100 has 2 label bytes)")
    images = raw[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, labels


class Cifar10:
    """CIFAR-10 binary files of one split as a rank-sharded ``tf.data`` pipeline.

    Args:
        path: folder with the ``.bin`` files.
        split: ``"train"`` (``data_batch_1..5.bin``) or ``"test"`` (``test_batch.bin``).
        files: file names to use instead of the standard ones (tests, subsets).
        limit: keep the first ``limit`` examples (0 = all).

    Raises:
        DataError: any file missing or malformed (checked here, on every rank).
    """

    num_classes = NUM_CLASSES
    input_shape = (32, 32, 3)

    def __init__(self, path: str, split: str = "train", files: Optional[Sequence[str]] = None,
                 limit: int = 0, mean=MEAN, std=STD):
        names = list(files) if files else list(TRAIN_FILES if split == "train" else TEST_FILES)
        parts = [read_cifar_file(os.path.join(path, f)) for f in names]
        self.files: List[str] = [os.path.join(path, f) for f in names]
        self._images = parts  # memory maps, one per file
        self._offsets = np.cumsum([0] + [len(p[1]) for p in parts])
        self.labels = np.concatenate([p[1] for p in parts]).astype(np.int32)
        if limit:
            self.labels = self.labels[:limit]
        self.n = len(self.labels)
        self.mean = np.asarray(mean, np.float32)
        self.std = np.asarray(std, np.float32)

    def images(self, idx: np.ndarray) -> np.ndarray:
        """uint8 ``[len(idx), 32, 32, 3]`` of the given example indices (reads only those records)."""
        idx = np.asarray(idx, np.int64)
        out = np.empty((len(idx), 32, 32, 3), np.uint8)
        f = np.searchsorted(self._offsets, idx, side="right") - 1
        for j in np.unique(f):
            sel = f == j
            out[sel] = self._images[j][0][idx[sel] - self._offsets[j]]
        return out

    def normalise(self, x):
        """``(x / 255 - mean) / std`` per channel; float32 in, float32 out."""
        return (x / 255.0 - self.mean) / self.std

    def dataset(self, rank: int, size: int, batch: int, seed: int, epoch: int, train: bool = True):
        """The pipeline of one rank for one epoch.

        Returns:
            ``(ds, steps)``: ``ds`` yields ``(x float32 [batch, 32, 32, 3], y int32 [batch])``;
            training: ``steps`` full batches (the same on every rank), augmented and shuffled;
            evaluation (``train=False``): this rank's examples in order, last batch partial.
        """
        import tensorflow as tf

        idx = rank_indices(self.n, rank, size, seed, epoch, shuffle=train)
        steps = steps_per_epoch(self.n, size, batch) if train else -(-len(idx) // batch)
        if train:
            idx = idx[: steps * batch]
        x, y = self.images(idx), self.labels[idx]  # this rank's records only
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        mean, std = tf.constant(self.mean), tf.constant(self.std)
        base = tf.constant([int(seed), int(epoch)], tf.int64)

        def prep(i, xy):
            img, label = xy
            img = tf.cast(img, tf.float32)
            if train:
                s = base + tf.stack([tf.constant(0, tf.int64), 2 * i])
                img = tf.pad(img, [[4, 4], [4, 4], [0, 0]])
                img = tf.image.stateless_random_crop(img, [32, 32, 3], seed=s)
                img = tf.image.stateless_random_flip_left_right(img, seed=s + [0, 1])
            return (img / 255.0 - mean) / std, label

        ds = ds.enumerate().map(prep, num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.batch(batch, drop_remainder=train).prefetch(tf.data.AUTOTUNE)
        return ds, steps


def write_cifar_file(path: str, images: np.ndarray, labels: np.ndarray) -> None:
    """Write uint8 ``images [N, 32, 32, 3]`` (HWC) and ``labels [N]`` as CIFAR-10 binary records."""
    images = np.asarray(images, np.uint8)
    rec = np.empty((len(labels), RECORD_BYTES), np.uint8)
    rec[:, 0] = labels
    rec[:, 1:] = images.transpose(0, 3, 1, 2).reshape(len(labels), -1)
    tmp = path + ".tmp"
    rec.tofile(tmp)
    os.replace(tmp, path)
