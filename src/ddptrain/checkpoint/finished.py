"""A run is finished once its exports are: `finished.json`, written last.

The end of a run writes `model.safetensors` (and `model_ema.safetensors`,
`model_raw.safetensors`, `hf/`, `adapter/` where the run has them), `summary.json` and
`curves.png`; then, last and atomically, `finished.json`, naming the run and the checkpoint
(its step) the exports came from, with each export's size (and for the small files, whose
bytes nothing else checks, their CRC-32; a weights file carries its tensors' checksums in
its header, a directory its `ddptrain_checksums.json`, which is summed here).

A kill, a SIGTERM or a full disk during the export leaves no record: a resume of the run
then writes the exports from the final checkpoint instead of saying the run finished. A
resume that trains on removes the record before its first step, so exports beside a newer
checkpoint are known to be stale: `ddptrain evaluate|predict RUN` use the exports only
when the record names the run's newest checkpoint (`exports_current`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddptrain.checkpoint.dcp import list_step_dirs
from ddptrain.checkpoint.kind import resolve_checkpoint
from ddptrain.checkpoint.pt import list_checkpoints
from ddptrain.errors import EXIT_IO, ConfigError, TrainingStopped
from ddptrain.files import SUMS_FILE, atomic_write_text, file_crc, fsync_dir, read_regular

FINISHED = "finished.json"
_STEP = re.compile(r"step_(\d+)")
# What the end of a run writes into its directory (those it has).
EXPORTS = ("model.safetensors", "model_raw.safetensors", "model_ema.safetensors", "hf",
           "adapter", "summary.json", "curves.png")


class ExportWriteError(TrainingStopped):
    """The end of a run could not write its exports (disk full, quota, I/O error, a
    read-only filesystem); its final checkpoint is intact, and a resume writes them."""

    exit_code = EXIT_IO
    alone = True  # this rank's own error: its peers' lines name it (`observe.hang`)


def write_errno(exc: BaseException) -> int | None:
    """The errno of a failed write: an `OSError`'s, or the `os error N` safetensors' and
    transformers' writers put in their own errors; None for anything else (a refusal of
    ddptrain's own, `ConfigError`, says what it is)."""
    if isinstance(exc, ConfigError):
        return None
    if isinstance(exc, OSError):
        return exc.errno or None
    found = re.search(r"os error (\d+)", str(exc))
    return int(found.group(1)) if found else None


@contextlib.contextmanager
def writing_exports(rank: int, run_dir: Path) -> Iterator[None]:
    """A write of the run's exports that fails for want of space (or any I/O error) is
    one line and exit 74 (`ExportWriteError`), like a checkpoint that cannot be written."""
    try:
        yield
    except Exception as exc:
        code = write_errno(exc)
        if code is None:
            raise
        name = getattr(exc, "filename", None)
        where = f" ({name})" if isinstance(name, str) else ""
        fix = "free space" if code in (errno.ENOSPC, errno.EDQUOT) else "fix the storage"
        raise ExportWriteError(
            f"rank {rank} could not write the run's exports in {str(run_dir)!r}{where}: "
            f"{os.strerror(code)} (errno {code}); the final checkpoint is intact: {fix}, "
            "then resume with --resume_from auto, which writes them"
        ) from None


def ended_at(ckpt_dir: Path, run_id: str | None) -> dict[str, Any]:
    """Which checkpoint the exports of run `run_id` come from: the newest whole one in
    `ckpt_dir`, known by its name (this run wrote it, and a checkpoint is named by its
    step: none is read again); None where the run has none. Rank 0, once the saves are
    done."""
    steps = [*list_checkpoints(ckpt_dir), *list_step_dirs(ckpt_dir)]
    newest = max(steps, key=lambda p: int(_STEP.findall(p.name)[0]), default=None)
    step = int(_STEP.findall(newest.name)[0]) if newest is not None else None
    return {"run_id": run_id, "step": step, "checkpoint": newest.name if newest else None}


def write_finished(run_dir: Path, ended: dict[str, Any]) -> None:
    """Record, last, that the run's exports are whole and which checkpoint they came from
    (`ended_at`). An I/O failure is `ExportWriteError`."""
    with writing_exports(0, run_dir):
        files = {name: stamp for name in EXPORTS
                 if (stamp := _stamp(run_dir, name)) is not None}
        atomic_write_text(run_dir / FINISHED,
                          json.dumps({**ended, "files": files}, indent=1) + "\n")


def clear_finished(run_dir: Path) -> None:
    """The run goes on: its exports are no longer the final ones (rank 0, before the first
    step)."""
    path = run_dir / FINISHED
    if os.path.lexists(path):
        path.unlink()
        fsync_dir(run_dir)


def read_finished(run_dir: Path) -> dict[str, Any] | None:
    """The run's record (`write_finished`), or None: none, or not one."""
    try:
        record = json.loads(read_regular(run_dir / FINISHED))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def exports_current(run_dir: Path, newest: dict[str, Any], whole: bool = True) -> bool:
    """Whether the run's exports are those of the checkpoint whose payload is `newest`
    (the run's newest): its record names it, and (`whole`) every export it lists is as
    written. Without `whole`, a damaged export is left to its own checksums to refuse."""
    record = read_finished(run_dir)
    if record is None or not isinstance(record.get("files"), dict):
        return False
    if (record.get("run_id"), record.get("step")) != (_run_id(newest), newest.get("step")):
        return False
    return not whole or all(_stamp(run_dir, name) == stamp
                            for name, stamp in record["files"].items())


def _run_id(payload: dict[str, Any]) -> str | None:
    config = payload.get("config")
    return config.get("run_id") if isinstance(config, dict) else None


def _stamp(run_dir: Path, name: str) -> list[int] | None:
    """[bytes] of a weights file, [bytes, crc32] of a small file; a directory by its
    `SUMS_FILE`; None where there is none."""
    path = run_dir / name
    if resolve_checkpoint(path).own_directory:
        path = path / SUMS_FILE
    if path.is_symlink() or not path.is_file():
        return None
    if name.endswith(".safetensors"):
        return [path.stat().st_size]
    return file_crc(path)
