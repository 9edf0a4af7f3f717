"""`steadydiff export`: a run's weights as a folder another tool loads, with a model card beside them.

    --format diffusers    a DDPMPipeline folder: `DDPMPipeline.from_pretrained(OUT)` loads it
        OUT/model_index.json
        OUT/unet/config.json, diffusion_pytorch_model.safetensors     UNet2DModel (nn/diffusers_export.py)
        OUT/scheduler/scheduler_config.json                            DDPMScheduler: the VP schedule's betas at
                                                                       the 1000 times the network saw
        OUT/steadydiff_config.yaml                                     the run's config (provenance)
    --format steadydiff   the self-describing model folder (`export_model`): any run, `steadydiff sample OUT`

Both formats get README.md (the model card: YAML metadata, training configuration, metrics from the run's
eval.json, how to load it) and samples.png (a grid drawn from the exported weights). The diffusers format is exact
or refused: only VP runs of the unet backbone whose network UNet2DModel reproduces (one GroupNorm group count, Org
skips, ...) are written; everything else gets one line naming why and `--format steadydiff`.

The folder is written under a temporary name beside OUT and renamed into place when complete, so a refused or
failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import Config, ConfigError, dump_config
from ..utils.errors import ExportError, SteadydiffError
from ..utils.io import atomic_write, atomic_write_text
from .run_dir import MODEL_JSON, LoadedModel, export_model, is_model_folder, load_model, source_config

FORMATS = ("diffusers", "steadydiff")
FALLBACK = "use --format steadydiff instead (the self-describing model folder: any run, `steadydiff sample DIR`)"
CARD = "README.md"
SAMPLES = "samples.png"
CARD_STEPS = 50  # the grid is drawn with the formulation's deterministic sampler at this many steps, seed 0


@dataclass
class Exported:
    path: Path
    fmt: str
    step: int
    weights: str  # "EMA", "raw", "post-hoc EMA ...": which weights were written
    files: list[str] = field(default_factory=list)


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} already exists and is not empty; choose a new directory (or delete it)")


def _is_latent(cfg: Config, run: Path) -> bool:
    from ..diffusion.latent import latent_record

    try:
        return latent_record(cfg.data) is not None
    except SteadydiffError as e:  # the store is gone: images or latents cannot be told apart
        raise ExportError(f"cannot tell whether {run} trained on images or on VAE latents ({e})") from e


def diffusers_refusal(cfg: Config, run: Path) -> str | None:
    """Why the run's config cannot be exported as a DDPMPipeline exactly (before any weight is read), or None."""
    from ..diffusion import FORMULATIONS

    if not hasattr(FORMULATIONS.choose(cfg.diffusion.kind), "discrete_schedule"):
        return (f"diffusion.kind={cfg.diffusion.kind}: its network is preconditioned with sigma-dependent scalings "
                "(c_in, c_skip, c_out, c_noise) and a learned loss weighting that no diffusers scheduler applies; "
                "a DDPMPipeline carries only a discrete alpha-bar schedule of a noise-predicting network (VP)")
    if cfg.model.skip_scaling in ("ls", "ls_ns"):
        return (f"model.skip_scaling={cfg.model.skip_scaling}: its LS gates compute each skip's coefficient from "
                "the skip itself, a network UNet2DModel has no place for")
    if _is_latent(cfg, run):
        return (f"the run trained on VAE latents ({cfg.data.root}), and a DDPMPipeline has no VAE to decode them "
                "into images")
    return None


