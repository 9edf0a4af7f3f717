"""One source per extension point (utils/registry.py): every list a user sees (CLI choices, help texts, config
errors) is read from the registry that dispatches, and a new entry needs no edit anywhere else."""

from __future__ import annotations

import argparse
import math
import pathlib

import pytest
import torch
from torch import nn

from steadydiff.cli import EXIT_USER_ERROR, build_parser, load_registries, main
from steadydiff.config import ConfigError, load_config, registered_keys
from steadydiff.utils.registry import Registry, registries_for, registry_keys

load_registries()

from steadydiff.diffusion import FORMULATIONS, VPSDE, EDMFormulation, FlowFormulation, check_sampler, generate  # noqa: E402
from steadydiff.diffusion import edm as edm_module  # noqa: E402
from steadydiff.diffusion import flow as flow_module  # noqa: E402
from steadydiff.diffusion import samplers as vp_module  # noqa: E402
from steadydiff.experiments.claims import CLAIM_KINDS  # noqa: E402
from steadydiff.experiments.regime import regime, tied_horizons  # noqa: E402
from steadydiff.metrics.evaluate import IMAGES, LOGITS, METRICS, POINTS, SAMPLES, Metric  # noqa: E402
from steadydiff.metrics.features import EXTRACTORS  # noqa: E402
from steadydiff.nn import BACKBONES, build_model  # noqa: E402
from steadydiff.nn.skip_scaling import LongSkips  # noqa: E402


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def _one_line_error(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("steadydiff: error: "), lines
    return lines[0]


# ---------------------------------------------------------------------------------------------------------
# The Registry type


def test_registry_chooses_or_names_every_choice_in_one_line():
    reg = Registry("widget")
    reg.add("a", 1)
    reg.register("b")(2)
    assert reg.choose("b") == 2 and reg.names == ("a", "b")
    with pytest.raises(ConfigError, match=r"^--widget: unknown widget 'c'; choose one of a, b$"):
        reg.choose("c", "--widget")
    with pytest.raises(KeyError, match="registered twice"):
        reg.add("a", 3)
    scoped = Registry("sampler", scope=("diffusion.kind", "toy"))
    scoped.add("x", 0)
    with pytest.raises(ConfigError, match=r"sampler 'y' does not apply to diffusion.kind=toy; choose one of x$"):
        scoped.choose("y", "--sampler")


def test_every_registered_config_field_has_a_registry_and_every_keyed_registry_a_field():
    assert set(registered_keys()) == set(registry_keys())
    assert {"model.backbone", "diffusion.kind", "train.sample_sampler", "train.eval_metrics", "train.lr_schedule",
            "train.momentum", "train.timesteps", "train.nonfinite"} <= set(registered_keys())


# ---------------------------------------------------------------------------------------------------------
# Config: one line naming the registry's choices, on load and through the CLI


def _bad_value(key: str) -> str:
    return "[no_such]" if key in ("train.eval_metrics", "diagnostics.trackers") else "no_such"  # the list fields


@pytest.mark.parametrize("key", registered_keys())
def test_an_unknown_name_is_one_line_listing_the_registry(key, tmp_path, capsys):
    (registry,) = [r for r in registries_for(key) if r.scope in (None, ("diffusion.kind", "vp"))]
    code = main(["train", "--out", str(tmp_path / "run"), "--set", f"{key}={_bad_value(key)}"])
    line = _one_line_error(capsys)
    assert code == EXIT_USER_ERROR and not (tmp_path / "run").exists()
    assert f"{key}: " in line and line.endswith(f"choose one of {', '.join(registry)}")


def test_a_sampler_of_another_formulation_names_that_formulations_samplers():
    with pytest.raises(ConfigError, match=r"train.sample_sampler: sampler 'heun' does not apply to diffusion.kind=vp; "
                                          r"choose one of em, ddim, dpmpp2m$"):
        load_config(None, ["train.sample_sampler=heun"])
    assert load_config(None, ["diffusion.kind=edm", "train.sample_sampler=heun"]).train.sample_sampler == "heun"
    with pytest.raises(ConfigError, match="--sampler: sampler 'em' does not apply to diffusion.kind=edm; choose one "
                                          "of heun, euler"):
        check_sampler("edm", "em")


# ---------------------------------------------------------------------------------------------------------
# Generated CLI lists equal their registries


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_sampler_choices_and_help_are_the_formulations_tables(command):
    action = _option(_subparser(command), "--sampler")
    union = [s for f in FORMULATIONS.values() for s in f.samplers]  # flow reuses the names euler, heun and em
    assert list(action.choices) == list(dict.fromkeys(union)) == ["em", "ddim", "dpmpp2m", "heun", "euler"]
    for kind, formulation in FORMULATIONS.items():
        assert f"{kind}: {' | '.join(formulation.samplers)}" in action.help


def test_eval_help_and_metric_help_list_every_metric():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    eval_help = next(a.help for a in sub._choices_actions if a.dest == "eval")
    metric_help = _option(sub.choices["eval"], "--metric").help
    for name in METRICS:  # class_acc_mnist was missing from the hand-typed list
        assert name in eval_help and name in metric_help
    assert "class_acc_mnist" in eval_help


def test_a_sampler_registered_here_is_a_cli_choice_and_generate_dispatches_to_it(monkeypatch):
    calls = []

    def sample_zero(eps_fn, sde, x_T, steps, generator=None):
        calls.append(steps)
        return torch.zeros_like(x_T)

    monkeypatch.setitem(vp_module.SAMPLERS, "zero", sample_zero)
    action = _option(_subparser("sample"), "--sampler")
    assert "zero" in action.choices and "vp: em | ddim | dpmpp2m | zero" in action.help
    assert load_config(None, ["train.sample_sampler=zero"]).train.sample_sampler == "zero"
    out = generate(nn.Identity(), VPSDE(), (2,), 3, "zero", 5, seed=0)
    assert calls == [5] and torch.equal(out, torch.zeros(3, 2))


def test_a_metric_registered_here_shows_in_the_eval_help_and_parses(monkeypatch):
    from steadydiff.metrics.evaluate import parse_metrics

    monkeypatch.setitem(METRICS, "toy_metric", Metric(lambda ctx: 0.0, SAMPLES, POINTS))
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert "toy_metric" in next(a.help for a in sub._choices_actions if a.dest == "eval")
    assert parse_metrics("sw,toy_metric", sample_ndim=1) == ["sw", "toy_metric"]
    assert load_config(None, ["train.eval_metrics=[toy_metric]"]).train.eval_metrics == ["toy_metric"]


def test_every_metric_needs_an_extractor_or_the_samples():
    for name, metric in METRICS.items():
        assert metric.domain in (IMAGES, POINTS), name
        assert metric.needs == SAMPLES or metric.needs.removesuffix(LOGITS) in EXTRACTORS, name
        assert metric.min_n >= 1, name


# ---------------------------------------------------------------------------------------------------------
# Samplers: one signature per formulation, generator=None everywhere


def test_every_sampler_takes_its_formulations_one_signature():
    sde = VPSDE()
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    for name, fn in VPSDE.samplers.items():
        a = fn(lambda x, t: 0.1 * x, sde, x, 3)
        b = fn(lambda x, t: 0.1 * x, sde, x, 3, torch.Generator().manual_seed(1))
        assert a.shape == x.shape and torch.isfinite(a).all() and (name == "em" or torch.equal(a, b)), name
    edm = EDMFormulation()
    for name, fn in EDMFormulation.samplers.items():
        sigmas = edm.sigma_grid(3)
        a = fn(lambda x, s: 0.5 * x, x * 80, sigmas)
        assert torch.equal(a, fn(lambda x, s: 0.5 * x, x * 80, sigmas, None)), name
    flow = FlowFormulation()
    for name, fn in FlowFormulation.samplers.items():
        ts = flow.time_grid(3)
        a = fn(lambda x, t: x - 0.5, x, ts)
        b = fn(lambda x, t: x - 0.5, x, ts, torch.Generator().manual_seed(1))
        assert a.shape == x.shape and torch.isfinite(a).all() and (name == "em" or torch.equal(a, b)), name
    assert EDMFormulation.samplers is edm_module.SAMPLERS and VPSDE.samplers is vp_module.SAMPLERS
    assert FlowFormulation.samplers is flow_module.SAMPLERS


# ---------------------------------------------------------------------------------------------------------
# Backbones: a new one is its module and its registry line


class TinyBackbone(LongSkips, nn.Module):
    """The smallest backbone with one long skip: what a new backbone declares, and nothing else."""

    time_input = "vp_time"

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.inp, self.fuse = nn.Linear(dim + 1, hidden), nn.Linear(2 * hidden, hidden)
        self.out = nn.Linear(hidden, dim)
        self.skip_channels = [hidden]
        self.attach_skip_scaling(None)

    def describe(self):
        return {"width": self.hidden, "depth": 1}

    def decoder_blocks(self):
        return [self.fuse]

    def forward(self, x, t, labels=None):
        h = self.inp(torch.cat([x, t.reshape(-1, 1).to(x.dtype) / 1000], dim=1))
        skip = h if self.skip_scaling is None else self.skip_scaling(0, h)
        return self.out(self.fuse(torch.cat([h, skip], dim=1)))


@pytest.fixture
def tiny_backbone(monkeypatch):
    monkeypatch.setitem(BACKBONES, "tiny", lambda cfg, shape: TinyBackbone(shape[0], cfg.hidden))


def test_a_backbone_registered_here_loads_builds_and_describes_itself(tiny_backbone):
    cfg = load_config(None, ["data.name=toy2d", "model.backbone=tiny", "model.hidden=8", "model.skip_scaling=cs",
                             "train.lr_schedule=cosine"])
    net = build_model(cfg.model, (2,))
    assert isinstance(net, TinyBackbone) and net.skip_scaling.coefficients() == [1.0]
    row = regime(cfg, (2,))  # experiments/regime.py keyed a dict on backbone names: a KeyError here
    assert (row["model"], row["width"], row["depth"], row["long_skips"]) == ("tiny (cs kappa 0.5)", 8, 1, 1)
    assert row["params"] == sum(p.numel() for p in net.parameters())
    model = EDMFormulation().wrap(net)  # the declared time-input convention sets EDM's noise scale
    assert model.noise_scale == 250.0
    assert model(torch.randn(3, 2), torch.full((3,), 1.0)).shape == (3, 2)


def test_a_backbone_without_a_time_input_convention_is_refused_by_the_edm_preconditioner():
    class Bare(nn.Module):
        def forward(self, x, t, labels=None):
            return x

    with pytest.raises(TypeError, match="time_input = one of c_noise, vp_time"):
        EDMFormulation().wrap(Bare())


def test_every_built_in_backbone_describes_itself_and_declares_its_time_input():
    shapes = {"unet": (1, 8, 8), "uvit": (1, 8, 8), "edm2": (1, 8, 8), "mlp_unet": (2,)}
    assert set(shapes) == set(BACKBONES)
    for name, shape in shapes.items():
        cfg = load_config(None, [f"model.backbone={name}", "model.channels=8", "model.channel_mult=[1]",
                                 "model.num_heads=1", "model.embed_dim=16", "model.channels_per_head=8",
                                 "model.depth=2", "model.hidden=8", "model.attn_resolutions=[]"])
        with torch.device("meta"):
            net = build_model(cfg.model, shape)
        assert set(net.describe()) == {"width", "depth"} and net.time_input in edm_module.TIME_INPUT_SCALES, name


# ---------------------------------------------------------------------------------------------------------
# Schedules state their own horizon


@pytest.mark.parametrize("overrides, tied", [
    ([], []),
    (["train.lr_schedule=cosine"], ["cosine LR decay length (train.steps)"]),
    (["train.timesteps=clts"], ["CLTS curriculum length train.clts_steps"]),
    (["train.timesteps=clts", "train.clts_steps=500"], []),
    (["train.momentum=mdlrc"], ["mdlrc horizon train.momentum_steps"]),
    (["train.momentum=lr_decay_only", "train.momentum_steps=1000"], []),  # set explicitly, even if equal
    (["train.lr_schedule=inv_sqrt", "train.momentum=constant"], []),
])
def test_tied_horizons_are_what_the_schedules_say(overrides, tied):
    assert tied_horizons(load_config(None, ["train.steps=1000", *overrides])) == tied


# ---------------------------------------------------------------------------------------------------------
# Claim kinds: one class each


def test_every_claim_kind_labels_and_the_spec_messages_name_the_kinds():
    c = {"target": "final", "keys": None, "stat": "cv", "series": "loss"}
    assert all(kind.label(c, "base").endswith("vs base") for kind in CLAIM_KINDS.values())
    assert [k for k, kind in CLAIM_KINDS.items() if not kind.takes_versus] == ["speedup"]
    with pytest.raises(ConfigError, match="unknown claim kind 'magic'; choose one of speedup, final, stability, "
                                          "sensitivity"):
        CLAIM_KINDS.choose("magic", "experiment claims[0]")


def test_a_claim_kind_judges_its_ratios():
    from steadydiff.experiments.analysis import judge
    from steadydiff.experiments.spec import Claim

    arms = {a: {"final_per_seed": v, "stability": {}} for a, v in (("base", [2.0, 2.0, 2.0]), ("a", [1.0, 0.8, 1.2]))}
    out = judge(Claim("a lower", "a", "final"), {"arms": arms, "baseline": "base", "lower_is_better": True})
    assert out["per_seed"] == [0.5, 0.4, 0.6] and out["claim"] == "less" and out["kind"] == "final"
    assert math.isclose(out["value"], (0.5 * 0.4 * 0.6) ** (1 / 3))


# ---------------------------------------------------------------------------------------------------------
# The CLI catches the error root only: a bug keeps its traceback


def test_a_bug_is_not_turned_into_a_one_line_error(monkeypatch, tmp_path):
    import steadydiff.cli as cli

    def buggy(args):
        raise ValueError("a bug")

    monkeypatch.setattr(cli, "_cmd_diagnose", buggy)
    with pytest.raises(ValueError, match="a bug"):
        main(["diagnose", "--out", str(tmp_path)])


# Errors raised inside the nn and diffusion layers (torch's own GroupNorm error among them) that the CLI once caught
# as any ValueError.
@pytest.mark.parametrize("overrides, needle", [
    (["model.channels=6", "model.num_heads=2", "model.channel_mult=[1,2,2]"], "GroupNorm cannot split"),
    (["model.channels=8", "model.num_heads=3"], "divisible by model.num_heads"),
    (["model.backbone=edm2", "model.channels=8", "model.channels_per_head=3"], "model.channels_per_head"),
    (["diffusion.beta_min=-1"], "the VP-SDE needs 0 <= beta_min"),
])
def test_a_bad_model_or_formulation_setting_is_a_config_error(overrides, needle):
    from steadydiff.diffusion import build_formulation

    cfg = load_config(None, ["model.channel_mult=[1]", "model.attn_resolutions=[28]", *overrides])
    with pytest.raises(ConfigError, match=needle):
        build_formulation(cfg.diffusion)
        with torch.device("meta"):
            build_model(cfg.model, (1, 28, 28))


def test_damaged_experiment_files_and_uncalibratable_metrics_are_one_line_errors(tmp_path):
    from steadydiff.experiments.runner import read_result
    from steadydiff.experiments.spec import load_experiment
    from steadydiff.utils.errors import SteadydiffError

    result = tmp_path / "runs" / "a" / "seed-0" / "result.json"
    result.parent.mkdir(parents=True)
    result.write_text('{"status": "ok"')  # truncated by hand
    with pytest.raises(SteadydiffError, match="result.json is not valid JSON .*; delete it to train that run again"):
        read_result(tmp_path, "a", 0)
    exp = tmp_path / "exp.yaml"
    exp.write_text(f"name: x\nbase: {pathlib.Path('configs/demo.yaml').resolve()}\nbaseline: a\narms: {{a: {{}}}}\n"
                   "seeds: [0]\nmetric: probe/loss\ncalibrate: {metrics: [probe/loss]}\n")
    with pytest.raises(ConfigError, match="cannot calibrate 'probe/loss'; calibration re-measures eval/<metric> "
                                          r"\(fd_fmnist, .*\), val/loss or val/ema_loss"):
        load_experiment(exp)
