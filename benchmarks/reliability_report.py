"""Reliability figures -> reports/reliability.md: the crash-resume soak plus the fault and bad-input tests.

Runs (or, with --reuse-soak, reads benchmarks/results/soak.json from) the SIGKILL soak of benchmarks/soak.py,
then runs tests/test_reliability.py and tests/test_bad_input.py under pytest with a JUnit XML report and counts
the cases by group. Every figure in the report comes from those two runs.

    PYTHONPATH=src python benchmarks/reliability_report.py [--reuse-soak] [--kills 24] [--steps 120]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {  # test-name prefix -> what it exercises
    "test_nonfinite_": "numerical faults (NaN/Inf injected into the loss or a gradient)",
    "test_storage_": "storage faults (disk full while writing a checkpoint, `latest`, metrics, a PNG)",
    "test_safe_load_": "safe loading (crafted pickles as state.pt and as an official U-ViT .pth; source audit)",
    "test_soak_": "crash-resume (SIGKILL soak in CI, torn log line, log window across a resume, half-deleted dir)",
}


def run_tests() -> tuple[dict[str, list[tuple[str, bool]]], float, str]:
    """{file stem: [(test name, passed)]}, wall seconds, the command."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "tests/test_reliability.py", "tests/test_bad_input.py", "-q",
               "-p", "no:cacheprovider", f"--junitxml={xml}"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        out: dict[str, list[tuple[str, bool]]] = {}
        for case in suite.iter("testcase"):
            failed = any(child.tag in ("failure", "error") for child in case)
            skipped = any(child.tag == "skipped" for child in case)
            stem = case.get("classname", "").split(".")[-1]
            out.setdefault(stem, []).append((case.get("name"), not failed and not skipped))
        return out, float(suite.get("time", "nan")), "pytest tests/test_reliability.py tests/test_bad_input.py"


def bad_input_tables():
    spec = importlib.util.spec_from_file_location("test_bad_input", ROOT / "tests" / "test_bad_input.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return {"config": mod.CONFIG_CASES, "dataset": mod.DATA_CASES, "dataset store": mod.STORE_CASES,
            "CLI arguments": mod.CLI_CASES, "guidance": mod.GUIDANCE_CASES, "latent diffusion": mod.LATENT_CASES}


def build_section(b: dict | None) -> str:
    """benchmarks/build_soak.py's figures: dataset builds killed at random points."""
    if b is None:
        return "Not run (`PYTHONPATH=src python benchmarks/build_soak.py`)."
    return (f"`{b['command']}` ({b['date']}; details in "
            "[benchmarks/results/build_soak.md](../benchmarks/results/build_soak.md)): "
            f"{len(b['trials'])} `steadydiff dataset build` processes (an array source and an image folder decoded "
            f"by 2 worker processes, alternately) SIGKILLed at uniform random times. After each kill the output "
            f"was either complete and verified ({b['complete']}) or refused by `open_store` with a one-line error "
            f"naming the fix ({b['refused']}; {b['refused_unfinished']} of them inside the build, as an unfinished "
            f"build); re-running the same command gave a store equal file for file (names, counts, SHA-256) to an "
            f"uninterrupted build: {'every time' if b['all_reruns_equal'] else 'NOT every time'}. Few kills land "
            "while shards are written (the builds are short next to the interpreter's start-up); "
            "`tests/test_store.py::test_a_killed_build_never_looks_complete_and_continues` kills a build inside a "
            "shard write deterministically in every CI run.")


