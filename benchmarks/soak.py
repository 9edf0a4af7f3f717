"""Crash-resume soak: SIGKILL `steadydiff train` at random moments, re-run it until done, compare with a run
that was never interrupted.

The same `steadydiff train` command (tiny toy2d MLP-UNet, 1 thread, a checkpoint every few steps, post-hoc
EMA snapshots, a log record every 3 steps so records straddle checkpoints) runs as a subprocess and is killed
with SIGKILL at moments drawn from a seeded RNG, in three kinds:

- `startup`: a uniform time after launch (import, config check, resume, metrics truncation, first steps);
- `step`:    once metrics.jsonl shows a drawn training step, plus a few random milliseconds;
- `ckpt`:    while a checkpoint is being written (a `.tmp-step-*` directory exists), plus a random delay.
             The hidden test hook STEADYDIFF_TEST_CKPT_WRITE_DELAY pauses after each checkpoint file so the
             write lasts long enough to be hit; the delay does not change what is written.

After every kill the run directory is checked: each `step-*` checkpoint directory loads (safetensors +
weights_only state), `latest` names a loadable one, and the resume point never moves backwards (no completed
checkpoint lost). Then the command is started again, and so on until it exits 0. Finally the killed run is
compared with an uninterrupted run of the same command: model and EMA weights, optimiser state, post-hoc EMA
snapshots, and every metrics.jsonl record (each step logged exactly once; all values but the wall-clock
timings images_per_sec, mfu and peak_flops equal).

    PYTHONPATH=src python benchmarks/soak.py [--kills 24] [--steps 120] [--seed 0]

Writes benchmarks/results/soak.json and soak.md (command, machine, date). tests/test_reliability.py reuses
`soak()` with 3 kills.

Stop signals (`signal_soak`): the same command gets SIGTERM instead, at the same kinds of moments, and must end at
the step boundary with that step's checkpoint (exit 75, `train/preemption.py`): steps lost per signal = the last
step logged before it minus the step the re-run resumes from (0 expected). With `--torchrun-signals` the command
runs under `torchrun --standalone --nproc_per_node=2` and each SIGTERM goes to rank 0, rank 1 or the whole process
group, in turn; the ranks agree on the stop by one all-reduce. The run is compared with one never stopped.

    PYTHONPATH=src python benchmarks/soak.py --signals 12 --torchrun-signals 6 [--steps 120] [--seed 0]

writes benchmarks/results/soak_signal.json and soak_signal.md; tests/test_reliability.py reuses `signal_soak()`
with one signal (inside a checkpoint write).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SRC = ROOT.parent / "src"
sys.path.insert(0, str(ROOT))
from dist_soak import workers_of  # noqa: E402  (a sibling script: the torchrun workers of a run, from /proc)

DELAY_ENV = "STEADYDIFF_TEST_CKPT_WRITE_DELAY"
KINDS = ("startup", "step", "ckpt")

# Keys that legitimately differ between two runs of the same command (wall-clock throughput).
VOLATILE = {"images_per_sec", "mfu", "peak_flops"}  # wall-clock measurements


def train_sets(steps: int, ckpt_every: int, log_every: int = 3) -> list[str]:
    return ["data.name=toy2d", "data.toy_size=1000", "model.backbone=mlp_unet", "model.hidden=32", "model.depth=4",
            "model.skip_scaling=cs", "train.batch_size=64", "train.lr=2e-3", "train.warmup_steps=5",
            f"train.steps={steps}", f"train.ckpt_every={ckpt_every}", f"train.log_every={log_every}",
            "train.keep_ckpts=3", "train.ema_sigma_rels=[0.05,0.1]", "train.sample_n=64", "train.sample_steps=4",
            "train.threads=1", "train.seed=7"]


def train_argv(out: Path, steps: int, ckpt_every: int, log_every: int = 3, nproc: int = 1) -> list[str]:
    """The `steadydiff train` command; `nproc` 2: under `torchrun --standalone` with 2 ranks."""
    launch = [sys.executable, "-m", "steadydiff.cli"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
        "steadydiff.cli"]
    return [*launch, "train", "--out", str(out), "--quiet",
            *[a for s in train_sets(steps, ckpt_every, log_every) for a in ("--set", s)]]


def _env(delay: float) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    if delay:
        env[DELAY_ENV] = str(delay)
    else:
        env.pop(DELAY_ENV, None)
    return env


def last_logged_step(run: Path) -> int:
    """Highest step in metrics.jsonl (0 if none); a torn last line is ignored."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    best = 0
    for line in path.read_text().splitlines():
        try:
            best = max(best, int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError):
            pass
    return best


