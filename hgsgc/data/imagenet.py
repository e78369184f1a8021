"""ImageNet (ILSVRC-2012) in its two usual on-disk forms, as rank-sharded ``tf.data`` pipelines.

* JPEG tree: ``<root>/train/<wnid>/*.JPEG`` and ``<root>/val/<wnid>/*.JPEG``; class ``c`` is the
  position of ``<wnid>`` in the sorted list of ``train/`` folders (``val/`` uses the same map).
* TFRecord shards ``<root>/train-*`` and ``<root>/validation-*`` with the standard feature keys
  ``image/encoded`` (JPEG bytes) and ``image/class/label`` (int64; 1-based in the usual Inception
  build scripts, so ``label_offset=1`` by default gives 0-based classes).

Training: random-resized crop (area 8 %..100 %, aspect ratio 3/4..4/3, Szegedy et al. 2015) and a
random horizontal flip, resized to ``image_size``; evaluation: resize the shorter side to
``image_size / 0.875`` and take the central ``image_size`` square. Normalised per channel with the
ImageNet mean and std.

Checks made when a loader is built (every rank, before training): folders and files exist, no
file is empty, every JPEG starts with the JPEG start-of-image marker ``FF D8`` and ends with an
end-of-image marker ``FF D9`` (a truncated copy does not), every TFRecord file's framing is whole
(length headers and payloads add up to the file size; the record counts come from this walk),
and every shard's first record is an Inception-style example (a JPEG in ``image/encoded``, a
label in range in ``image/class/label``).

The offline default (``scripts/install.sh``) is a small 10-class tree and TFRecords made from
Fashion-MNIST images (64x64): real images, not ImageNet.
"""
from __future__ import annotations

import glob
import os
import struct
from typing import List, Tuple

import numpy as np

from hgsgc.data.errors import DataError
from hgsgc.data.sharding import epoch_permutation, rank_indices, steps_per_epoch

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
JPEG_EXT = (".jpeg", ".jpg")


