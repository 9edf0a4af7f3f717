"""`steadydiff eval` and the trainer's periodic eval."""

import json

import pytest

from helpers import toy
from steadydiff.cli import main
from steadydiff.config import ConfigError, load_config
from steadydiff.train import Trainer

TOY = toy("data.toy_size=2000", "train.batch_size=64", "train.lr=3e-3", "train.warmup_steps=5", "train.log_every=10",
          "train.sample_n=64", "train.sample_steps=8", "train.ckpt_every=1000")


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


def test_eval_bad_input(toy_run, capsys):
    run = toy_run  # a trained toy run (2 steps)
    assert main(["eval", str(run), "--metric", "fid_typo", "--n", "8"]) == 2
    assert "choose one of fd_fmnist" in capsys.readouterr().err
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
    test = load_fashion_mnist("test").items_range(0, 2000)
    mu, sigma = gaussian_stats(ext.features(test))
    ref = reference_stats("fashion_mnist", "train", ext)
    fd_real = frechet_distance(mu, sigma, ref["mu"], ref["sigma"])
    assert m["fd_fmnist"] > 10 * fd_real  # 2 training steps: far from the data
    assert 0 <= m["precision"] <= 1 and 0 <= m["recall"] <= 1 and m["kid"] > 0
    assert torch.isfinite(torch.tensor(list(m.values()))).all()


@pytest.mark.parametrize("sampler", ["em", "dpmpp2m"])  # stochastic and deterministic
def test_sample_chunks_do_not_depend_on_how_they_are_shared_out(sampler, one_thread):
    """The contract distributed evaluation rests on: chunk k is a pure function of (seed, k, batch)."""
    import torch

    from steadydiff.diffusion import build_formulation, generate, generate_chunks
    from steadydiff.nn import build_model

    torch.manual_seed(0)
    cfg = load_config(None, TOY)
    sde = build_formulation(cfg.diffusion)
    model = sde.wrap(build_model(cfg.model, (2,)))
    whole = generate(model, sde, (2,), 10, sampler, 4, seed=3, batch=4)
    parts = {}
    for rank in range(3):  # three "processes": rank r draws chunks r, r + 3, ...
        mine = generate_chunks(model, sde, (2,), 10, sampler, 4, 3, batch=4, rank=rank, world_size=3)
        assert sorted(mine) == list(range(rank, 3, 3))
        parts.update(mine)
    assert [len(parts[k]) for k in range(3)] == [4, 4, 2]
    assert torch.equal(torch.cat([parts[k] for k in range(3)]), whole)
    # more samples leave the earlier full chunks unchanged
    assert torch.equal(generate(model, sde, (2,), 8, sampler, 4, seed=3, batch=4), whole[:8])
    assert not torch.allclose(whole[:4], whole[4:8])  # chunks are independent streams, not copies
    # up to one chunk: exactly what one generator seeded with `seed` draws (the behaviour before chunking)
    g = torch.Generator().manual_seed(3)
    x_T = torch.randn((4, 2), generator=g)
    ref = sde.generate(model, x_T, sampler, 4, None, generator=g, clip=False)
    assert torch.equal(generate(model, sde, (2,), 4, sampler, 4, seed=3, batch=4), ref)


def test_merge_chunks_restores_chunk_order_across_ranks():
    import torch

    from steadydiff.diffusion import merge_chunks

    a, b, c = torch.zeros(4, 3), torch.ones(4, 3), torch.full((2, 3), 2.0)
    # rank 0 drew chunks 0 and 2, rank 1 chunk 1 (the round-robin of generate_chunks)
    assert torch.equal(merge_chunks([{0: a, 2: c}, {1: b}]), torch.cat([a, b, c]))
    with pytest.raises(ValueError, match="two processes"):
        merge_chunks([{0: a}, {0: a}])
    with pytest.raises(ValueError, match="not 0..1"):
        merge_chunks([{0: a}, {2: c}])


def test_periodic_eval_at_nfe_budgets_uses_the_same_seed(tmp_path):
    """train.eval_nfe adds eval/<metric>@nfe<N> at the most sampler steps within N evaluations (dpmpp2m:
    steps + 1), from the eval's seed: at NFE 9 that is sample_steps = 8 itself, so the values agree exactly."""
    run = tmp_path / "run"
    Trainer(load_config(None, TOY + ["train.steps=4", "train.eval_every=4", "train.eval_metrics=[sw]",
                                     "train.eval_n=64", "train.eval_nfe=[3, 9]"]), run, show_progress=False).fit()
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    (ev,) = [r for r in rows if "eval/sw" in r]
    assert {"eval/sw@nfe3", "eval/sw@nfe9"} <= set(ev)
    assert ev["eval/sw@nfe9"] == ev["eval/sw"]
    assert ev["eval/sw@nfe3"] != ev["eval/sw"]
    assert main(["eval", str(run), "--metric", "sw", "--n", "64", "--steps", "2", "--threads", "1"]) == 0
    assert json.loads((run / "eval.json").read_text())["metrics"]["sw"] == pytest.approx(ev["eval/sw@nfe3"],
                                                                                        rel=1e-9)
    # `steadydiff eval --nfe` scores the same budgets the same way.
    assert main(["eval", str(run), "--metric", "sw", "--n", "64", "--steps", "8", "--nfe", "3", "9",
                 "--threads", "1"]) == 0
    rec = json.loads((run / "eval.json").read_text())
    assert [(r["nfe"], r["steps"]) for r in rec["nfe"]] == [(3, 2), (9, 8)]
    assert rec["nfe"][0]["metrics"]["sw"] == pytest.approx(ev["eval/sw@nfe3"], rel=1e-9)
    assert rec["nfe"][1]["metrics"]["sw"] == pytest.approx(rec["metrics"]["sw"], rel=1e-9)
    assert main(["eval", str(run), "--metric", "sw", "--n", "8", "--nfe", "1"]) == 2  # dpmpp2m needs 2 at 1 step


@pytest.mark.parametrize("overrides, needle", [
    (["train.eval_nfe=[10]"], "train.eval_nfe needs train.eval_every > 0"),
    (["train.eval_every=4", "train.eval_metrics=[sw]", "train.eval_nfe=[10, 0]"], "positive integers"),
    (["train.eval_every=4", "train.eval_metrics=[sw]", "train.eval_nfe=[ten]"], "expected an integer"),
])
def test_eval_nfe_bad_values(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, TOY + overrides)


def test_eval_nfe_below_one_step_fails_at_start(tmp_path):
    cfg = load_config(None, TOY + ["train.eval_every=4", "train.eval_metrics=[sw]", "train.eval_nfe=[1]"])
    with pytest.raises(ConfigError, match="dpmpp2m needs 2 network evaluations at 1 step"):
        Trainer(cfg, tmp_path / "run", show_progress=False)
