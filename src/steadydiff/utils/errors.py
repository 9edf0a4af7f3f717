"""The error root. Every failure steadydiff expects (bad input, missing data, unreadable files, a diverged
run) is a `SteadydiffError` whose message is one line naming the fix; the CLI prints it as
`steadydiff: error: ...` and exits non-zero. Anything else is a bug and keeps its traceback."""

from __future__ import annotations


class SteadydiffError(Exception):
    """Root of steadydiff's expected errors; the message names the fix."""


class ConfigError(SteadydiffError, ValueError):
    """A setting (config key, CLI flag, environment variable) is invalid; the message names the fix."""


class ExportError(SteadydiffError):
    """A model cannot be exported in the asked format, or its upload failed; the message names why and what to use."""
