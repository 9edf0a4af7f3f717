"""GPU check: is a CUDA training step right, and how fast is it?

(a) Numerics: one training step (loss, backward) of the demo UNet, the U-ViT and the EDM2 UNet on the same
    weights and the same batch on the CPU (fp32, the reference) and on the device, in fp32 (TF32 off) and
    under bf16 autocast. Tolerances, relative to the CPU fp32 step: fp32 loss and global gradient 1e-3;
    bf16 loss 2e-2 and global gradient 5e-2 (bf16 keeps 8 mantissa bits, ~4e-3 per rounding, and a step
    rounds through every layer). All weights are perturbed first: the zero-initialised output layers would
    otherwise leave every other gradient exactly zero, and the check would compare zeros.
(b) Timing: the main configs (configs/demo.yaml conv UNet, configs/uvit-cifar10-s2.yaml U-ViT-S/2,
    configs/edm2-img64-s.yaml EDM2-S) take training steps in bf16 autocast on random data: loss, backward,
    grad clipping, AdamW and the EMA update, as in `Trainer.train_step`. Reported: images/s, peak memory
    (torch.cuda.max_memory_allocated), FLOPs/step (steadydiff.train.flops.count_train_flops) and MFU against
    the device's measured bf16 matmul peak.

Needs a CUDA machine with PyTorch and this checkout only: no installs, no downloads, no datasets.

    bash benchmarks/gpu_check.sh                         # the GPU run, < 5 minutes on one GPU
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --tiny    # CPU smoke test (CI)

Options to try the speed switches: --channels-last, --compile, --optimizer {auto,foreach,fused,plain}.
Writes OUT.json and OUT.md (default benchmarks/results/gpu_check).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from steadydiff.config import load_config
from steadydiff.diffusion import build_formulation
from steadydiff.nn import build_model
from steadydiff.train.flops import count_train_flops, measure_peak_flops

ROOT = Path(__file__).resolve().parent
CONFIGS = ROOT.parent / "configs"

FP32_TOL = {"loss": 1e-3, "grad": 1e-3}
BF16_TOL = {"loss": 2e-2, "grad": 5e-2}

# (name, config file, batch on one GPU). EDM2-S trains at batch 2048 over 32 GPUs in the paper: 64 per GPU.
TIMED = [("demo", "demo.yaml", 256), ("uvit-cifar10-s2", "uvit-cifar10-s2.yaml", 128),
         ("edm2-img64-s", "edm2-img64-s.yaml", 64)]
NUMERICS = [("demo", "demo.yaml"), ("uvit-fashion", "uvit-fashion.yaml"), ("edm2-fashion", "edm2-fashion.yaml")]

# --tiny: the same layouts, shrunk so that a 2-core CPU runs the whole script in seconds.
TINY = {
    "unet": ["model.channels=8", "model.channel_mult=[1,2]", "model.attn_resolutions=[8]", "model.num_heads=2"],
    "uvit": ["model.embed_dim=32", "model.depth=4", "model.num_heads=2"],
    "edm2": ["model.channels=16", "model.channel_mult=[1,2]", "model.attn_resolutions=[8]",
             "model.channels_per_head=8", "model.num_res_blocks=1", "model.num_classes=10"],
}


class CheckError(RuntimeError):
    """A one-line failure of the check itself (no CUDA, bad option)."""


def load(path: Path, tiny: bool, extra: list[str] | None = None):
    """(config, sample shape) of a config file; --tiny shrinks the model and the images (16x16)."""
    cfg = load_config(path, extra or [])
    if tiny:
        over = TINY[cfg.model.backbone] + ["data.resolution=16"]
        if cfg.data.name == "fashion_mnist":  # its resolution is fixed at 28; the check never loads it
            over = over[:-1] + ["data.name=folder", "data.root=unused", "data.resolution=16"]
        cfg = load_config(path, over + (extra or []))
    channels = 1 if cfg.data.name == "fashion_mnist" else 3
    return cfg, (channels, cfg.data.resolution, cfg.data.resolution)


def build(cfg, shape):
    formulation = build_formulation(cfg.diffusion)
    return formulation, formulation.wrap(build_model(cfg.model, shape))


def random_batch(cfg, formulation, shape, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand((batch, *shape), generator=g) * 2 - 1  # images live in [-1, 1]
    t = formulation.sample_t(batch, g, "cpu")
    noise = torch.randn((batch, *shape), generator=g)
    labels = torch.randint(0, cfg.model.num_classes, (batch,), generator=g) if cfg.model.num_classes else None
    return x, labels, t, noise


def loss_and_grads(model, formulation, batch, device, bf16: bool):
    x, labels, t, noise = (None if v is None else v.to(device) for v in batch)
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast(device_type=device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    with ctx:
        loss = formulation.loss(model, x, labels, t=t, noise=noise).float().mean()
    loss.backward()
    grads = [p.grad.detach().float().cpu().reshape(-1) if p.grad is not None else torch.zeros(p.numel())
             for p in model.parameters()]
    return float(loss.detach()), grads


def check_numerics(device: torch.device, tiny: bool, batch: int) -> list[dict]:
    """CPU fp32 vs `device` fp32 and bf16 autocast, same weights and batch (see module docstring)."""
    # The fp32 check means IEEE fp32, not TF32; the flags are restored for the timing (PyTorch's defaults there).
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return _check_numerics(device, tiny, batch)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def _check_numerics(device: torch.device, tiny: bool, batch: int) -> list[dict]:
    rows = []
    for name, file in NUMERICS:
        cfg, shape = load(CONFIGS / file, tiny)
        torch.manual_seed(0)
        formulation, ref = build(cfg, shape)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.02 * torch.randn_like(p))
        data = random_batch(cfg, formulation, shape, batch)
        dev = copy.deepcopy(ref).to(device)
        # EDM2 renormalises its weights in place in training mode: every run starts from a fresh copy.
        loss_ref, g_ref = loss_and_grads(copy.deepcopy(ref), formulation, data, torch.device("cpu"), bf16=False)
        g_ref_all = torch.cat(g_ref)
        for precision, tol in (("fp32", FP32_TOL), ("bf16", BF16_TOL)):
            loss, g = loss_and_grads(copy.deepcopy(dev), formulation, data, device, bf16=precision == "bf16")
            loss_rel = abs(loss - loss_ref) / max(abs(loss_ref), 1e-12)
            grad_rel = float((torch.cat(g) - g_ref_all).norm() / g_ref_all.norm().clamp_min(1e-30))
            # worst tensor among those carrying at least 1e-3 of the gradient norm (others are round-off only)
            big = [(a, b) for a, b in zip(g, g_ref) if b.norm() > 1e-3 * g_ref_all.norm()]
            worst = max(float((a - b).norm() / b.norm()) for a, b in big)
            ok = loss_rel <= tol["loss"] and grad_rel <= tol["grad"]
            rows.append({"model": name, "precision": precision, "loss_cpu": loss_ref, "loss_device": loss,
                         "loss_rel_err": loss_rel, "grad_rel_err": grad_rel, "worst_tensor_rel_err": worst,
                         "tol_loss": tol["loss"], "tol_grad": tol["grad"], "ok": ok})
    return rows


def make_step(model, formulation, cfg, device, bf16: bool, optimizer_impl: str, compile_: bool):
    """One training step as the Trainer takes it (without data loading): loss, backward, clip, AdamW, EMA."""
    from steadydiff.train.step import TrainLoss, build_optimizer

    t = copy.copy(cfg.train)
    t.optimizer_impl = optimizer_impl
    opt = build_optimizer(model.parameters(), t, device)
    ema = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    fwd = TrainLoss(model, formulation)
    if compile_:
        fwd = torch.compile(fwd)
    clip = cfg.train.grad_clip if cfg.train.grad_clip is not None else float("inf")

    def step(x, labels, t, noise):
        ctx = torch.autocast(device_type=device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
        with ctx:
            loss = fwd(x, labels, t, noise).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - 0.999)
        return loss

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_config(name: str, file: str, batch: int, device: torch.device, tiny: bool, bf16: bool, steps: int,
                warmup: int, peak: float, channels_last: bool = False, optimizer_impl: str = "auto",
                compile_: bool = False, profile_path: Path | None = None) -> dict:
    """Time `steps` training steps of a config after `warmup`; with `profile_path`, also write a profiler table."""
    cfg, shape = load(CONFIGS / file, tiny)
    torch.manual_seed(0)
    formulation, model = build(cfg, shape)
    model = model.to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    flops = count_train_flops(model, formulation, cfg, shape, batch=batch)
    x, labels, t, noise = (None if v is None else v.to(device) for v in random_batch(cfg, formulation, shape, batch))
    x, noise = x.contiguous(memory_format=fmt), noise.contiguous(memory_format=fmt)
    step = make_step(model, formulation, cfg, device, bf16, optimizer_impl, compile_)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):  # kernel selection, allocator growth, compilation
        step(x, labels, t, noise)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(x, labels, t, noise)
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    row = {
        "config": name, "params": sum(p.numel() for p in model.parameters()), "batch": batch,
        "resolution": shape[1], "precision": "bf16" if bf16 else "fp32", "images_per_s": batch / dt,
        "ms_per_step": 1e3 * dt, "flops_per_step": flops, "achieved_flops": flops / dt, "mfu": flops / dt / peak,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "final_loss": float(loss),
    }
    if profile_path is not None:
        row["time_shares"] = profile(step, (x, labels, t, noise), device, profile_path)
        row["profile"] = str(profile_path)
    del model, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def profile(step, args, device: torch.device, out: Path, steps: int = 3, top: int = 25) -> dict[str, float]:
    """torch.profiler table of the `top` ops by self time (device time on CUDA) over `steps` steps, to `out`;
    returns the share of time per op category (`op_breakdown`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(steps):
            step(*args)
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(prof.key_averages().table(sort_by=key, row_limit=top) + "\n")
    return op_breakdown(prof, device)


# Op-name fragments of each category, checked in order; the first that matches wins.
OP_CATEGORIES = [
    ("convolution", ("conv",)),
    ("matmul + attention", ("addmm", "aten::mm", "bmm", "matmul", "linear", "scaled_dot_product", "attention")),
    ("normalisation", ("group_norm", "layer_norm", "batch_norm", "rms_norm")),
    ("optimiser + EMA", ("optimizer", "_foreach", "adam", "lerp")),
]


def op_breakdown(prof, device: torch.device) -> dict[str, float]:
    """Share of the step's self time (device time on CUDA) per op category, from a finished profiler.

    Self times do not double count nested ops, so the shares add up to 1. Convolutions and matmuls are where
    the FLOPs are; everything else (activations, norms, copies, the optimiser) is time an implementation of
    the same FLOPs with the same kernels could at best remove: 1 / (conv + matmul share) bounds its speed-up.
    """
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    totals: dict[str, float] = {c: 0.0 for c, _ in OP_CATEGORIES} | {"other": 0.0}
    for ev in prof.key_averages():
        name = ev.key.lower()
        cat = next((c for c, frags in OP_CATEGORIES if any(f in name for f in frags)), "other")
        totals[cat] += float(getattr(ev, attr, 0.0) or 0.0)
    whole = sum(totals.values()) or 1.0
    return {c: v / whole for c, v in totals.items()}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {torch.get_num_threads()} threads"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt_row(r: dict) -> str:
    mem = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else "-"
    return (f"| {r['config']} | {r['params'] / 1e6:.1f}M | {r['batch']} | {r['resolution']} | {r['precision']} | "
            f"{r['images_per_s']:.1f} | {r['ms_per_step']:.1f} | {mem} | {r['flops_per_step'] / 1e9:.2f} | "
            f"{r['achieved_flops'] / 1e12:.3f} | {100 * r['mfu']:.1f}% |")


TABLE_HEAD = ["| config | params | batch | res | precision | img/s | ms/step | peak mem GiB | GFLOP/step | TFLOP/s "
              "| MFU |", "|---|---|---|---|---|---|---|---|---|---|---|"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="shrunken models, batch 2, 2 steps: a CPU smoke test")
    ap.add_argument("--steps", type=int, help="timed steps per config (default 20; --tiny 2)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 5; --tiny 1)")
    ap.add_argument("--batch", type=int, help="batch for every timed config (default: per config, see TIMED)")
    ap.add_argument("--fp32", action="store_true", help="time in fp32 instead of bf16 autocast")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile the loss (compile time not timed)")
    ap.add_argument("--optimizer", default="auto", choices=["auto", "foreach", "fused", "plain"])
    ap.add_argument("--skip-numerics", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu_check"), help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckError(f"no CUDA device is visible (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                         "run this on a GPU machine, or pass --device cpu --tiny for the CPU smoke test")
    if device.type not in ("cuda", "cpu"):
        raise CheckError(f"--device {args.device}: use cuda or cpu")
    steps = args.steps or (2 if args.tiny else 20)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    bf16 = not args.fp32
    t_start = time.perf_counter()

    numerics = [] if args.skip_numerics else check_numerics(device, args.tiny, batch=4 if args.tiny else 8)
    if numerics:
        print("numerics, CPU fp32 step vs device step (same weights and batch):")
        print("| model | precision | loss rel err | grad rel err | worst tensor | tolerance (loss, grad) | ok |")
        print("|---|---|---|---|---|---|---|")
        for r in numerics:
            print(f"| {r['model']} | {r['precision']} | {r['loss_rel_err']:.2e} | {r['grad_rel_err']:.2e} | "
                  f"{r['worst_tensor_rel_err']:.2e} | {r['tol_loss']:.0e}, {r['tol_grad']:.0e} | "
                  f"{'yes' if r['ok'] else 'NO'} |", flush=True)

    dtype = torch.bfloat16 if bf16 else torch.float32
    peak = measure_peak_flops(device, dtype, seconds=0.2 if args.tiny else 0.5, n=512 if args.tiny else None)
    print(f"\nmeasured {dtype} matmul peak of {device_name(device)}: {peak / 1e12:.1f} TFLOP/s", flush=True)
    timing = []
    for name, file, batch in TIMED:
        b = args.batch or (2 if args.tiny else batch)
        timing.append(time_config(name, file, b, device, args.tiny, bf16, steps, warmup, peak, args.channels_last,
                                  args.optimizer, args.compile))
        print(f"  {name}: {timing[-1]['images_per_s']:.1f} img/s", flush=True)
    print("\n" + "\n".join(TABLE_HEAD + [fmt_row(r) for r in timing]))

    command = "python " + " ".join(sys.argv if argv is None else ["benchmarks/gpu_check.py", *argv])
    meta = {
        "command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "device": device_name(device), "torch": torch.__version__, "tiny": args.tiny,
        "switches": {"channels_last": args.channels_last, "compile": args.compile, "optimizer": args.optimizer},
        "peak_flops": peak, "peak_dtype": str(dtype), "steps": steps, "warmup": warmup,
        "numerics": numerics, "timing": timing, "wall_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    md = [f"# GPU check: {meta['device']}", "", f"- command: `{meta['command']}`", f"- date: {meta['date']}",
          f"- torch {meta['torch']}; switches {meta['switches']}; MFU against the measured {dtype} matmul peak "
          f"{peak / 1e12:.1f} TFLOP/s; {steps} timed steps after {warmup} warm-up", ""]
    if numerics:
        md += ["| model | precision | loss rel err | grad rel err | ok |", "|---|---|---|---|---|"]
        md += [f"| {r['model']} | {r['precision']} | {r['loss_rel_err']:.2e} | {r['grad_rel_err']:.2e} | "
               f"{'yes' if r['ok'] else 'NO'} |" for r in numerics]
        md.append("")
    md += TABLE_HEAD + [fmt_row(r) for r in timing]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {out.with_suffix('.json')} and .md ({meta['wall_s']:.0f} s)")
    failed = [f"{r['model']} {r['precision']}" for r in numerics if not r["ok"]]
    if failed:
        print(f"gpu_check: error: numerics outside tolerance: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CheckError as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        sys.exit(2)