def _write_diffusers(out: Path, m: LoadedModel) -> list[str]:
    from safetensors.torch import save_file

    from ..nn.diffusers_export import ddpm_pipeline_index, ddpm_scheduler_config, unet2d_config, unet2d_state_dict

    null_class = m.cfg.model.num_classes > 0 and m.cfg.model.label_dropout > 0
    net = m.model  # VP's trained module is the backbone itself
    config = unet2d_config(net, m.sample_shape[1], null_class=null_class)
    weights = unet2d_state_dict(net, null_class=null_class)
    betas, _ = m.formulation.discrete_schedule()
    (out / "unet").mkdir()
    (out / "scheduler").mkdir()
    atomic_write(out / "unet" / "diffusion_pytorch_model.safetensors",
                 lambda p: save_file(weights, str(p), metadata={"format": "pt"}))
    _write_json(out / "unet" / "config.json", config)
    _write_json(out / "scheduler" / "scheduler_config.json", ddpm_scheduler_config(betas.tolist(), clip_sample=True))
    _write_json(out / "model_index.json", ddpm_pipeline_index())
    atomic_write_text(out / "steadydiff_config.yaml", dump_config(m.cfg))
    return ["model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
            "scheduler/scheduler_config.json", "steadydiff_config.yaml"]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def _latent(m: LoadedModel) -> bool:
    try:
        from ..diffusion.latent import latent_record

        return latent_record(m.cfg.data) is not None
    except SteadydiffError:
        return True  # a store that cannot be read: draw no grid rather than guess what its samples are


def _write_samples(out: Path, m: LoadedModel, n: int) -> dict[str, Any] | None:
    """samples.png: `n` samples from the exported weights (None when n is 0, or for latents: a grid needs the VAE)."""
    if n <= 0 or _latent(m):
        return None
    from ..diffusion import generate
    from ..utils.images import save_samples

    sampler = m.formulation.ode_sampler
    x = generate(m.model, m.formulation, m.sample_shape, n, sampler, CARD_STEPS, seed=0, device="cpu",
                 num_classes=m.cfg.model.num_classes)
    save_samples(x, out / SAMPLES)
    return {"file": SAMPLES, "n": n, "sampler": sampler, "steps": CARD_STEPS, "seed": 0}


def _run_dir_of(run: Path) -> Path:
    """Where `steadydiff eval` wrote eval.json for this source: the run directory (also for a checkpoint
    directory inside it) or the model folder itself."""
    if not is_model_folder(run) and (run / "model.safetensors").is_file():
        return run.parent.parent
    return run


def read_eval(run: Path) -> dict[str, Any] | None:
    path = _run_dir_of(Path(run)) / "eval.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{path} is not valid JSON ({e}); re-run `steadydiff eval` or delete it") from e


def export_run(run: str | Path, out: str | Path, fmt: str = "diffusers", *, raw: bool = False, samples: int = 16,
               license: str = "other", repo_id: str | None = None) -> Exported:
    """Export the run (or checkpoint directory, or model folder) at `run` to the new folder `out` in `fmt`.

    `raw`: the raw weights instead of the EMA (a run's default); `samples`: the grid's size (0: none);
    `license` and `repo_id` go into the model card (the repo its load snippets name, else the local folder)."""
    run, out = Path(run), Path(out)
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    _check_out(out)
    cfg = source_config(run)
    if raw and is_model_folder(run):
        info = json.loads((run / MODEL_JSON).read_text())
        raise ConfigError(f"--raw: {run} is an exported model folder holding one set of weights "
                          f"({info.get('weights')}); pass the run directory to choose between raw and EMA weights")
    if fmt == "diffusers":
        reason = diffusers_refusal(cfg, run)
        if reason:
            raise ExportError(f"cannot export {run} to diffusers exactly: {reason}; {FALLBACK}")
    m = load_model(run, use_ema=not raw)
    if fmt == "diffusers":
        from ..nn.diffusers_export import unet2d_refusal

        reason = unet2d_refusal(m.model)
        if reason:
            raise ExportError(f"cannot export {run} to diffusers exactly (model.backbone={cfg.model.backbone}, "
                              f"model.skip_scaling={cfg.model.skip_scaling}): {reason}; {FALLBACK}")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if fmt == "diffusers":
            files = _write_diffusers(tmp, m)
        else:
            export_model(tmp, m.cfg, m.model.state_dict(), m.sample_shape, m.step, m.weights, source=str(run))
            files = ["config.yaml", "model.json", "model.safetensors"]
        grid = _write_samples(tmp, m, samples)
        card = model_card(m, fmt, location=repo_id or str(out), local=repo_id is None, license=license,
                          evaluation=read_eval(run), grid=grid)
        atomic_write_text(tmp / CARD, card)
        files += [CARD] + ([SAMPLES] if grid and (tmp / SAMPLES).is_file() else [])
        if out.is_dir():
            out.rmdir()  # empty (checked above): the complete folder takes its place
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, fmt, m.step, m.weights, files)


