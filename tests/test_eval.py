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


def test_eval_fd_fmnist_kid_precision_recall_on_a_fashion_run(tmp_path, capsys):
    """A barely trained model scores far from the data; the real test images score close to it."""
    import torch

    from steadydiff.data import load_fashion_mnist
    from steadydiff.metrics import get_extractor, reference_stats
    from steadydiff.metrics.distances import frechet_distance, gaussian_stats

    run = tmp_path / "run"
    assert main(["train", "--config", "configs/demo.yaml", "--out", str(run), "--quiet", "--set", "train.steps=2",
                 "--set", "data.max_items=64", "--set", "train.batch_size=4", "--set", "model.channels=8",
                 "--set", "model.num_heads=2", "--set", "train.sample_n=4", "--set", "train.sample_steps=2",
                 "--set", "train.threads=1"]) == 0
    assert main(["eval", str(run), "--metric", "fd_fmnist,kid,precision,recall", "--n", "64", "--steps", "4",
                 "--threads", "1"]) == 0
    m = json.loads((run / "eval.json").read_text())["metrics"]
    ext = get_extractor("fmnist")
    test = load_fashion_mnist("test").data[:2000]
    mu, sigma = gaussian_stats(ext.features(test))
    ref = reference_stats("fashion_mnist", "train", ext)
    fd_real = frechet_distance(mu, sigma, ref["mu"], ref["sigma"])
    assert m["fd_fmnist"] > 10 * fd_real  # 2 training steps: far from the data
    assert 0 <= m["precision"] <= 1 and 0 <= m["recall"] <= 1 and m["kid"] > 0
    assert torch.isfinite(torch.tensor(list(m.values()))).all()
