"""Files that readers see whole or not at all.

Every file ddptrain writes into a run directory (checkpoints, config.yaml, summary.json,
metrics.jsonl when it is rewritten on resume, model.safetensors) goes through
`atomic_write`: a temporary name beside the target, fsync, rename into place, fsync of the
directory. A crash leaves the old file or the new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def temp_name(path: Path) -> Path:
    """A per-process temporary name beside `path` (hidden, so globs of results skip it)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it is fsynced and renamed to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        yield tmp
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(file)` on a temporary file and move the result to `path` atomically."""
    with staged(path) as tmp, tmp.open("wb") as f:
        write(f)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))
