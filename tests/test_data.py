"""Data loaders on tiny files written here in each real format (good and malformed), against
numpy references; sharding covers every example exactly once per epoch across 2, 3 and 4 ranks."""

import numpy as np
import pytest

from hgsgc.data import DataError
from hgsgc.data.sharding import epoch_permutation, rank_indices, steps_per_epoch


# ---------------------------------------------------------------- sharding
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 10, 101])
def test_shards_cover_every_example_once(n, size):
    for epoch in range(3):
        parts = [rank_indices(n, r, size, seed=7, epoch=epoch) for r in range(size)]
        allidx = np.concatenate(parts)
        assert sorted(allidx.tolist()) == list(range(n))  # exactly once
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert min(map(len, parts)) >= steps_per_epoch(n, size, 1)
    # reshuffled every epoch, reproducible from the seed
    assert not np.array_equal(epoch_permutation(101, 7, 0), epoch_permutation(101, 7, 1))
    assert np.array_equal(epoch_permutation(101, 7, 1), np.random.default_rng([7, 1]).permutation(101))


def test_epoch_batches_unchanged():
    from hgsgc.data import epoch_batches

    b = epoch_batches(100, 8, 1, 3, 2, 42)
    perm = np.random.default_rng([42, 2]).permutation(100)
    assert np.array_equal(b.ravel(), perm[1::3][:32])


# ---------------------------------------------------------------- CIFAR-10 binary
def _cifar_records(n, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, n).astype(np.uint8)


def _write_raw_cifar(path, x, y):
    # the format written by hand (label byte, then R, G, B planes), not via the module's writer
    with open(path, "wb") as f:
        for img, lab in zip(x, y):
            f.write(bytes([lab]) + img[:, :, 0].tobytes() + img[:, :, 1].tobytes() + img[:, :, 2].tobytes())


def test_cifar_matches_numpy(tmp_path):
    from hgsgc.data.cifar import Cifar10, read_cifar_file, write_cifar_file

    x1, y1 = _cifar_records(7, 1)
    x2, y2 = _cifar_records(5, 2)
    _write_raw_cifar(tmp_path / "a.bin", x1, y1)
    write_cifar_file(str(tmp_path / "b.bin"), x2, y2)
    assert open(tmp_path / "b.bin", "rb").read()[:3073] == bytes([y2[0]]) + x2[0].transpose(2, 0, 1).tobytes()
    xi, yi = read_cifar_file(str(tmp_path / "a.bin"))
    assert np.array_equal(xi, x1) and np.array_equal(yi, y1)
    d = Cifar10(str(tmp_path), files=["a.bin", "b.bin"])
    X, Y = np.concatenate([x1, x2]), np.concatenate([y1, y2]).astype(np.int32)
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    for size in (2, 3, 4):
        got = []
        for r in range(size):
            ds, steps = d.dataset(r, size, batch=2, seed=3, epoch=1, train=False)
            idx = rank_indices(12, r, size, 3, 1, shuffle=False)
            xs, ys = zip(*[(a.numpy(), b.numpy()) for a, b in ds])
            assert len(xs) == steps
            np.testing.assert_allclose(np.concatenate(xs), (X[idx] / 255.0 - mean) / std, rtol=1e-5, atol=1e-5)
            assert np.array_equal(np.concatenate(ys), Y[idx])
            got += np.concatenate(ys).tolist()
        assert sorted(got) == sorted(Y.tolist())


def test_cifar_train_augmentation_is_a_padded_crop(tmp_path):
    from hgsgc.data.cifar import Cifar10

    x, y = _cifar_records(12, 3)
    _write_raw_cifar(tmp_path / "t.bin", x, y)
    d = Cifar10(str(tmp_path), files=["t.bin"], mean=(0, 0, 0), std=(1, 1, 1))
    for size in (2, 3, 4):
        seen = []
        for r in range(size):
            ds, steps = d.dataset(r, size, batch=1, seed=5, epoch=0, train=True)
            idx = rank_indices(12, r, size, 5, 0)[:steps]
            batches = list(ds)
            assert len(batches) == steps == 12 // size
            for (xb, yb), i in zip(batches, idx):
                assert int(yb[0]) == y[i]
                img = np.round(xb[0].numpy() * 255).astype(np.int64)
                pad = np.pad(x[i].astype(np.int64), [(4, 4), (4, 4), (0, 0)])
                ok = any(np.array_equal(img, c) or np.array_equal(img, c[:, ::-1])
                         for c in (pad[t:t + 32, s:s + 32] for t in range(9) for s in range(9)))
                assert ok, "training image is not a flipped/unflipped 32x32 crop of the padded record"
                seen.append(int(i))
        assert sorted(seen) == list(range(12))  # every example exactly once (12 divisible by 2, 3, 4)


