"""Distributed faults: SIGKILL a random rank of a 2-process `torchrun` training run, again and again.

`torchrun --max-restarts=K` restarts the whole group after each kill; the new group resumes from the last
checkpoint. Each kill is aimed after a new checkpoint has landed (so every restart has progress to keep) and
lands on rank 0 or 1 at random (seeded). At the end the run is compared with an uninterrupted 1-process run
of the same config: every step logged once, losses within 1e-5 relative (the 2-process gradient sum runs in
another order), final weights within 1e-5.

    PYTHONPATH=src python benchmarks/dist_soak.py [--kills 5] [--steps 40] [--seed 0]

Writes benchmarks/results/dist_soak.json and prints a summary.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TOY = ["data.name=toy2d", "data.toy_size=2000", "model.backbone=mlp_unet", "model.hidden=32", "model.depth=4",
       "train.batch_size=64", "train.lr=2e-3", "train.warmup_steps=2", "train.log_every=1", "train.ckpt_every=4",
       "train.keep_ckpts=3", "train.sample_n=64", "train.sample_steps=5", "train.threads=1", "train.ema_decay=0.9"]


def workers_of(run: Path) -> dict[int, int]:
    """{rank: pid} of the live training processes of `run`, read from /proc (their env and command line)."""
    found = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in (p / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if str(run).encode() in cmd and b"RANK" in env and b"LOCAL_WORLD_SIZE" in env:
            found[int(env[b"RANK"])] = int(p.name)
    return found


def latest_step(run: Path) -> int:
    ptr = run / "checkpoints" / "latest"
    try:
        return int(ptr.read_text().strip().split("-")[1])
    except (OSError, IndexError, ValueError):
        return -1


def losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def soak(kills: int, steps: int, seed: int, workdir: Path) -> dict:
    from steadydiff.config import load_config
    from steadydiff.runs import latest_checkpoint, read_checkpoint
    from steadydiff.train import Trainer

    rng = random.Random(seed)
    sets = TOY + [f"train.steps={steps}", f"train.seed={seed}"]
    ref = workdir / "uninterrupted"
    Trainer(load_config(None, sets), ref, show_progress=False).fit()

    run = workdir / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEADYDIFF_TEST_CKPT_WRITE_DELAY": "0.2",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={kills}", "-m", "steadydiff.cli", "train", "--out", str(run), "--quiet",
           *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events, last_kill_ckpt = [], -1
    while proc.poll() is None and len(events) < kills:
        step = latest_step(run)
        if step > last_kill_ckpt and step < steps:
            pids = workers_of(run)
            if len(pids) == 2:
                time.sleep(rng.uniform(0.0, 0.3))  # somewhere in the steps after that checkpoint
                rank = rng.randrange(2)
                pids = workers_of(run)
                if rank in pids:
                    os.kill(pids[rank], signal.SIGKILL)
                    events.append({"rank": rank, "after_checkpoint": step, "t": round(time.perf_counter() - t0, 2)})
                    last_kill_ckpt = step
        time.sleep(0.02)
    out, err = proc.communicate(timeout=600)
    wall = time.perf_counter() - t0
    a, b = losses(run), losses(ref)
    la, lb = dict(a), dict(b)
    ck_a = read_checkpoint(latest_checkpoint(run / "checkpoints"))
    ck_b = read_checkpoint(latest_checkpoint(ref / "checkpoints"))
    max_w = max(float((ck_a.model[k] - ck_b.model[k]).abs().max()) for k in ck_b.model)
    max_rel_loss = max(abs(la[k] - lb[k]) / abs(lb[k]) for k in lb if k in la)
    return {
        "kills": len(events), "events": events, "restarts_seen": err.count("closing signal SIGTERM"),
        "exit_code": proc.returncode, "resumes_printed": out.count("resuming"),
        "steps_logged_once": [s for s, _ in a] == list(range(1, steps + 1)),
        "final_step": ck_a.step, "max_rel_loss_diff": max_rel_loss, "max_abs_weight_diff": max_w,
        "exact_within_tolerance": ck_a.step == steps and max_rel_loss <= 1e-5 and max_w <= 1e-5,
        "wall_s": round(wall, 1), "stderr_tail": err[-1500:] if proc.returncode else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        res = soak(args.kills, args.steps, args.seed, Path(tmp))
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    res.update(command=f"PYTHONPATH=src python benchmarks/dist_soak.py --kills {args.kills} --steps {args.steps} "
                       f"--seed {args.seed}", date=now, torch=torch.__version__, cpus=os.cpu_count())
    out = ROOT / "benchmarks" / "results" / "dist_soak.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "events"}, indent=1))


if __name__ == "__main__":
    main()