def check_jpeg(path: str) -> None:
    """Raise :class:`DataError` naming ``path`` if it is empty, not a JPEG, or truncated."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(max(0, size - 64))
            tail = f.read()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc})") from None
    if size == 0:
        raise DataError(f"{path}: empty JPEG file: re-copy it or delete it")
    if head != b"\xff\xd8":
        raise DataError(f"{path}: not a JPEG (starts with {head.hex()}, expected ffd8): convert it "
                        f"to JPEG or delete it")
    if b"\xff\xd9" not in tail:
        raise DataError(f"{path}: truncated JPEG (no end-of-image marker ffd9 at the end): re-copy it")


def list_jpeg_tree(root: str, split: str) -> Tuple[List[str], np.ndarray, List[str]]:
    """Files (sorted), int32 labels and class names (sorted ``train/`` folder names) of a split.

    Raises:
        DataError: missing folders, a class folder without images, an unknown class under
            ``val/``, or a bad JPEG (see :func:`check_jpeg`).
    """
    train_dir = os.path.join(root, "train")
    if not os.path.isdir(train_dir):
        raise DataError(f"ImageNet JPEG tree not found: {train_dir} does not exist (expected "
                        f"<root>/train/<wnid>/*.JPEG; set data.path)")
    classes = sorted(d for d in os.listdir(train_dir) if os.path.isdir(os.path.join(train_dir, d)))
    if not classes:
        raise DataError(f"{train_dir}: no class folders (expected train/<wnid>/*.JPEG)")
    split_dir = os.path.join(root, split)
    if not os.path.isdir(split_dir):
        raise DataError(f"ImageNet JPEG tree: {split_dir} does not exist (expected {split}/<wnid>/*.JPEG)")
    index = {c: i for i, c in enumerate(classes)}
    files, labels = [], []
    for c in sorted(os.listdir(split_dir)):
        d = os.path.join(split_dir, c)
        if not os.path.isdir(d):
            continue
        if c not in index:
            raise DataError(f"{d}: class {c!r} is not among the {len(classes)} classes of {train_dir}")
        imgs = sorted(f for f in os.listdir(d) if f.lower().endswith(JPEG_EXT))
        if not imgs:
            raise DataError(f"{d}: class folder without .JPEG files")
        for f in imgs:
            p = os.path.join(d, f)
            check_jpeg(p)
            files.append(p)
            labels.append(index[c])
    if not files:
        raise DataError(f"{split_dir}: no images")
    return files, np.asarray(labels, np.int32), classes


def tfrecord_count(path: str) -> int:
    """Number of records in one TFRecord file, walking its framing
    (``uint64 length, uint32 crc, length bytes, uint32 crc`` per record).

    Raises:
        DataError: missing, empty, or truncated file.
    """
    if not os.path.isfile(path):
        raise DataError(f"TFRecord file not found: {path}")
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"{path}: empty TFRecord file: re-copy it")
    n = pos = 0
    with open(path, "rb") as f:
        while pos < size:
            head = f.read(12)
            if len(head) < 12:
                raise DataError(f"{path}: truncated TFRecord file (record {n} header cut at byte {pos}): re-copy it")
            (length,) = struct.unpack("<Q", head[:8])
            pos += 12 + length + 4
            if pos > size:
                raise DataError(f"{path}: truncated TFRecord file (record {n} needs {pos} bytes, file "
                                f"has {size}): re-copy it")
            f.seek(pos)
            n += 1
    return n


def check_first_record(path: str, label_offset: int = 1, num_classes: int = 1000) -> None:
    """Parse the first record of a TFRecord shard as an Inception-style ImageNet example: a JPEG in
    ``image/encoded`` and a label in ``label_offset .. num_classes - 1 + label_offset`` in
    ``image/class/label``. A shard of another layout (TensorFlow Datasets' ``image`` / ``label``,
    0-based labels, PNG bytes) failed in ``tf.data`` at the first batch of the ranks reading it,
    naming no file (or trained on label -1).

    Raises:
        DataError: naming the file and what its first record lacks.
    """
    import tensorflow as tf

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(12)[:8])
        payload = f.read(length)
    try:
        feats = tf.train.Example.FromString(payload).features.feature
    except Exception as exc:  # google.protobuf.message.DecodeError
        raise DataError(f"{path}: record 0 is not a tf.train.Example ({exc}): not an ImageNet "
                        f"TFRecord shard") from None
    keys = ", ".join(sorted(feats)) or "none"
    img = feats["image/encoded"].bytes_list.value if "image/encoded" in feats else []
    if len(img) != 1:
        raise DataError(f"{path}: record 0 has no 'image/encoded' (bytes) feature (its features: "
                        f"{keys}): hgsgc reads the Inception build script's layout (image/encoded, "
                        f"image/class/label)")
    if img[0][:2] != b"\xff\xd8":
        raise DataError(f"{path}: record 0's image/encoded is not a JPEG (starts with {img[0][:4].hex()}, "
                        f"expected ffd8): convert the images to JPEG")
    lab = feats["image/class/label"].int64_list.value if "image/class/label" in feats else []
    if len(lab) != 1:
        raise DataError(f"{path}: record 0 has no 'image/class/label' (int64) feature (its features: "
                        f"{keys})")
    lo, hi = label_offset, num_classes - 1 + label_offset
    if not lo <= lab[0] <= hi:
        raise DataError(f"{path}: record 0 has label {lab[0]}, outside {lo}..{hi} (labels are "
                        f"{'1' if label_offset == 1 else label_offset}-based by the Inception build "
                        f"scripts; data.num_classes={num_classes}): set data.num_classes or re-make the shards")


def _preprocess(image_bytes, train: bool, image_size: int, seed):
    import tensorflow as tf

    img = tf.io.decode_jpeg(image_bytes, channels=3)
    if train:
        bbox = tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, [1, 1, 4])
        begin, sz, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.shape(img), bbox, seed=seed, min_object_covered=0.1, aspect_ratio_range=(3 / 4, 4 / 3),
            area_range=(0.08, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
        img = tf.slice(img, begin, sz)
        img = tf.image.resize(img, [image_size, image_size])
        img = tf.image.stateless_random_flip_left_right(img, seed=seed + tf.constant([0, 1], tf.int64))
    else:
        shape = tf.cast(tf.shape(img)[:2], tf.float32)
        scale = (image_size / 0.875) / tf.reduce_min(shape)
        new = tf.cast(tf.round(shape * scale), tf.int32)
        img = tf.image.resize(img, new)
        top = (new[0] - image_size) // 2
        left = (new[1] - image_size) // 2
        img = img[top:top + image_size, left:left + image_size]
    img = tf.ensure_shape(img, [image_size, image_size, 3])
    return (img / 255.0 - tf.constant(MEAN)) / tf.constant(STD)


class ImageNetJPEG:
    """A split of the JPEG tree as a rank-sharded pipeline (a rank opens only its files).

    Raises:
        DataError: see :func:`list_jpeg_tree`.
    """

    def __init__(self, root: str, split: str = "train", image_size: int = 224, limit: int = 0):
        self.files, self.labels, self.classes = list_jpeg_tree(root, split)
        if limit and limit < len(self.files):  # a fixed, class-balanced-in-expectation subset
            keep = np.sort(np.random.default_rng(0).permutation(len(self.files))[:limit])
            self.files, self.labels = [self.files[i] for i in keep], self.labels[keep]
        self.n = len(self.files)
        self.num_classes = len(self.classes)
        self.image_size = image_size
        self.input_shape = (image_size, image_size, 3)

    def dataset(self, rank: int, size: int, batch: int, seed: int, epoch: int, train: bool = True):
        """``(ds, steps)``; ``ds`` yields ``(x float32 [batch, S, S, 3], y int32 [batch])``
        (training: ``steps`` full shuffled batches, same on every rank; evaluation: in order)."""
        import tensorflow as tf

        idx = rank_indices(self.n, rank, size, seed, epoch, shuffle=train)
        steps = steps_per_epoch(self.n, size, batch) if train else -(-len(idx) // batch)
        if train:
            idx = idx[: steps * batch]
        files = np.asarray(self.files, dtype=object)[idx].astype(str)
        ds = tf.data.Dataset.from_tensor_slices((files, self.labels[idx]))
        base = tf.constant([int(seed), int(epoch)], tf.int64)

        def load(i, fy):
            f, y = fy
            s = base + tf.stack([tf.constant(0, tf.int64), 2 * i])
            return _preprocess(tf.io.read_file(f), train, self.image_size, s), y

        ds = ds.enumerate().map(load, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.batch(batch, drop_remainder=train).prefetch(tf.data.AUTOTUNE), steps


class ImageNetTFRecord:
    """TFRecord shards of a split (``train-*`` or ``validation-*``) as a rank-sharded pipeline.

    With at least ``size`` files, each epoch permutes the files (run seed, epoch) and rank ``r``
    reads files ``r, r + size, ...`` of that order; with fewer files every rank reads all and
    keeps records ``r, r + size, ...``. Records are shuffled in a seeded buffer. Every rank takes
    the same number of full batches: the smallest rank share, known from the record counts.

    Raises:
        DataError: no shards, or an empty / truncated shard.
    """

    def __init__(self, root: str, split: str = "train", image_size: int = 224, label_offset: int = 1,
                 num_classes: int = 1000, shuffle_buffer: int = 1024):
        prefix = "train" if split == "train" else "validation"
        self.files = sorted(glob.glob(os.path.join(root, f"{prefix}-*")))
        if not self.files:
            raise DataError(f"no TFRecord shards {os.path.join(root, prefix + '-*')} (set data.path "
                            f"to the folder of train-*-of-* / validation-*-of-* files)")
        self.counts = np.asarray([tfrecord_count(f) for f in self.files], np.int64)
        for f in self.files:  # the layout of every shard (its first record), before training
            check_first_record(f, label_offset, num_classes)
        self.n = int(self.counts.sum())
        self.image_size = image_size
        self.label_offset = label_offset
        self.num_classes = num_classes
        self.input_shape = (image_size, image_size, 3)
        self.shuffle_buffer = shuffle_buffer

    def _rank_files(self, rank, size, seed, epoch, train):
        k = len(self.files)
        order = epoch_permutation(k, seed, epoch) if train else np.arange(k)
        if k >= size:
            shares = [int(self.counts[order[r::size]].sum()) for r in range(size)]
            return [self.files[i] for i in order[rank::size]], None, shares
        shares = [len(range(r, self.n, size)) for r in range(size)]
        return [self.files[i] for i in order], rank, shares

    def dataset(self, rank: int, size: int, batch: int, seed: int, epoch: int, train: bool = True):
        """``(ds, steps)`` as :meth:`ImageNetJPEG.dataset`."""
        import tensorflow as tf

        files, record_shard, shares = self._rank_files(rank, size, seed, epoch, train)
        ds = tf.data.TFRecordDataset(files, num_parallel_reads=min(4, len(files)) if train else None)
        if record_shard is not None:
            ds = ds.shard(size, record_shard)
        if train:
            ds = ds.shuffle(self.shuffle_buffer, seed=int(seed) * 1000 + int(epoch) * 7 + rank)
        feats = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
                 "image/class/label": tf.io.FixedLenFeature([], tf.int64)}
        base = tf.constant([int(seed), int(epoch) * 1000 + rank], tf.int64)
        off = self.label_offset

        def parse(i, rec):
            ex = tf.io.parse_single_example(rec, feats)
            s = base + tf.stack([tf.constant(0, tf.int64), 2 * i])
            x = _preprocess(ex["image/encoded"], train, self.image_size, s)
            return x, tf.cast(ex["image/class/label"] - off, tf.int32)

        ds = ds.enumerate().map(parse, num_parallel_calls=tf.data.AUTOTUNE)
        if train:
            steps = min(shares) // batch
            ds = ds.take(steps * batch)
        else:
            steps = -(-shares[rank] // batch)
        return ds.batch(batch, drop_remainder=train).prefetch(tf.data.AUTOTUNE), steps


def write_tfrecords(paths: List[str], jpegs: List[bytes], labels: List[int]) -> None:
    """Write ``(jpeg bytes, int label)`` examples round-robin into the TFRecord files ``paths``,
    with the standard keys ``image/encoded`` and ``image/class/label`` (labels as given)."""
    import tensorflow as tf

    def feature(b=None, i=None):
        if b is not None:
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=[b]))
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))

    writers = [tf.io.TFRecordWriter(p + ".tmp") for p in paths]
    for j, (b, y) in enumerate(zip(jpegs, labels)):
        ex = tf.train.Example(features=tf.train.Features(feature={
            "image/encoded": feature(b=b), "image/class/label": feature(i=int(y)),
            "image/format": feature(b=b"JPEG")}))
        writers[j % len(writers)].write(ex.SerializeToString())
    for w, p in zip(writers, paths):
        w.close()
        os.replace(p + ".tmp", p)
