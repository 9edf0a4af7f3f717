"""Trackers (runs/trackers.py): W&B (offline) and MLflow (a local file store) receive exactly the numbers of
metrics.jsonl, across a resume, in one tracker run each; `compare` groups its runs and sends its report; a missing
package or an unknown tracker is one line; a server that cannot be reached or a tracker that fails mid-run is one
warning and training goes on. No network: W&B runs offline, MLflow writes files."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import yaml

from helpers import metrics_rows, toy_cfg, toy_sets
from steadydiff.cli import EXIT_USER_ERROR, main
from steadydiff.runs.trackers import TRACKERS, Tracker, tracker_scalars
from steadydiff.train import Trainer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline (its files in the run directory) and MLflow on a file store under tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
    return tmp_path / "mlruns"


def expected(run: Path) -> dict[tuple[int, str], float]:
    """(step, tracker name) -> value of every number metrics.jsonl holds."""
    return {(r["step"], k): v for r in metrics_rows(run) for k, v in tracker_scalars(r).items()}


def wandb_history(run: Path) -> tuple[dict[tuple[int, str], float], list]:
    """(step, key) -> value of every history row in the run's offline W&B files, and their run records. The
    .wandb file is a LevelDB-style log (32 KiB blocks, 7-byte chunk headers) of protobuf Records after a 7-byte
    W&B header; reading it needs no server."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows, runs = {}, []
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, buf = path.read_bytes(), 7, b""
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
            buf = chunk if kind in (1, 2) else buf + chunk  # FULL/FIRST start a record, MIDDLE/LAST continue it
            if kind in (1, 4) and n:
                rec = pb.Record.FromString(buf)
                if rec.WhichOneof("record_type") == "history":
                    for item in rec.history.item:
                        key = item.key or "/".join(item.nested_key)  # an image's fields are nested under its name
                        if not key.startswith("_"):
                            rows[rec.history.step.num, key] = json.loads(item.value_json)
                elif rec.WhichOneof("record_type") == "run":
                    runs.append(rec.run)
    return rows, runs


@pytest.mark.plots("save_samples")  # the sample grids exist, and go to the trackers as images
def test_wandb_and_mlflow_receive_the_numbers_of_metrics_jsonl_across_a_resume(tmp_path, offline):
    pytest.importorskip("wandb", reason="the [wandb] extra is not installed")
    mlflow = pytest.importorskip("mlflow", reason="the [mlflow] extra is not installed")
    run = tmp_path / "run"
    sets = ["diagnostics.trackers=[wandb, mlflow]", "diagnostics.tracker_group=exp", "diagnostics.tracker_job=org",
            "diagnostics.tracker_name=org/seed-0", "train.ckpt_every=2", "train.sample_every=2", "train.seed=3"]
    Trainer(toy_cfg(*sets, "train.steps=3"), run, show_progress=False).fit()
    ids = json.loads((run / "trackers.json").read_text())
    Trainer(toy_cfg(*sets, "train.steps=6"), run, show_progress=False).fit()  # resumes from step 3
    assert json.loads((run / "trackers.json").read_text()) == ids  # the same tracker runs, not new ones
    want = expected(run)
    assert (6, "train/loss") in want and (6, "grad/total") in want and (0, "train/flops_per_step") in want

    # W&B: two offline runs of one id (the first and the resumed process), every number as in metrics.jsonl.
    got, runs = wandb_history(run)
    assert {k: v for k, v in got.items() if not k[1].startswith("samples")} == want
    assert {k[0] for k in got if k[1].startswith("samples")} == {2, 3, 4, 6}  # every sample grid (3: the first end)
    assert len(runs) == 2 and {r.run_id for r in runs} == {ids["wandb"]["id"]}
    assert (runs[0].run_group, runs[0].job_type, runs[0].display_name) == ("exp", "org", "org/seed-0")

    # MLflow: one run in the experiment named by the group, tagged arm and seed, the same numbers at the same steps.
    client = mlflow.MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert found.info.run_id == ids["mlflow"]["run_id"] and found.info.status == "FINISHED"
    assert (found.info.run_name, found.data.tags["arm"], found.data.tags["seed"]) == ("org/seed-0", "org", "3")
    logged = {(m.step, key): m.value for key in found.data.metrics
              for m in client.get_metric_history(found.info.run_id, key)}
    assert logged == want
    assert found.data.params["train.lr"] == "0.002"  # the resolved config, as params and as config.json
    assert {a.path for a in client.list_artifacts(found.info.run_id)} >= {"config.json", "samples"}


