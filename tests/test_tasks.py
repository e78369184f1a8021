"""Tasks, models, learning-rate schedules, progress lines and configs of the experiments."""
import math

import numpy as np
import pytest

from conftest import mpi_cases
from hgsgc.config import ConfigError, load_config

MPI_CASES = mpi_cases("tests/mpi/check_indexed_slices.py", ranks=[2, 3], timeout=600)


def _t(**kw):
    from hgsgc.config import TrainConfig

    t = TrainConfig()
    for k, v in kw.items():
        setattr(t, k, v)
    return t


@pytest.mark.parametrize("kw", [
    dict(),
    dict(warmup_steps=7, base_batch_size=64),
    dict(lr_schedule="step", lr_decay=0.5, lr_decay_epochs=[2, 3], epochs=4),
    dict(lr_schedule="cosine", warmup_steps=3, epochs=3),
])
def test_lr_schedule_matches_formula(kw):
    from hgsgc.loop import lr_at, lr_schedule

    t = _t(lr=0.1, **kw)
    spe, wb = 10, 128
    sched = lr_schedule(t, spe, wb)
    for step in range(0, 40):
        e = step // spe + 1
        ref = 0.1 * (wb / t.base_batch_size if t.base_batch_size else 1.0)  # linear scaling rule
        if t.warmup_steps:
            ref *= min(1.0, (step + 1) / t.warmup_steps)
        if t.lr_schedule == "step":
            ref *= 0.5 ** sum(e >= b for b in t.lr_decay_epochs)
        if t.lr_schedule == "cosine":
            ref *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / (t.epochs * spe))))
        assert lr_at(t, step, spe, wb) == pytest.approx(ref, rel=1e-12)
        got = float(sched(step)) if callable(sched) else sched
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-9)


def test_schedule_survives_optimizer_config_round_trip():
    import tensorflow as tf

    from hgsgc.loop import lr_schedule

    opt = tf.keras.optimizers.legacy.SGD(learning_rate=lr_schedule(_t(lr=0.2, warmup_steps=4), 5, 32))
    again = tf.keras.optimizers.legacy.SGD.from_config(opt.get_config())  # what Horovod's wrapper does
    assert float(again.learning_rate(1)) == pytest.approx(0.1)


