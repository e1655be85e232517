"""Sharded checkpoints: a step directory that every rank writes its own shard into.

`torch.distributed.checkpoint` (DCP) writes the model and optimizer state as each rank
holds it (a shard under fsdp and zero; tensors every rank holds alike are written
once) and reshards on load, so a directory written on N ranks resumes on M. The rest of
the state (progress, RNG, data position, history: what a `.pt` checkpoint holds beside
the weights) is `meta.pt`, written by rank 0.

A step directory counts only once it is whole: the shards and DCP's `.metadata` go into
`.step_XXXXXXXXX.partial/`, rank 0 adds `meta.pt` and only then renames the directory to
`step_XXXXXXXXX/`. A kill during the write leaves a `.partial` directory that resume
ignores (and the next save removes), so the newest whole directory is always loadable.
`latest` and `best` are one-line files naming a directory; resume scans the directories
themselves, so a damaged pointer costs nothing, and `--keep_last` never prunes the best.

With `--async_checkpoint` the shards are copied to memory and written by a background
thread (on its own gloo group) while training goes on; a run has at most one save in
flight: the next save, a stop and the end of the run wait for it first.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ddptrain.checkpoint.common import (
    CheckpointError,
    agree_on_write,
    atomic_save,
    read_payload,
    stamped,
)
from ddptrain.context import DistributedContext
from ddptrain.files import atomic_write_text, fsync_dir

META = "meta.pt"
LATEST_DIR = "latest"
BEST_DIR = "best"
_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL = re.compile(r"^\.step_(\d+)\.partial$")


def dir_name(step: int) -> str:
    return f"step_{step:09d}"


def is_whole(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / META).is_file()


def read_meta(path: Path, device: torch.device) -> dict[str, Any]:
    """A step directory's `meta.pt` (all but the sharded state), once the directory is whole."""
    if not is_whole(path):
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a whole DCP step directory (its save did "
            "not finish): give a step_XXXXXXXXX directory, or --resume_from auto"
        )
    return read_payload(path / META, device)


def list_step_dirs(directory: Path) -> list[Path]:
    """Whole step directories in `directory`, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True) if is_whole(p)]


class ShardedCheckpointer:
    """Writes step directories; collective, like `save_checkpoint`."""

    def __init__(
        self, directory: Path, ctx: DistributedContext, keep_last: int, background: bool
    ) -> None:
        self.directory, self.ctx, self.keep_last = directory, ctx, keep_last
        self.background = background
        # The background thread's collectives must not interleave with the training
        # loop's on the default group.
        self.group = dist.new_group(backend="gloo") if background and ctx.distributed else None
        self._pending: tuple[Any, Path, Path, dict[str, Any], bool] | None = None  # a Future
        self.blocking_s: list[float] = []  # time each save held up training

    def save(self, step: int, meta: dict[str, Any], state: dict[str, Any], best: bool) -> Path:
        self.wait()
        final = self.directory / dir_name(step)
        partial = self.directory / f".{final.name}.partial"
        if self.ctx.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # a writer killed at this step
        if self.ctx.distributed:
            dist.barrier()
        t0 = time.perf_counter()
        failure: BaseException | None = None
        try:
            if self.background:
                future = dcp.async_save(state, checkpoint_id=partial, process_group=self.group)
                self._pending = (future, partial, final, meta, best)
            else:
                dcp.save(state, checkpoint_id=partial)
        except Exception as exc:  # DCP gathers every rank's error; one line follows
            failure = exc
        self.blocking_s.append(time.perf_counter() - t0)
        if failure is not None or not self.background:
            self._commit(partial, final, meta, best, failure)
        return final

    def wait(self) -> None:
        """Finish the save in flight, if any (collective)."""
        if self._pending is None:
            return
        future, partial, final, meta, best = self._pending
        self._pending = None
        failure: BaseException | None = None
        try:
            future.result()
        except Exception as exc:
            failure = exc
        self._commit(partial, final, meta, best, failure)

    def _commit(
        self, partial: Path, final: Path, meta: dict[str, Any], best: bool,
        failure: BaseException | None,
    ) -> None:
        """Rank 0 makes the directory whole and gives it its name; all learn if it could."""
        if self.ctx.is_main and failure is None:
            try:
                atomic_save(stamped(meta), partial / META)
                if final.exists():  # the same step saved again (an epoch end after a step)
                    shutil.rmtree(final)
                os.replace(partial, final)
                fsync_dir(self.directory)
                atomic_write_text(self.directory / LATEST_DIR, final.name + "\n")
                if best:
                    atomic_write_text(self.directory / BEST_DIR, final.name + "\n")
                self._prune(final)
            except OSError as exc:
                failure = exc
        agree_on_write(failure, final, self.directory, self.ctx, who="a rank")

    def _prune(self, newest: Path) -> None:
        for stale in self.directory.glob(".step_*.partial"):
            if _PARTIAL.match(stale.name):
                shutil.rmtree(stale, ignore_errors=True)
        if self.keep_last <= 0:
            return
        keep = {newest.name, _pointer(self.directory / BEST_DIR)}
        for old in list_step_dirs(self.directory)[self.keep_last:]:
            if old.name not in keep:
                shutil.rmtree(old, ignore_errors=True)


def _pointer(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def load_sharded(path: Path, state: dict[str, Any]) -> None:
    """Collective: fill `state` (what `Strategy.sharded_state` returns) from `path`."""
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as exc:
        text = str(exc).strip()
        reason = text.splitlines()[0][:200] if text else type(exc).__name__
        missing = re.findall(r"Missing key in checkpoint state_dict: ([\w.]+)", text)
        if missing:
            reason = f"it lacks {', '.join(missing[:4])}"
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit this model and optimizer: {reason}; "
            "resume with the same --model, --width, --optimizer and dataset it was trained with"
        ) from None


def model_state_from_dir(path: Path) -> dict[str, torch.Tensor]:
    """The whole model state of a step directory, in one process (no process group):
    for `ddptrain export`, whatever world size wrote it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception:
        raise CheckpointError(
            f"{str(path)!r} is not a whole DCP step directory (no readable .metadata): "
            "give a step_XXXXXXXXX directory of a finished save"
        ) from None
    template = {
        key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    state = {"model": template}
    with warnings.catch_warnings():  # one process on purpose: no "assuming" warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]
