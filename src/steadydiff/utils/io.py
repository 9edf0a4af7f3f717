"""Atomic file writes (a crash mid-write never leaves a half-written file under the final name), and JSON reads
that fail in one line."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import SteadydiffError


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp_path)`, fsync it, then rename it onto `path` (atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # e.g. a full disk: name the file the caller asked for, not the temporary one
        if e.errno is None or e.filename not in (None, str(tmp)):
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda p: p.write_text(text))


def read_json(path: str | Path, fix: str) -> Any:
    """The JSON in `path`; a damaged file (hand-edited, truncated) is a one-line SteadydiffError ending in `fix`."""
    try:
        return json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SteadydiffError(f"{path} is not valid JSON ({e}); {fix}") from e