def check_run_dir(run: Path) -> dict:
    """What a kill left behind: every `step-*` checkpoint must load; `latest` must name a loadable one."""
    from steadydiff.runs import latest_checkpoint, read_checkpoint

    ckdir = run / "checkpoints"
    dirs = sorted(p for p in ckdir.glob("step-*") if p.is_dir()) if ckdir.is_dir() else []
    bad = []
    for d in dirs:
        try:
            read_checkpoint(d)
        except Exception as e:  # noqa: BLE001 - any failure to load is what we count
            bad.append(f"{d.name}: {type(e).__name__}: {e}")
    latest = latest_checkpoint(ckdir)
    pointer = ckdir / "latest"
    return {
        "checkpoints": [d.name for d in dirs],
        "unloadable": bad,
        "resume_step": int(latest.name.split("-")[1]) if latest is not None else 0,
        "latest_ok": latest is None or latest.name not in {b.split(":")[0] for b in bad},
        "pointer_dangling": pointer.exists() and not (ckdir / pointer.read_text().strip()).is_dir(),
        "hidden_leftovers": sorted(p.name for p in ckdir.glob(".*")) if ckdir.is_dir() else [],
        "metrics_torn_tail": _torn_tail(run / "metrics.jsonl"),
    }


def _torn_tail(path: Path) -> bool:
    if not path.exists() or path.stat().st_size == 0:
        return False
    text = path.read_text()
    if not text.endswith("\n"):
        return True
    try:
        json.loads(text.splitlines()[-1])
        return False
    except ValueError:
        return True


