"""LibriSpeech layout (Panayotov et al. 2015): ``<root>/<split>/<speaker>/<chapter>/<id>.flac`` with
one ``<speaker>-<chapter>.trans.txt`` per chapter (lines ``<speaker>-<chapter>-<utt> TRANSCRIPT``).

Audio is read with ``soundfile`` (libsndfile), 16 kHz mono. Features: log-mel spectrogram,
25 ms Hann windows every 10 ms (400/160 samples, 512-point FFT), ``n_mels`` triangular mel filters
(HTK mel scale, 20 Hz..7.6 kHz, ``tf.signal.linear_to_mel_weight_matrix``),
``log(mel power + 1e-6)``. Targets: characters, ``0`` = CTC blank, then space, apostrophe,
``a..z`` (ids 1..28). Batches are bucketed by length: a rank's shuffled examples are cut into
chunks of ``bucket_batches`` batches, each chunk sorted by duration and cut into batches, and the
batch order shuffled, so a batch holds utterances of similar length (little padding).

Checks when a loader is built (every rank, before training): every transcript line has its
FLAC file and every FLAC file its transcript line; no file is empty; every FLAC opens, is mono at
the expected rate, has at least one frame, and its last frame can be read (a truncated copy
cannot); every transcript holds only letters, spaces and apostrophes.

The offline default (``scripts/install.sh``) is synthetic speech: sentences spoken by espeak-ng
with several voices, rates and pitches, written in this layout. It is not LibriSpeech.
"""
from __future__ import annotations

import os
from typing import List

import numpy as np

from hgsgc.data.errors import DataError
from hgsgc.data.sharding import rank_indices, steps_per_epoch

ALPHABET = " 'abcdefghijklmnopqrstuvwxyz"  # ids 1..28; 0 = CTC blank
CHAR_ID = {c: i + 1 for i, c in enumerate(ALPHABET)}
NUM_CLASSES = len(ALPHABET) + 1
SAMPLE_RATE = 16000
WINDOW, HOP, FFT = 400, 160, 512


def encode_text(text: str) -> np.ndarray:
    """int32 character ids (1..28) of a transcript (case-insensitive)."""
    return np.asarray([CHAR_ID[c] for c in text.lower()], np.int32)


def decode_ids(ids) -> str:
    """Text of character ids (0 and out-of-range ids dropped)."""
    return "".join(ALPHABET[i - 1] for i in ids if 1 <= i <= len(ALPHABET))


def check_flac(path: str, sample_rate: int = SAMPLE_RATE) -> int:
    """Frames of a FLAC file after the checks above.

    Raises:
        DataError: naming ``path``: empty, unreadable, wrong rate or channels, no frames, truncated.
    """
    import soundfile as sf

    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: empty FLAC file: re-copy it")
    try:
        with sf.SoundFile(path) as f:
            frames, rate, ch = f.frames, f.samplerate, f.channels
            if frames > 0:
                f.seek(frames - 1)
                last = f.read(1, dtype="float32")
                if len(last) != 1:
                    raise DataError(f"{path}: truncated FLAC (header says {frames} frames, the last "
                                    f"cannot be read): re-copy it")
    except DataError:
        raise
    except Exception as exc:  # soundfile.LibsndfileError, RuntimeError
        raise DataError(f"{path}: not a readable FLAC file ({str(exc).strip()}): re-copy it") from None
    if rate != sample_rate or ch != 1:
        raise DataError(f"{path}: {ch} channel(s) at {rate} Hz, expected mono {sample_rate} Hz "
                        f"(LibriSpeech): resample it")
    if frames == 0:
        raise DataError(f"{path}: FLAC file without audio frames: re-copy it or delete it and its "
                        f"transcript line")
    return frames