# --- the model card ------------------------------------------------------------------------------------------

def _dataset_ids(cfg: Config) -> list[str]:
    """Hub dataset ids of the training data, where known (the card's `datasets:`)."""
    fashion = "zalando-datasets/fashion_mnist"
    if cfg.data.name == "fashion_mnist":
        return [fashion]
    if cfg.data.name == "store" and cfg.data.root:
        try:
            from ..data.store import read_index

            source = str(read_index(cfg.data.root).get("source", ""))
        except SteadydiffError:
            return []
        if source.startswith("fashion_mnist"):
            return [fashion]
        if source.startswith("hf:"):
            return [source[3:].split(":")[0]]
    return []


def _front_matter(m: LoadedModel, fmt: str, license: str) -> str:
    cfg = m.cfg
    images = len(m.sample_shape) == 3
    tags = ["steadydiff", "diffusion", f"{cfg.diffusion.kind}-diffusion", cfg.model.backbone,
            f"skip-scaling-{cfg.model.skip_scaling}"]
    if fmt == "diffusers":
        tags += ["diffusers", "ddpm", "DDPMPipeline"]
    if cfg.model.num_classes:
        tags.append("class-conditional")
    meta: dict[str, Any] = {"library_name": "diffusers" if fmt == "diffusers" else "steadydiff", "license": license,
                            "tags": tags}
    if images:
        meta["pipeline_tag"] = "unconditional-image-generation"
    datasets = _dataset_ids(cfg)
    if datasets:
        meta["datasets"] = datasets
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _config_rows(m: LoadedModel) -> list[tuple[str, str]]:
    cfg, mc, d, t = m.cfg, m.cfg.model, m.cfg.diffusion, m.cfg.train
    rows = [("data", f"{cfg.data.name}" + (f" ({cfg.data.root})" if cfg.data.root else "")
             + f", samples of shape {'x'.join(map(str, m.sample_shape))}"),
            ("backbone", mc.backbone)]
    if mc.backbone in ("unet", "edm2"):
        rows += [("channels", f"{mc.channels} x {mc.channel_mult}, {mc.num_res_blocks} blocks per level"),
                 ("attention", f"at resolutions {mc.attn_resolutions}" + (f", {mc.num_heads} heads"
                                                                         if mc.backbone == "unet" else ""))]
    if mc.backbone == "unet":
        rows.append(("GroupNorm groups", str(mc.norm_groups) if mc.norm_groups else "per layer, gcd(32, C / 4)"))
    if mc.backbone == "uvit":
        rows.append(("transformer", f"{mc.embed_dim}d, depth {mc.depth}, patch {mc.patch_size}, {mc.num_heads} heads"))
    if mc.backbone == "mlp_unet":
        rows.append(("MLP", f"width {mc.hidden}, depth {mc.depth}"))
    scaling = mc.skip_scaling + (f" (kappa {mc.kappa})" if mc.skip_scaling == "cs" else "")
    rows += [("skip scaling (ScaleLong)", scaling),
             ("classes", f"{mc.num_classes}" + (f", label dropout {mc.label_dropout}" if mc.label_dropout else "")
              if mc.num_classes else "none (unconditional)")]
    if d.kind == "vp":
        rows.append(("diffusion", f"VP-SDE, beta_min {d.beta_min}, beta_max {d.beta_max}, t_eps {d.t_eps}, "
                     "eps-prediction, model time 999 t"))
    else:
        rows.append(("diffusion", f"{d.kind}, sigma_data {d.sigma_data}, P_mean {d.p_mean}, P_std {d.p_std}"))
    rows += [("training", f"{t.steps} steps, batch {t.batch_size}, lr {t.lr} ({t.lr_schedule}), timesteps "
              f"{t.timesteps}, momentum {t.momentum}, EMA decay {t.ema_decay}, seed {t.seed}"),
             ("these weights", f"step {m.step}, {m.weights}")]
    return rows


