"""Preemption-safe training: a stop signal ends the run at a step boundary with a checkpoint of that step.

Clusters stop jobs with a signal before killing them: Slurm sends SIGTERM at the time limit or on preemption
(`--signal` can ask for SIGUSR2 ahead of it), submitit forwards SIGUSR2 to ask a job to checkpoint, and a user
presses Ctrl-C (SIGINT). Under `train.stop_signals` (default SIGTERM, SIGINT, SIGUSR2) the trainer's handler only
records the signal. The step in flight finishes; at the step boundary every rank learns whether any rank got a
signal (one all-reduce: a scheduler may signal only some of the ranks), all write the checkpoint of that step
together, and `fit` raises `TrainingInterrupted`, which `steadydiff train` turns into exit status
EXIT_PREEMPTED = 75 (sysexits' EX_TEMPFAIL: try again later). Re-running the same command resumes from that
checkpoint onto exactly the trajectory of a run that was never stopped: at most the step in flight is lost,
and not even that, since it completes before the checkpoint. A second SIGINT while the first is pending stops
at once (KeyboardInterrupt), for a user who does not want to wait for the step.
"""

from __future__ import annotations

import signal
import threading

from ..utils import distributed as dist_utils
from ..utils.errors import SteadydiffError

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL


class TrainingInterrupted(SteadydiffError):
    """A stop signal ended training at a step boundary; the checkpoint of that step is on disk."""

    def __init__(self, message: str, step: int, signal_name: str):
        super().__init__(message)
        self.step, self.signal_name = step, signal_name


def signal_number(name: str) -> int:
    """The number of a signal named like SIGTERM; a ValueError (the config check's) for an unknown name."""
    num = getattr(signal.Signals, name, None) if name.startswith("SIG") else None
    if num is None:
        raise ValueError(name)
    return int(num)


class StopSignals:
    """A context that records the listed signals while training runs (main thread only: Python delivers
    signals there), restoring the previous handlers on exit."""

    def __init__(self, names: list[str]):
        self.numbers = [signal_number(n) for n in names]
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without the checkpoint of the step in flight
        self.received = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for num in self.numbers:
                self._previous[num] = signal.signal(num, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for num, handler in self._previous.items():
            signal.signal(num, handler)
        self._previous.clear()

    def requested(self, dist_info, device) -> bool:
        """Whether any rank has received a stop signal; collective under DDP (every rank calls it at the same
        step boundary, so all stop at the same step)."""
        local = 0.0 if self.received is None else 1.0
        return dist_utils.all_reduce_sum(local, dist_info, device) > 0

    def interrupted(self, step: int) -> TrainingInterrupted:
        name = signal.Signals(self.received).name if self.received is not None else "a stop signal on another rank"
        return TrainingInterrupted(f"stopped by {name} at step {step}; its checkpoint is saved: re-run the same "
                                   "command to continue", step, name)
