#!/usr/bin/env python3
"""Prepare the offline default data sets in their real on-disk formats (run by scripts/install.sh).

    python scripts/prepare_data.py [--out DIR] [--only NAME ...]

``DIR`` defaults to ``$HGSGC_DATA`` or ``~/.cache/hgsgc/data`` (``hgsgc.data.DATA_HOME``). Each set
is written to a temporary folder and renamed into place when complete, with a ``.done`` stamp,
so a second run skips it (idempotent) and an interrupted run leaves nothing half-written.

- ``cifar10-fmnist``: Fashion-MNIST (Debian ``dataset-fashion-mnist``) as CIFAR-10 binary records:
  28x28 zero-padded to 32x32, grey replicated to 3 channels; 60,000 training images in
  ``data_batch_1..5.bin`` (12,000 each), 10,000 in ``test_batch.bin``. Real images, not CIFAR-10.
- ``imagenet-fmnist``: 10 classes of Fashion-MNIST resized to 64x64 RGB JPEGs (quality 95):
  ``jpeg/train/n0000000C/*.JPEG`` (300 per class) and ``jpeg/val/...`` (50 per class), and the same
  images as TFRecords ``tfrecord/train-0000K-of-00004`` / ``validation-0000K-of-00002`` with
  ``image/encoded`` and 1-based ``image/class/label``. Real images, not ImageNet.
- ``ptb-kjv``: the King James Bible (Debian ``bible-kjv``, read with its ``bible`` program) in PTB
  form: lower case, punctuation removed, numbers as ``N``, one verse per line, words outside the
  10,000 - 1 most frequent training words as ``<unk>``; chapters split train/valid/test 8:1:1
  (chapter number mod 10 = 8 -> valid, 9 -> test). Real English, not the Penn Treebank.
- ``librispeech-espeak``: synthetic speech: 300 training and 60 test verses of 3..12 words spoken
  by ``espeak-ng`` with 6 voices x 3 rates x 2 pitches (12 "speakers" in training, 2 other
  voice settings in test), resampled 22,050 -> 16,000 Hz, FLAC 16-bit, LibriSpeech layout
  ``train-clean-100/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac`` + ``.trans.txt``.
  Synthetic, not LibriSpeech.

Exits non-zero with one line naming the set and the cause when a source is missing.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hgsgc.data import DATA_HOME, DEFAULT_PATH, load_fashion_mnist  # noqa: E402

SETS = ("cifar10-fmnist", "imagenet-fmnist", "ptb-kjv", "librispeech-espeak")


def _fmnist():
    d = load_fashion_mnist(DEFAULT_PATH)
    to_u8 = lambda x: np.round(x[..., 0] * 255).astype(np.uint8)  # noqa: E731
    return to_u8(d.x_train), d.y_train, to_u8(d.x_test), d.y_test


def make_cifar(tmp):
    from hgsgc.data.cifar import write_cifar_file

    xtr, ytr, xte, yte = _fmnist()

    def rgb32(x):
        x = np.pad(x, [(0, 0), (2, 2), (2, 2)])
        return np.repeat(x[..., None], 3, axis=-1)

    for i in range(5):
        s = slice(i * 12000, (i + 1) * 12000)
        write_cifar_file(os.path.join(tmp, f"data_batch_{i + 1}.bin"), rgb32(xtr[s]), ytr[s])
    write_cifar_file(os.path.join(tmp, "test_batch.bin"), rgb32(xte), yte)


def make_imagenet(tmp, per_class=(300, 50)):
    import tensorflow as tf

    from hgsgc.data.imagenet import write_tfrecords

    xtr, ytr, xte, yte = _fmnist()
    for split, x, y, n, tf_name, shards in (("train", xtr, ytr, per_class[0], "train", 4),
                                            ("val", xte, yte, per_class[1], "validation", 2)):
        jpegs, labels = [], []
        for c in range(10):
            idx = np.flatnonzero(y == c)[:n]
            d = os.path.join(tmp, "jpeg", split, f"n{c:08d}")
            os.makedirs(d, exist_ok=True)
            imgs = tf.image.resize(x[idx][..., None].astype(np.float32), [64, 64]).numpy()
            imgs = np.repeat(np.clip(np.round(imgs), 0, 255).astype(np.uint8), 3, axis=-1)
            for j, (i, img) in enumerate(zip(idx, imgs)):
                b = tf.io.encode_jpeg(img, quality=95).numpy()
                with open(os.path.join(d, f"n{c:08d}_{i}.JPEG"), "wb") as f:
                    f.write(b)
                jpegs.append(b)
                labels.append(c + 1)  # 1-based, as the standard ImageNet build scripts
        order = np.random.default_rng(0).permutation(len(jpegs))
        os.makedirs(os.path.join(tmp, "tfrecord"), exist_ok=True)
        paths = [os.path.join(tmp, "tfrecord", f"{tf_name}-{k:05d}-of-{shards:05d}") for k in range(shards)]
        write_tfrecords(paths, [jpegs[i] for i in order], [labels[i] for i in order])


def kjv_verses():
    """``[(chapter key, verse text)]`` of the whole King James Bible via the ``bible`` program."""
    if not shutil.which("bible"):
        raise SystemExit("prepare_data.py: ptb-kjv: the 'bible' program is missing: apt-get install bible-kjv")
    out = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], capture_output=True, text=True, check=True).stdout
    verses = []
    for line in out.splitlines():
        m = re.match(r"^(\S+?\d+):\d+ (.*)$", line)
        if m:
            verses.append((m.group(1), m.group(2)))
    if len(verses) < 30000:
        raise SystemExit(f"prepare_data.py: ptb-kjv: 'bible' printed only {len(verses)} verses (expected 31,102)")
    return verses


def clean(text: str) -> str:
    """PTB-style normalisation: lower case, numbers as N, punctuation removed (apostrophes kept
    inside words)."""
    t = text.lower()
    t = re.sub(r"\d+([.,]\d+)*", " 0 ", t)
    t = re.sub(r"[^a-z' 0]", " ", t)
    t = re.sub(r"(^|\s)'+|'+(\s|$)", " ", t)
    return " ".join("N" if w == "0" else w for w in t.split())


def make_ptb(tmp, vocab_size=10000):
    from hgsgc.data.ptb import write_ptb

    chapters = collections.OrderedDict()
    for key, text in kjv_verses():
        chapters.setdefault(key, []).append(clean(text))
    splits = {"train": [], "valid": [], "test": []}
    for i, verses in enumerate(chapters.values()):
        splits["valid" if i % 10 == 8 else "test" if i % 10 == 9 else "train"] += verses
    counts = collections.Counter(w for ln in splits["train"] for w in ln.split())
    keep = {w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab_size - 2]}
    for s in splits:
        splits[s] = [" ".join(w if w in keep else "<unk>" for w in ln.split()) for ln in splits[s]]
    write_ptb(tmp, splits)


VOICES = ["en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-us+f3"]
RATES = [140, 165, 190]
PITCHES = [35, 65]


def _resample(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Linear-interpolation resampling after a 5-tap moving-average low-pass (enough for
    speech whose energy sits below 8 kHz)."""
    x = np.convolve(x, np.ones(5) / 5, mode="same")
    t = np.arange(int(len(x) * dst / src)) * (src / dst)
    return np.interp(t, np.arange(len(x)), x).astype(np.float32)