def _metrics_section(evaluation: dict[str, Any] | None, m: LoadedModel) -> list[str]:
    if not evaluation:
        return ["No evaluation recorded (run `steadydiff eval RUN` before exporting to report metrics here).", ""]
    how = (f"{evaluation.get('n')} samples, {evaluation.get('sampler')} at {evaluation.get('steps')} steps, "
           f"seed {evaluation.get('seed')}, {evaluation.get('weights')} weights at step {evaluation.get('step')}")
    lines = [f"From the run's `eval.json` ({how}):", ""]
    if evaluation.get("step") is not None and int(evaluation["step"]) != m.step:
        lines += [f"(measured at step {evaluation['step']}; the exported weights are step {m.step}'s)", ""]
    if "metrics" in evaluation:
        guidance = evaluation.get("guidance", 1)
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k}{'' if guidance == 1 else f' (guidance {guidance})'} | {v:.5g} |"
                  for k, v in evaluation["metrics"].items()]
    for row in evaluation.get("sweep", []):
        lines.append(f"- guidance {row['guidance']}: " + ", ".join(f"{k} {v:.5g}" for k, v in row["metrics"].items()))
    return lines + [""]


def _diffusers_snippets(m: LoadedModel, where: str) -> list[str]:
    c, r = m.sample_shape[0], m.sample_shape[1]
    k = m.cfg.model.num_classes
    d = m.cfg.diffusion
    lines = ["## Load it in diffusers", "", "```python"]
    if not k:
        lines += ["from diffusers import DDIMPipeline, DDIMScheduler, DDPMPipeline", "",
                  f'pipe = DDPMPipeline.from_pretrained("{where}")',
                  "images = pipe(batch_size=16).images  # DDPM ancestral sampling, 1000 steps", "",
                  "# DDIM at 50 steps: steadydiff's `ddim` on diffusers' grid (see Schedule below)",
                  "ddim = DDIMPipeline(unet=pipe.unet, scheduler=DDIMScheduler.from_config(pipe.scheduler.config))",
                  "images = ddim(batch_size=16, num_inference_steps=50, eta=0.0, use_clipped_model_output=True).images"]
    else:
        null = (f"; class {k} is the null label (unconditional, as trained with label dropout)"
                if m.cfg.model.label_dropout else "")
        lines += ["import torch", "from diffusers import DDIMScheduler, UNet2DModel", "",
                  "# class-conditional: DDPMPipeline passes no labels, so drive the UNet directly",
                  f'unet = UNet2DModel.from_pretrained("{where}", subfolder="unet")',
                  f'scheduler = DDIMScheduler.from_pretrained("{where}", subfolder="scheduler")',
                  "scheduler.set_timesteps(50)",
                  f"labels = torch.arange(16) % {k}  # classes 0..{k - 1}{null}",
                  f"x = torch.randn(16, {c}, {r}, {r})",
                  "with torch.no_grad():",
                  "    for t in scheduler.timesteps:",
                  "        eps = unet(x, t, class_labels=labels).sample",
                  "        x = scheduler.step(eps, t, x, use_clipped_model_output=True).prev_sample",
                  "images = (x / 2 + 0.5).clamp(0, 1)"]
    lines += ["```", "", "## Load it in steadydiff", "",
              "The UNet behind steadydiff's backbone interface, sampled by steadydiff's samplers:", "", "```python",
              "from diffusers import UNet2DModel", "from steadydiff.diffusion import VPSDE, generate",
              "from steadydiff.nn.diffusers_compat import DiffusersUNetAdapter", "",
              f'model = DiffusersUNetAdapter(UNet2DModel.from_pretrained("{where}", subfolder="unet")).eval()',
              f"sde = VPSDE(beta_min={d.beta_min}, beta_max={d.beta_max}, t_eps={d.t_eps})",
              f'x = generate(model, sde, ({c}, {r}, {r}), 16, "dpmpp2m", 30, seed=0, num_classes={k})  # in [-1, 1]',
              "```", ""]
    return lines


