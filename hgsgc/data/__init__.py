"""Data loaders, one module per on-disk format; every loader raises :class:`DataError` (naming the
file) for a missing, empty, truncated or malformed file when it is built, on every rank.

- :mod:`hgsgc.data.fashion_mnist`: Fashion-MNIST IDX files (the main job);
- :mod:`hgsgc.data.cifar`: CIFAR-10 binary records;
- :mod:`hgsgc.data.imagenet`: ImageNet JPEG tree and TFRecord shards;
- :mod:`hgsgc.data.ptb`: PTB word-level text;
- :mod:`hgsgc.data.librispeech`: LibriSpeech FLAC + transcripts;
- :mod:`hgsgc.data.sharding`: the per-epoch, per-rank shards all of them use.

``DATA_HOME`` (``$HGSGC_DATA``, default ``~/.cache/hgsgc/data``) is where ``scripts/install.sh``
prepares the offline defaults (``scripts/prepare_data.py``). Nothing here downloads.
"""
import os

from hgsgc.data.errors import DataError
from hgsgc.data.fashion_mnist import (DEFAULT_PATH, FILES, NUM_CLASSES, Dataset, epoch_batches,
                                      load_fashion_mnist, read_idx, shard)
from hgsgc.data.sharding import epoch_permutation, rank_indices, steps_per_epoch

DATA_HOME = os.environ.get("HGSGC_DATA") or os.path.join(os.path.expanduser("~"), ".cache", "hgsgc", "data")

__all__ = ["DataError", "DEFAULT_PATH", "FILES", "NUM_CLASSES", "Dataset", "epoch_batches",
           "load_fashion_mnist", "read_idx", "shard", "epoch_permutation", "rank_indices",
           "steps_per_epoch", "DATA_HOME"]