def test_cifar_bad_files(tmp_path):
    from hgsgc.data.cifar import Cifar10

    with pytest.raises(DataError, match="not found.*missing.bin"):
        Cifar10(str(tmp_path), files=["missing.bin"])
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty.bin: empty"):
        Cifar10(str(tmp_path), files=["empty.bin"])
    x, y = _cifar_records(2, 4)
    _write_raw_cifar(tmp_path / "t.bin", x, y)
    (tmp_path / "trunc.bin").write_bytes((tmp_path / "t.bin").read_bytes()[:-100])
    with pytest.raises(DataError, match="trunc.bin: truncated.*1 records of 3073 bytes plus 2973"):
        Cifar10(str(tmp_path), files=["t.bin", "trunc.bin"])
    y[1] = 17
    _write_raw_cifar(tmp_path / "lab.bin", x, y)
    with pytest.raises(DataError, match="lab.bin: record 1 has label 17"):
        Cifar10(str(tmp_path), files=["lab.bin"])


# ---------------------------------------------------------------- ImageNet JPEG tree + TFRecord
def _colour_jpeg(i, hw=(40, 56)):
    """A constant-colour JPEG whose colour encodes example i (survives resize and crop)."""
    import tensorflow as tf

    c = np.array([(i * 37) % 200 + 20, (i * 11) % 200 + 20, (i * 53) % 200 + 20], np.uint8)
    return tf.io.encode_jpeg(np.broadcast_to(c, hw + (3,)).copy(), quality=100).numpy(), c


def _ident(img, colours):
    c = np.asarray(img).reshape(-1, 3).mean(0)
    d = np.abs(colours - c).max(1)
    j = int(np.argmin(d))
    assert d[j] < 3.0, (c, colours[j])
    return j


def _tree(tmp_path, n_per_class=(3, 4, 2)):
    root = tmp_path / "imnet"
    colours, labels, i = [], [], 0
    for split in ("train", "val"):
        for c, k in enumerate(n_per_class):
            d = root / split / f"n0{c}"
            d.mkdir(parents=True)
            for j in range(k):
                b, col = _colour_jpeg(i)
                (d / f"img{j}.JPEG").write_bytes(b)
                if split == "train":
                    colours.append(col)
                    labels.append(c)
                i += 1
    return root, np.array(colours, np.float64), labels


