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
flight: the next save, a stop and the end of the run wait for it first. The copies go
into staging buffers kept from one save to the next (pinned on CUDA, so the copy off the
GPU is fast), and the save plan, the same at every save, is agreed on once and cached.

Once a save is written, every rank checksums its share of the directory's files and rank
0 records them in `meta.pt` (`shards`); a resume checks them the same way, every rank its
share, before it loads a byte (`integrity`).
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
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ddptrain.checkpoint.common import (
    CheckpointError,
    SaveGroup,
    agree_on_write,
    atomic_save,
    damaged,
    read_payload,
    stamped,
)
from ddptrain.checkpoint.integrity import file_crc, files_damage, share
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
    return read_payload(path / META, device, verify=True)


def shards_damage(path: Path, meta: dict[str, Any], ctx: DistributedContext) -> str | None:
    """Collective: every rank checks its share of a step directory's files against the
    checksums in its `meta.pt`; what is wrong (the same on every rank), or None. A
    directory written before checksums passes."""
    expected = meta.get("shards") or {}
    damage = files_damage(path, expected, share(list(expected), ctx.rank, ctx.world_size))
    if not ctx.distributed:
        return damage
    found: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(found, damage)
    return next((d for d in found if d is not None), None)


def check_shards(path: Path, meta: dict[str, Any], ctx: DistributedContext) -> None:
    """`shards_damage` as an error naming the directory."""
    damage = shards_damage(path, meta, ctx)
    if damage is not None:
        raise damaged(path, damage)


def list_step_dirs(directory: Path) -> list[Path]:
    """Whole step directories in `directory`, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True) if is_whole(p)]


class ShardedCheckpointer:
    """Writes step directories; collective, like `save_checkpoint`."""

    def __init__(
        self, directory: Path, ctx: DistributedContext, keep_last: int, background: bool,
        group: SaveGroup | None = None,
    ) -> None:
        self.directory, self.ctx, self.keep_last = directory, ctx, keep_last
        self.background = background
        # Every collective of a save runs on `group` (gloo, `--checkpoint_timeout_s`): a
        # slow write is told apart from a lost peer, and the background thread's
        # collectives never interleave with the training loop's on the default group.
        self.waiting = group
        self.group = group.group if group is not None else None
        on_gpu = ctx.device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=on_gpu,
        )) if background else None
        self._pending: tuple[Any, Path, Path, dict[str, Any], bool] | None = None  # a Future
        self.blocking_s: list[float] = []  # time each save held up training

    def save(self, step: int, meta: dict[str, Any], state: dict[str, Any], best: bool) -> Path:
        self.wait()
        final = self.directory / dir_name(step)
        partial = self.directory / f".{final.name}.partial"
        if self.ctx.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # a writer killed at this step
        if self.ctx.distributed:
            dist.barrier(group=self.group)
        t0 = time.perf_counter()
        failure: BaseException | None = None
        try:
            planner = DefaultSavePlanner(enable_plan_caching=True)
            if self.background:
                future = dcp.async_save(
                    state, checkpoint_id=partial, process_group=self.group,
                    async_stager=self.stager, planner=planner,
                )
                self._pending = (future, partial, final, meta, best)
            else:
                dcp.save(
                    state, checkpoint_id=partial, planner=planner, process_group=self.group
                )
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

    def close(self) -> None:
        """Finish the save in flight and free the staging buffers."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _commit(
        self, partial: Path, final: Path, meta: dict[str, Any], best: bool,
        failure: BaseException | None,
    ) -> None:
        """Every rank checksums its share of the files, rank 0 makes the directory whole
        and gives it its name; all learn if it could."""
        sums: dict[str, list[int]] | None = None
        if failure is None:
            try:
                names = [p.name for p in partial.iterdir() if p.name != META]
                mine = share(names, self.ctx.rank, self.ctx.world_size)
                sums = {name: file_crc(partial / name) for name in mine}
            except OSError as exc:
                failure = exc
        if self.ctx.distributed:  # rank 0 records them all; a rank that failed sends None
            every: list[Any] = [None] * self.ctx.world_size if self.ctx.is_main else []
            dist.gather_object(
                sums, every if self.ctx.is_main else None, dst=0, group=self.group
            )
            if self.ctx.is_main:
                parts = [part for part in every if part is not None]
                sums = {k: v for part in parts for k, v in part.items()}
                if len(parts) < self.ctx.world_size and failure is None:
                    failure = OSError("a rank could not read back the files it wrote")
        if self.ctx.is_main and failure is None:
            try:
                atomic_save(stamped({**meta, "shards": sums or {}}), partial / META)
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
        agree_on_write(
            failure, final, self.directory, self.ctx, who="a rank", group=self.waiting
        )

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
