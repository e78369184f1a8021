"""Penn Treebank, word level (Mikolov's ``ptb.{train,valid,test}.txt``), contiguous batching.

Each line is a sentence of space-separated words; the loader appends ``<eos>`` to every line.
The vocabulary comes from the training file: words sorted by count (descending), then
alphabetically, cut at ``vocab_size`` words with ``<unk>`` and ``<eos>`` always inside (PTB itself
has exactly 10,000 words including ``<unk>``, so nothing is cut); words not in it become ``<unk>``.

Batching (Zaremba et al. 2014): the token stream of a rank is cut into ``batch`` equal rows; step
``i`` feeds ``x = rows[:, i T : (i + 1) T]`` and targets ``y = rows[:, i T + 1 : (i + 1) T + 1]``
with ``T`` = BPTT steps, so the recurrent state carries from one step to the next. Data
parallelism splits the training stream into ``size`` contiguous parts first (rank ``r`` takes part
``r``); the stream is not shuffled (the state carries across steps), so every epoch reads the same
order.

The offline default (``scripts/install.sh``) is Debian's ``bible-kjv-text`` written in PTB form:
real English, not the Penn Treebank.
"""
from __future__ import annotations

import collections
import os
from typing import Dict, List, Optional

import numpy as np

from hgsgc.data.errors import DataError
from hgsgc.data.sharding import contiguous_range

FILES = {"train": "ptb.train.txt", "valid": "ptb.valid.txt", "test": "ptb.test.txt"}
UNK, EOS = "<unk>", "<eos>"


def read_words(path: str) -> List[str]:
    """Words of a PTB-format file, ``<eos>`` after every line.

    Raises:
        DataError: missing, empty (no words), or not UTF-8 text (names the line).
    """
    if not os.path.isfile(path):
        raise DataError(f"PTB file not found: {path} (set data.path to the folder holding "
                        f"{', '.join(FILES.values())})")
    words: List[str] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start}): "
                                f"not a PTB text file") from None
            if "\x00" in line:
                raise DataError(f"{path}:{lineno}: NUL byte: not a PTB text file")
            words.extend(line.split())
            words.append(EOS)
    if not any(w != EOS for w in words):
        raise DataError(f"{path}: empty (no words): re-copy it")
    return words


def build_vocab(words: List[str], vocab_size: int = 10000) -> Dict[str, int]:
    """Word -> id: by count (descending) then word; ``<unk>`` and ``<eos>`` always included."""
    counts = collections.Counter(words)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    keep = [w for w, _ in ranked]
    for special in (EOS, UNK):
        if special not in keep:
            keep.append(special)
    if len(keep) > vocab_size:
        head = [w for w in keep if w not in (EOS, UNK)][: vocab_size - 2]
        keep = [w for w in keep if w in head or w in (EOS, UNK)]
    return {w: i for i, w in enumerate(keep)}


class PTB:
    """The three PTB files as id streams plus batching.

    Args:
        path: folder with ``ptb.train.txt``, ``ptb.valid.txt``, ``ptb.test.txt``.
        vocab_size: vocabulary size, built from the whole training file (``<unk>``, ``<eos>``
            included), so neither limit changes the model.
        limit: keep the first ``limit`` training tokens (0 = all; ``data.train_limit``).
        eval_limit: keep the first ``eval_limit`` tokens of valid and test (0 = all;
            ``data.test_limit``).

    Attributes:
        vocab: word -> id; ``ids[split]``: int32 token streams; ``unk_rate[split]``.

    Raises:
        DataError: a file missing, empty or malformed (every rank checks all three).
    """

    def __init__(self, path: str, vocab_size: int = 10000, limit: int = 0, eval_limit: int = 0):
        words = {s: read_words(os.path.join(path, f)) for s, f in FILES.items()}
        # the vocabulary (and so the model) comes from the whole training file, whatever the limits
        self.vocab = build_vocab(words["train"], vocab_size)
        if limit:  # data.train_limit: the first `limit` training tokens
            words["train"] = words["train"][:limit]
        if eval_limit:  # data.test_limit: the first `eval_limit` tokens of valid and test
            words = {s: (w if s == "train" else w[:eval_limit]) for s, w in words.items()}
        unk = self.vocab[UNK]
        self.ids = {s: np.asarray([self.vocab.get(w, unk) for w in ws], np.int32) for s, ws in words.items()}
        self.unk_rate = {s: float(np.mean(v == unk)) for s, v in self.ids.items()}
        self.num_classes = len(self.vocab)

    def rows(self, split: str, rank: int, size: int, batch: int, bptt: int, contiguous_ranks: bool = True):
        """``(data int32 [batch, L], steps)``: rank ``rank``'s part of the split as ``batch`` rows.

        ``L = steps * bptt + 1``; training (``contiguous_ranks``) takes part ``rank`` of ``size``
        equal contiguous parts of the stream.

        Raises:
            DataError: the part is too short for one step.
        """
        ids = self.ids[split]
        if contiguous_ranks:
            n = len(ids) // size
            ids = ids[rank * n:(rank + 1) * n]
        row = len(ids) // batch
        steps = (row - 1) // bptt
        if steps < 1:
            raise DataError(f"PTB {split}: {len(ids)} tokens per rank are too few for batch {batch} x "
                            f"{bptt} steps: lower train.batch_size or data.bptt")
        data = ids[: batch * row].reshape(batch, row)[:, : steps * bptt + 1]
        return data, steps

    def dataset(self, split: str, rank: int, size: int, batch: int, bptt: int, contiguous_ranks: bool = True):
        """``(ds, steps)``; ``ds`` yields ``(x int32 [batch, bptt], y int32 [batch, bptt])`` in
        stream order (the caller carries the LSTM state from one step to the next)."""
        import tensorflow as tf

        data, steps = self.rows(split, rank, size, batch, bptt, contiguous_ranks)
        xs = np.stack([data[:, i * bptt:(i + 1) * bptt] for i in range(steps)])
        ys = np.stack([data[:, i * bptt + 1:(i + 1) * bptt + 1] for i in range(steps)])
        return tf.data.Dataset.from_tensor_slices((xs, ys)).prefetch(tf.data.AUTOTUNE), steps


def eval_part(n_tokens: int, rank: int, size: int):
    """Evaluation split of a stream across ranks: contiguous ``(start, stop)`` of rank ``rank``."""
    return contiguous_range(n_tokens, rank, size)


def write_ptb(path: str, sentences: Dict[str, List[str]], name: Optional[str] = None) -> None:
    """Write ``{"train": [line, ...], "valid": ..., "test": ...}`` as ``ptb.<split>.txt`` files."""
    os.makedirs(path, exist_ok=True)
    for split, lines in sentences.items():
        p = os.path.join(path, FILES[split])
        with open(p + ".tmp", "w", encoding="utf-8") as f:
            for ln in lines:
                f.write(" " + ln + " \n")
        os.replace(p + ".tmp", p)