def _steadydiff_snippets(where: str, local: bool) -> list[str]:
    lines = ["## Load it in steadydiff", "", "```bash"]
    if not local:
        lines += [f'python -c "from huggingface_hub import snapshot_download; '
                  f"snapshot_download('{where}', local_dir='model')\"", "steadydiff sample model --out samples.png"]
    else:
        lines.append(f"steadydiff sample {where} --out samples.png")
    lines += ["```", "", "or in Python: `from steadydiff.runs import load_model; m = load_model(DIR)` (`m.model`, "
              "`m.formulation`, `m.sample_shape`).", ""]
    return lines


def _schedule_section(m: LoadedModel) -> list[str]:
    d = m.cfg.diffusion
    return ["## Schedule", "",
            f"steadydiff trains on the continuous VP-SDE (beta_min {d.beta_min}, beta_max {d.beta_max}) and feeds the "
            "network the time 999 t. DDPM timestep n = 0..999 is t = n / 999, and the scheduler's `trained_betas` "
            "give alphas_cumprod[n] = alpha(n / 999)^2 with log alpha(t) = -t^2 (beta_max - beta_min) / 4 - "
            "t beta_min / 2, so every timestep diffusers visits is a noise level the network was trained at. "
            "`timestep_spacing` is `trailing`: 50 DDIM steps visit 999, 979, ..., 19 and end with x0_hat at 19. "
            "steadydiff's own `ddim` at 50 steps goes from t = 1 to t_eps = 1e-5 on a grid up to one timestep "
            "away from that one: the same integrator, so the two differ by less than its 50-step discretisation "
            "error (steadydiff's tests bound it by the 50-vs-100-step difference), and driven over the same "
            "timesteps they agree to float32 rounding.", ""]


def model_card(m: LoadedModel, fmt: str, *, location: str, local: bool, license: str = "other",
               evaluation: dict[str, Any] | None = None, grid: dict[str, Any] | None = None) -> str:
    """README.md of an exported folder: YAML metadata (library, license, tags, datasets), the training
    configuration, metrics from eval.json, the sample grid, and how to load it. `location`: the Hub repo id
    (`local` False) or the local folder (`local` True) that the load snippets name."""
    cfg = m.cfg
    title = (f"{cfg.model.backbone} ({cfg.diffusion.kind.upper()}) on {cfg.data.name}, "
             f"skip scaling {cfg.model.skip_scaling}")
    lines = [_front_matter(m, fmt, license), f"# {title}", "",
             f"Trained with steadydiff and exported with `steadydiff export --format {fmt}` "
             f"({m.weights} weights at step {m.step}).", "", "## Training configuration", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _config_rows(m)]
    lines += ["", "## Metrics", ""] + _metrics_section(evaluation, m)
    if grid:
        lines += ["## Samples", "", f"![samples]({grid['file']})", "",
                  f"{grid['n']} samples from these weights: steadydiff `{grid['sampler']}` at {grid['steps']} steps, "
                  f"seed {grid['seed']}" + (", classes cycling" if cfg.model.num_classes else "") + ".", ""]
    if fmt == "diffusers":
        lines += _diffusers_snippets(m, location) + _schedule_section(m)
    else:
        lines += _steadydiff_snippets(location, local)
    return "\n".join(lines).rstrip("\n") + "\n"
