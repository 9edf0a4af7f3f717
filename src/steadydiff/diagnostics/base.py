"""Shared type of the diagnostics package: the `Monitor` base the trainer calls around each optimiser step.

It lives apart from `monitors.py` so that monitors in their own modules (`validation.py`) can subclass it
while `monitors.build_monitors` imports them, without an import cycle.
"""

from __future__ import annotations


class Monitor:
    """Base: `every` = 0 disables; `before_step` runs only on due steps."""

    def __init__(self, every: int):
        self.every = every

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def after_backward(self, trainer, step: int) -> dict[str, float]:
        """After backward, before gradient clipping."""
        return {}

    def before_step(self, trainer, step: int) -> None:  # noqa: B027 - optional hook
        """After clipping, right before the optimiser step."""

    def after_step(self, trainer, step: int) -> dict[str, float]:
        return {}
