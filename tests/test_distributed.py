"""Distributed data parallel: `torchrun --nproc_per_node=2` (gloo, CPU) on tiny runs.

Every 2-process command of this file (the shared 4-step toy2d run with grad_accum 2, post-hoc EMA and periodic
eval; a refused global batch; `steadydiff eval`; training on an image store and on a latent store; a flow
matching run) runs in one
torchrun launch (tests/torchrun_worker.py), once per module; the killed-rank test needs its own launch
(--max-restarts). Single-process references run in this process. Tolerances: the 2-process run sums gradients
in another order (per-shard, then DDP's average), so it matches the 1-process run to float32 round-off,
amplified a little by Adam over a few steps: 1e-5 relative on losses, 1e-5 absolute on weights.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import steadydiff
from helpers import LATENT_UNET, UVIT, latent_stores, rgb_tree, toy
from steadydiff.config import load_config
from steadydiff.runs import latest_checkpoint, read_checkpoint
from steadydiff.train import Trainer
from steadydiff.utils.distributed import fingerprint

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")

HERE = Path(__file__).resolve().parent
TOY = toy("data.toy_size=2000", "train.batch_size=64", "train.grad_accum=2", "train.ckpt_every=2",
          "train.keep_ckpts=10", "train.sample_n=64", "train.sample_steps=5", "train.ema_decay=0.9",
          "train.ema_sigma_rels=[0.1]", "train.eval_every=2", "train.eval_metrics=[sw]", "train.eval_n=64",
          "train.eval_batch=16")  # 4 eval chunks, shared out over the ranks
N2, N1 = 4, 8  # steps of the 2-process run, and of the 1-process reference it is resumed towards
# Flow matching (logit-normal times under CLTS, x0-prediction) on the same global batch and accumulation.
FLOW_TOY = toy("data.toy_size=2000", "train.batch_size=64", "train.grad_accum=2", "train.steps=4",
               "train.ckpt_every=4", "diffusion.kind=flow", "train.sample_sampler=heun",
               "diffusion.t_sampling=logit_normal", "diffusion.prediction=x0", "train.timesteps=clts")


def torchrun(nproc: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(steadydiff.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def rows(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def loss_list(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows(run) if "loss" in r}


HAVE_DIFFUSERS = importlib.util.find_spec("diffusers") is not None  # the latent store's VAE
EVAL_ARGS = ["--metric", "fd_fmnist,kid", "--num-samples", "48", "--batch", "16", "--steps", "2", "--threads", "1"]
STORE_SETS = ["data.name=store", "train.steps=4"]  # + data.root: UVIT on the image store
LATENT_SETS = ["data.name=store", "train.steps=3", "train.sample_every=0", "train.ckpt_every=100",
               "train.log_every=1"]  # + data.root: LATENT_UNET (with configs/demo.yaml) on the latent store


def sets_of(overrides: list[str]) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One `torchrun --nproc_per_node=2` launch of every 2-process command of this file, with the inputs they
    read (made here, in this process). `launch.result(name)`: each rank's exit code, and stdout and stderr of
    the ranks together (as torchrun's own output would hold them)."""
    from steadydiff.cli import main

    base = tmp_path_factory.mktemp("torchrun")
    commands = []
    # The shared 2-process toy2d run (`ddp`); each rank also dumps its weights.
    commands.append({"name": "ddp", "dump": str(base / "dump"),
                     "argv": ["train", "--out", str(base / "run2"), "--quiet", *sets_of(TOY + [f"train.steps={N2}"])]})
    # A global batch the processes cannot share.
    (base / "b66").mkdir()
    commands.append({"name": "b66", "argv": ["train", "--out", str(base / "b66" / "run"), "--quiet",
                                             *sets_of(TOY + ["train.batch_size=66"])]})
    # `steadydiff eval` of a 2-step Fashion-MNIST run, beside the same eval on one process.
    ev = base / "eval"
    assert main(["train", "--config", "configs/demo.yaml", "--out", str(ev / "run"), "--quiet", "--set",
                 "train.steps=2", "--set", "data.max_items=64", "--set", "train.batch_size=4", "--set",
                 "model.channels=8", "--set", "train.sample_n=4", "--set", "train.sample_steps=2", "--set",
                 "train.threads=1"]) == 0
    assert main(["eval", str(ev / "run"), *EVAL_ARGS, "--out", str(ev / "one.json")]) == 0
    commands.append({"name": "eval", "argv": ["eval", str(ev / "run"), *EVAL_ARGS, "--out", str(ev / "two.json")]})
    # Training on an image store.
    from steadydiff.data import build_store

    st = base / "store"
    rgb_tree(st / "imgs", n_per_class=12)
    build_store(str(st / "imgs"), st / "st", resolution=8, shard_size=5, workers=0, progress=False)
    commands.append({"name": "store", "argv": ["train", "--out", str(st / "two"), "--quiet",
                                               *sets_of(UVIT + STORE_SETS + [f"data.root={st / 'st'}"])]})
    # Training on a latent store.
    if HAVE_DIFFUSERS:
        lat = latent_stores(base / "latent")
        commands.append({"name": "latent", "argv": [
            "train", "--config", "configs/demo.yaml", "--out", str(lat / "two"), "--quiet",
            *sets_of(LATENT_UNET + LATENT_SETS + [f"data.root={lat / 'lat'}"])]})
    # A flow matching run.
    commands.append({"name": "flow", "argv": ["train", "--out", str(base / "flow2"), "--quiet", *sets_of(FLOW_TOY)]})
    plan = base / "plan.json"
    plan.write_text(json.dumps({"out": str(base / "results"), "commands": commands}))
    proc = torchrun(2, str(HERE / "torchrun_worker.py"), str(plan), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def result(name: str) -> SimpleNamespace:
        recs = [json.loads((base / "results" / f"{name}.rank{r}.json").read_text()) for r in range(2)]
        return SimpleNamespace(codes=[r["code"] for r in recs], stdout="".join(r["stdout"] for r in recs),
                               stderr="".join(r["stderr"] for r in recs))

    return SimpleNamespace(base=base, result=result)


@pytest.fixture(scope="module")
def ddp(launch):
    """The 2-process run: (run dir, per-rank dumps dir, its output)."""
    res = launch.result("ddp")
    assert res.codes == [0, 0], res.stderr[-3000:]
    return launch.base / "run2", launch.base / "dump", res


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The 1-process reference run to N1 steps (checkpoints every 2 steps)."""
    run = tmp_path_factory.mktemp("single") / "run1"
    Trainer(load_config(None, TOY + [f"train.steps={N1}"]), run, show_progress=False).fit()
    return run


def test_replicas_hold_identical_weights_and_the_checkpoint_is_theirs(ddp):
    run, dump, _ = ddp
    r0, r1 = load_file(str(dump / "rank0.safetensors")), load_file(str(dump / "rank1.safetensors"))
    assert r0.keys() == r1.keys()
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k  # bit for bit: DDP broadcasts, all-reduces, and EMAs agree
    ck = read_checkpoint(latest_checkpoint(run / "checkpoints"))
    assert ck.step == N2 and ck.state["world_size"] == 2
    assert not any(k.startswith("module.") for k in ck.model)  # saved from the unwrapped model
    for k, v in ck.model.items():
        assert torch.equal(v, r0[f"model.{k}"]), k
    for k, v in ck.ema.items():
        assert torch.equal(v, r0[f"ema.{k}"]), k


def test_two_processes_match_one_process_at_the_same_global_batch(ddp, single):
    run2, _, _ = ddp
    l2, l1 = losses(run2), losses(single)
    assert sorted(l2) == list(range(1, N2 + 1))
    for k in l2:
        assert abs(l2[k] - l1[k]) <= 1e-5 * abs(l1[k]), (k, l2[k], l1[k])
    # the same noise levels were drawn (the global batch's, whatever the number of processes)
    hist2 = {r["step"]: r["level_hist"] for r in rows(run2) if "loss" in r}
    hist1 = {r["step"]: r["level_hist"] for r in rows(single) if "loss" in r}
    assert all(hist2[k] == hist1[k] for k in hist2)
    a = read_checkpoint(run2 / "checkpoints" / f"step-{N2:07d}")
    b = read_checkpoint(single / "checkpoints" / f"step-{N2:07d}")
    for k in a.model:
        torch.testing.assert_close(a.model[k], b.model[k], rtol=0, atol=1e-5)
        torch.testing.assert_close(a.ema[k], b.ema[k], rtol=0, atol=1e-5)
    for k, v in a.state["power_ema"].items():  # rank 0's post-hoc EMA state went into the checkpoint
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            torch.testing.assert_close(v, b.state["power_ema"][k], rtol=0, atol=1e-5)
    ev2 = [r["eval/sw"] for r in rows(run2) if "eval/sw" in r]
    ev1 = [r["eval/sw"] for r in rows(single) if "eval/sw" in r][: len(ev2)]
    assert len(ev2) == N2 // 2 and ev2 == pytest.approx(ev1, rel=1e-4)


def test_only_rank0_writes(ddp):
    run, _, out = ddp
    rs = rows(run)
    for key in ("loss", "grad/total"):  # one training line and one monitor line per step, not one per rank
        assert [r["step"] for r in rs if key in r] == list(range(1, N2 + 1)), key
    assert [r["step"] for r in rs if "eval/sw" in r] == [2, 4]
    flops = [r for r in rs if "flops_per_step" in r]
    assert len(flops) == 1 and flops[0]["world_size"] == 2 and flops[0]["flops_per_step"] > 0
    assert all(0 < r["mfu"] < 1 for r in rs if "loss" in r)
    files = {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}
    ck = {f"checkpoints/step-{s:07d}/{f}" for s in (2, 4) for f in ("model.safetensors", "ema.safetensors", "state.pt")}
    expected = ck | {"checkpoints/latest", "config.yaml", "metrics.jsonl", "curves.png", "samples/step-0000004.png",
                     "phema/phema-000000002-0.100.safetensors", "phema/phema-000000004-0.100.safetensors"}
    assert files == expected
    assert out.stdout.count("done:") == 1 and out.stdout.count("FLOP/step") == 1  # rank 0 prints


def test_a_two_process_checkpoint_resumes_with_one_process(ddp, single, tmp_path):
    run = tmp_path / "resumed"
    shutil.copytree(ddp[0], run)
    tr = Trainer(load_config(None, TOY + [f"train.steps={N1}"]), run, show_progress=False)
    assert tr.step == N2
    tr.fit()
    lr, l1 = losses(run), losses(single)
    assert sorted(lr) == list(range(1, N1 + 1))
    for k in range(N2 + 1, N1 + 1):
        assert abs(lr[k] - l1[k]) <= 1e-5 * abs(l1[k]), (k, lr[k], l1[k])
    a = read_checkpoint(latest_checkpoint(run / "checkpoints"))
    b = read_checkpoint(latest_checkpoint(single / "checkpoints"))
    assert a.step == b.step == N1
    for k in a.model:
        torch.testing.assert_close(a.model[k], b.model[k], rtol=0, atol=1e-5)


def test_a_flow_run_on_two_processes_matches_one_process(launch, tmp_path):
    res = launch.result("flow")
    assert res.codes == [0, 0], res.stderr[-3000:]
    Trainer(load_config(None, FLOW_TOY), tmp_path / "one", show_progress=False).fit()
    l2, l1 = losses(launch.base / "flow2"), losses(tmp_path / "one")
    assert sorted(l2) == sorted(l1) == [1, 2, 3, 4]
    for k in l2:
        assert abs(l2[k] - l1[k]) <= 1e-5 * abs(l1[k]), (k, l2[k], l1[k])
    a = read_checkpoint(latest_checkpoint(launch.base / "flow2" / "checkpoints"))
    b = read_checkpoint(latest_checkpoint(tmp_path / "one" / "checkpoints"))
    assert a.step == b.step == 4 and a.state["world_size"] == 2
    for k in a.model:
        torch.testing.assert_close(a.model[k], b.model[k], rtol=0, atol=1e-5)


def test_global_batch_not_divisible_by_processes_is_a_one_line_error(launch):
    res = launch.result("b66")
    assert all(code != 0 for code in res.codes)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("steadydiff: error:")]
    assert errors and all("train.batch_size=66 is the global batch" in ln and "multiple of 4" in ln for ln in errors)
    assert not (launch.base / "b66" / "run").exists()


def test_global_batch_rule_and_rank_slices_as_pure_functions():
    from steadydiff.train.batch import check_global_batch, rank_slice
    from steadydiff.utils.errors import ConfigError

    check_global_batch(64, 2, 4)  # 64 = 2 ranks x 4 micro-batches x 8
    with pytest.raises(ConfigError, match=r"train.batch_size=66 is the global batch.*multiple of 4"):
        check_global_batch(66, 2, 2)
    with pytest.raises(ConfigError, match="multiple of 12"):
        check_global_batch(30, 3, 4)
    for b, world in ((64, 2), (60, 3), (12, 4)):
        slices = [rank_slice(b, r, world) for r in range(world)]
        rows = [i for s in slices for i in range(b)[s]]
        assert rows == list(range(b))  # contiguous, disjoint, covering the batch in rank order
        assert len({s.stop - s.start for s in slices}) == 1  # equal shards


def test_replica_fingerprint_sees_a_one_ulp_change_and_a_swap():
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    ref = fingerprint(net)
    w = net[0].weight
    with torch.no_grad():
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))  # one element, one ulp
    assert not torch.equal(fingerprint(net), ref)
    with torch.no_grad():
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(-1.0))
        assert torch.equal(fingerprint(net), ref)
        w[[0, 1]] = w[[1, 0]]  # same values, other places
    assert not torch.equal(fingerprint(net), ref)


def _workers_of(run: Path) -> dict[int, int]:
    """{rank: pid} of `run`'s training processes: the helper benchmarks/dist_soak.py aims its kills with."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dist_soak", HERE.parent / "benchmarks" / "dist_soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.workers_of(run)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find the worker processes")
def test_a_killed_rank_restarts_under_torchrun_from_the_last_checkpoint(single, tmp_path):
    """SIGKILL rank 1 mid-run; torchrun --max-restarts=1 restarts both ranks, which resume from the last
    checkpoint and end where an uninterrupted run ends."""
    import signal
    import time

    run = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEADYDIFF_TEST_CKPT_WRITE_DELAY": "0.3",  # slow enough to aim
           "PYTHONPATH": os.pathsep.join([str(Path(steadydiff.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "steadydiff.cli", "train", "--out", str(run), "--quiet",
           *[a for s in TOY + [f"train.steps={N1}"] for a in ("--set", s)]]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed_after = None
    deadline = time.monotonic() + 120
    while killed_after is None and time.monotonic() < deadline and proc.poll() is None:
        ckpt = latest_checkpoint(run / "checkpoints") if (run / "checkpoints").is_dir() else None
        if ckpt is not None and int(ckpt.name.split("-")[1]) >= 2:
            pids = _workers_of(run)
            if 1 in pids:
                os.kill(pids[1], signal.SIGKILL)
                killed_after = int(ckpt.name.split("-")[1])
        time.sleep(0.05)
    out, err = proc.communicate(timeout=180)
    assert killed_after is not None and killed_after < N1, "the run ended before rank 1 could be killed"
    assert proc.returncode == 0, err[-3000:]
    assert "resuming" in out  # the restarted group found the checkpoint
    # Every step logged once, with the losses of the uninterrupted 1-process run.
    lr, l1 = losses(run), losses(single)
    assert [r["step"] for r in rows(run) if "loss" in r] == list(range(1, N1 + 1))
    for k in lr:
        assert abs(lr[k] - l1[k]) <= 1e-5 * abs(l1[k]), (k, lr[k], l1[k])
    a = read_checkpoint(latest_checkpoint(run / "checkpoints"))
    b = read_checkpoint(latest_checkpoint(single / "checkpoints"))
    assert a.step == b.step == N1
    for k in a.model:
        torch.testing.assert_close(a.model[k], b.model[k], rtol=0, atol=1e-5)


def test_eval_under_torchrun_shares_the_chunks_and_matches_one_process(launch):
    """`steadydiff eval` on 2 processes: each draws and featurises its chunks (3 chunks of 16: uneven shares),
    rank 0 gathers the classifier features and writes the one result. Same chunks, same kernels at one thread,
    so the metrics agree with one process to float32 round-off (1e-6 relative)."""
    res, ev = launch.result("eval"), launch.base / "eval"
    assert res.codes == [0, 0], res.stderr[-3000:]
    assert res.stdout.count("two.json") == 1  # rank 0 alone prints and writes
    one, two = (json.loads((ev / f).read_text()) for f in ("one.json", "two.json"))
    assert one["processes"] == 1 and two["processes"] == 2
    assert two["metrics"] == pytest.approx(one["metrics"], rel=1e-6)
    assert {p.name for p in ev.iterdir()} == {"run", "one.json", "two.json"}


def test_two_processes_on_a_store_match_one_process(launch):
    """(From test_store.py.) torchrun --nproc_per_node=2 (gloo): each rank reads only its rows of the store
    (flips drawn for the whole batch), and the run matches one process to float32 round-off of the split
    gradient sum."""
    res, st = launch.result("store"), launch.base / "store"
    Trainer(load_config(None, UVIT + STORE_SETS + [f"data.root={st / 'st'}"]), st / "one", show_progress=False).fit()
    assert res.codes == [0, 0], res.stderr[-2000:]
    one, two = loss_list(st / "one"), loss_list(st / "two")
    assert len(one) == 4 and two == pytest.approx(one, rel=1e-5)


@pytest.mark.skipif(not HAVE_DIFFUSERS, reason="diffusers is not installed (the latent store's VAE)")
def test_two_processes_on_a_latent_store_match_one_process(launch):
    """(From test_latent.py.) torchrun --nproc_per_node=2 (gloo): each rank draws its rows' latents from the
    whole batch's noise."""
    res, lat = launch.result("latent"), launch.base / "latent"
    sets = LATENT_UNET + LATENT_SETS + [f"data.root={lat / 'lat'}"]
    Trainer(load_config("configs/demo.yaml", sets), lat / "one", show_progress=False).fit()
    assert res.codes == [0, 0], res.stderr[-2000:]

    def losses(run):
        rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r and r.get("loss") is not None]

    one, two = losses(lat / "one"), losses(lat / "two")
    assert len(one) == 3 and two == pytest.approx(one, rel=1e-5)