def list_utterances(root: str):
    """``(files, transcripts, frames)`` of a LibriSpeech split folder, sorted by utterance id.

    Raises:
        DataError: see the module docstring.
    """
    if not os.path.isdir(root):
        raise DataError(f"LibriSpeech folder not found: {root} (expected <speaker>/<chapter>/<id>.flac; "
                        f"set data.path)")
    files, texts, frames = [], [], []
    for dirpath, _, names in sorted(os.walk(root)):
        flacs = sorted(n for n in names if n.endswith(".flac"))
        trans = [n for n in names if n.endswith(".trans.txt")]
        if not flacs and not trans:
            continue
        rel = os.path.relpath(dirpath, root).split(os.sep)
        if not trans:
            raise DataError(f"{dirpath}: FLAC files without a transcript file "
                            f"{'-'.join(rel[-2:])}.trans.txt")
        lines = {}
        for t in trans:
            tp = os.path.join(dirpath, t)
            with open(tp, "rb") as f:
                raw = f.read()
            if not raw.strip():
                raise DataError(f"{tp}: empty transcript file")
            for lineno, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
                if not line.strip():
                    continue
                parts = line.strip().split(" ", 1)
                text = parts[1].strip() if len(parts) == 2 else ""
                if not text or any(c not in CHAR_ID for c in text.lower()):
                    raise DataError(f"{tp}:{lineno}: malformed line {line.strip()[:60]!r} (expected "
                                    f"'<id> TRANSCRIPT' of letters, spaces and apostrophes)")
                lines[parts[0]] = (text, tp, lineno)
        have = {n[:-5] for n in flacs}
        for uid, (_, tp, lineno) in lines.items():
            if uid not in have:
                raise DataError(f"{tp}:{lineno}: audio file {os.path.join(dirpath, uid + '.flac')} not found")
        for n in flacs:
            uid = n[:-5]
            p = os.path.join(dirpath, n)
            if uid not in lines:
                raise DataError(f"{p}: no transcript line for {uid} in {', '.join(trans)}")
            frames.append(check_flac(p))
            files.append(p)
            texts.append(lines[uid][0])
    if not files:
        raise DataError(f"{root}: no .flac files found (expected <speaker>/<chapter>/<id>.flac)")
    return files, texts, np.asarray(frames, np.int64)


