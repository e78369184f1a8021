"""The language model's evaluation sharded across ranks (hgsgc.tasks.LanguageModelTask.evaluate):
under mpirun with 2, 3 and 4 ranks the allreduced perplexity equals the same shards evaluated in
one process and summed, on every rank, before and after the weights change (the evaluation
function is built once per task and must see the new weights); with ``train.test_every_epoch=false``
only the valid split, except after the last epoch."""
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import mpi_result  # noqa: E402


def _corpus(path):
    from hgsgc.data.ptb import write_ptb

    words = "the cat sat on a mat and the dog ran to the red house by a tree".split()
    lines = {s: [" ".join(words[(i * k) % len(words):] + words[:(i * k) % len(words)])[: 40 + 3 * i]
                 for i in range(n)] for s, k, n in (("train", 3, 30), ("valid", 5, 14), ("test", 7, 12))}
    write_ptb(str(path), lines)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_sharded_lm_evaluation_equals_one_process(ranks, tmp_path):
    _corpus(tmp_path)
    res = mpi_result(ranks, [os.path.join(ROOT, "tests", "mpi", "check_lm_eval.py"), str(tmp_path)], timeout=300)
    assert len(res["rounds"]) == 2
    for rnd in res["rounds"]:
        got, ref = rnd["sharded"], rnd["one_process"]
        for split in ("valid", "test"):
            assert got[f"{split}_loss"] == pytest.approx(ref[f"{split}_loss"], rel=1e-12)
            assert got[f"{split}_perplexity"] == pytest.approx(ref[f"{split}_perplexity"], rel=1e-12)
            assert got[f"{split}_perplexity"] == pytest.approx(math.exp(got[f"{split}_loss"]), rel=1e-12)
            assert 1.0 < got[f"{split}_perplexity"] < 1e3
        assert rnd["spread_across_ranks"] == 0.0
        # train.test_every_epoch=false: the same valid figures, the test split only when final
        assert rnd["valid_only"] == {k: v for k, v in got.items() if k.startswith("valid_")}
        assert rnd["last"] == got
    # the weights changed between the rounds: so does the perplexity (no stale cached graph)
    assert res["rounds"][0]["sharded"]["valid_perplexity"] != res["rounds"][1]["sharded"]["valid_perplexity"]
    assert res["traced_functions"] == 1  # one trace for both splits and both rounds (same shapes)
