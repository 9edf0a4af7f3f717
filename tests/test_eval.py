"""`steadydiff eval` and the trainer's periodic eval."""

import json

import pytest

from steadydiff.cli import main
from steadydiff.config import ConfigError, load_config
from steadydiff.train import Trainer

TOY = [
    "data.name=toy2d", "data.toy_size=2000", "model.backbone=mlp_unet", "model.hidden=32", "model.depth=4",
    "train.batch_size=64", "train.lr=3e-3", "train.warmup_steps=5", "train.log_every=10", "train.threads=1",
    "train.sample_n=64", "train.sample_steps=8", "train.ckpt_every=1000",
]


def test_periodic_eval_on_toy2d_improves_and_eval_cli_writes_json(tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(load_config(None, TOY + ["train.steps=200", "train.eval_every=50", "train.eval_metrics=[sw,mmd]",
                                     "train.eval_n=500"]), run, show_progress=False).fit()
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/sw" in r]
    assert [r["step"] for r in evals] == [50, 100, 150, 200]
    assert evals[-1]["eval/sw"] < evals[0]["eval/sw"]
    assert main(["eval", str(run), "--metric", "sw,mmd", "--n", "500", "--steps", "8", "--threads", "1"]) == 0
    record = json.loads((run / "eval.json").read_text())
    assert record["step"] == 200 and set(record["metrics"]) == {"sw", "mmd"}
    # Same seed, same weights, same sampler: the CLI reproduces the trainer's last periodic eval exactly.
    assert record["metrics"]["sw"] == pytest.approx(evals[-1]["eval/sw"], rel=1e-9)


def test_eval_bad_input(tmp_path, capsys):
    run = tmp_path / "run"
    Trainer(load_config(None, TOY + ["train.steps=2"]), run, show_progress=False).fit()
    assert main(["eval", str(run), "--metric", "fid_typo", "--n", "8"]) == 2
    assert "choose from" in capsys.readouterr().err
    assert main(["eval", str(run), "--metric", "fd_fmnist", "--n", "8"]) == 2  # images metric on points
    assert "does not apply" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="needs train.eval_metrics"):
        load_config(None, TOY + ["train.eval_every=10"])
    with pytest.raises(ConfigError, match="unknown metric"):
        load_config(None, TOY + ["train.eval_every=10", "train.eval_metrics=[nope]"])