def test_hourglass_refused_for_models_without_boundary(capsys):
    from hgsgc.cli import main

    with pytest.raises(ConfigError, match=r"^layout=hourglass needs a model with a conv/FC boundary; "
                                          r"model lstm_small has none .*: use layout=data_parallel$"):
        load_config("configs/ptb_lstm/sgc.yaml", ["layout=hourglass"])
    assert main(["train", "configs/librispeech_ctc/dense.yaml", "layout=hourglass"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model ctc_small has none" in err[0]


@pytest.mark.parametrize("overrides,match", [
    (["model.name=resnet20"], "data.format=ptb needs a lm model: use one of lstm_small, lstm_medium"),
    (["data.format=mnist"], "data.format='mnist' is invalid"),
    (["train.lr_schedule=poly"], "train.lr_schedule='poly' is invalid"),
    (["train.lr_schedule=cosine"], "applies to train.lr_schedule=step only"),
    (["train.clip_norm=-1"], "train.clip_norm=-1.0 is invalid"),
])
def test_task_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("configs/ptb_lstm/dense.yaml", overrides)


def test_every_shipped_task_config_loads():
    import glob

    for f in sorted(glob.glob("configs/*/*.yaml")):
        if "/bench/" in f:
            continue
        cfg = load_config(f)
        assert cfg.layout == ("hourglass" if "hourglass" in f else "data_parallel"), f


def test_models_shapes_and_boundaries():
    import tensorflow as tf

    from hgsgc.hourglass.split import split_model
    from hgsgc.models import BOUNDARY, build_model

    cases = {"resnet20": ((32, 32, 3), 10), "vgg16": ((32, 32, 3), 10), "alexnet": ((64, 64, 3), 10)}
    for name, (shape, k) in cases.items():
        m = build_model(name, num_classes=k, input_shape=shape, width=0.25 if name != "resnet20" else 1.0)
        assert m(tf.zeros((2,) + shape)).shape == (2, k)
        s = split_model(m)
        assert s.boundary_layer == BOUNDARY[name]
        x = tf.random.uniform((3,) + shape)
        np.testing.assert_allclose(s.head(s.trunk(x)).numpy(), m(x).numpy(), rtol=1e-5, atol=1e-5)
    r20 = build_model("resnet20")
    # He et al.: ResNet-20 has 0.27 M parameters (ours: projection shortcuts at the 2 stage changes)
    assert 0.26e6 < r20.count_params() < 0.28e6
    lm = build_model("lstm_small", num_classes=100)
    z = tf.zeros((2, 200))
    logits, h1, c1, h2, c2 = lm([tf.zeros((2, 7), tf.int32), z, z, z, z])
    assert logits.shape == (2, 7, 100) and h2.shape == (2, 200)
    # embedding 100x200, 2 LSTMs 4*(200*200*2+200) each, softmax 200x100+100
    assert lm.count_params() == 100 * 200 + 2 * 4 * (2 * 200 * 200 + 200) + 200 * 100 + 100
    ctc = build_model("ctc_small", num_classes=29, input_shape=(None, 40))
    assert ctc(tf.zeros((2, 51, 40))).shape == (2, 26, 29)  # stride 2: ceil(51 / 2)


def test_lstm_embedding_gradient_is_indexed_slices():
    import tensorflow as tf

    from hgsgc.models import build_model

    lm = build_model("lstm_small", num_classes=50, units=8)
    z = tf.zeros((2, 8))
    with tf.GradientTape() as tape:
        logits = lm([tf.constant([[1, 2, 3], [4, 5, 6]]), z, z, z, z])[0]
        loss = tf.reduce_mean(logits)
    g = tape.gradient(loss, lm.trainable_variables)
    assert isinstance(g[0], tf.IndexedSlices) and sorted(g[0].indices.numpy().tolist()) == [1, 2, 3, 4, 5, 6]


def test_greedy_decode_and_error_rates():
    from hgsgc.tasks import edit_sums, greedy_decode

    logits = np.full((1, 7, 4), -5.0)
    for t, c in enumerate([1, 1, 0, 1, 2, 2, 0]):  # "a a _ a b b _" -> [1, 1, 2]
        logits[0, t, c] = 5.0
    assert greedy_decode(logits, np.array([7])) == [[1, 1, 2]]
    assert greedy_decode(logits, np.array([2])) == [[1]]
    # "the cat sat" vs "the bat": words: 1 substitution + 1 deletion = 2 of 3; chars: c->b + " sat" = 5 of 11
    assert edit_sums(["the cat sat"], ["the bat"]) == (2, 3, 5, 11)
    assert edit_sums(["a b", "c"], ["a b", "c"]) == (0, 3, 0, 4)


def test_progress_plain_lines_when_not_a_terminal():
    from hgsgc.loop import Progress

    lines = []
    p = Progress(True, 1, 2, 5, interval_s=0.0, log=lines.append, tty=False)
    for i in range(1, 6):
        p.update(i, 0.5)
    assert len(lines) == 5 and lines[-1].startswith("epoch 1/2 step 5/5 loss 0.5000, ")
    lines.clear()
    p = Progress(True, 2, 2, 400, interval_s=3600.0, log=lines.append, tty=False)
    for i in range(1, 401):
        p.update(i, 1.0)
    assert len(lines) == 1 and lines[0].startswith("epoch 2/2 step 400/400")  # only the last step
    assert "\r" not in "".join(lines)


def test_run_log_step_lines_and_tensorboard(tmp_path):
    import json

    import tensorflow as tf

    from hgsgc.loop import RunLog, epoch_records

    cfg = load_config("configs/ptb_lstm/dense.yaml", [f"run.out_dir={tmp_path}", "train.log_every_steps=2"])
    r = RunLog(cfg, "x", True, log=lambda s: None)
    for s, loss in enumerate([4.0, 3.0, 2.0, 1.0, 0.5], 1):
        r.step(s, 1, loss, lr=0.1)
    r.epoch({"epoch": 1, "train_loss": 2.1, "valid_perplexity": 9.0}, 5)
    r.summary({"ok": 1})
    recs = [json.loads(ln) for ln in (tmp_path / "x" / "metrics.jsonl").read_text().splitlines()]
    assert recs[0] == {"kind": "step", "step": 2, "epoch": 1, "train_loss": 3.5, "lr": 0.1}
    assert recs[1]["train_loss"] == 1.5 and epoch_records(recs) == [recs[2]]
    tags = set()
    for f in (tmp_path / "x" / "tb").iterdir():
        for e in tf.compat.v1.train.summary_iterator(str(f)):
            tags |= {v.tag for v in e.summary.value}
    assert {"step/train_loss", "step/lr", "epoch/valid_perplexity"} <= tags


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3])
def test_indexed_slices_through_every_compression(np_, mpi_batch):
    out = mpi_batch.result(np_, "tests/mpi/check_indexed_slices.py")
    for name, m in out["methods"].items():
        assert "error" not in m, (name, m)
        # the sparse path and the densified path apply the same update (float32 sums in another order)
        assert m["slices_vs_dense"] < 1e-5, (name, m)
        assert m["rank_spread"] < 1e-6 or name == "localsgd", (name, m)
    for name in ("none", "topk_exact"):
        assert out["methods"][name]["vs_numpy"] < 1e-4, (name, out["methods"][name])
