"""What a training step with a NaN/Inf loss or gradient norm does (`train.nonfinite`): stop the run, or skip
the update. Either way the bad step changes no weight, EMA or optimiser state."""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

from ..utils.errors import SteadydiffError
from ..utils.registry import Registry


class NonFiniteLossError(SteadydiffError):
    """The loss or the gradient became NaN/Inf (and train.nonfinite=stop, or too many steps in a row were
    skipped); the run stopped and the last good checkpoint is kept."""


class StopOnNonFinite:
    """train.nonfinite=stop: the first bad step ends the run (the last good checkpoint stays)."""

    skipped_steps = 0
    consecutive = 0

    def __init__(self, ckpt_dir: Path):
        self.kept = f"stopped without saving (last good checkpoint kept in {ckpt_dir})"

    def bad_step(self, k: int, what: str) -> None:
        raise NonFiniteLossError(
            f"{what} at step {k}; {self.kept}; lower train.lr, set train.grad_clip, disable train.bf16, "
            "or set train.nonfinite=skip to skip such steps"
        )

    def good_step(self) -> None:
        pass

    def log_fields(self) -> dict[str, int]:
        return {}

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class SkipNonFinite(StopOnNonFinite):
    """train.nonfinite=skip: the bad step's update is skipped (the step still counts, so step k's randomness
    stays a function of (seed, k) and resuming stays exact); more than `max_consecutive` bad steps in a row
    stop the run as diverged."""

    def __init__(self, ckpt_dir: Path, max_consecutive: int):
        super().__init__(ckpt_dir)
        self.max_consecutive = max_consecutive
        self.skipped_steps = 0
        self.consecutive = 0

    def bad_step(self, k: int, what: str) -> None:
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(
                f"{what} at step {k} after {self.consecutive} skipped steps in a row "
                f"(train.max_consecutive_skips={self.max_consecutive}); {self.kept}; the run diverged: lower "
                "train.lr or disable train.bf16"
            )
        self.skipped_steps += 1
        self.consecutive += 1
        tqdm.write(f"steadydiff: warning: {what} at step {k}; skipped the update ({self.skipped_steps} skipped, "
                   f"{self.consecutive} in a row, limit train.max_consecutive_skips={self.max_consecutive})",
                   file=sys.stderr)

    def good_step(self) -> None:
        self.consecutive = 0

    def log_fields(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive = int(state.get("consecutive", 0))


# train.nonfinite -> the policy, built from a TrainConfig and the checkpoint directory.
NONFINITE_POLICIES = Registry("non-finite policy", key="train.nonfinite")
NONFINITE_POLICIES.add("stop", lambda t, ckpt_dir: StopOnNonFinite(ckpt_dir))
NONFINITE_POLICIES.add("skip", lambda t, ckpt_dir: SkipNonFinite(ckpt_dir, t.max_consecutive_skips))


def build_nonfinite_policy(t, ckpt_dir: Path) -> StopOnNonFinite:
    """The policy train.nonfinite names (a TrainConfig `t`)."""
    return NONFINITE_POLICIES.choose(t.nonfinite)(t, ckpt_dir)
