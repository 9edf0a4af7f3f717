"""Shared test fixtures (tests/README.md says how the suite is organised and run).

- Threads: under pytest-xdist each worker is a process: each gets cores / workers intra-op threads (1 on the
  2-core CI machine), also for the processes it starts (OMP_NUM_THREADS). Two workers at 2 threads each on 2
  cores spin in OpenMP waiting for each other: a 16 s diagnose took 128 s next to other work.
- Plots: matplotlib figures and sample PNGs are no-ops for every test not marked `@pytest.mark.plots`
  (drawing was most of the wall time of a tiny training run: 0.5 of 0.6 s for 2 toy steps).
- The toy run (tests/helpers.py: `toy`, `toy_cfg`, `toy_sets`): `toy_run` is a copy of one 2-step run trained
  once per session (per xdist worker); `assert_resume_exact` is the full / split / resume check.
"""

import functools
import importlib
import os
import shutil
import sys
from collections.abc import Callable, Collection
from pathlib import Path

import pytest
import torch

import helpers

# ---------------------------------------------------------------------------------------------------------
# Threads


def _worker_threads() -> int | None:
    if os.environ.get("STEADYDIFF_TEST_THREADS"):  # an explicit choice, e.g. to measure
        return int(os.environ["STEADYDIFF_TEST_THREADS"])
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, workers))


WORKER_THREADS = _worker_threads()
if WORKER_THREADS is not None:
    torch.set_num_threads(WORKER_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))  # the subprocesses a test starts


@pytest.fixture
def one_thread():
    """Small tensor ops on a shared 2-core machine: one thread is as fast and does not contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------------------
# Order: the longest files first

# The files that take longest (tests/README.md has the timings), longest first. xdist (--dist loadfile) hands
# out whole files; started early, none of them is left for the end while the other worker sits idle. `make
# test` passes --no-loadscope-reorder, so xdist keeps this order (its default sorts files by test count).
LONGEST_FIRST = ["test_perf.py", "test_metrics_features.py", "test_distributed.py", "test_reliability.py",
                 "test_guidance.py", "test_experiments.py", "test_launch.py", "test_inference.py",
                 "test_bad_input.py", "test_flow.py", "test_diagnostics.py", "test_cli.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the other files keep their order


# ---------------------------------------------------------------------------------------------------------
# Plots: no-ops unless the test is marked `plots`

# (module, function) of everything that draws a figure or writes a sample PNG.
PLOT_FUNCTIONS = [
    ("steadydiff.runs.metrics_log", "plot_curves"),  # curves.png at every checkpoint and at the end
    ("steadydiff.utils.images", "save_samples"),  # samples/step-*.png and `steadydiff sample --out`
    ("steadydiff.diagnostics.report", "plot_runs"),  # `steadydiff diagnose`
    ("steadydiff.experiments.report", "plot_experiment"),  # `steadydiff compare`
    ("steadydiff.metrics.evaluate", "plot_guidance_sweep"),  # `steadydiff eval --guidance 1,2`
]


class _PlotSwitch:
    """Points every reference a steadydiff module holds to each plot function (`from x import f` copies the
    reference) at a no-op stand-in, or back at the real function."""

    def __init__(self) -> None:
        self.real = [getattr(importlib.import_module(mod), name) for mod, name in PLOT_FUNCTIONS]
        self.stub = {fn: _no_op(fn) for fn in self.real}

    def point(self, mp: pytest.MonkeyPatch, real: Collection[str] = ()) -> None:
        """The functions named in `real` real, the others stubbed."""
        # id of a real function or of its stub -> the real function
        target = {**{id(f): f for f in self.real}, **{id(s): f for f, s in self.stub.items()}}
        for name, mod in list(sys.modules.items()):
            if mod is None or not (name == "steadydiff" or name.startswith("steadydiff.")):
                continue
            for attr, val in list(vars(mod).items()):
                fn = target.get(id(val))
                if fn is not None and (val is fn or val is self.stub[fn]):
                    want = fn if fn.__name__ in real else self.stub[fn]
                    if val is not want:
                        mp.setattr(mod, attr, want)


def _no_op(fn: Callable) -> Callable:
    def stub(*args, **kwargs) -> None:
        return None

    stub.__name__ = stub.__qualname__ = f"{fn.__name__}_stub"
    stub.__doc__ = f"No-op stand-in for {fn.__module__}.{fn.__name__} (a test not marked `plots`)."
    return stub


@pytest.fixture(scope="session", autouse=True)
def _plot_switch():
    """Session-wide, so module- and session-scoped fixtures that train runs draw nothing either."""
    switch = _PlotSwitch()
    with pytest.MonkeyPatch.context() as mp:
        switch.point(mp)
        yield switch


@pytest.fixture(autouse=True)
def _plots(request, _plot_switch, monkeypatch):
    """`@pytest.mark.plots`: the real plot functions for this test; `@pytest.mark.plots("save_samples", ...)`:
    those named only. Unmarked tests get no-ops (pointed at again here for modules imported since)."""
    mark = request.node.get_closest_marker("plots")
    real = () if mark is None else (mark.args or [fn.__name__ for fn in _plot_switch.real])
    unknown = set(real) - {fn.__name__ for fn in _plot_switch.real}
    assert not unknown, f"@pytest.mark.plots: no plot function {sorted(unknown)} in tests/conftest.py"
    _plot_switch.point(monkeypatch, real)


# ---------------------------------------------------------------------------------------------------------
# The toy run


@pytest.fixture(scope="session")
def toy_run_shared(tmp_path_factory):
    """The toy run trained to step 2 once per session (per xdist worker). Read it or copy it; never change it:
    `toy_run` is a copy."""
    from steadydiff.cli import main

    run = tmp_path_factory.mktemp("toy_run") / "run"
    sets = [a for o in helpers.TOY_RUN for a in ("--set", o)]
    assert main(["train", "--out", str(run), "--quiet", *sets]) == 0  # as the tests that copy it trained it
    return run


@pytest.fixture
def toy_run(toy_run_shared, tmp_path):
    """tmp_path/run: a copy of the toy run trained to step 2 (`helpers.TOY_RUN`; checkpoint step-0000002),
    instead of training it again."""
    return Path(shutil.copytree(toy_run_shared, tmp_path / "run"))


@pytest.fixture
def assert_resume_exact(tmp_path):
    """`assert_resume_exact(overrides, steps, ...)`: helpers.assert_resume_exact with its runs under tmp_path."""
    return functools.partial(helpers.assert_resume_exact, tmp_path)