def make_speech(tmp, n_train=300, n_test=60):
    import soundfile as sf

    from hgsgc.data.librispeech import write_utterance

    if not shutil.which("espeak-ng"):
        raise SystemExit("prepare_data.py: librispeech-espeak: espeak-ng is missing: apt-get install espeak-ng")
    verses = [clean(t) for _, t in kjv_verses()]
    verses = [v for v in verses if 3 <= len(v.split()) <= 12 and "N" not in v.split()]
    rng = np.random.default_rng(0)
    pick = rng.choice(len(verses), n_train + n_test, replace=False)
    settings = [(v, r, p) for v in VOICES for r in RATES for p in PITCHES]  # 36 voice settings
    rng.shuffle(settings)
    train_set, test_set = settings[:12], settings[12:14]
    for k, vi in enumerate(pick):
        split = "train-clean-100" if k < n_train else "test-clean"
        group = train_set if k < n_train else test_set
        si = k % len(group)
        voice, rate, pitch = group[si]
        with tempfile.NamedTemporaryFile(suffix=".wav") as w:
            subprocess.run(["espeak-ng", "-v", voice, "-s", str(rate), "-p", str(pitch), "-w", w.name,
                            verses[vi]], check=True, capture_output=True)
            audio, sr = sf.read(w.name, dtype="float32")
        if audio.ndim > 1:
            audio = audio.mean(1)
        audio = _resample(audio, sr, 16000)
        speaker = 100 + si + (0 if k < n_train else 50)
        write_utterance(os.path.join(tmp, split), speaker, 1 + k // 40, k, audio, verses[vi])


MAKERS = {"cifar10-fmnist": make_cifar, "imagenet-fmnist": make_imagenet, "ptb-kjv": make_ptb,
          "librispeech-espeak": make_speech}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DATA_HOME)
    ap.add_argument("--only", nargs="*", choices=SETS)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name in args.only or SETS:
        final = os.path.join(args.out, name)
        if os.path.exists(os.path.join(final, ".done")):
            print(f"==> {name}: present ({final})")
            continue
        print(f"==> {name}: preparing in {final}", flush=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=args.out)
        try:
            MAKERS[name](tmp)
            open(os.path.join(tmp, ".done"), "w").close()
            os.chmod(tmp, 0o755)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
