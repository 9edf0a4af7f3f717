"""The test suite's own machinery (tests/conftest.py): plots are no-ops unless a test is marked `plots`."""

import pytest

from steadydiff.config import load_config
from steadydiff.train import Trainer

TINY = ["data.name=toy2d", "data.toy_size=200", "model.backbone=mlp_unet", "model.hidden=16", "model.depth=2",
        "train.batch_size=16", "train.sample_n=16", "train.sample_steps=2", "train.threads=1", "train.steps=1"]


def _outputs(tmp_path):
    run = tmp_path / "run"
    Trainer(load_config(None, TINY), run, show_progress=False).fit()
    return (run / "curves.png").exists(), (run / "samples" / "step-0000001.png").exists()


def test_unmarked_tests_draw_nothing(tmp_path):
    assert _outputs(tmp_path) == (False, False)


@pytest.mark.plots
def test_marked_tests_draw_everything(tmp_path):
    assert _outputs(tmp_path) == (True, True)


@pytest.mark.plots("save_samples")
def test_a_mark_with_names_keeps_those_only(tmp_path):
    assert _outputs(tmp_path) == (False, True)
