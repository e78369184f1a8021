"""Tasks: what a runner trains on and how it scores (data, model, loss, metrics).

================== ==================================== ====================== ==========================
``data.format``    data (``hgsgc.data``)                 models                 metrics (per epoch)
================== ==================================== ====================== ==========================
fashion_mnist      Fashion-MNIST IDX                     alexnet_small, tiny    test_loss, test_accuracy
cifar10            CIFAR-10 binary                       resnet20, vgg16        test_loss, test_accuracy
imagenet_jpeg      ImageNet JPEG tree                    alexnet, resnet50      test_loss, test_accuracy
imagenet_tfrecord  ImageNet TFRecord shards              alexnet, resnet50      test_loss, test_accuracy
ptb                PTB word level                        lstm_small/medium      valid/test loss, perplexity
librispeech        LibriSpeech FLAC                      ctc_small              test_loss, test_wer, test_cer
================== ==================================== ====================== ==========================

Losses: softmax cross-entropy (images: mean over the batch; language model: mean over the
``batch x bptt`` tokens, perplexity ``exp`` of the mean token loss); CTC (Graves et al. 2006) for
speech, mean over utterances, greedy decoding (best path, repeats merged, blanks dropped) for
WER/CER. Evaluation sums per-example figures on every rank and adds them with ``allreduce_sum``,
so the result covers each evaluation example once, whatever the number of ranks.

Every task's ``evaluate(model, rank, size, allreduce_sum, final=True)`` builds its evaluation
``tf.function`` once per task and model (:func:`cached_eval_fn`). The language model evaluates the
valid split after every epoch and the test split after every epoch too, or only when ``final``
(the last epoch) with ``train.test_every_epoch=false``; the other tasks ignore ``final``.

Optional per task: ``train.weight_decay`` adds ``wd * sum(||W||^2) / 2`` over kernels and
embeddings to the loss; ``train.clip_norm`` clips this rank's gradients to that global norm before
the exchange (Zaremba et al. clip at 5 for the LSTM).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict

import numpy as np

from hgsgc.data import DATA_HOME, DEFAULT_PATH

FORMATS = ("fashion_mnist", "cifar10", "imagenet_jpeg", "imagenet_tfrecord", "ptb", "librispeech")
TASK_OF_FORMAT = {"fashion_mnist": "image", "cifar10": "image", "imagenet_jpeg": "image",
                  "imagenet_tfrecord": "image", "ptb": "lm", "librispeech": "speech"}
DEFAULT_DATA = {  # offline defaults prepared by scripts/install.sh (scripts/prepare_data.py)
    "fashion_mnist": DEFAULT_PATH,
    "cifar10": os.path.join(DATA_HOME, "cifar10-fmnist"),
    "imagenet_jpeg": os.path.join(DATA_HOME, "imagenet-fmnist", "jpeg"),
    "imagenet_tfrecord": os.path.join(DATA_HOME, "imagenet-fmnist", "tfrecord"),
    "ptb": os.path.join(DATA_HOME, "ptb-kjv"),
    "librispeech": os.path.join(DATA_HOME, "librispeech-espeak"),
}
DEFAULT_SPLITS = {"librispeech": ("train-clean-100", "test-clean"), "imagenet_jpeg": ("train", "val"),
                  "imagenet_tfrecord": ("train", "validation")}


def cached_eval_fn(task, model, build: Callable) -> Callable:
    """The evaluation function of ``model`` for ``task``: ``build()`` (a new ``tf.function``) on the
    first call for that model, the same function afterwards. Evaluating after every epoch with a
    fresh ``tf.function`` traced the graph again each time (about a second on this machine for the
    LSTM); the cached one traces once per input shape, with the same values."""
    cached = getattr(task, "_eval_fn", None)
    if cached is None or cached[0] is not model:
        task._eval_fn = (model, build())
    return task._eval_fn[1]


def data_path(cfg) -> str:
    """``data.path``, or the offline default of ``data.format``."""
    return cfg.data.path or DEFAULT_DATA[cfg.data.format]


def _penalty(model, wd: float):
    import tensorflow as tf

    if not wd:
        return 0.0
    vs = [v for v in model.trainable_variables if "kernel" in v.name or "embedding" in v.name]
    return wd * tf.add_n([tf.nn.l2_loss(v) for v in vs])


def _grads(tape, loss, model, clip: float):
    import tensorflow as tf

    grads = tape.gradient(loss, model.trainable_variables)
    if clip:
        grads, _ = tf.clip_by_global_norm(grads, clip)
    return grads


class _Fashion:
    """Fashion-MNIST arrays behind the loader interface (numpy batches, as the main job always had)."""

    num_classes, input_shape = 10, (28, 28, 1)

    def __init__(self, path, train_limit, test_limit):
        from hgsgc.data import load_fashion_mnist

        self.d = load_fashion_mnist(path, train_limit, test_limit)
        self.n = len(self.d.x_train)

    def train(self, rank, size, batch, seed, epoch):
        from hgsgc.data import epoch_batches

        b = epoch_batches(self.n, batch, rank, size, epoch, seed)
        return ((self.d.x_train[i], self.d.y_train[i]) for i in b), len(b)

    def test(self, rank, size, batch):
        from hgsgc.data import shard

        idx = shard(len(self.d.x_test), rank, size)
        return [(self.d.x_test[idx[s:s + 500]], self.d.y_test[idx[s:s + 500]]) for s in range(0, len(idx), 500)]


class _Loader:
    """A ``hgsgc.data`` loader pair (train, test) behind the same interface as :class:`_Fashion`."""

    def __init__(self, train, test, limit):
        self.tr, self.te = train, test
        self.n = train.n
        self.num_classes, self.input_shape = train.num_classes, train.input_shape

    def train(self, rank, size, batch, seed, epoch):
        return self.tr.dataset(rank, size, batch, seed, epoch, train=True)

    def test(self, rank, size, batch):
        return self.te.dataset(rank, size, batch, 0, 0, train=False)[0]


class ImageTask:
    """Image classification on any of the image formats."""

    kind = "image"
    metric = "test_accuracy"

    def __init__(self, cfg):
        d, path = cfg.data, data_path(cfg)
        fmt = d.format
        if fmt == "fashion_mnist":
            self.data = _Fashion(path, d.train_limit, d.test_limit)
        elif fmt == "cifar10":
            from hgsgc.data.cifar import Cifar10

            self.data = _Loader(Cifar10(path, "train", limit=d.train_limit),
                                Cifar10(path, "test", limit=d.test_limit), 0)
        elif fmt == "imagenet_jpeg":
            from hgsgc.data.imagenet import ImageNetJPEG

            tr, te = d.train_split or "train", d.test_split or "val"
            s = d.image_size or 224
            self.data = _Loader(ImageNetJPEG(path, tr, s, d.train_limit), ImageNetJPEG(path, te, s, d.test_limit), 0)
        else:
            from hgsgc.data.imagenet import ImageNetTFRecord

            tr, te = d.train_split or "train", d.test_split or "validation"
            s = d.image_size or 224
            train = ImageNetTFRecord(path, tr, s, num_classes=d.num_classes or 1000)
            self.data = _Loader(train, ImageNetTFRecord(path, te, s, num_classes=train.num_classes), 0)
        self.cfg = cfg
        self.num_classes = self.data.num_classes
        self.n_train = self.data.n

    def build_model(self):
        from hgsgc.models import build_model

        m = self.cfg.model
        return build_model(m.name, num_classes=self.num_classes, seed=self.cfg.run.seed,
                           input_shape=self.data.input_shape, width=m.width)

    def train_data(self, rank, size, epoch):
        """``(iterable of (x, y) batches, steps)`` of this rank for ``epoch``."""
        t = self.cfg.train
        return self.data.train(rank, size, t.batch_size, self.cfg.run.seed, epoch)

    def test_data(self, rank, size):
        return self.data.test(rank, size, self.cfg.train.eval_batch_size or 4 * self.cfg.train.batch_size)

    def start_epoch(self):
        pass

    def make_step(self, model, opt) -> Callable:
        import tensorflow as tf

        t = self.cfg.train
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
                total = loss + _penalty(model, t.weight_decay)
            grads = _grads(tape, total, model, t.clip_norm)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        fn = tf.function(step)
        return lambda batch: fn(*batch)

    def evaluate(self, model, rank, size, allreduce_sum, final: bool = True) -> Dict[str, float]:
        import tensorflow as tf

        def build():
            @tf.function
            def ev(x, y):
                logits = model(x, training=False)
                loss = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
                correct = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), tf.cast(y, tf.int32))
                return tf.reduce_sum(loss), tf.reduce_sum(tf.cast(correct, tf.float32))
            return ev

        ev = cached_eval_fn(self, model, build)
        tot = np.zeros(3)
        for x, y in self.test_data(rank, size):
            lo, c = ev(x, y)
            tot += [float(lo), float(c), len(y)]
        s = allreduce_sum(tot)
        return {"test_loss": s[0] / s[2], "test_accuracy": s[1] / s[2]}


class LanguageModelTask:
    """Word-level language modelling on PTB-format text (Zaremba et al. 2014)."""

    kind = "lm"
    metric = "test_perplexity"

    def __init__(self, cfg):
        from hgsgc.data.ptb import PTB

        self.cfg = cfg
        self.data = PTB(data_path(cfg), cfg.data.vocab_size, cfg.data.train_limit, cfg.data.test_limit)
        self.num_classes = self.data.num_classes
        self.n_train = len(self.data.ids["train"])
        self.state = None

    def build_model(self):
        from hgsgc.models import build_model

        m = self.cfg.model
        self.model = build_model(m.name, num_classes=self.num_classes, units=m.units or None,
                                 dropout=m.dropout if m.dropout >= 0 else None)
        self.units = self.model.get_layer("lstm1").units
        return self.model

    def train_data(self, rank, size, epoch):
        t = self.cfg.train
        return self.data.dataset("train", rank, size, t.batch_size, self.cfg.data.bptt)

    def check_eval(self, size):
        """Raise the DataError evaluation would raise after the first epoch, before training:
        each rank's contiguous part of valid and test must hold one evaluation batch of
        ``bptt`` steps (with many ranks, or a small ``data.test_limit``, it may not)."""
        from hgsgc.data import DataError
        from hgsgc.data.ptb import FILES

        t, d = self.cfg.train, self.cfg.data
        b = t.eval_batch_size or t.batch_size
        for split in ("valid", "test"):
            n = len(self.data.ids[split])
            if (n // size) // b - 1 < d.bptt:
                key = "train.eval_batch_size" if t.eval_batch_size else "train.eval_batch_size (default train.batch_size)"
                raise DataError(
                    f"{os.path.join(data_path(self.cfg), FILES[split])}: {n} tokens"
                    f"{' (data.test_limit)' if d.test_limit else ''} over {size} ranks are "
                    f"{n // size} per rank, too few for one evaluation batch of {b} rows x "
                    f"{d.bptt + 1} tokens: lower {key} or data.bptt"
                    f"{', raise data.test_limit' if d.test_limit else ''}, or use fewer ranks")

    def start_epoch(self):
        self.state = None

    def _zeros(self, b):
        import tensorflow as tf

        return [tf.zeros([b, self.units]) for _ in range(4)]

    def make_step(self, model, opt) -> Callable:
        import tensorflow as tf

        t = self.cfg.train

        @tf.function
        def step(x, y, h1, c1, h2, c2):
            with tf.GradientTape() as tape:
                logits, *st = model([x, h1, c1, h2, c2], training=True)
                loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
                total = loss + _penalty(model, t.weight_decay)
            grads = _grads(tape, total, model, t.clip_norm)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss, st

        def run(batch):
            x, y = batch
            if self.state is None:
                self.state = self._zeros(int(x.shape[0]))
            loss, self.state = step(x, y, *self.state)
            return loss

        return run

    def evaluate(self, model, rank, size, allreduce_sum, final: bool = True) -> Dict[str, float]:
        import tensorflow as tf

        def build():
            @tf.function
            def ev(x, y, h1, c1, h2, c2):
                logits, *st = model([x, h1, c1, h2, c2], training=False)
                loss = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
                return tf.reduce_sum(loss), st
            return ev

        ev = cached_eval_fn(self, model, build)
        out = {}
        b = self.cfg.train.eval_batch_size or self.cfg.train.batch_size
        # the test split after every epoch, or (train.test_every_epoch=false) after the last only
        splits = ("valid", "test") if final or self.cfg.train.test_every_epoch else ("valid",)
        self.eval_split_times_s = {}  # seconds per split, this rank (the training loop records them)
        for split in splits:
            t0 = time.perf_counter()
            ds, _ = self.data.dataset(split, rank, size, b, self.cfg.data.bptt)
            tot, st = np.zeros(2), self._zeros(b)
            for x, y in ds:
                lo, st = ev(x, y, *st)
                tot += [float(lo), int(np.prod(y.shape))]
            s = allreduce_sum(tot)
            out[f"{split}_loss"] = s[0] / s[1]
            out[f"{split}_perplexity"] = float(np.exp(s[0] / s[1]))
            self.eval_split_times_s[split] = time.perf_counter() - t0
        return out


def greedy_decode(logits: np.ndarray, lengths: np.ndarray):
    """Best-path CTC decoding: per-frame argmax, repeats merged, blanks (0) dropped.

    Args:
        logits: float ``[B, T, C]``; lengths: int ``[B]`` valid frames.
    Returns:
        list of ``B`` int lists (character ids 1..C-1).
    """
    best = np.argmax(logits, -1)
    out = []
    for b, n in zip(best, lengths):
        seq, prev = [], 0
        for c in b[: int(n)]:
            if c != prev and c != 0:
                seq.append(int(c))
            prev = c
        out.append(seq)
    return out


class SpeechTask:
    """Character CTC speech recognition on LibriSpeech-layout data."""

    kind = "speech"
    metric = "test_wer"

    def __init__(self, cfg):
        from hgsgc.data.librispeech import LibriSpeech

        d = cfg.data
        root = data_path(cfg)
        tr, te = DEFAULT_SPLITS["librispeech"]
        self.cfg = cfg
        self.tr = LibriSpeech(os.path.join(root, d.train_split or tr), d.n_mels, limit=d.train_limit)
        self.te = LibriSpeech(os.path.join(root, d.test_split or te), d.n_mels, limit=d.test_limit)
        self.num_classes = self.tr.num_classes
        self.n_train = self.tr.n

    def build_model(self):
        from hgsgc.models import build_model

        return build_model(self.cfg.model.name, num_classes=self.num_classes,
                           input_shape=(None, self.cfg.data.n_mels))

    def train_data(self, rank, size, epoch):
        return self.tr.dataset(rank, size, self.cfg.train.batch_size, self.cfg.run.seed, epoch, True)

    def start_epoch(self):
        pass

    @staticmethod
    def _loss(model, feats, frames, y, ylen, training):
        import tensorflow as tf

        logits = model(feats, training=training)
        logit_len = tf.minimum((frames + 1) // 2, tf.shape(logits)[1])
        loss = tf.nn.ctc_loss(labels=y, logits=logits, label_length=ylen, logit_length=logit_len,
                              logits_time_major=False, blank_index=0)
        return loss, logits, logit_len

    def make_step(self, model, opt) -> Callable:
        import tensorflow as tf

        t = self.cfg.train

        b, m = self.cfg.train.batch_size, self.cfg.data.n_mels
        # one trace for every batch length: every rank runs the same graph (and so the same
        # collectives), whatever lengths its buckets hold
        spec = [tf.TensorSpec([b, None, m], tf.float32), tf.TensorSpec([b], tf.int32),
                tf.TensorSpec([b, None], tf.int32), tf.TensorSpec([b], tf.int32)]

        @tf.function(input_signature=spec)
        def step(feats, frames, y, ylen):
            with tf.GradientTape() as tape:
                loss, _, _ = self._loss(model, feats, frames, y, ylen, True)
                loss = tf.reduce_mean(loss)
                total = loss + _penalty(model, t.weight_decay)
            grads = _grads(tape, total, model, t.clip_norm)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return lambda batch: step(*batch[0], *batch[1])

    def evaluate(self, model, rank, size, allreduce_sum, final: bool = True) -> Dict[str, float]:
        import tensorflow as tf

        from hgsgc.data.librispeech import decode_ids

        spec = [tf.TensorSpec([None, None, self.cfg.data.n_mels], tf.float32), tf.TensorSpec([None], tf.int32),
                tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.int32)]

        def build():
            @tf.function(input_signature=spec)
            def ev(feats, frames, y, ylen):
                loss, logits, n = self._loss(model, feats, frames, y, ylen, False)
                return tf.reduce_sum(loss), logits, n
            return ev

        ev = cached_eval_fn(self, model, build)

        b = self.cfg.train.eval_batch_size or self.cfg.train.batch_size
        ds, _ = self.te.dataset(rank, size, b, 0, 0, train=False)
        tot = np.zeros(6)  # loss, utterances, word edits, words, char edits, chars
        for (feats, frames), (y, ylen) in ds:
            lo, logits, n = ev(feats, frames, y, ylen)
            hyps = [decode_ids(h) for h in greedy_decode(logits.numpy(), n.numpy())]
            refs = [decode_ids(r[:int(k)]) for r, k in zip(y.numpy(), ylen.numpy())]
            tot += [float(lo), len(refs), *edit_sums(refs, hyps)]
        s = allreduce_sum(tot)
        return {"test_loss": s[0] / s[1], "test_wer": s[2] / max(1, s[3]), "test_cer": s[4] / max(1, s[5])}


def edit_sums(refs, hyps):
    """``(word edits, reference words, character edits, reference characters)`` summed over pairs
    (Levenshtein distance; WER = word edits / words, CER = char edits / chars)."""
    def lev(a, b):
        prev = list(range(len(b) + 1))
        for i, x in enumerate(a, 1):
            cur = [i] + [0] * len(b)
            for j, y in enumerate(b, 1):
                cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
            prev = cur
        return prev[-1]

    return (sum(lev(r.split(), h.split()) for r, h in zip(refs, hyps)), sum(len(r.split()) for r in refs),
            sum(lev(r, h) for r, h in zip(refs, hyps)), sum(len(r) for r in refs))


def check_same_data(task, comm, cfg) -> None:
    """Collective (every rank, before any collective whose count depends on the data): the ranks'
    data have the same size and classes.

    ``data.path`` may differ between ranks (node-local copies, ``hgsgc.cli.NODE_LOCAL_KEYS``); a
    copy with fewer training examples on one node gave that rank fewer steps per epoch, so it
    reached the evaluation's allreduce while the others were still training: the job hung in
    Horovod until killed. Only sizes and classes are compared (no checksum of the contents).

    Raises:
        DataError: on every rank alike (``all_ranks``), naming each group of ranks, its sizes and
            its ``data.path``.
    """
    from hgsgc.data import DataError

    if comm is None or comm.Get_size() == 1:
        return
    unit = "tokens" if getattr(task, "kind", "") == "lm" else "examples"
    got = comm.allgather((int(task.n_train), int(task.num_classes), data_path(cfg)))
    groups: Dict[tuple, list] = {}
    for r, (n, c, path) in enumerate(got):
        groups.setdefault((n, c), []).append((r, path))
    if len(groups) == 1:
        return
    parts = []
    for (n, c), members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0][0])):
        ranks = ",".join(str(r) for r, _ in members)
        paths = ", ".join(sorted({p for _, p in members}))
        parts.append(f"{n:,} training {unit}, {c} classes on rank{'s' if len(members) > 1 else ''} "
                     f"{ranks} ({paths})")
    err = DataError(f"the training data differs between ranks ({'; '.join(parts)}): give every node "
                    f"the same copy (data.path may differ between nodes, the data may not)")
    err.all_ranks = True
    raise err


def make_task(cfg):
    """The task of ``cfg.data.format`` (loads and checks the data: DataError on a bad file)."""
    kind = TASK_OF_FORMAT[cfg.data.format]
    return {"image": ImageTask, "lm": LanguageModelTask, "speech": SpeechTask}[kind](cfg)
