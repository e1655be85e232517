"""The file backend: rank 0 writes the whole state as one `step_XXXXXXXXX.pt` (atomic:
temp file, fsync, rename), `latest.pt` and `best.pt` beside it as hard links to the same
bytes (written once), and prunes to `--keep_last`. Every rank passes a barrier after the
write so none reads ahead of it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ddptrain.checkpoint.common import SaveGroup, agree_on_write, atomic_save, stamped
from ddptrain.checkpoint.kind import entries
from ddptrain.context import DistributedContext

LATEST = "latest.pt"
BEST = "best.pt"  # the best epoch's state by the task's metric; never pruned
_NAME = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:09d}.pt"


def prune(directory: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step checkpoints (0 keeps all), and the
    temporary files of writers that were killed mid-write."""
    mine = f".{os.getpid()}.tmp"
    for stale in directory.glob(".*.tmp"):
        if not stale.name.endswith(mine):
            stale.unlink(missing_ok=True)
    if keep_last <= 0:
        return
    for old in list_checkpoints(directory)[keep_last:]:
        old.unlink(missing_ok=True)


def list_checkpoints(directory: Path) -> list[Path]:
    """Step checkpoints in `directory`, newest first."""
    found = [(int(m.group(1)), p) for p in entries(directory) if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def save_checkpoint(
    directory: Path, step: int, state: dict[str, Any], ctx: DistributedContext, keep_last: int,
    best: bool = False, group: SaveGroup | None = None,
) -> Path:
    """Collective: every rank calls it; rank 0 writes, then all learn whether it could.

    A failed write (a full disk, a quota, a vanished mount) leaves the previous checkpoint
    as it was, and every rank stops with the same line naming the path and the errno,
    instead of the other ranks blaming the network once rank 0 is gone. `group`: the
    process group the others wait on (`saving_group`: the checkpoint's own timeout; rank 0
    waits for them --timeout_s, as for any peer)."""
    path = directory / checkpoint_name(step)
    failure: OSError | None = None
    if ctx.is_main:
        payload = stamped(state)
        links = (directory / LATEST, *((directory / BEST,) if best else ()))
        try:
            atomic_save(payload, path, links)
            prune(directory, keep_last)
        except OSError as exc:
            failure = exc
    agree_on_write(failure, path, directory, ctx, group=group, wrote_alone=ctx.is_main)
    return path