def dist_section(d: dict | None) -> str:
    if d is None:
        return "Not run: `PYTHONPATH=src python benchmarks/dist_soak.py` writes benchmarks/results/dist_soak.json."
    ranks = [e["rank"] for e in d["events"]]
    return f"""`{d['command']}` ({d['date']}, {d['wall_s']} s): a 2-process gloo run (toy2d, checkpoint every 4 steps)
whose rank 0 or 1 (seeded choice) is SIGKILLed right after each new checkpoint; torchrun restarts the group,
which resumes from the last checkpoint. Compared with an uninterrupted 1-process run of the same config
(the 2-process gradient sum runs in another order, hence a tolerance, not bit-equality).

| figure | value |
|---|---|
| ranks killed with SIGKILL / group restarts / resumes | {d['kills']} (rank 0: {ranks.count(0)}, rank 1: \
{ranks.count(1)}) / {d['restarts_seen']} / {d['resumes_printed']} |
| run finished (exit code, final step) | {d['exit_code']}, {d['final_step']} |
| every step logged exactly once | {'yes' if d['steps_logged_once'] else 'NO'} |
| max relative loss difference / max abs weight difference vs uninterrupted | {d['max_rel_loss_diff']:.1e} / \
{d['max_abs_weight_diff']:.1e} (tolerance 1e-5) |

In CI: `tests/test_distributed.py::test_a_killed_rank_restarts_under_torchrun_from_the_last_checkpoint`.
Found on the way: a restarted group could not connect ("Gloo connectFullMesh failed ... Connection
refused"): the new attempt read the killed attempt's peer addresses from torchrun's store. The process
group's keys are now prefixed with the restart count."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reuse-soak", action="store_true", help="read benchmarks/results/soak.json instead of running it")
    p.add_argument("--kills", type=int, default=24)
    p.add_argument("--steps", type=int, default=120)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import soak as soak_mod

    if not args.reuse_soak:
        with tempfile.TemporaryDirectory() as tmp:
            res = soak_mod.soak(Path(tmp), args.kills, args.steps, 5, seed=0)
        soak_mod.write_results(res, f"PYTHONPATH=src python benchmarks/soak.py --kills {args.kills} "
                                    f"--steps {args.steps}")
    s = json.loads((ROOT / "benchmarks" / "results" / "soak.json").read_text())
    dist_path = ROOT / "benchmarks" / "results" / "dist_soak.json"  # benchmarks/dist_soak.py (torchrun)
    d = json.loads(dist_path.read_text()) if dist_path.exists() else None
    build_path = ROOT / "benchmarks" / "results" / "build_soak.json"  # benchmarks/build_soak.py
    b = json.loads(build_path.read_text()) if build_path.exists() else None
    tests, test_seconds, test_cmd = run_tests()
    rel, bad = tests.get("test_reliability", []), tests.get("test_bad_input", [])
    tables = bad_input_tables()
    table_cases = [(n, ok) for n, ok in bad if n.startswith("test_bad_input_is_one_line")]
    passed_by_id = {n.split("[", 1)[1].rstrip("]"): ok for n, ok in table_cases}
    c = s["compare"]
    metrics_lost = 0 if c["metrics_equal"] else "see soak.json"
    data_lost = (s["completed_checkpoints_lost"] == 0 and c["metrics_equal"] and c["weights_bit_equal"]
                 and s["unloadable_checkpoint_dirs_after_kills"] == 0)
    group_rows = []
    for prefix, what in GROUPS.items():
        cases = [ok for n, ok in rel if n.startswith(prefix)]
        group_rows.append(f"| {what} | {len(cases)} | {sum(cases)} |")
    bad_rows = []
    for kind, cases in tables.items():
        ok = sum(passed_by_id.get(c_.id, False) for c_ in cases)
        bad_rows.append(f"| {kind} | {len(cases)} | {ok} |")
    extra_bad = [(n, ok) for n, ok in bad if not n.startswith("test_bad_input_is_one_line")]
    by_kind = ", ".join(f"{k}: {v}" for k, v in s["kills_by_kind"].items())
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    n_bad = sum(len(v) for v in tables.values())
    cmd = "PYTHONPATH=src python benchmarks/reliability_report.py " + " ".join(sys.argv[1:])
    md = f"""# Reliability: crashes, faults and bad input

- command: `{cmd.strip()}` (soak: `{s['command']}`)
- date: {now}; soak run {s['date']}
- machine: {s['machine']}
- tests: `{test_cmd}` ({sum(len(v) for v in tests.values())} cases, {test_seconds:.0f} s)

## Headline figures