def _wait_for(predicate, proc: subprocess.Popen, timeout: float, poll: float = 0.002) -> bool:
    """Poll until predicate() or the process exits or timeout; True if predicate() held."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def _kill_once(cmd, env, run: Path, kind: str, rng: random.Random, ckpt_every: int, delay: float, log) -> dict:
    """Start the command, kill it at a moment of the given kind; returns what happened."""
    resume = check_run_dir(run)["resume_step"]
    metrics, ckdir = run / "metrics.jsonl", run / "checkpoints"
    t0, launched_ns = time.monotonic(), time.time_ns()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)

    def fresh_step() -> int:  # ignore what the previous attempt logged past its checkpoint until truncated
        fresh = metrics.exists() and metrics.stat().st_mtime_ns > launched_ns
        return last_logged_step(run) if fresh else 0

    def writing() -> bool:  # this process's checkpoint write (killed writes leave stale `.tmp-step-*` dirs)
        return ckdir.is_dir() and any(ckdir.glob(f".tmp-step-*-{proc.pid}"))

    try:
        if kind == "startup":
            time.sleep(rng.uniform(0.2, 2.5))
        elif kind == "step":
            target = resume + rng.randint(1, 2 * ckpt_every)
            _wait_for(lambda: fresh_step() >= target, proc, timeout=120)
            time.sleep(rng.uniform(0.0, 0.03))
        else:
            _wait_for(writing, proc, timeout=120)
            time.sleep(rng.uniform(0.0, 5 * delay))  # anywhere in the 3 files, the rename, `latest`, pruning
        in_write = writing()
        killed = proc.poll() is None
        if killed:
            proc.kill()  # SIGKILL: no cleanup handlers run
    finally:
        proc.wait()
    return {"kind": kind, "killed": killed, "exit_code": proc.returncode, "seconds": round(time.monotonic() - t0, 3),
            "resume_step_before": resume, "logged_step_at_kill": last_logged_step(run),
            "inside_checkpoint_write": in_write}


def _records(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def compare_runs(a: Path, b: Path) -> dict:
    """Final weights, EMA, optimiser state, post-hoc EMA snapshots and metrics of two runs."""
    import torch
    from safetensors.torch import load_file

    from steadydiff.runs import latest_checkpoint, read_checkpoint

    ca = read_checkpoint(latest_checkpoint(a / "checkpoints"))
    cb = read_checkpoint(latest_checkpoint(b / "checkpoints"))
    max_diff, bit_equal = 0.0, True
    for name, sa, sb in (("model", ca.model, cb.model), ("ema", ca.ema, cb.ema)):
        assert sa.keys() == sb.keys(), name
        for k in sa:
            bit_equal &= torch.equal(sa[k], sb[k])
            max_diff = max(max_diff, float((sa[k].double() - sb[k].double()).abs().max()))
    opt_a, opt_b = ca.state["optimizer"]["state"], cb.state["optimizer"]["state"]
    opt_equal = opt_a.keys() == opt_b.keys() and all(
        torch.equal(opt_a[i][n], opt_b[i][n]) for i in opt_a for n in opt_a[i])
    snaps_a = sorted(p.name for p in (a / "phema").glob("phema-*.safetensors"))
    snaps_b = sorted(p.name for p in (b / "phema").glob("phema-*.safetensors"))
    snaps_equal = snaps_a == snaps_b and all(
        all(torch.equal(x[k], y[k]) for k in x)
        for x, y in ((load_file(str(a / "phema" / n)), load_file(str(b / "phema" / n))) for n in snaps_a))
    ra, rb = _records(a), _records(b)

    def key(r):  # a record is identified by its step and kind (training record vs monitor record)
        return (r["step"], "loss" in r)

    dup_a = len(ra) - len({key(r) for r in ra})
    dup_b = len(rb) - len({key(r) for r in rb})
    strip = [{k: v for k, v in r.items() if k not in VOLATILE} for r in ra]
    strip_b = [{k: v for k, v in r.items() if k not in VOLATILE} for r in rb]
    loss_steps = [r["step"] for r in ra if "loss" in r]
    return {
        "weights_bit_equal": bool(bit_equal), "weights_max_abs_diff": max_diff,
        "optimizer_state_equal": bool(opt_equal), "phema_snapshots": len(snaps_a),
        "phema_snapshots_equal": bool(snaps_equal), "final_step": ca.step,
        "metrics_records": len(ra), "metrics_equal": strip == strip_b, "duplicate_records": dup_a,
        "duplicate_records_reference": dup_b, "loss_records": len(loss_steps),
        "loss_steps_once": loss_steps == sorted(set(loss_steps)),
    }


def soak(workdir: Path, kills: int, steps: int, ckpt_every: int, seed: int, delay: float = 0.05,
         kinds: list[str] | None = None) -> dict:
    """Kill `kills` times (kinds drawn from the seeded RNG unless given in order), finish, compare."""
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    ref, run = workdir / "reference", workdir / "killed"
    for d in (ref, run):
        shutil.rmtree(d, ignore_errors=True)
    log = open(workdir / "stderr.log", "w")  # noqa: SIM115 - shared by all subprocesses
    t0 = time.monotonic()
    ref_proc = subprocess.run(train_argv(ref, steps, ckpt_every), env=_env(0), stdout=subprocess.DEVNULL,
                              stderr=log)
    ref_seconds = time.monotonic() - t0
    if ref_proc.returncode != 0:
        raise RuntimeError(f"reference run failed ({ref_proc.returncode}); see {workdir / 'stderr.log'}")
    cmd, env = train_argv(run, steps, ckpt_every), _env(delay)
    events, resume_prev, lost = [], 0, 0
    t0 = time.monotonic()
    while len([e for e in events if e["killed"]]) < kills:
        kind = kinds[len(events) % len(kinds)] if kinds else rng.choice(KINDS)
        ev = _kill_once(cmd, env, run, kind, rng, ckpt_every, delay, log)
        ev.update(check_run_dir(run))
        lost += ev["resume_step"] < resume_prev  # a completed checkpoint vanished: data lost
        resume_prev = max(resume_prev, ev["resume_step"])
        events.append(ev)
        if not ev["killed"]:
            if ev["exit_code"] != 0:
                raise RuntimeError(f"training exited {ev['exit_code']}; see {workdir / 'stderr.log'}")
            break  # it finished before the kill moment
    if events[-1]["killed"]:  # resume once more, uninterrupted, to the end
        final = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        if final.returncode != 0:
            raise RuntimeError(f"resume after the last kill exited {final.returncode}; see {workdir / 'stderr.log'}")
    killed_seconds = time.monotonic() - t0
    log.close()
    killed = [e for e in events if e["killed"]]
    cmp_ = compare_runs(run, ref)
    return {
        "kills": len(killed),
        "kills_by_kind": {k: sum(e["kind"] == k for e in killed) for k in KINDS},
        "kills_inside_checkpoint_write": sum(e["inside_checkpoint_write"] for e in killed),
        "launches": len(events) + (1 if events[-1]["killed"] else 0),
        "unloadable_checkpoint_dirs_after_kills": sum(len(e["unloadable"]) for e in events),
        "checkpoint_dirs_checked": sum(len(e["checkpoints"]) for e in events),
        "dangling_latest_after_kills": sum(e["pointer_dangling"] for e in events),
        "torn_metrics_tail_after_kills": sum(e["metrics_torn_tail"] for e in events),
        "completed_checkpoints_lost": lost,
        "resume_exact": bool(cmp_["weights_bit_equal"] and cmp_["optimizer_state_equal"] and cmp_["metrics_equal"]
                             and cmp_["phema_snapshots_equal"] and cmp_["loss_steps_once"]
                             and cmp_["duplicate_records"] == 0),
        "compare": cmp_,
        "reference_seconds": round(ref_seconds, 1), "killed_run_seconds": round(killed_seconds, 1),
        "steps": steps, "ckpt_every": ckpt_every, "seed": seed, "ckpt_write_delay_s": delay,
        "train_command": "python " + " ".join(train_argv(Path("RUN"), steps, ckpt_every)[1:]),
        "events": events,
    }


# ---------------------------------------------------------------------------------------------------------
# Stop signals: SIGTERM at random moments; the trainer ends at the step boundary with that step's checkpoint

MOMENTS = ("startup", "step", "ckpt")  # single process; under torchrun, step and ckpt (see `signal_soak`)
TARGETS = ("rank0", "rank1", "group")  # torchrun: one rank, or the whole process group as Slurm signals a step


def _signal_once(cmd, env, run: Path, moment: str, rng: random.Random, ckpt_every: int, delay: float, err: Path,
                 nproc: int = 1, target: str = "process") -> dict:
    """Start the command, send SIGTERM at a moment of the given kind, wait for it to end; what happened."""
    resume = check_run_dir(run)["resume_step"]
    metrics, ckdir = run / "metrics.jsonl", run / "checkpoints"
    t0, launched_ns = time.monotonic(), time.time_ns()
    with open(err, "w") as errf:
        # Its own session: `group` signals the launcher and every rank, as a scheduler signals a job step.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errf, start_new_session=True)

    def fresh_step() -> int:  # what this attempt logged (lines past an older checkpoint are cut on resume)
        fresh = metrics.exists() and metrics.stat().st_mtime_ns > launched_ns
        return last_logged_step(run) if fresh else 0

    def writing() -> bool:  # a checkpoint write of this attempt (the temporary directory, before its rename)
        return ckdir.is_dir() and any(p.stat().st_mtime_ns > launched_ns for p in ckdir.glob(".tmp-step-*"))

    sent, hung = False, False
    try:
        if moment == "startup":
            time.sleep(rng.uniform(0.2, 2.5))
        elif moment == "step":
            goal = resume + rng.randint(1, 2 * ckpt_every)
            _wait_for(lambda: fresh_step() >= goal, proc, timeout=300)
            time.sleep(rng.uniform(0.0, 0.03))
        else:
            _wait_for(writing, proc, timeout=300)
            time.sleep(rng.uniform(0.0, 2 * delay))
        in_write = writing()
        logged = max(fresh_step(), resume)  # the last step known done when the signal leaves
        if proc.poll() is None:
            if target == "group":
                os.killpg(proc.pid, signal.SIGTERM)
            elif target.startswith("rank"):
                pids = workers_of(run)
                if int(target[4:]) in pids:
                    os.kill(pids[int(target[4:])], signal.SIGTERM)
                else:  # not started yet, or gone: the launcher forwards it
                    proc.send_signal(signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            sent = True
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = err.read_text(errors="replace")
    after = check_run_dir(run)
    return {"moment": moment, "target": target, "signalled": sent, "exit_code": proc.returncode,
            "rank_exit_codes": [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", text)] if nproc > 1 else [],
            "stopped_at_boundary": "stopped by SIG" in text or "a stop signal on another rank" in text,
            "seconds": round(time.monotonic() - t0, 3), "resume_step_before": resume, "logged_step_at_signal": logged,
            "inside_checkpoint_write": in_write, "resume_step": after["resume_step"],
            "steps_lost": max(0, logged - after["resume_step"]), "steps_kept_past_log": after["resume_step"] - logged,
            "unloadable": after["unloadable"], "hung": hung}


def signal_soak(workdir: Path, signals: int, steps: int, ckpt_every: int, seed: int, delay: float = 0.05,
                nproc: int = 1, moments: list[str] | None = None, targets: list[str] | None = None) -> dict:
    """SIGTERM `signals` times at seeded random moments (given in order, else drawn), re-running the command after
    each, then finish it and compare with a run never stopped. `nproc` 2: `torchrun` with 2 ranks, the signals
    to rank 0, rank 1 and the whole group in turn (or to `targets`); moments step and ckpt only (a rank signalled
    while starting, before the trainer's handler exists, dies at once as under SIGKILL). log_every 1, so the last
    step logged before a signal is the step before the one in flight: steps lost = that step minus the step the run
    resumes from, if positive (0 expected), and steps kept = the converse (>= 1: the step in flight was finished)."""
    rng = random.Random(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    ref, run = workdir / f"reference-{nproc}", workdir / f"signalled-{nproc}"
    for d in (ref, run):
        shutil.rmtree(d, ignore_errors=True)
    env = _env(0)
    env.pop("WORLD_SIZE", None)
    with open(workdir / "reference.err", "w") as errf:
        if subprocess.run(train_argv(ref, steps, ckpt_every, 1, nproc), env=env, stdout=subprocess.DEVNULL,
                          stderr=errf).returncode != 0:
            raise RuntimeError(f"reference run failed; see {workdir / 'reference.err'}")
    cmd, env = train_argv(run, steps, ckpt_every, 1, nproc), dict(_env(delay))
    env.pop("WORLD_SIZE", None)
    choices = moments or (list(MOMENTS) if nproc == 1 else ["step", "ckpt"])
    events: list[dict] = []
    while sum(e["signalled"] for e in events) < signals:
        i = len(events)
        moment = moments[i % len(moments)] if moments else rng.choice(choices)
        # Under torchrun every target in turn (rank 0, rank 1, the group), so that each is covered.
        target = "process" if nproc == 1 else (targets or TARGETS)[i % len(targets or TARGETS)]
        ev = _signal_once(cmd, env, run, moment, rng, ckpt_every, delay, workdir / f"attempt-{i}.err", nproc, target)
        events.append(ev)
        if not ev["signalled"]:
            if ev["exit_code"] != 0:
                raise RuntimeError(f"training exited {ev['exit_code']}; see {workdir / f'attempt-{i}.err'}")
            break  # it finished before the signal's moment
    if events[-1]["signalled"]:
        with open(workdir / "final.err", "w") as errf:
            if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=errf).returncode != 0:
                raise RuntimeError(f"resume after the last signal failed; see {workdir / 'final.err'}")
    sent = [e for e in events if e["signalled"]]
    cmp_ = compare_runs(run, ref)
    handled = [e for e in sent if e["stopped_at_boundary"]]
    finished = [e for e in sent if not e["stopped_at_boundary"] and e["exit_code"] == 0]  # came in the last save
    return {
        "processes": nproc, "signals": len(sent),
        "signals_by_moment": {m: sum(e["moment"] == m for e in sent) for m in MOMENTS},
        "signals_by_target": {t: sum(e["target"] == t for e in sent) for t in ({e["target"] for e in sent})},
        "stopped_at_a_step_boundary": len(handled),
        "exit_75": sum(e["exit_code"] == 75 or 75 in e["rank_exit_codes"] for e in sent),
        "finished_anyway": len(finished), "died_before_the_handler": len(sent) - len(handled) - len(finished),
        "inside_checkpoint_write": sum(e["inside_checkpoint_write"] for e in sent),
        "steps_lost_per_signal": [e["steps_lost"] for e in sent],
        "steps_lost_max": max([e["steps_lost"] for e in sent], default=0),
        "steps_kept_past_the_log": [e["steps_kept_past_log"] for e in handled],
        "unloadable_checkpoints": sum(len(e["unloadable"]) for e in events), "hung": sum(e["hung"] for e in events),
        "resume_exact": bool(cmp_["weights_bit_equal"] and cmp_["optimizer_state_equal"] and cmp_["metrics_equal"]
                             and cmp_["phema_snapshots_equal"] and cmp_["loss_steps_once"]
                             and cmp_["duplicate_records"] == 0),
        "compare": cmp_, "steps": steps, "ckpt_every": ckpt_every, "seed": seed, "ckpt_write_delay_s": delay,
        "train_command": " ".join(["python", *train_argv(Path("RUN"), steps, ckpt_every, 1, nproc)[1:]]),
        "events": events,
    }


def _machine() -> str:
    import platform

    import torch

    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, {os.cpu_count()} cpus, {platform.system()} {platform.release()}, torch {torch.__version__}"


def write_results(res: dict, command: str) -> tuple[Path, Path]:
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    res = {"command": command, "machine": _machine(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **res}
    (out / "soak.json").write_text(json.dumps(res, indent=2) + "\n")
    c = res["compare"]
    rows = "\n".join(
        f"| {i + 1} | {e['kind']} | {'yes' if e['killed'] else 'no (finished)'} | {e['seconds']} | "
        f"{e['resume_step_before']} | {e['logged_step_at_kill']} | {'yes' if e['inside_checkpoint_write'] else ''} | "
        f"{e['resume_step']} | {len(e['checkpoints'])} | {len(e['unloadable'])} | "
        f"{'yes' if e['metrics_torn_tail'] else ''} |"
        for i, e in enumerate(res["events"]))
    md = f"""# Crash-resume soak

- command: `{command}`
- date: {res['date']}
- machine: {res['machine']}
- run: `{res['train_command']}`, SIGKILL at seeded random moments (seed {res['seed']}),
  checkpoint write delay hook {res['ckpt_write_delay_s']} s per file; re-run the same command after each kill

| figure | value |
|---|---|
| runs killed (SIGKILL) | {res['kills']} ({', '.join(f'{k}: {v}' for k, v in res['kills_by_kind'].items())}) |
| kills that landed inside a checkpoint write | {res['kills_inside_checkpoint_write']} |
| checkpoint directories checked after kills / unloadable | {res['checkpoint_dirs_checked']} / \
{res['unloadable_checkpoint_dirs_after_kills']} |
| `latest` dangling after a kill | {res['dangling_latest_after_kills']} |
| kills that left a torn metrics.jsonl line (repaired on resume) | {res['torn_metrics_tail_after_kills']} |
| completed checkpoints lost | {res['completed_checkpoints_lost']} |
| final weights + EMA bit-equal to the uninterrupted run | {c['weights_bit_equal']} (max abs diff \
{c['weights_max_abs_diff']:.1e}) |
| optimiser state equal | {c['optimizer_state_equal']} |
| post-hoc EMA snapshots equal | {c['phema_snapshots_equal']} ({c['phema_snapshots']} files) |
| metrics.jsonl records equal (all keys but the timings) | {c['metrics_equal']} ({c['metrics_records']} records, \
{c['duplicate_records']} duplicates) |
| resume exact (all of the above) | {res['resume_exact']} |
| wall time: uninterrupted / killed run | {res['reference_seconds']} s / {res['killed_run_seconds']} s |

Per attempt (resume step = the checkpoint the next attempt resumes from):

| # | kind | killed | s | resumed from | logged step at kill | in ckpt write | resume step after | ckpt dirs | \
unloadable | torn metrics tail |
|---|---|---|---|---|---|---|---|---|---|---|
{rows}
"""
    (out / "soak.md").write_text(md)
    return out / "soak.json", out / "soak.md"


NOTE_RANK_EXITS = ("exit: torchrun's status (1 when a worker exits non-zero); rank exits: the statuses its failure "
                   "report lists (75: stopped with the step's checkpoint; -15: a rank still exiting after that "
                   "checkpoint, ended by torchrun's SIGTERM to the group); none listed when torchrun itself got the "
                   "signal.\n\n")


TABLE_HEAD = "| # | moment | target | exit | rank exits | logged at signal | resumes from | lost | in ckpt write | s |"


def write_signal_results(parts: list[dict], command: str) -> tuple[Path, Path]:
    """benchmarks/results/soak_signal.json and .md: the SIGTERM soaks (single process, torchrun 2 ranks)."""
    out = ROOT / "results"
    out.mkdir(exist_ok=True)
    res = {"command": command, "machine": _machine(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "soaks": parts}
    (out / "soak_signal.json").write_text(json.dumps(res, indent=2) + "\n")
    md = [f"""# Stop-signal soak: SIGTERM at random moments

- command: `{command}`
- date: {res['date']}
- machine: {res['machine']}
- what: `steadydiff train` (log_every 1, a checkpoint every few steps) gets SIGTERM at seeded random moments and
  is re-run after each; the trainer's handler (`train.stop_signals`, `train/preemption.py`) lets the step in flight
  finish, saves that step's checkpoint and exits 75. Steps lost per signal = the last step logged before the
  signal minus the step the re-run resumes from, when positive (0 expected; the step in flight is not lost
  either: it is finished and saved). Under torchrun (2 ranks, gloo) the signal goes to rank 0, rank 1 or the whole
  process group (launcher and ranks, as a scheduler signals a job step); the ranks agree by one all-reduce.
  Finally the run is compared with one of the same command that was never stopped.
"""]
    for r in parts:
        c = r["compare"]
        kept = r["steps_kept_past_the_log"]
        sent = "moments: " + ", ".join(f"{k} {v}" for k, v in r["signals_by_moment"].items() if v)
        if r["processes"] > 1:
            sent += "; targets: " + ", ".join(f"{k} {v}" for k, v in sorted(r["signals_by_target"].items()))
        md.append(f"""
## {'Single process' if r['processes'] == 1 else f"torchrun, {r['processes']} ranks"}

- run: `{r['train_command']}`; seed {r['seed']}, checkpoint write delay hook {r['ckpt_write_delay_s']} s per file

| figure | value |
|---|---|
| SIGTERMs sent | {r['signals']} ({sent}) |
| stopped at a step boundary with that step's checkpoint (exit 75) | {r['stopped_at_a_step_boundary']} \
(exit 75 seen: {r['exit_75']}) |
| came during the last step's save: the run finished (exit 0) | {r['finished_anyway']} |
| ended before the trainer's handler existed (start-up: default action, nothing trained yet) | \
{r['died_before_the_handler']} |
| signals that landed inside a checkpoint write | {r['inside_checkpoint_write']} |
| **steps lost per signal** | {', '.join(map(str, r['steps_lost_per_signal']))} (max **{r['steps_lost_max']}**) |
| steps saved past the last logged one (the step in flight, finished) | {', '.join(map(str, kept))} |
| unloadable checkpoints after a signal / attempts that hung | {r['unloadable_checkpoints']} / {r['hung']} |
| final weights + EMA bit-equal to the run never stopped | {c['weights_bit_equal']} (max abs diff \
{c['weights_max_abs_diff']:.1e}) |
| optimiser state, post-hoc EMA snapshots, metrics.jsonl (all but timings) equal | {c['optimizer_state_equal']}, \
{c['phema_snapshots_equal']}, {c['metrics_equal']} ({c['metrics_records']} records, {c['duplicate_records']} \
duplicates) |
| resume exact (all of the above) | {r['resume_exact']} |

{"" if r["processes"] == 1 else NOTE_RANK_EXITS}{TABLE_HEAD}
|---|---|---|---|---|---|---|---|---|---|
""" + "\n".join(f"| {i + 1} | {e['moment']} | {e['target']} | {e['exit_code']} | "
                f"{' '.join(map(str, e['rank_exit_codes']))} | {e['logged_step_at_signal']} | {e['resume_step']} | "
                f"{e['steps_lost']} | {'yes' if e['inside_checkpoint_write'] else ''} | {e['seconds']} |"
                for i, e in enumerate(r["events"])) + "\n")
    (out / "soak_signal.md").write_text("".join(md))
    return out / "soak_signal.json", out / "soak_signal.md"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=24)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.05, help="checkpoint write delay per file (test hook), s")
    p.add_argument("--workdir", help="keep the run directories here (default: a temporary directory)")
    p.add_argument("--signals", type=int, default=0, help="SIGTERM soak instead: this many signals, one process")
    p.add_argument("--torchrun-signals", type=int, default=0,
                   help="SIGTERM soak under torchrun with 2 ranks: this many signals (--torchrun-steps steps)")
    p.add_argument("--torchrun-steps", type=int, default=60)
    args = p.parse_args()
    sys.path.insert(0, str(SRC))
    command = ("PYTHONPATH=src python benchmarks/soak.py " + " ".join(sys.argv[1:])).strip()
    if args.signals or args.torchrun_signals:
        parts = []
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(args.workdir) if args.workdir else Path(tmp)
            if args.signals:
                parts.append(signal_soak(work / "single", args.signals, args.steps, args.ckpt_every, args.seed,
                                         args.delay))
            if args.torchrun_signals:
                parts.append(signal_soak(work / "torchrun", args.torchrun_signals, args.torchrun_steps,
                                         args.ckpt_every, args.seed, args.delay, nproc=2))
        js, md = write_signal_results(parts, command)
        print(md.read_text())
        ok = all(r["steps_lost_max"] == 0 and r["resume_exact"] and not r["unloadable_checkpoints"] and not r["hung"]
                 for r in parts)
        return 0 if ok else 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        res = soak(work, args.kills, args.steps, args.ckpt_every, args.seed, args.delay)
    js, md = write_results(res, command)
    print(md.read_text())
    ok = (res["kills"] >= args.kills and res["resume_exact"] and res["completed_checkpoints_lost"] == 0
          and res["unloadable_checkpoint_dirs_after_kills"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