def test_imagenet_jpeg_tree(tmp_path):
    from hgsgc.data.imagenet import MEAN, STD, ImageNetJPEG

    root, colours, labels = _tree(tmp_path)
    d = ImageNetJPEG(str(root), "train", image_size=16)
    assert d.classes == ["n00", "n01", "n02"] and d.labels.tolist() == labels and d.n == 9
    for size in (2, 3, 4):
        for train in (True, False):
            seen = []
            for r in range(size):
                ds, steps = d.dataset(r, size, batch=1, seed=1, epoch=2, train=train)
                got = list(ds)
                assert len(got) == steps
                for x, y in got:
                    assert x.shape == (1, 16, 16, 3)
                    img = x[0].numpy() * STD + MEAN
                    j = _ident(img * 255.0, colours)
                    assert int(y[0]) == labels[j]
                    seen.append(j)
            if train:
                assert len(seen) == len(set(seen)) == (9 // size) * size
            else:
                assert sorted(seen) == list(range(9))
    v = ImageNetJPEG(str(root), "val", image_size=16)
    assert v.n == 9 and v.labels.tolist() == labels


def test_imagenet_bad_jpegs(tmp_path):
    from hgsgc.data.imagenet import ImageNetJPEG

    with pytest.raises(DataError, match="train does not exist"):
        ImageNetJPEG(str(tmp_path), "train")
    root, _, _ = _tree(tmp_path)
    f = root / "train" / "n01" / "img1.JPEG"
    good = f.read_bytes()
    f.write_bytes(good[: len(good) // 2])
    with pytest.raises(DataError, match="n01/img1.JPEG: truncated JPEG"):
        ImageNetJPEG(str(root), "train")
    f.write_bytes(b"")
    with pytest.raises(DataError, match="n01/img1.JPEG: empty"):
        ImageNetJPEG(str(root), "train")
    f.write_bytes(b"\x89PNG\r\n" + good)
    with pytest.raises(DataError, match="n01/img1.JPEG: not a JPEG"):
        ImageNetJPEG(str(root), "train")
    f.write_bytes(good)
    (root / "val" / "n09").mkdir()
    with pytest.raises(DataError, match="n09.*not among the 3 classes"):
        ImageNetJPEG(str(root), "val")


def test_imagenet_tfrecords(tmp_path):
    import tensorflow as tf

    from hgsgc.data.imagenet import MEAN, STD, ImageNetTFRecord, tfrecord_count, write_tfrecords

    jpegs, colours = zip(*[_colour_jpeg(i) for i in range(13)])
    colours = np.array(colours, np.float64)
    labels = [1 + i % 5 for i in range(13)]  # 1-based, as the standard build scripts write
    paths = [str(tmp_path / f"train-{k:05d}-of-00004") for k in range(4)]
    write_tfrecords(paths, list(jpegs), labels)
    assert [tfrecord_count(p) for p in paths] == [4, 3, 3, 3]
    assert sum(1 for _ in tf.data.TFRecordDataset(paths[0])) == 4
    d = ImageNetTFRecord(str(tmp_path), "train", image_size=8, num_classes=5)
    assert d.n == 13
    for size in (2, 3, 4):  # 2, 4: file-level shards; 3 of 4 files: file-level too; all cover once
        seen, steps_all = [], []
        for r in range(size):
            ds, steps = d.dataset(r, size, batch=1, seed=2, epoch=0, train=False)
            for x, y in ds:
                j = _ident((x[0].numpy() * STD + MEAN) * 255.0, colours)
                assert int(y[0]) == labels[j] - 1
                seen.append(j)
            tr, st = d.dataset(r, size, batch=2, seed=2, epoch=1, train=True)
            assert sum(1 for _ in tr) == st
            steps_all.append(st)
        assert sorted(seen) == list(range(13))
        assert len(set(steps_all)) == 1  # the same number of steps on every rank
    d5 = ImageNetTFRecord(str(tmp_path), "train", image_size=8)  # 4 files, 5 ranks: record-level
    seen = []
    for r in range(5):
        ds, _ = d5.dataset(r, 5, batch=4, seed=2, epoch=0, train=False)
        seen += [_ident((x.numpy() * STD + MEAN) * 255.0, colours) for xb, _ in ds for x in xb]
    assert sorted(seen) == list(range(13))


def test_imagenet_bad_tfrecords(tmp_path):
    from hgsgc.data.imagenet import ImageNetTFRecord, write_tfrecords

    with pytest.raises(DataError, match="no TFRecord shards"):
        ImageNetTFRecord(str(tmp_path))
    p = str(tmp_path / "train-00000-of-00001")
    write_tfrecords([p], [_colour_jpeg(0)[0], _colour_jpeg(1)[0]], [1, 2])
    raw = open(p, "rb").read()
    open(p, "wb").write(raw[:-7])
    with pytest.raises(DataError, match="train-00000-of-00001: truncated TFRecord file"):
        ImageNetTFRecord(str(tmp_path))
    open(p, "wb").write(b"")
    with pytest.raises(DataError, match="train-00000-of-00001: empty"):
        ImageNetTFRecord(str(tmp_path))


# ---------------------------------------------------------------- PTB
TRAIN = ["the cat sat on the mat", "the dog sat", "a cat and a dog"]
VALID = ["the cat ran", "zebra"]


def _ptb(tmp_path, train=TRAIN, valid=VALID, test=VALID):
    from hgsgc.data.ptb import write_ptb

    write_ptb(str(tmp_path), {"train": train, "valid": valid, "test": test})
    return str(tmp_path)


def test_ptb_vocab_and_ids(tmp_path):
    from collections import Counter

    from hgsgc.data.ptb import PTB

    d = PTB(_ptb(tmp_path), vocab_size=6)
    words = " <eos> ".join(TRAIN).split() + ["<eos>"]
    counts = Counter(words)
    ranked = sorted(counts, key=lambda w: (-counts[w], w))  # numpy-free reference
    expect = ranked[:4] + ["<unk>"] if "<eos>" in ranked[:4] else ranked[:4]
    assert list(d.vocab)[:4] == ranked[:4] and "<unk>" in d.vocab and "<eos>" in d.vocab
    assert len(d.vocab) == 6 and set(expect) <= set(d.vocab)
    ids = [d.vocab.get(w, d.vocab["<unk>"]) for w in words]
    assert d.ids["train"].tolist() == ids
    assert d.ids["valid"].tolist()[-2:] == [d.vocab["<unk>"], d.vocab["<eos>"]]  # zebra -> <unk>


@pytest.mark.parametrize("size", [2, 3, 4])
def test_ptb_contiguous_batches(tmp_path, size):
    from hgsgc.data.ptb import PTB

    train = [" ".join(f"w{(i * 7 + j) % 23}" for j in range(9)) for i in range(40)]
    d = PTB(_ptb(tmp_path, train=train), vocab_size=100)
    stream = d.ids["train"]
    part = len(stream) // size
    for r in range(size):
        ds, steps = d.dataset("train", r, size, batch=3, bptt=5)
        mine = stream[r * part:(r + 1) * part]
        row = len(mine) // 3
        rows = mine[: 3 * row].reshape(3, row)  # Zaremba et al.: batch x contiguous stream
        got = list(ds)
        assert len(got) == steps == (row - 1) // 5
        for i, (x, y) in enumerate(got):
            assert np.array_equal(x.numpy(), rows[:, i * 5:(i + 1) * 5])
            assert np.array_equal(y.numpy(), rows[:, i * 5 + 1:(i + 1) * 5 + 1])


def test_ptb_bad_files(tmp_path):
    from hgsgc.data.ptb import PTB

    with pytest.raises(DataError, match="ptb.train.txt"):
        PTB(str(tmp_path))
    _ptb(tmp_path)
    (tmp_path / "ptb.valid.txt").write_bytes(b"")
    with pytest.raises(DataError, match="ptb.valid.txt: empty"):
        PTB(str(tmp_path))
    (tmp_path / "ptb.valid.txt").write_bytes(b"good words\nbad \xff\xfe bytes\n")
    with pytest.raises(DataError, match="ptb.valid.txt:2: not UTF-8"):
        PTB(str(tmp_path))


# ---------------------------------------------------------------- LibriSpeech
def _speech(tmp_path, n=6):
    from hgsgc.data.librispeech import write_utterance

    root = tmp_path / "train-clean"
    texts = ["hello world", "it's a test", "abc", "speech recognition", "zz top", "one two three"]
    lens = []
    for i in range(n):
        s = 1600 + 997 * i
        t = np.arange(s) / 16000.0
        audio = (0.3 * np.sin(2 * np.pi * (200 + 50 * i) * t)).astype(np.float32)
        write_utterance(str(root), 100 + i % 2, 7, i, audio, texts[i % len(texts)])
        lens.append(s)
    return root, texts, lens


def test_librispeech_features_and_targets(tmp_path):
    import soundfile as sf

    from hgsgc.data.librispeech import (FFT, HOP, WINDOW, LibriSpeech, decode_ids, encode_text,
                                        mel_matrix)

    root, texts, lens = _speech(tmp_path)
    d = LibriSpeech(str(root), n_mels=8)
    assert d.n == 6 and sorted(d.frames.tolist()) == sorted(lens)
    assert decode_ids(encode_text("It's ab")) == "it's ab" and encode_text("a b").tolist() == [3, 1, 4]
    ds, steps = d.dataset(0, 1, batch=3, seed=0, epoch=0, train=False)
    (feats, frames), (y, ylen) = next(iter(ds))
    idx = list(range(3))
    mel = mel_matrix(8)
    for j, i in enumerate(idx):
        a = sf.read(d.files[i], dtype="float32")[0]
        nfr = 1 + (len(a) - WINDOW) // HOP
        assert int(frames[j]) == nfr
        win = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(WINDOW) / WINDOW)  # periodic Hann
        ref = np.stack([np.abs(np.fft.rfft(a[k * HOP:k * HOP + WINDOW] * win, FFT)) ** 2 for k in range(nfr)])
        ref = np.log(ref @ mel + 1e-6)
        np.testing.assert_allclose(feats[j, :nfr].numpy(), ref, rtol=1e-3, atol=2e-3)
        assert decode_ids(y[j, :int(ylen[j])].numpy()) == d.texts[i].lower()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_librispeech_sharding_and_buckets(tmp_path, size):
    from hgsgc.data.librispeech import LibriSpeech

    root, _, _ = _speech(tmp_path)
    d = LibriSpeech(str(root), n_mels=8, bucket_batches=2)
    seen = []
    steps = set()
    for r in range(size):
        bs = d.batches(r, size, 1, seed=4, epoch=3, train=True)
        steps.add(len(bs))
        seen += [int(i) for b in bs for i in b]
        ev = d.batches(r, size, 2, seed=4, epoch=3, train=False)
        assert np.array_equal(np.concatenate(ev), np.arange(r, 6, size))
    assert len(steps) == 1 and len(seen) == len(set(seen)) == (6 // size) * size
    d6 = LibriSpeech(str(root), n_mels=8, bucket_batches=3)  # one chunk of 3 batches of 2
    two = d6.batches(0, 1, 2, seed=4, epoch=0)
    assert sorted(int(i) for b in two for i in b) == list(range(6))
    spans = sorted((int(d.frames[b].min()), int(d.frames[b].max())) for b in two)
    # bucketed: the 6 utterances sorted by length, cut into consecutive pairs
    order = np.sort(d.frames)
    assert spans == [(int(order[k]), int(order[k + 1])) for k in (0, 2, 4)]


def test_librispeech_bad_files(tmp_path):
    from hgsgc.data.librispeech import LibriSpeech

    with pytest.raises(DataError, match="not found"):
        LibriSpeech(str(tmp_path / "nope"))
    root, _, _ = _speech(tmp_path)
    chapter = root / "100" / "7"
    flac = chapter / "100-7-0002.flac"
    good = flac.read_bytes()
    flac.write_bytes(good[: len(good) // 2])
    with pytest.raises(DataError, match="100-7-0002.flac: (truncated|not a readable)"):
        LibriSpeech(str(root))
    flac.write_bytes(b"")
    with pytest.raises(DataError, match="100-7-0002.flac: empty"):
        LibriSpeech(str(root))
    flac.write_bytes(b"fLaC" + b"\x00" * 50)
    with pytest.raises(DataError, match="100-7-0002.flac: not a readable FLAC"):
        LibriSpeech(str(root))
    flac.unlink()
    with pytest.raises(DataError, match="100-7.trans.txt:2: audio file .*100-7-0002.flac not found"):
        LibriSpeech(str(root))
    flac.write_bytes(good)
    trans = chapter / "100-7.trans.txt"
    trans.write_text(trans.read_text().replace("100-7-0002 ABC", "100-7-0002 AB#C"))
    with pytest.raises(DataError, match="100-7.trans.txt:2: malformed"):
        LibriSpeech(str(root))


def test_ptb_limits_cut_only_their_splits_and_keep_the_vocabulary(tmp_path):
    """data.train_limit cuts the training stream only, data.test_limit valid and test only; the
    vocabulary (the model's size) is built from the whole training file either way."""
    from hgsgc.data.ptb import PTB

    train = [" ".join(f"w{(i * 7 + j) % 23}" for j in range(9)) for i in range(40)]
    valid = [" ".join(f"w{(i * 5 + j) % 23}" for j in range(7)) for i in range(30)]
    path = _ptb(tmp_path, train=train, valid=valid, test=valid)
    full = PTB(path, vocab_size=100)
    cut = PTB(path, vocab_size=100, limit=50)
    assert cut.vocab == full.vocab and cut.num_classes == full.num_classes == 25  # 23 words, <eos>, <unk>
    assert cut.ids["train"].tolist() == full.ids["train"][:50].tolist()
    assert cut.ids["valid"].tolist() == full.ids["valid"].tolist() and len(full.ids["valid"]) == 30 * 8
    both = PTB(path, vocab_size=100, limit=50, eval_limit=17)
    assert both.ids["train"].tolist() == full.ids["train"][:50].tolist()
    assert both.ids["valid"].tolist() == full.ids["valid"][:17].tolist()
    assert both.ids["test"].tolist() == full.ids["test"][:17].tolist()