| figure | value |
|---|---|
| training runs killed with SIGKILL (soak) | {s['kills']} ({by_kind}) |
| kills inside a checkpoint write | {s['kills_inside_checkpoint_write']} |
| resumes exact (weights + EMA bit-equal, optimiser state, post-hoc EMA snapshots, every metrics record) | \
{'yes' if s['resume_exact'] else 'NO'} (max abs weight diff {c['weights_max_abs_diff']:.1e}) |
| checkpoint directories checked after kills / unloadable | {s['checkpoint_dirs_checked']} / \
{s['unloadable_checkpoint_dirs_after_kills']} |
| completed checkpoints lost / metrics records lost or duplicated | {s['completed_checkpoints_lost']} / \
{metrics_lost} lost, {c['duplicate_records']} duplicated |
| data lost | {'0' if data_lost else 'SEE soak.json'} |
| fault-injection test cases passed | {sum(ok for _, ok in rel)} / {len(rel)} |
| bad inputs tried (one-line error naming the fix, exit 2, nothing changed) | {n_bad} tried, \
{sum(passed_by_id.get(c_.id, False) for v in tables.values() for c_ in v)} passed |

Soak details (per-kill table): [benchmarks/results/soak.md](../benchmarks/results/soak.md).

## Distributed faults (torchrun --max-restarts)

{dist_section(d)}

## Dataset builds killed at random points

{build_section(b)}

## Fault-injection tests (tests/test_reliability.py)

| group | cases | passed |
|---|---|---|
{chr(10).join(group_rows)}

## Bad-input sweep (tests/test_bad_input.py)

Each case runs `steadydiff.cli.main(argv)` in-process against a world of existing runs, data folders and
config files, and checks: exit status 2, exactly one stderr line `steadydiff: error: ...` containing the fix,
sha256 and mtime of every existing file unchanged, and no output created.

| kind | cases | passed |
|---|---|---|
{chr(10).join(bad_rows)}

Plus {len(extra_bad)} more: {', '.join(f'`{n}`' for n, _ in extra_bad)} ({sum(ok for _, ok in extra_bad)} passed).

## Bugs found and fixed

Found while building the soak and the sweep (by reading the write paths and by the sweep's failures); each
is now covered by the soak or a test above.

- metrics.jsonl: log lines of steps before a checkpoint could still sit in the file buffer when the process was
  killed after the checkpoint landed, and were then lost for good (a resume never rewrites steps <= its
  checkpoint). The log is now flushed and fsynced before every checkpoint.
- metrics.jsonl: a kill mid-write leaves a torn last line; the resume crashed on it (`JSONDecodeError`), or,
  when the torn line parsed, appended onto it. Torn lines are dropped on resume; readers skip them.
- Log records averaged over a window that straddles a checkpoint (log_every not dividing ckpt_every)
  differed after a resume: the partial window now travels in the checkpoint.
- Checkpoint pruning and same-step replacement deleted `step-*` directories in place: a kill inside
  `rmtree` left a half-deleted checkpoint that looked complete to the no-`latest` fallback. Directories are
  now renamed to hidden `.trash-*` names first.
- A failed checkpoint write (disk full) surfaced as a bare `[Errno 28]`; a failed `latest` update left a new
  unreferenced checkpoint. Both now raise one line naming the fix and leave the directory as it was.
- Bad input that crashed with a traceback, passed silently or gave an error without a fix: a data folder
  whose channel count changed under an existing run (state-dict size mismatch traceback), `--n 0` (torch.cat
  of nothing), negative grad_clip / weight_decay / warmup_steps (accepted), `train.threads=0` (ignored),
  `--out` that is a file (train: "File exists") or a directory (eval, convert: "Is a directory"), and
  argparse's multi-line usage errors.

## Not covered here

- Kills during post-hoc EMA snapshot writes are covered only by chance (the snapshots are written with
  mkstemp + os.replace and compared bit-for-bit at the end); there is no write-delay hook for them.
- Power loss (as opposed to SIGKILL): files are fsynced, but nothing here cuts power.
"""
    out = ROOT / "reports" / "reliability.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(md)
    print(md)
    all_ok = data_lost and s["resume_exact"] and all(ok for _, ok in rel + bad)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
