"""Short training runs, one per task, on the offline defaults prepared by scripts/install.sh
(2 ranks under mpirun; SGC for the language and speech models, dense for the CNNs, whose
SGC runs at 1 % density need more steps than a test can afford: docs/experiments.md): each shows learning by a margin measured on these runs.

The margins: see MEASURED below; each bound sits well inside the measured change and well outside
what an untrained model gives (chance accuracy, the uniform-vocabulary perplexity, the loss of
the first steps), so a run that does not learn fails.
"""
import json
import os

import pytest

from conftest import MPIRUN, PY, ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

RUNS = {
    # name: (config, overrides)
    "cifar10": ("configs/cifar10_resnet20/dense.yaml",
                ["data.train_limit=1024", "data.test_limit=512", "train.epochs=1", "train.warmup_steps=2"]),
    "imagenet": ("configs/imagenet_alexnet/dense.yaml",
                 ["data.train_limit=640", "data.test_limit=200", "train.epochs=2", "train.warmup_steps=2",
                  "train.lr=0.2", "train.weight_decay=0"]),
    "ptb": ("configs/ptb_lstm/sgc.yaml", ["data.train_limit=12000", "data.vocab_size=1200", "train.epochs=1",
             "model.units=64"]),
    "speech": ("configs/librispeech_ctc/sgc.yaml", ["data.test_limit=32", "train.epochs=2"]),
}


def _run(name, tmp):
    import subprocess

    cfg, over = RUNS[name]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    cmd = MPIRUN + ["-np", "2", "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL", PY, "-m", "hgsgc.cli", "train",
                    cfg, *over, f"run.out_dir={tmp}", f"run.id={name}", "train.progress=false",
                    "train.log_every_steps=1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    d = tmp / name
    s = json.loads((d / "summary.json").read_text())
    steps = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    steps = [r["train_loss"] for r in steps if r.get("kind") == "step"]
    print(name, "RESULT", json.dumps({"first": steps[:3], "last": steps[-3:],
                                      **{k: v for k, v in s.items() if k.startswith("final_")}}))
    return s, steps


def _mean(xs):
    return sum(xs) / len(xs)


def test_cifar10_resnet20_learns(tmp_path):
    s, steps = _run("cifar10", tmp_path)
    assert len(steps) == 1024 // (2 * 32)
    # test accuracy is not checked: after 16 steps the batch-norm moving statistics used in
    # evaluation still lag the weights (measured: 0.105), so the training loss is the signal
    assert _mean(steps[-3:]) < _mean(steps[:3]) - MEASURED["cifar10"]["loss_drop"], steps
    assert 0.0 < s["final_test_loss"] < float("inf") and s["world_size"] == 2


def test_imagenet_alexnet_learns(tmp_path):
    s, steps = _run("imagenet", tmp_path)
    assert len(steps) == 2 * (640 // (2 * 32))
    # AlexNet (no batch norm) barely moves its training loss in 20 steps (measured 2.31 -> 2.26
    # over 3-step means, within step noise); its test accuracy does move
    assert s["final_test_accuracy"] > MEASURED["imagenet"]["accuracy"], s


def test_ptb_lstm_learns(tmp_path):
    s, steps = _run("ptb", tmp_path)
    assert _mean(steps[-3:]) < _mean(steps[:3]) - MEASURED["ptb"]["loss_drop"], steps
    assert s["final_valid_perplexity"] < MEASURED["ptb"]["perplexity"], s


def test_librispeech_ctc_learns(tmp_path):
    s, steps = _run("speech", tmp_path)
    assert len(steps) == 2 * (300 // (2 * 8))
    first = _mean(steps[:3])
    assert _mean(steps[-3:]) < MEASURED["speech"]["loss_ratio"] * first, steps
    assert s["final_test_loss"] < MEASURED["speech"]["test_loss_ratio"] * first, s
    # WER/CER are computed (greedy decoding) but not bounded: after 36 steps the model still
    # emits almost only blanks (measured CER 0.98 after epoch 1)
    assert 0.0 <= s["final_test_cer"] <= 1.5 and 0.0 <= s["final_test_wer"] <= 1.5


MEASURED = {
    # resnet20 dense, 16 steps: mean loss of the first 3 steps 2.75, of the last 3 1.93 (drop
    # 0.82); a single step's loss on 32 images varies by about +-0.25, a 3-step mean by about
    # +-0.15: a drop of 0.3 is about 3 such deviations under the measured drop and 2 above zero
    "cifar10": {"loss_drop": 0.3},
    # alexnet dense, 20 steps: test accuracy 0.285 on 200 images (chance 0.10; the binomial
    # standard deviation of chance accuracy on 200 images is 0.021): 0.18 is 4 deviations above
    # chance and 0.1 under the measured value
    "imagenet": {"accuracy": 0.18},
    # lstm_small (64 units), SGC, 1 epoch on 12,000 tokens, the 1,200 most frequent words of the
    # whole training file as vocabulary: 3-step mean loss 7.06 -> 6.54 (drop 0.52; the stream is
    # not shuffled, steps vary by about 0.03); valid perplexity 643.2 (whole validation split)
    # while a uniform guess over the 1,200-word vocabulary scores 1,200
    "ptb": {"loss_drop": 0.15, "perplexity": 1000.0},
    # ctc_small, SGC as shipped (delay 2, warm-up 36 steps: this whole run), 2 epochs of 300
    # utterances (36 steps): per-step CTC loss 578, 488, 291 in the first 3 steps (mean 452),
    # last 3 steps 168, 191, 224 (mean 194, ratio 0.43; length buckets make single steps vary by
    # about +-60, a 3-step mean by about +-35 = 0.08 of 452); test loss 166 (ratio 0.37); CER
    # 0.90, WER 1.00. (Delay 4: ratio 0.40, test 0.32; delay 1 + DGC momentum correction, shipped
    # before: 0.40, 0.33; before that, plain SGC: 0.61, 0.49.)
    "speech": {"loss_ratio": 0.8, "test_loss_ratio": 0.7},
}