def mel_matrix(n_mels: int):
    """float32 ``[FFT/2 + 1, n_mels]`` mel filterbank (HTK mel scale, 20..7600 Hz)."""
    import tensorflow as tf

    return tf.signal.linear_to_mel_weight_matrix(n_mels, FFT // 2 + 1, SAMPLE_RATE, 20.0, 7600.0).numpy()


def log_mel(audio, n_mels: int = 40):
    """Log-mel features of padded audio ``float32 [B, S]`` -> ``[B, frames, n_mels]``,
    ``frames = 1 + (S - 400) // 160`` (TensorFlow ops)."""
    import tensorflow as tf

    spec = tf.signal.stft(audio, WINDOW, HOP, FFT, window_fn=tf.signal.hann_window, pad_end=False)
    power = tf.math.square(tf.abs(spec))
    mel = tf.signal.linear_to_mel_weight_matrix(n_mels, FFT // 2 + 1, SAMPLE_RATE, 20.0, 7600.0)
    return tf.math.log(tf.tensordot(power, mel, 1) + 1e-6)


def feature_frames(samples):
    """Feature frames of ``samples`` audio samples (numpy or int): ``max(0, 1 + (S - 400) // 160)``."""
    return np.maximum(0, 1 + (np.asarray(samples) - WINDOW) // HOP)


class LibriSpeech:
    """A LibriSpeech split as a rank-sharded, length-bucketed pipeline.

    Args:
        root: the split folder (e.g. ``.../LibriSpeech/train-clean-100``).
        n_mels: mel bins; bucket_batches: batches per length-sorted chunk.

    Raises:
        DataError: see :func:`list_utterances`.
    """

    num_classes = NUM_CLASSES

    def __init__(self, root: str, n_mels: int = 40, bucket_batches: int = 8, limit: int = 0):
        self.files, self.texts, self.frames = list_utterances(root)
        if limit and limit < len(self.files):  # a fixed subset across speakers
            keep = np.sort(np.random.default_rng(0).permutation(len(self.files))[:limit])
            self.files, self.texts, self.frames = ([self.files[i] for i in keep], [self.texts[i] for i in keep],
                                                   self.frames[keep])
        self.n = len(self.files)
        self.n_mels = n_mels
        self.bucket_batches = bucket_batches
        self.input_shape = (None, n_mels)

    def batches(self, rank: int, size: int, batch: int, seed: int, epoch: int, train: bool = True) -> List[np.ndarray]:
        """Index batches of one rank for one epoch (bucketed by length when training)."""
        idx = rank_indices(self.n, rank, size, seed, epoch, shuffle=train)
        if not train:
            return [idx[i:i + batch] for i in range(0, len(idx), batch)]
        steps = steps_per_epoch(self.n, size, batch)
        idx = idx[: steps * batch]
        chunk = batch * self.bucket_batches
        out = []
        for s in range(0, len(idx), chunk):
            c = idx[s:s + chunk]
            c = c[np.argsort(self.frames[c], kind="stable")]
            out += [c[i:i + batch] for i in range(0, len(c), batch)]
        order = np.random.default_rng([int(seed), int(epoch), 1 + rank]).permutation(len(out))
        return [out[i] for i in order]

    def load_batch(self, idx: np.ndarray):
        """Padded audio float32 ``[B, S]``, sample counts int32 ``[B]``, padded labels int32
        ``[B, L]`` and label lengths int32 ``[B]`` of example indices ``idx``."""
        import soundfile as sf

        audio = [sf.read(self.files[i], dtype="float32")[0] for i in idx]
        labels = [encode_text(self.texts[i]) for i in idx]
        S = max(max(len(a) for a in audio), WINDOW)
        L = max(len(t) for t in labels)
        a = np.zeros((len(idx), S), np.float32)
        y = np.zeros((len(idx), L), np.int32)
        for j, (x, t) in enumerate(zip(audio, labels)):
            a[j, :len(x)] = x
            y[j, :len(t)] = t
        return (a, np.asarray([len(x) for x in audio], np.int32), y,
                np.asarray([len(t) for t in labels], np.int32))

    def dataset(self, rank: int, size: int, batch: int, seed: int, epoch: int, train: bool = True):
        """``(ds, steps)``; ``ds`` yields ``((features float32 [B, T, n_mels], frames int32 [B]),
        (labels int32 [B, L], label_lengths int32 [B]))``; FLAC decode runs in parallel."""
        import tensorflow as tf

        bs = self.batches(rank, size, batch, seed, epoch, train)
        ragged = tf.ragged.constant([b.tolist() for b in bs], dtype=tf.int64)
        ds = tf.data.Dataset.from_tensor_slices(ragged)
        n_mels = self.n_mels

        def load(idx):
            a, n, y, ln = tf.numpy_function(lambda i: self.load_batch(i), [idx],
                                            [tf.float32, tf.int32, tf.int32, tf.int32])
            a.set_shape([None, None])
            feats = log_mel(a, n_mels)
            frames = tf.maximum(0, 1 + (n - WINDOW) // HOP)
            y.set_shape([None, None])
            return (feats, frames), (y, tf.reshape(ln, [-1]))

        ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.prefetch(tf.data.AUTOTUNE), len(bs)


def write_utterance(root: str, speaker: int, chapter: int, utt: int, audio: np.ndarray, text: str,
                    sample_rate: int = SAMPLE_RATE) -> str:
    """Write one utterance (FLAC + its transcript line, appended) in LibriSpeech layout; returns the
    FLAC path."""
    import soundfile as sf

    d = os.path.join(root, str(speaker), str(chapter))
    os.makedirs(d, exist_ok=True)
    uid = f"{speaker}-{chapter}-{utt:04d}"
    p = os.path.join(d, uid + ".flac")
    sf.write(p, audio, sample_rate, format="FLAC", subtype="PCM_16")
    with open(os.path.join(d, f"{speaker}-{chapter}.trans.txt"), "a") as f:
        f.write(f"{uid} {text.upper()}\n")
    return p
