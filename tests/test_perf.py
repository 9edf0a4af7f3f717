"""Speed switches (same results within fp32 round-off), FLOP accounting, and the GPU check's CPU mode."""

import importlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import toy
from steadydiff.config import ConfigError, load_config
from steadydiff.diffusion import VPSDE, build_formulation
from steadydiff.nn import build_model
from steadydiff.train import Trainer, loop
from steadydiff.train.flops import count_train_flops, measure_peak_flops

ROOT = Path(__file__).resolve().parents[1]
TOY = toy("data.toy_size=512", "train.warmup_steps=1", "train.lr=1e-2")
# A tiny conv UNet on 64 Fashion-MNIST images (attention at 14x14 so SDPA is exercised too).
IMG = ["data.max_items=64", "model.channels=8", "model.channel_mult=[1,2]", "model.num_res_blocks=1",
       "model.attn_resolutions=[14]", "model.num_heads=2", "train.batch_size=8", "train.threads=1",
       "train.warmup_steps=1", "train.lr=1e-2", "model.skip_scaling=ls"]
EDM2 = IMG + ["model.backbone=edm2", "model.channels_per_head=8", "diffusion.kind=edm", "train.sample_sampler=heun",
              "model.skip_scaling=cs"]


def run_steps(tmp_path, overrides, n=3):
    """Losses of the first n steps and the final weights (no fit(): no files, no FLOP count)."""
    tr = Trainer(load_config(None, overrides), tmp_path / f"run{len(list(tmp_path.iterdir()))}", show_progress=False)
    losses = [tr.train_step().loss for _ in range(n)]
    return losses, {k: v.detach().clone() for k, v in tr.model.state_dict().items()}, tr


def assert_same_run(a, b, rtol=1e-5, atol=5e-4):
    """Losses within `rtol`; weights within `atol` = 5% of one Adam step at lr 1e-2: Adam divides each gradient
    element by its own magnitude, so fp32 round-off in near-zero elements moves weights by a small fraction of
    a step (observed up to ~1% with channels_last) while the losses agree to ~1e-7."""
    (la, wa, _), (lb, wb, _) = a, b
    for x, y in zip(la, lb):
        assert abs(x - y) <= rtol * abs(x), (la, lb)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=k)


@pytest.mark.parametrize("base, switch", [
    (IMG, "train.channels_last=true"),
    (IMG, "model.grad_checkpointing=true"),
    (EDM2, "model.grad_checkpointing=true"),
    (EDM2, "train.channels_last=true"),
    (TOY + ["model.dropout=0.2"], "model.grad_checkpointing=true"),  # dropout masks replayed in the recompute
    (TOY, "train.optimizer_impl=foreach"),
    (TOY, "train.optimizer_impl=fused"),
    (TOY, "train.optimizer_impl=plain"),
])
def test_speed_switches_leave_the_training_numerically_unchanged(tmp_path, monkeypatch, base, switch):
    plain = run_steps(tmp_path, base)
    recomputed = []
    real_checkpoint = torch.utils.checkpoint.checkpoint

    def spy(fn, *args, **kw):
        recomputed.append(type(fn).__name__)
        return real_checkpoint(fn, *args, **kw)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", spy)
    fast = run_steps(tmp_path, base + [switch])
    assert plain[0][0] != plain[0][-1]  # it trained
    assert bool(recomputed) == ("grad_checkpointing" in switch)  # the switch really checkpoints blocks
    assert_same_run(plain, fast)


def test_channels_last_really_changes_the_layout(tmp_path):
    *_, tr = run_steps(tmp_path, IMG + ["train.channels_last=true"], n=1)
    convs = [p for p in tr.model.parameters() if p.dim() == 4 and p.shape[1] > 1 and p.shape[2] > 1]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous() for p in convs)
    assert tr.optimizer.defaults["foreach"] is None and not tr.optimizer.defaults["fused"]  # auto: PyTorch's pick


def test_optimizer_impl_reaches_adamw(tmp_path):
    *_, tr = run_steps(tmp_path, TOY + ["train.optimizer_impl=fused"], n=1)
    assert tr.optimizer.defaults["fused"] is True


def _compile_available() -> bool:
    try:
        import torch._dynamo  # noqa: F401
    except Exception:
        return False
    return hasattr(torch, "compile")


@pytest.mark.skipif(not _compile_available(), reason="torch.compile is not available in this build")
def test_compiled_step_traces_and_matches(tmp_path, monkeypatch):
    # Inductor's C++ code generation takes over a minute on 2 shared CPU cores, so the default test traces the
    # step with the aot_eager backend: Dynamo capture and AOTAutograd's forward+backward graphs, i.e. the wiring
    # of train.compile, without code generation. STEADYDIFF_TEST_COMPILE=1 runs the real (inductor) compile.
    calls = []
    real_compile = torch.compile
    if not os.environ.get("STEADYDIFF_TEST_COMPILE"):
        def compile_aot_eager(module, **kw):
            calls.append(module)
            return real_compile(module, backend="aot_eager", **kw)

        monkeypatch.setattr(loop.torch, "compile", compile_aot_eager)
    plain = run_steps(tmp_path, TOY)
    compiled = run_steps(tmp_path, TOY + ["train.compile=true"])
    monkeypatch.undo()
    assert calls or os.environ.get("STEADYDIFF_TEST_COMPILE")
    assert_same_run(plain, compiled)


