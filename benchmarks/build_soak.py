"""Dataset builds killed at random points: the store is either complete and verified, or refused; re-running
the same command completes it, equal file for file to an uninterrupted build (issue 20, bad input).

Each trial starts `steadydiff dataset build` on a source (a .npz array, or an image folder decoded by 2 worker
processes) in its own process group, SIGKILLs the group at a uniformly random time within the measured length
of a clean build, then checks: (a) the output either opens and verifies, or `open_store` refuses it with a
one-line error naming the fix; (b) re-running the same command finishes; (c) its dataset.json shards (file
names, counts, SHA-256s) equal the clean build's.

    PYTHONPATH=src python benchmarks/build_soak.py [--kills 20] [--seed 0]

Writes benchmarks/results/build_soak.json and build_soak.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from steadydiff.data import DataError, open_store, read_index, verify_store

ROOT = Path(__file__).resolve().parents[1]


def build_cmd(src: Path, out: Path, kind: str) -> list[str]:
    cmd = [sys.executable, "-m", "steadydiff.cli", "dataset", "build", str(src), "--out", str(out), "--quiet",
           "--labels"]
    return cmd + (["--shard-size", "500"] if kind == "array" else ["--shard-size", "40", "--resolution", "16",
                                                                   "--workers", "2"])


def run(cmd: list[str], kill_after: float | None = None) -> tuple[int, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    if kill_after is None:
        proc.wait()
    else:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "build_soak"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="build-soak-"))
    try:
        g = np.random.default_rng(args.seed)
        np.savez(work / "d.npz", images=g.integers(0, 256, (20000, 32, 32, 3), dtype=np.uint8),
                 labels=g.integers(0, 10, 20000))
        for c in range(4):
            (work / "imgs" / f"c{c}").mkdir(parents=True)
            for i in range(60):
                arr = g.integers(0, 256, (20, 24, 3), dtype=np.uint8)
                Image.fromarray(arr).save(work / "imgs" / f"c{c}" / f"{i}.png")
        sources = {"array": work / "d.npz", "folder": work / "imgs"}
        # The interpreter and imports take a while before a build writes anything; kill times are drawn
        # after that (from 90% of it), so that most kills land inside the build itself.
        _, startup = run([sys.executable, "-m", "steadydiff.cli", "dataset", "info", str(work / "none")])
        clean, length = {}, {}
        for kind, src in sources.items():
            rc, dt = run(build_cmd(src, work / f"clean-{kind}", kind))
            assert rc == 0, f"clean {kind} build failed"
            clean[kind], length[kind] = read_index(work / f"clean-{kind}")["shards"], dt
        trials = []
        for k in range(args.kills):
            kind = "array" if k % 2 == 0 else "folder"
            out = work / f"t{k}"
            at = rng.uniform(0.9 * startup, length[kind])
            rc, _ = run(build_cmd(sources[kind], out, kind), kill_after=at)
            killed = rc == -signal.SIGKILL
            try:
                open_store(out)
                verify_store(out)
                state = "complete and verified"
            except DataError as e:
                state = "refused: " + str(e)[:60]
            rc2, _ = run(build_cmd(sources[kind], out, kind))
            if state == "complete and verified":
                equal = rc2 == 2 and read_index(out)["shards"] == clean[kind]  # the re-run refuses to overwrite
            else:
                equal = rc2 == 0 and read_index(out)["shards"] == clean[kind] and verify_store(out)["count"] > 0
            trials.append({"trial": k, "source": kind, "kill_at_s": round(at, 3), "killed": killed,
                           "after_kill": state, "rerun_equal_to_clean": equal})
            print(trials[-1], flush=True)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {"command": "PYTHONPATH=src python benchmarks/build_soak.py " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "clean_build_s": length, "startup_s": startup, "trials": trials,
           "refused_unfinished": sum("unfinished build" in t["after_kill"] for t in trials),
           "killed": sum(t["killed"] for t in trials),
           "refused": sum(t["after_kill"].startswith("refused") for t in trials),
           "complete": sum(t["after_kill"] == "complete and verified" for t in trials),
           "all_reruns_equal": all(t["rerun_equal_to_clean"] for t in trials)}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    lines = ["# Dataset builds killed at random points", "", f"- Command: `{res['command']}`", f"- Date: {res['date']}",
             f"- Clean build: array source {length['array']:.2f} s (20000 images, 40 shards), folder source "
             f"{length['folder']:.2f} s (240 PNGs, 2 decoding processes, 6 shards); interpreter start-up "
             f"{startup:.2f} s; kill times uniform in [0.9 x start-up, clean build]", "",
             f"{res['killed']} of {len(trials)} builds were SIGKILLed before their process exited "
             f"(the rest had exited by their kill time); "
             f"after the kill {res['refused']} outputs were refused with the fix named ({res['refused_unfinished']} "
             f"as an unfinished build, the rest had written nothing yet) and {res['complete']} were complete and "
             f"verified; every re-run gave a store equal file for file to a clean build: "
             f"{'yes' if res['all_reruns_equal'] else 'NO'}.", "",
             "| trial | source | kill at (s) | killed | after the kill | re-run equals clean |",
             "|---|---|---|---|---|---|"]
    for t in trials:
        lines.append(f"| {t['trial']} | {t['source']} | {t['kill_at_s']} | {t['killed']} | {t['after_kill']} | "
                     f"{t['rerun_equal_to_clean']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:8]))
    return 0 if res["all_reruns_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
