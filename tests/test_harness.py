"""The test suite's own machinery (tests/conftest.py, tests/helpers.py): plots are no-ops unless a test is
marked `plots`; `toy_run` is a private copy of the session's toy run."""

import pytest

from helpers import TOY_RUN, toy_cfg
from steadydiff.runs import latest_checkpoint, read_config
from steadydiff.train import Trainer


def _outputs(tmp_path):
    run = tmp_path / "run"
    Trainer(toy_cfg("train.steps=1"), run, show_progress=False).fit()
    return (run / "curves.png").exists(), (run / "samples" / "step-0000001.png").exists()


def test_unmarked_tests_draw_nothing(tmp_path):
    assert _outputs(tmp_path) == (False, False)


@pytest.mark.plots
def test_marked_tests_draw_everything(tmp_path):
    assert _outputs(tmp_path) == (True, True)


@pytest.mark.plots("save_samples")
def test_a_mark_with_names_keeps_those_only(tmp_path):
    assert _outputs(tmp_path) == (False, True)


def test_toy_run_is_a_copy_of_the_shared_run(toy_run, toy_run_shared, tmp_path):
    from steadydiff.config import load_config

    assert toy_run.parent == tmp_path and toy_run != toy_run_shared
    assert latest_checkpoint(toy_run / "checkpoints").name == "step-0000002"
    assert read_config(toy_run).to_dict() == load_config(None, TOY_RUN).to_dict()
    assert sorted(p.relative_to(toy_run) for p in toy_run.rglob("*")) == \
        sorted(p.relative_to(toy_run_shared) for p in toy_run_shared.rglob("*"))