def test_compare_groups_its_runs_and_sends_its_report(tmp_path, offline):
    mlflow = pytest.importorskip("mlflow", reason="the [mlflow] extra is not installed")
    spec = {"name": "tiny", "description": "two arms", "base": str(ROOT / "configs" / "toy2d.yaml"),
            "set": {"train.steps": 4, "train.ckpt_every": 4, "train.log_every": 1, "train.batch_size": 32,
                    "train.threads": 1, "train.sample_n": 16, "train.sample_steps": 2, "model.hidden": 32,
                    "model.depth": 4, "data.toy_size": 500, "diagnostics.trackers": ["mlflow"]},
            "baseline": "org", "arms": {"org": {"model.skip_scaling": "org"}, "cs": {"model.skip_scaling": "cs"}},
            "seeds": [0], "metric": {"key": "loss"}, "stability": ["loss"], "sensitivity": False, "claims": []}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec))
    assert main(["compare", str(tmp_path / "exp.yaml"), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    client = mlflow.MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    assert set(by_name) == {"org/seed-0", "cs/seed-0", "tiny/report"}
    assert by_name["cs/seed-0"].data.tags["arm"] == "cs" and by_name["cs/seed-0"].data.tags["seed"] == "0"
    report = by_name["tiny/report"].info.run_id
    assert {a.path for a in client.list_artifacts(report)} >= {"report.md", "results.json"}
    # Each run's tracker id is in its directory: a resumed run (here: a re-run that trains nothing) reuses it.
    ids = json.loads((tmp_path / "out" / "runs" / "cs" / "seed-0" / "trackers.json").read_text())
    assert ids["mlflow"]["run_id"] == by_name["cs/seed-0"].info.run_id
    rows = [r for r in metrics_rows(tmp_path / "out" / "runs" / "cs" / "seed-0") if "loss" in r]
    assert [m.value for m in client.get_metric_history(ids["mlflow"]["run_id"], "train/loss")] == [r["loss"] for r
                                                                                                   in rows]


@pytest.mark.parametrize("trackers, needle", [
    ("[wandb]", "diagnostics.trackers: wandb needs the wandb package: pip install 'steadydiff[wandb]'"),
    ("[mlflow]", "diagnostics.trackers: mlflow needs the mlflow-skinny (or mlflow) package: pip install "
                 "'steadydiff[mlflow]'"),
    ("[comet]", "diagnostics.trackers: unknown tracker 'comet'; choose one of tensorboard, wandb, mlflow"),
    ("[mlflow, mlflow]", "diagnostics.trackers: mlflow is listed twice"),
])
def test_a_missing_package_or_an_unknown_tracker_is_one_line(tmp_path, capsys, monkeypatch, trackers, needle):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extras were not installed
    monkeypatch.setitem(sys.modules, "mlflow", None)
    code = main(["train", "--out", str(tmp_path / "run"), "--quiet", *toy_sets("train.steps=2"),
                 "--set", f"diagnostics.trackers={trackers}"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == EXIT_USER_ERROR and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


class Flaky(Tracker):
    """A tracker whose server goes away after its second batch of numbers."""

    fix = "check the flaky server"
    calls: list = []

    @staticmethod
    def load():
        return None

    def __init__(self, run, package):
        pass

    def log_scalars(self, step, values):
        Flaky.calls.append(step)
        if len(Flaky.calls) > 2:
            raise ConnectionError("server went away")


def test_a_server_out_of_reach_or_a_tracker_failing_mid_run_warns_once_and_training_goes_on(
        tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlflow", reason="the [mlflow] extra is not installed")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setitem(TRACKERS, "flaky", Flaky)
    Flaky.calls = []
    assert main(["train", "--out", str(tmp_path / "run"), "--quiet", *toy_sets("train.steps=5"),
                 "--set", "diagnostics.trackers=[mlflow, flaky]"]) == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("steadydiff: warning")]
    assert len(warnings) == 2, warnings
    assert "mlflow tracker could not start (MlflowException: API request to http://127.0.0.1:9" in warnings[0]
    assert "set MLFLOW_TRACKING_URI to a reachable server" in warnings[0]
    assert "flaky tracker stopped (ConnectionError: server went away); check the flaky server; training goes on" \
        in warnings[1]
    assert [r["step"] for r in metrics_rows(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4, 5]
    assert len(Flaky.calls) == 3  # switched off at its first failure, never called again


def test_tracker_names_keep_sections_and_give_bare_keys_one():
    rec = {"step": 7, "loss": 0.5, "grad/total": 2, "lr": 1e-3, "level_hist": [1, 2], "skipped": True,
           "grad_norm": None, "mfu": float("nan"), "eval/sw": 0.25}
    assert tracker_scalars(rec) == {"train/loss": 0.5, "grad/total": 2.0, "train/lr": 1e-3, "eval/sw": 0.25}
