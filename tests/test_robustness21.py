"""Session 21: a setting that was silently ignored is now used or refused, each pinned by a test
that failed before its fix (said so in each docstring)."""
import json

import pytest

from conftest import mpirun

TINY = ["model.name=tiny", "data.train_limit=500", "data.test_limit=100", "train.epochs=1",
        "train.max_steps_per_epoch=2", "train.progress=false", "train.threads=1",
        "hourglass.link_bandwidth_mbps=100"]


def _hgsgc(args, np_, timeout=300):
    return mpirun(np_, ["-m", "hgsgc.cli"] + list(args), timeout=timeout)


@pytest.mark.mpi
def test_layout_auto_weighs_only_the_given_fc_workers_on_4_ranks(tmp_path):
    """layout: auto with hourglass.fc_workers=2 on 4 ranks predicted the Hourglass with 1 and 2 FC
    ranks and could run it with 1 (the integer was ignored); now it weighs data parallelism
    against 2 FC ranks only, and the run is the layout it chose."""
    p = _hgsgc(["train", "configs/fashion_mnist_auto.yaml", "hourglass.fc_workers=2", *TINY,
                f"run.out_dir={tmp_path}", "run.id=a"], 4)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    choice = s["layout_choice"]
    assert [q["fc_workers"] for q in choice["predictions"]] == [None, 2]
    assert s["layout"] == choice["layout"] and choice["fc_workers"] in (None, 2)
    if s["layout"] == "hourglass":
        assert s["roles"]["fc"]["ranks"] == [2, 3], s["roles"]["fc"]


@pytest.mark.mpi
def test_layout_auto_refuses_fc_workers_that_do_not_fit_on_3_ranks(tmp_path):
    """hourglass.fc_workers=2 on 3 ranks (1 CONV rank for 2 FC ranks) is refused by layout:
    hourglass; layout: auto measured, ignored it and trained. Now one line names it, every rank
    ends before measuring."""
    p = _hgsgc(["train", "configs/fashion_mnist_auto.yaml", "hourglass.fc_workers=2", *TINY,
                f"run.out_dir={tmp_path}", "run.id=b"], 3)
    assert p.returncode != 0, p.stdout[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("hgsgc: ")]
    assert len(lines) == 1 and "hourglass.fc_workers=2 is more than the 1 CONV ranks left of 3" in lines[0], \
        p.stderr[-2000:]
    assert "layout auto:" not in p.stdout and not (tmp_path / "b" / "summary.json").exists()