def test_speed_switch_config_errors():
    with pytest.raises(ConfigError, match="channels_last applies to image data"):
        load_config(None, TOY + ["train.channels_last=true"])
    with pytest.raises(ConfigError, match="train.peak_flops"):
        load_config(None, TOY + ["train.peak_flops=-1"])
    with pytest.raises(ConfigError, match="choose one of auto, foreach, fused, plain"):
        load_config(None, TOY + ["train.optimizer_impl=apex"])


# ---------------------------------------------------------------------------------------------------------
# FLOP accounting


class OneLinear(nn.Module):
    """A single Linear layer as an eps-model. `gain` is a learnable elementwise scale in front of it (no FLOPs
    counted), so the Linear's input requires grad and its backward computes both matmuls, as in a hidden layer."""

    def __init__(self, dim_in, dim_out, gain: bool):
        super().__init__()
        self.fc = nn.Linear(dim_in, dim_out)
        self.gain = nn.Parameter(torch.ones(dim_in)) if gain else None

    def forward(self, x, t, labels=None):
        return self.fc(x if self.gain is None else x * self.gain)


def test_flops_of_a_linear_step_match_the_closed_form():
    b, i = 48, 24
    cfg = load_config(None, TOY + [f"train.batch_size={b}"])
    sde = VPSDE()
    hidden = count_train_flops(OneLinear(i, i, gain=True), sde, cfg, (i,))
    assert hidden == 3 * 2 * b * i * i  # forward 2BIO, backward 2BIO (input grad) + 2BIO (weight grad)
    first = count_train_flops(OneLinear(i, i, gain=False), sde, cfg, (i,))
    assert first == 2 * 2 * b * i * i  # a first layer's input needs no gradient: PyTorch skips that matmul


def test_unet_flops_are_positive_linear_in_batch_and_leave_the_model_alone():
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    f = build_formulation(cfg.diffusion)
    model = f.wrap(build_model(cfg.model, (1, 28, 28)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    f2, f4 = (count_train_flops(model, f, cfg, (1, 28, 28), batch=b) for b in (2, 4))
    assert f2 > 0 and f4 == 2 * f2
    assert count_train_flops(model, f, cfg, (1, 28, 28)) == cfg.train.batch_size // 2 * f2  # default: global batch
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_edm2_flops_count_does_not_rewrite_the_weights():
    # EDM2's MPConv renormalises its weights in place on every training-mode forward: counting runs on a copy.
    cfg = load_config(None, EDM2)
    f = build_formulation(cfg.diffusion)
    torch.manual_seed(0)
    model = f.wrap(build_model(cfg.model, (1, 28, 28)))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # off the unit-norm manifold, so a forward in train mode would visibly change them
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert count_train_flops(model, f, cfg, (1, 28, 28)) > 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_measured_peak_is_positive_and_cached():
    a = measure_peak_flops("cpu", torch.float32, seconds=0.05, n=256)
    assert 1e6 < a < 1e15
    assert measure_peak_flops("cpu", torch.float32) == a  # measured once per process


def test_fit_logs_flops_once_and_mfu_on_every_log_line(tmp_path):
    cfg = load_config(None, TOY + ["train.steps=3", "train.log_every=1", "train.sample_n=16", "train.sample_steps=2",
                                   "train.peak_flops=1e9"])
    tr = Trainer(cfg, tmp_path / "run", show_progress=False)
    tr.fit()
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    fl = [r for r in rows if "flops_per_step" in r]
    assert len(fl) == 1 and fl[0]["peak_flops"] == 1e9
    assert fl[0]["flops_per_step"] == count_train_flops(tr.model, tr.diffusion, cfg, (2,))
    logs = [r for r in rows if "loss" in r]
    assert len(logs) == 3
    for r in logs:  # mfu = flops/step x images/s / batch / peak
        expect = fl[0]["flops_per_step"] * r["images_per_sec"] / cfg.train.batch_size / 1e9
        assert r["mfu"] == pytest.approx(expect, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------
# benchmarks/gpu_check.py in its CPU mode


def test_gpu_check_runs_in_tiny_cpu_mode(tmp_path, capsys):
    gpu_check = _bench_module("gpu_check")
    code = gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "gpu_check")])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["numerics"] and all(c["ok"] for c in res["numerics"])
    names = {r["config"] for r in res["timing"]}
    assert names == {"demo", "uvit-cifar10-s2", "edm2-img64-s"}
    for r in res["timing"]:
        assert r["images_per_s"] > 0 and r["flops_per_step"] > 0 and r["mfu"] > 0
    assert "| config |" in out


