"""steadydiff command line: train | sample | eval | convert | export | diagnose | phema | compare | lr-range | dataset.

Every expected failure (bad config, missing data, unreadable checkpoint, NaN loss: a `SteadydiffError`, or an
`OSError`) ends with one line `steadydiff: error: ...` that names the fix, and a non-zero exit status; anything
else is a bug and keeps its traceback. This module parses, prints and picks exit codes; the work is done by
the layers below.

Exit statuses: 0 done; 2 a user error (one line names the fix); 3 a non-finite loss stopped training (the last
good checkpoint is kept); 75 a stop signal (SIGTERM, SIGINT, SIGUSR2: `train.stop_signals`) ended training at a
step boundary with that step's checkpoint saved: re-run the same command to continue.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from .config import ConfigError, load_config
from .utils.errors import SteadydiffError

EXIT_USER_ERROR = 2
EXIT_NONFINITE = 3


class OutputError(SteadydiffError):
    """Writing an output failed (full disk, no permission); the message names the file and the fix."""


def _cmd_train(args: argparse.Namespace) -> int:
    """Also the entry point of every process under `torchrun --nproc_per_node=N -m steadydiff.cli train ...`:
    the Trainer joins the process group; only rank 0 prints."""
    from .train import Trainer
    from .train.flops import format_flops

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a file; --out must be a directory (a new one, or a run to resume)")
    cfg = load_config(args.config, args.set)
    trainer = Trainer(cfg, args.out, show_progress=not args.quiet)
    try:
        say = print if trainer.dist.is_main else (lambda *a, **k: None)
        if trainer.step >= cfg.train.steps:
            say(f"{args.out}: already trained to step {trainer.step} (train.steps={cfg.train.steps}); nothing to do")
            return 0
        if trainer.step:
            say(f"resuming {args.out} from step {trainer.step}")
        fl = trainer.flop_report()
        procs = f" on {trainer.dist.world_size} processes" if trainer.dist.enabled else ""
        if fl["flops_per_step"]:
            say(f"{format_flops(fl['flops_per_step'])}/step (forward + backward, global batch {cfg.train.batch_size}"
                f"{procs}); peak {format_flops(fl['peak_flops'])}/s "
                f"({'train.peak_flops' if cfg.train.peak_flops else 'measured matmul'})", flush=True)
        try:
            trainer.fit()
        except OSError as e:  # metrics, curves, samples (checkpoint writes raise CheckpointError)
            raise OutputError(f"could not write to {args.out}: {os_error_text(e)}; re-running the same command "
                              "resumes from the last checkpoint") from e
        say(f"done: {args.out} (config.yaml, metrics.jsonl, curves.png, samples/, checkpoints/)")
    finally:
        trainer.close()
    return 0


def _load_guide(args: argparse.Namespace):
    """The --guide run, loaded (None without --guide)."""
    from .runs import load_model

    return None if args.guide is None else load_model(args.guide, use_ema=not args.no_ema)


def _add_guidance_args(p: argparse.ArgumentParser, sweep: str) -> None:
    """The options `sample` and `eval` share: guidance, the class drawn, and the VAE of a latent run."""
    p.add_argument("--guidance", default="1", metavar="W",
                   help="guidance weight (1: none; >1: stronger): classifier-free with a model trained with "
                   f"model.label_dropout, or autoguidance with --guide{sweep}")
    p.add_argument("--guidance-interval", metavar="LO,HI",
                   help="guide only at noise levels sigma in [LO, HI] (Kynkaanniemi et al. 2024)")
    p.add_argument("--guide", metavar="RUN", help="autoguidance: guide with this weaker model of the same task "
                   "(a smaller or earlier run; an unconditional one: classifier-free guidance as in EDM2): "
                   "D = D_guide + W (D_main - D_guide)")
    p.add_argument("--vae", help="latent runs: load the store's VAE from here instead of where the store says "
                   "(a moved folder; it must be the same VAE)")
    p.add_argument("--class", dest="class_label", type=int, metavar="C",
                   help="draw every sample for class C (default: classes cycle over the samples)")


def _cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from .diffusion import (
        check_guidance,
        check_sampler,
        generate,
        guided,
        parse_guidance_interval,
        parse_guidance_weights,
    )
    from .diffusion.latent import latent_decoder
    from .runs import load_model
    from .utils.device import pick_device
    from .utils.images import save_samples

    m = load_model(args.run, use_ema=not args.no_ema)
    sampler = args.sampler or m.cfg.train.sample_sampler
    check_sampler(m.formulation.kind, sampler)
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name such as {out / 'samples.png'}")
    weights = parse_guidance_weights(args.guidance)
    if len(weights) != 1:
        raise ConfigError(f"--guidance {args.guidance}: sample takes one weight; sweep with steadydiff eval")
    weight = weights[0]
    interval = parse_guidance_interval(args.guidance_interval)
    guide = _load_guide(args)
    check_guidance(m, weights, args.class_label, guide, args.guide)
    device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = guided(m.model.to(device), None if guide is None else guide.model.to(device), m.formulation, weight,
                   interval)
    decode = latent_decoder(m.cfg.data, args.vae, device)  # None unless the run trained on a latent store
    x = generate(model, m.formulation, m.sample_shape, args.n, sampler, args.steps, args.seed, device,
                 m.cfg.model.num_classes, clip=not args.no_clip, class_label=args.class_label, decode=decode)
    save_samples(x, out)
    how = f", guidance {weight:g}" + (f" by {args.guide}" if guide is not None else "") if weight != 1 else ""
    print(f"wrote {args.n} samples (step {m.step}, {m.weights} weights, {sampler}{how}) to {out}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """Under `torchrun --nproc_per_node=N -m steadydiff.cli eval ...` the N processes share the sampling and
    feature extraction; rank 0 writes the result, which is the same as one process's."""
    import json

    import torch

    from .data import load_dataset
    from .diffusion import (
        check_guidance,
        check_sampler,
        guided,
        parse_guidance_interval,
        parse_guidance_weights,
        steps_for_nfe,
    )
    from .diffusion.latent import latent_decoder
    from .metrics.evaluate import evaluate, parse_metrics, plot_guidance_sweep
    from .runs import load_model
    from .utils.device import pick_device
    from .utils.distributed import init_distributed, local_main_first, shutdown_distributed
    from .utils.io import atomic_write_text

    m = load_model(args.run, use_ema=not args.no_ema)
    cfg = m.cfg
    metrics = parse_metrics(args.metric)
    out = Path(args.out) if args.out else Path(args.run) / "eval.json"
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name such as {out / 'eval.json'}")
    sampler = args.sampler or cfg.train.sample_sampler
    check_sampler(m.formulation.kind, sampler)
    weights = parse_guidance_weights(args.guidance)
    interval = parse_guidance_interval(args.guidance_interval)
    guide = _load_guide(args)
    check_guidance(m, weights, args.class_label, guide, args.guide)
    budgets = [(n, steps_for_nfe(m.formulation.kind, sampler, n, "--nfe")) for n in args.nfe]
    if budgets and len(weights) > 1:
        raise ConfigError("--nfe takes one --guidance weight; sweep the weights and the budgets in separate runs")
    if args.threads:
        torch.set_num_threads(args.threads)
    info, device = init_distributed(pick_device(args.device))
    try:
        with local_main_first(info):  # a first run may download the data: once per node
            dataset = load_dataset(cfg.data)
        model, guide = m.model.to(device), None if guide is None else guide.model.to(device)
        decode = latent_decoder(cfg.data, args.vae, device)  # None unless the run trained on a latent store
        def score(w: float, steps: int) -> dict[str, float]:
            return evaluate(guided(model, guide, m.formulation, w, interval), m.formulation, cfg, dataset, metrics,
                            args.n, sampler, steps, args.seed, device, clip=not args.no_clip, ref_n=args.ref_n,
                            batch=args.batch, dist_info=info, class_label=args.class_label, decode=decode)

        results = [score(w, args.steps) for w in weights]
        at_nfe = [{"nfe": n, "steps": steps, "metrics": score(weights[0], steps)} for n, steps in budgets]
        if info.is_main:
            record = {"step": m.step, "n": args.n, "sampler": sampler, "steps": args.steps, "seed": args.seed,
                      "batch": args.batch, "weights": "raw" if args.no_ema else "ema", "ref_n": args.ref_n,
                      "processes": info.world_size, "class": args.class_label, "guide": args.guide,
                      "guidance_interval": interval}
            if len(weights) == 1:
                record.update(guidance=weights[0], metrics=results[0])
            else:  # a sweep: the metrics against the weight, and their plot beside the JSON
                record["sweep"] = [{"guidance": w, "metrics": r} for w, r in zip(weights, results)]
                plot_guidance_sweep(record["sweep"], out.with_suffix(".png"))
            if at_nfe:
                record["nfe"] = at_nfe
            atomic_write_text(out, json.dumps(record, indent=2) + "\n")
            for w, res in zip(weights, results):
                tag = f"guidance={w:g} " if len(weights) > 1 or w != 1 else ""
                print(tag + " ".join(f"{k}={v:.5g}" for k, v in res.items()) + f"  -> {out}")
            for r in at_nfe:
                scores = " ".join(f"{k}={v:.5g}" for k, v in r["metrics"].items())
                print(f"nfe={r['nfe']} (steps={r['steps']}) {scores}")
    finally:
        shutdown_distributed(info)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from .config import Config, DataConfig
    from .nn.convert import load_official_uvit, steadydiff_to_official
    from .runs import export_model, load_model
    from .utils.io import atomic_write

    src, out = Path(args.input), Path(args.out)
    if args.kind == "uvit-official":
        if not src.is_file():
            raise ConfigError(f"{src} not found; pass the official nnet.pth or nnet_ema.pth file")
        if args.num_heads is None:
            raise ConfigError("--num-heads is required: no tensor records the head count (U-ViT-S: 8, M/L: 12)")
        if out.exists() and any(out.iterdir()):
            raise ConfigError(f"{out} already exists and is not empty; choose a new --out directory")
        model, mcfg, shape = load_official_uvit(src, args.num_heads, args.skip_scaling, args.kappa)
        # The data section is a placeholder: point data.root at your images (or pick a dataset) to fine-tune.
        cfg = Config(model=mcfg, data=DataConfig(name="folder", root="SET-data.root", resolution=shape[1]))
        export_model(out, cfg, model.state_dict(), shape, step=0, weights_kind="converted", source=str(src))
        print(f"converted {src} -> {out} (U-ViT {mcfg.embed_dim}d, depth {mcfg.depth}, patch {mcfg.patch_size}, "
              f"{shape[1]}x{shape[2]}x{shape[0]}, skip_scaling {mcfg.skip_scaling}); sample with "
              f"`steadydiff sample {out} --out samples.png`")
        return 0
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name such as {out / 'nnet_ema.pth'}")
    m = load_model(src, use_ema=not args.no_ema)
    weights = m.model.state_dict()
    n_skips = len({k.split(".")[1] for k in weights if k.startswith("out_blocks.")})
    if not n_skips:
        raise ConfigError(f"{src} does not hold a U-ViT (no out_blocks.* weights)")
    official = steadydiff_to_official(weights, n_skips)
    atomic_write(out, lambda p: torch.save(official, p))
    print(f"wrote the official U-ViT layout of {src} (step {m.step}) to {out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .runs.export import export_run
    from .runs.hub import push_to_hub, require_hub

    if args.samples < 0:
        raise ConfigError(f"--samples must be >= 0 (0: no sample grid), got {args.samples}")
    if args.private and not args.push_to_hub:
        raise ConfigError("--private applies to --push-to-hub REPO_ID; add it or drop --private")
    if args.push_to_hub:
        require_hub()  # before anything is written
    done = export_run(args.run, args.out, args.format, raw=args.raw, samples=args.samples, license=args.license,
                      repo_id=args.push_to_hub)
    how = ("load it with DDPMPipeline.from_pretrained" if done.fmt == "diffusers"
           else "sample it with `steadydiff sample`")
    print(f"exported {args.run} (step {done.step}, {done.weights} weights) as {done.fmt} to {done.path}; {how}")
    if args.push_to_hub:
        url = push_to_hub(done.path, args.push_to_hub, private=args.private)
        print(f"uploaded {done.path} to {url}")
    return 0


def _cmd_diagnose(args: argparse.Namespace) -> int:
    from .diagnostics.report import diagnose_at_init, diagnose_runs
    from .runs import read_config

    out = Path(args.out)
    if args.at_init:
        if args.runs:
            raise ConfigError("pass either run directories or --at-init CONFIG, not both")
        diagnose_at_init(load_config(args.at_init, args.set), out)
    else:
        if not args.runs:
            raise ConfigError("nothing to diagnose: pass RUN_DIR ... or --at-init CONFIG.yaml")
        for r in args.runs:
            read_config(r)  # a one-line error for anything but a run directory
        diagnose_runs([Path(r) for r in args.runs], out)
    print(f"wrote {out}/stability.json, stability.md and plots")
    return 0


def _cmd_phema(args: argparse.Namespace) -> int:
    from .train.phema_export import export_phema

    try:
        sigmas = [float(v) for v in args.sigma_rel.split(",") if v.strip()]
    except ValueError as e:
        raise ConfigError(f"--sigma-rel {args.sigma_rel!r}: expected numbers like 0.05,0.1") from e
    for sr, st, target in export_phema(args.run, args.out, sigmas, args.step):
        print(f"sigma_rel {sr:.3f} at step {st}: {target} (sample with `steadydiff sample {target} --out x.png`)")
    return 0


def _launch_options(args: argparse.Namespace):
    from .experiments.launch import LaunchOptions

    return LaunchOptions(launcher=args.launcher, cluster=args.cluster, partition=args.partition,
                         gpus_per_run=args.gpus_per_run, cpus_per_run=args.cpus_per_run, timeout_min=args.timeout_min,
                         max_requeues=args.max_requeues, array_parallelism=args.array_parallelism,
                         slurm_extra=tuple(args.slurm_extra), dry_run=args.dry_run)


def _cmd_compare(args: argparse.Namespace) -> int:
    from .experiments.compare import compare

    rep = compare(args.experiment, args.out, args.set, args.argv if args.argv is not None else sys.argv[1:],
                  workers=args.workers, report_only=args.report_only, calibrate=args.calibrate,
                  show_progress=not args.quiet, launch=_launch_options(args))
    if rep is None:  # --dry-run: the plan is printed, nothing was written or submitted
        return 0
    for c in rep["claims"]:
        print(f"{c['verdict']:>14}: {c['name']} ({c['registration']})")
    print(f"wrote {Path(args.out)}/results.json and report.md")
    return 0


def _cmd_lr_range(args: argparse.Namespace) -> int:
    from .experiments.lr_range import FILES, lr_range, summary_lines

    rep = lr_range(args.experiment, args.out, args.set, args.argv if args.argv is not None else sys.argv[1:],
                   workers=args.workers, report_only=args.report_only, show_progress=not args.quiet,
                   launch=_launch_options(args))
    if rep is None:  # --dry-run
        return 0
    for line in summary_lines(rep):
        print(line)
    for c in rep["claims"]:
        print(f"{c['verdict']:>14}: {c['name']} ({c['registration']})")
    print(f"wrote {', '.join(str(Path(args.out) / f) for f in FILES)}")
    return 0


def os_error_text(e: OSError) -> str:
    """`reason (file); fix` for a failed file operation, e.g. a full disk."""
    reason = e.strerror or str(e) or type(e).__name__
    where = f" ({e.filename})" if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space or change --out"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "make it writable or change --out"
    elif e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
        fix = "check the path"
    else:
        fix = "check the path and the disk"
    return f"{reason}{where}; {fix}"


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line error format (argparse prints the whole usage block by default)."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"steadydiff: error: {message}; see `{self.prog} --help`\n")


def _count(text: str) -> int:
    """A positive integer argument (--n, --steps, --threads, ...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _count0(text: str) -> int:
    """A non-negative integer argument (--gpus-per-run, --max-requeues)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    """--launcher and the cluster options of `compare` and `lr-range` (choices from experiments/launch.py)."""
    from .experiments.launch import CLUSTERS, DEFAULT_MAX_REQUEUES, DEFAULT_TIMEOUT_MIN, LAUNCHERS

    g = p.add_argument_group("where the runs train", "--launcher submitit submits one job per run, as one job "
                             "array (the [slurm] extra); the options below apply to it only")
    g.add_argument("--launcher", choices=LAUNCHERS.names, default="local",
                   help="local: this machine's pool (--workers at once); submitit: one cluster job per run")
    g.add_argument("--cluster", choices=CLUSTERS.names, help="submitit's cluster (default slurm): "
                   + "; ".join(f"{k}: {v}" for k, v in CLUSTERS.items()))
    g.add_argument("--partition", help="Slurm partition")
    g.add_argument("--gpus-per-run", type=_count0, help="GPUs per run; N > 1 trains each run with DDP on N tasks")
    g.add_argument("--cpus-per-run", type=_count, help="CPUs per run (also its torch threads)")
    g.add_argument("--timeout-min", type=_count, help=f"a job's time limit in minutes (default {DEFAULT_TIMEOUT_MIN}); "
                   "at the limit the run checkpoints its step and the job is requeued")
    g.add_argument("--max-requeues", type=_count0, help="requeues after a time limit (default "
                   f"{DEFAULT_MAX_REQUEUES}; preemptions do not count)")
    g.add_argument("--array-parallelism", type=_count, help="jobs of the array running at once")
    g.add_argument("--slurm-extra", action="append", default=[], metavar="KEY=VALUE",
                   help="any other sbatch option, e.g. --slurm-extra account=ab12 (repeatable)")
    g.add_argument("--dry-run", action="store_true", help="print what would be submitted (the sbatch script of the "
                   "array) and submit nothing")


def load_registries() -> None:
    """Import every module that fills a registry (`utils/registry.py`), so that the choices and help below list
    every entry and configs loaded after this are checked against all of them."""
    from . import diffusion, experiments, metrics, nn, train  # noqa: F401


def build_parser() -> argparse.ArgumentParser:
    """The parser; its choices and help texts are read from the registries (a new entry shows up here)."""
    load_registries()
    from .diffusion import sampler_help, sampler_names
    from .experiments.claims import CLAIM_KINDS
    from .metrics import METRICS
    from .runs.export import FORMATS as EXPORT_FORMATS

    p = _Parser(prog="steadydiff", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (re-run the same command to resume)")
    t.add_argument("--config", help="YAML config file (defaults apply to keys it omits)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=1e-4 (repeatable)")
    t.add_argument("--out", required=True, help="run directory (created; an existing one is resumed)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_cmd_train)

    s = sub.add_parser("sample", help="draw samples from a trained run into a PNG")
    s.add_argument("run", help="run directory (or a checkpoint directory inside it)")
    s.add_argument("--n", type=_count, default=64)
    s.add_argument("--sampler", choices=sampler_names(),
                   help=f"{sampler_help()} (default: the run's train.sample_sampler)")
    s.add_argument("--steps", type=_count, default=50)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True, help="PNG file to write")
    s.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA")
    s.add_argument("--no-clip", action="store_true", help="do not keep image estimates in [-1, 1] while sampling")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    s.add_argument("--threads", type=_count, default=None)
    _add_guidance_args(s, sweep="")
    s.set_defaults(func=_cmd_sample)

    e = sub.add_parser("eval", help=f"sample a run and score it ({', '.join(METRICS)})")
    e.add_argument("run", help="run directory (or a phema output directory)")
    e.add_argument("--metric", default="fd_fmnist", help=f"comma-separated metrics: {', '.join(METRICS)}")
    e.add_argument("--n", "--num-samples", dest="n", type=_count, default=5000,
                   help="number of samples (under torchrun write --num-samples: torchrun reads --n as its own)")
    e.add_argument("--sampler", choices=sampler_names(),
                   help=f"{sampler_help()} (default: the run's train.sample_sampler)")
    e.add_argument("--steps", type=_count, default=50)
    e.add_argument("--nfe", type=_count, nargs="+", default=[], metavar="N",
                   help="network-evaluation budgets, e.g. --nfe 10 20 50: also score the sampler at the most steps "
                   "within N evaluations each (heun: 2 steps - 1; VP: steps + 1), same seed; JSON key nfe")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--batch", type=_count, default=256, help="samples per chunk; each chunk has its own seed, and "
                   "under torchrun the chunks are shared out over the processes (default: 256)")
    e.add_argument("--ref-n", type=_count, help="reference statistics over this many training images (default: all; "
                   "Inception on a CPU: ~6 img/s)")
    e.add_argument("--no-ema", action="store_true")
    e.add_argument("--no-clip", action="store_true")
    e.add_argument("--out", help="JSON file (default RUN/eval.json)")
    e.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    e.add_argument("--threads", type=_count, default=None)
    _add_guidance_args(e, sweep="; a comma-separated list sweeps it (metrics against W, and a plot)")
    e.set_defaults(func=_cmd_eval)

    c = sub.add_parser("convert", help="convert checkpoints from/to the official U-ViT/ScaleLong layout")
    c.add_argument("kind", choices=["uvit-official", "to-uvit-official"],
                   help="uvit-official: official nnet.pth -> steadydiff run dir; to-uvit-official: the reverse")
    c.add_argument("input", help="official .pth file (uvit-official) or steadydiff run/checkpoint dir")
    c.add_argument("--out", required=True, help="run directory (uvit-official) or .pth file (to-uvit-official)")
    c.add_argument("--num-heads", type=_count, help="attention heads (uvit-official; not stored in checkpoints)")
    c.add_argument("--skip-scaling", choices=["org", "inv_sqrt2", "cs"], default="org",
                   help="official scalelong 0/1/2 (LS variants are detected from the weights)")
    c.add_argument("--kappa", type=float, default=0.5)
    c.add_argument("--no-ema", action="store_true", help="to-uvit-official: export raw instead of EMA weights")
    c.set_defaults(func=_cmd_convert)

    x = sub.add_parser("export", help="export a run as a diffusers DDPMPipeline or a steadydiff model folder, with "
                       "a model card; optionally upload it to the Hugging Face Hub")
    x.add_argument("run", help="run directory (its latest checkpoint), a checkpoint directory, or a model folder")
    x.add_argument("--format", choices=EXPORT_FORMATS, default="diffusers",
                   help="diffusers: a DDPMPipeline folder, exact or refused (VP runs of the unet backbone with "
                   "model.norm_groups set and skip_scaling org); steadydiff: the self-describing model folder, any "
                   "run (default: diffusers)")
    x.add_argument("--out", required=True, help="folder to create (new or empty)")
    x.add_argument("--raw", action="store_true", help="export the raw weights instead of the EMA")
    x.add_argument("--samples", type=int, default=16, metavar="N",
                   help="samples in the model card's grid (0: none; default 16)")
    x.add_argument("--license", default="other", help="the model card's license (a Hub license id; default other)")
    x.add_argument("--push-to-hub", metavar="REPO_ID", help="upload the folder to this Hub model repo (needs "
                   'huggingface_hub: pip install "steadydiff[hub]")')
    x.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    x.set_defaults(func=_cmd_export)

    d = sub.add_parser("diagnose", help="stability statistics and plots of runs, or init-time checks")
    d.add_argument("runs", nargs="*", help="run directories to compare (overlaid in the plots)")
    d.add_argument("--at-init", metavar="CONFIG", help="init-time checks (theory fit, sensitivity) for a config")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override (with --at-init)")
    d.add_argument("--out", required=True, help="output directory")
    d.set_defaults(func=_cmd_diagnose)

    ph = sub.add_parser("phema", help="post-hoc EMA: reconstruct EMA weights of any length from snapshots")
    ph.add_argument("run", help="run directory trained with train.ema_sigma_rels")
    ph.add_argument("--sigma-rel", required=True, help="comma-separated relative EMA lengths, e.g. 0.03,0.05,0.1")
    ph.add_argument("--step", type=int, help="training step to reconstruct at (default: the last snapshot)")
    ph.add_argument("--out", required=True, help="directory for one sampleable run directory per sigma_rel")
    ph.set_defaults(func=_cmd_phema)

    ds = sub.add_parser("dataset", help="build, encode (VAE latents), describe or verify a dataset store")
    dsub = ds.add_subparsers(dest="action", required=True)
    db = dsub.add_parser("build", help="build a store from an image folder, .zip, .npz/.npy, fashion_mnist or hf:NAME")
    db.add_argument("src", help="image folder, .zip, .npz/.npy, fashion_mnist[:test], or hf:NAME[:SPLIT]")
    db.add_argument("--out", required=True, help="store directory to create (re-run to continue a killed build)")
    db.add_argument("--resolution", type=_count, help="resize + centre-crop to RxR (required for image files)")
    db.add_argument("--labels", action="store_true", help="keep class labels (sub-folders, or the labels array)")
    db.add_argument("--shard-size", type=_count, default=10_000, help="images per shard file (default 10000)")
    db.add_argument("--workers", type=int, default=None, help="decoding processes (default: min(8, CPUs); 0: none)")
    db.add_argument("--strict", action="store_true", help="stop at the first unreadable image instead of skipping")
    db.add_argument("--quiet", action="store_true")
    db.set_defaults(func=_cmd_dataset)
    de = dsub.add_parser("encode", help="encode an image store with a VAE into a latent store (latent diffusion)")
    de.add_argument("store", help="image store directory (from `steadydiff dataset build`)")
    de.add_argument("--vae", required=True, help="AutoencoderKL: a local folder (save_pretrained) or a hub id (online)")
    de.add_argument("--out", required=True, help="latent store directory to create (re-run to continue)")
    de.add_argument("--batch", type=_count, default=32, help="images per VAE call (default 32)")
    de.add_argument("--shard-size", type=_count, default=10_000, help="latents per shard file (default 10000)")
    de.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    de.add_argument("--quiet", action="store_true")
    de.set_defaults(func=_cmd_dataset)
    for name, what in (("info", "describe a store"), ("verify", "re-hash every file of a store")):
        dp = dsub.add_parser(name, help=what)
        dp.add_argument("store", help="store directory")
        dp.set_defaults(func=_cmd_dataset)

    cm = sub.add_parser("compare", help="run an experiment (arms x seeds) and judge its claims on paired seeds")
    cm.add_argument("experiment", help="experiment YAML, e.g. experiments/scalelong-unet.yaml")
    cm.add_argument("--out", required=True, help="output directory (re-run to resume; finished runs are kept)")
    cm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key in every run, e.g. --set train.steps=20000 on a GPU")
    cm.add_argument("--workers", type=_count, help="runs trained at once in separate processes (default: the file's; "
                    "--launcher local)")
    cm.add_argument("--report-only", action="store_true",
                    help="only analyse the finished runs (or, when they are gone, re-judge OUT/results.json)")
    cm.add_argument("--calibrate", action="store_true",
                    help="measure the metric's noise on the finished runs first (the experiment's calibrate: block)")
    cm.add_argument("--quiet", action="store_true")
    _add_launch_args(cm)
    cm.set_defaults(func=_cmd_compare)

    lr_kinds = ", ".join(k for k, kind in CLAIM_KINDS.items() if kind.lr_range)
    lr = sub.add_parser("lr-range", help="train every arm x LR x seed of an experiment's lr_range: grid; max stable "
                        f"and best LR per seed, LR sensitivity, and its claims ({lr_kinds})")
    lr.add_argument("experiment", help="experiment YAML with an lr_range: {lrs: [...], rule: {...}} block")
    lr.add_argument("--out", required=True, help="output directory (re-run to resume; finished runs are kept)")
    lr.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key in every run (not train.lr: the grid sets it)")
    lr.add_argument("--workers", type=_count, help="runs trained at once in separate processes (default: the file's; "
                    "--launcher local)")
    lr.add_argument("--report-only", action="store_true", help="only judge the finished runs again; train nothing")
    lr.add_argument("--quiet", action="store_true")
    _add_launch_args(lr)
    lr.set_defaults(func=_cmd_lr_range)
    return p


def _cmd_dataset(args: argparse.Namespace) -> int:
    from .data import build_store, store_info, verify_store

    if args.action == "build":
        if args.workers is not None and args.workers < 0:
            raise ConfigError(f"--workers must be >= 0, got {args.workers}")
        meta = build_store(args.src, args.out, args.resolution, args.labels, args.shard_size, args.workers,
                           args.strict, progress=not args.quiet)
        skipped = f"; skipped {meta['skipped']} unreadable image(s)" if meta["skipped"] else ""
        print(f"built {args.out}: {meta['count']} images{skipped}")
        print(store_info(args.out))
    elif args.action == "encode":
        from .data.encode import encode_store
        from .data.store import INDEX
        from .nn.vae import load_vae
        from .utils.device import pick_device

        out = Path(args.out)
        if (out / INDEX).exists():  # before loading a VAE: nothing to do, and nothing may change
            raise ConfigError(f"{out} is already a complete store; choose another --out, or delete it to re-encode")
        codec = load_vae(args.vae, pick_device(args.device))
        meta = encode_store(args.store, out, codec.encode, codec.identity, batch=args.batch,
                            shard_size=args.shard_size, progress=not args.quiet)
        print(f"encoded {args.store} -> {out}: {meta['count']} latents of {'x'.join(map(str, meta['shape']))}")
        print(store_info(out))
    elif args.action == "info":
        print(store_info(args.store))
    else:
        res = verify_store(args.store, progress=True)
        print(f"{args.store}: {res['files']} files verified, {res['count']} images")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .train import EXIT_PREEMPTED, NonFiniteLossError, TrainingInterrupted

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # usage errors (already printed as one line) and --help: return, do not exit
        return e.code if isinstance(e.code, int) else EXIT_USER_ERROR
    args.argv = argv
    try:
        return args.func(args)
    except NonFiniteLossError as e:
        print(f"steadydiff: error: {_rank_tag()}{e}", file=sys.stderr)
        return EXIT_NONFINITE
    except TrainingInterrupted as e:  # a stop signal: not an error, and the run continues when re-run
        print(f"steadydiff: {_rank_tag()}{e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except (SteadydiffError, OSError) as e:
        if os.environ.get("STEADYDIFF_DEBUG"):  # full traceback for bug reports
            raise
        text = os_error_text(e) if isinstance(e, OSError) else str(e)
        print(f"steadydiff: error: {_rank_tag()}{' '.join(text.split())}", file=sys.stderr)
        return EXIT_USER_ERROR


def _rank_tag() -> str:
    """'[rank 3] ' for ranks other than 0 under torchrun (the same error from every rank is then told apart)."""
    rank = os.environ.get("RANK", "0")
    return "" if rank == "0" or os.environ.get("WORLD_SIZE", "1") == "1" else f"[rank {rank}] "


if __name__ == "__main__":
    sys.exit(main())