def _bench_module(name: str):
    """A script of benchmarks/ as a module (its `main(argv)` runs it in this process: no interpreter start)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.mark.parametrize("kind", ["conv", "linear"])
def test_op_breakdown_names_the_op_that_dominates(kind):
    """A step that is one large conv (or matmul) puts most of its time in that category; shares add up to 1."""
    from torch.profiler import ProfilerActivity, profile

    op_breakdown = _bench_module("gpu_check").op_breakdown
    torch.manual_seed(0)
    if kind == "conv":
        net, x, cat = nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.randn(16, 64, 32, 32), "convolution"
    else:
        net, x, cat = nn.Linear(2048, 2048, bias=False), torch.randn(256, 2048), "matmul + attention"
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            net(x).sum().backward()  # one cheap reduction: the layer dominates
    shares = op_breakdown(prof, torch.device("cpu"))
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-9)
    assert shares[cat] > 0.5, shares
    assert max(shares, key=shares.get) == cat


def test_speed_switches_benchmark_runs_in_tiny_mode(tmp_path, capsys):
    code = _bench_module("speed_switches").main([
        "--device", "cpu", "--tiny", "--rounds", "2", "--steps", "1", "--warmup", "1", "--configs", "demo",
        "--variants", "channels_last", "optimizer plain loop", "grad checkpointing", "--out", str(tmp_path / "ss")])
    assert code == 0, capsys.readouterr().err[-3000:]
    res = json.loads((tmp_path / "ss.json").read_text())
    rows = {r["variant"]: r for r in res["results"]}
    assert list(rows) == ["default", "channels_last", "optimizer plain loop", "grad checkpointing"]
    assert rows["default"]["per_round_speedup"] == [1.0, 1.0]  # the reference against itself
    assert all(r["ms_per_step"] > 0 and len(r["per_round_speedup"]) == 2 for r in rows.values())
    assert "| demo | channels_last |" in (tmp_path / "ss.md").read_text()


@pytest.mark.slow
def test_gpu_evidence_runs_in_tiny_cpu_mode(tmp_path, capsys):
    """benchmarks/gpu_evidence.py end to end at toy size on the CPU: the main test's compare with its claims,
    the two paper-size stand-ins trained, and the diagnose report over them (as the script's own processes)."""
    out = tmp_path / "ev"
    code = _bench_module("gpu_evidence").main(["--tiny", "--device", "cpu", "--lrs", "1e-3", "--minutes", "6",
                                               "--out", str(out)])
    assert code == 0, "".join(capsys.readouterr())
    summary = json.loads((out / "summary.json").read_text())
    assert {k: v["exit"] for k, v in summary["status"].items()} == {
        "main-lr0.001": 0, "uvit-s-org": 0, "uvit-s-cs": 0, "uvit-s-diagnose": 0}
    res = json.loads((out / "main-lr0.001" / "results.json").read_text())
    assert len(res["claims"]) == 9 and all(c["registration"] == "pre-registered" for c in res["claims"])
    assert set(res["arms"]) == {"org", "cs-0.5", "ls"} and res["seeds"] == [0, 1]
    assert (out / "uvit-s-diagnose" / "stability.md").exists()


@pytest.mark.slow
def test_gpu_evidence_edge_stage_runs_lr_range_in_tiny_cpu_mode(tmp_path, capsys):
    """`gpu_evidence.py --stage edge` at toy size on the CPU (a random 64-image 32x32 RGB store built by the
    script): `steadydiff lr-range` on the U-ViT-S/2 and EDM2 edge files (2 seeds, 2 LRs, 4 steps), every arm's
    report; a second call trains nothing (finished runs are kept) and only writes the reports again."""
    ev = _bench_module("gpu_evidence")
    out = tmp_path / "ev"
    args = ["--tiny", "--device", "cpu", "--stage", "edge", "--minutes", "6", "--out", str(out)]
    assert ev.main(args) == 0, "".join(capsys.readouterr())
    assert all(p.is_file() for p in ev.EDGE)  # the depth-16 file too (the smoke test leaves it out)
    arms = {"scalelong-edge-uvit-s2": {"org", "inv-sqrt2", "cs-0.5", "cs-0.8", "ls"},
            "edm2-edge-cifar10": {"no-mp", "mp", "mp-cs-0.5"}}
    summary = json.loads((out / "summary.json").read_text())
    assert {k: v["exit"] for k, v in summary["status"].items()} == {f"edge-{n}": 0 for n in arms}
    for name, expected in arms.items():
        rep = json.loads((out / f"edge-{name}" / "lr_range.json").read_text())
        assert set(rep["arms"]) == expected and rep["seeds"] == [1, 2] and len(rep["lrs"]) == 2
        assert all(set(a["seeds"]) == {"1", "2"} for a in rep["arms"].values())
        assert rep["config"]["data"]["name"] == "store" and rep["config"]["data"]["resolution"] == 32
        assert rep["claims"] and all(c["registration"] == "pre-registered" for c in rep["claims"])
        assert summary["edge"][f"edge-{name}"]["finished"] == summary["edge"][f"edge-{name}"]["total"] == \
            len(expected) * 2 * 2
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("edge-*/runs/**/*") if p.is_file()}
    assert ev.main(args) == 0, "".join(capsys.readouterr())
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("edge-*/runs/**/*") if p.is_file()}
