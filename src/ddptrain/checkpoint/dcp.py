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
On a GPU that copy is itself made in a thread of the stager's, on a stream of its own,
while the next step's forward and backward run; the next optimizer step first waits for
it (`settle`), so the weights do not change under it.

Every rank takes the checksums of what it writes as it writes it, each file's and each
entry's (`summing`), and rank 0 records them in `meta.pt` (`shards`, `items`). A resume
checks each entry's bytes as it reads them, once (`SafeReader`, in `dcp_read`); a
directory read whole in one process (export, evaluate, --init_from) is checked file by
file first, every rank its share (`shards_damage`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from ddptrain.checkpoint.common import (
    CheckpointError,
    SaveGroup,
    agree_on_write,
    atomic_save,
    damaged,
    read_payload,
    stamped,
)
from ddptrain.checkpoint.dcp_read import (
    ForeignMetadata,
    SafeLoadPlanner,
    SafeReader,
    check_metadata,
    refused,
)
from ddptrain.checkpoint.dcp_read import load_metadata as load_metadata  # importable here too
from ddptrain.checkpoint.integrity import share
from ddptrain.checkpoint.kind import META, entries, resolve_checkpoint
from ddptrain.checkpoint.kind import is_whole as is_whole  # importable here too
from ddptrain.checkpoint.summing import Damaged, SummingWriter
from ddptrain.context import DistributedContext
from ddptrain.files import atomic_write_text, files_damage, fsync_dir, remove

LATEST_DIR = "latest"
BEST_DIR = "best"
_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL = re.compile(r"^\.step_(\d+)\.partial$")


def dir_name(step: int) -> str:
    return f"step_{step:09d}"


def read_meta(path: Path, device: torch.device) -> dict[str, Any]:
    """A step directory's `meta.pt` (all but the sharded state), once the directory is whole."""
    if not is_whole(path):
        lacks = " and ".join(n for n in (".metadata", META) if not (path / n).is_file())
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a whole DCP step directory (it lacks {lacks}: "
            "its save did not finish, or a file was removed): give a step_XXXXXXXXX "
            "directory, or --resume_from auto"
        )
    check_metadata(path)  # before anything loads: a planted one is refused, not run
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


def list_step_dirs(directory: Path, whole: bool = True) -> list[Path]:
    """Whole step directories in `directory`, newest first; with `whole=False` also those
    that lost a file since (a save renames its directory into place only once whole)."""
    found = [(int(m.group(1)), p) for p in entries(directory) if (m := _DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)
            if resolve_checkpoint(p).directory and (not whole or is_whole(p))]


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
        options = staging_options(ctx.device)
        self.async_staging = background and options.use_async_staging
        self.stager = DefaultStager(options) if background else None
        # (a Future, or DCP's pair of them when staging is asynchronous; partial, final,
        # meta, best, the writer)
        self._pending: tuple[Any, Path, Path, dict[str, Any], bool, SummingWriter] | None = None
        self.blocking_s: list[float] = []  # time each save held up training

    def save(self, step: int, meta: dict[str, Any], state: dict[str, Any], best: bool) -> Path:
        self.wait()
        final = self.directory / dir_name(step)
        partial = self.directory / f".{final.name}.partial"
        if self.ctx.is_main:  # a writer killed at this step; a link there removed, not followed
            with contextlib.suppress(OSError):
                remove(partial)
                os.mkdir(partial)
        if self.ctx.distributed:
            dist.barrier(group=self.group)
        t0 = time.perf_counter()
        failure: BaseException | None = None
        writer = SummingWriter(partial)  # the checksums, taken as the bytes are written
        try:
            planner = DefaultSavePlanner(enable_plan_caching=True)
            if self.background:
                self._order_staging()
                future = dcp.async_save(
                    state, checkpoint_id=partial, process_group=self.group,
                    async_stager=self.stager, planner=planner, storage_writer=writer,
                )
                self._pending = (future, partial, final, meta, best, writer)
            else:
                with quiet_without_group():
                    dcp.save(
                        state, checkpoint_id=partial, planner=planner,
                        process_group=self.group, storage_writer=writer,
                    )
        except (Exception, CheckpointException) as exc:  # every rank's error; one line follows
            failure = dcp_cause(exc)
        self.blocking_s.append(time.perf_counter() - t0)
        if failure is not None or not self.background:
            self._commit(partial, final, meta, best, failure, writer)
        return final

    def _order_staging(self) -> None:
        """The stager's own stream (DCP's) first waits, on the device, for what the
        current stream has yet to write (the step just taken), then copies it."""
        stream = getattr(self.stager, "_staging_stream", None)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.ctx.device))
        elif self.async_staging and torch.cuda.is_available():  # no stream to order after
            torch.cuda.current_stream(self.ctx.device).synchronize()

    def settle(self) -> None:
        """Wait until the save in flight has copied the state off the tensors it saves
        (not until it is written); a no-op when none is staging. Before anything
        changes those tensors in place (an optimizer step). A failed copy is told by
        `wait`, as the save's failure."""
        if self._pending is None or not isinstance(self._pending[0], AsyncSaveResponse):
            return
        staging = self._pending[0].staging_completion
        if staging.done():
            return
        t0 = time.perf_counter()
        with contextlib.suppress(Exception):
            staging.result()
        if self.blocking_s:  # the save held training up this long too
            self.blocking_s[-1] += time.perf_counter() - t0

    def wait(self) -> None:
        """Finish the save in flight, if any (collective)."""
        if self._pending is None:
            return
        self.settle()
        future, partial, final, meta, best, writer = self._pending
        self._pending = None
        failure: BaseException | None = None
        try:
            if isinstance(future, AsyncSaveResponse):
                future = future.upload_completion  # which fails too when the copy did
            future.result()
        except (Exception, CheckpointException) as exc:
            failure = dcp_cause(exc)
        self._commit(partial, final, meta, best, failure, writer)

    def close(self) -> None:
        """Finish the save in flight and free the staging buffers."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _commit(
        self, partial: Path, final: Path, meta: dict[str, Any], best: bool,
        failure: BaseException | None, writer: SummingWriter,
    ) -> None:
        """Rank 0 gathers the checksums every rank took of what it wrote, makes the
        directory whole and gives it its name; all learn if it could."""
        sums = (writer.files, writer.items) if failure is None else None
        files: dict[str, list[int]] = {}
        items: dict[str, list[int]] = {}
        if self.ctx.distributed:  # a rank that failed sends None
            every: list[Any] = [None] * self.ctx.world_size if self.ctx.is_main else []
            dist.gather_object(
                sums, every if self.ctx.is_main else None, dst=0, group=self.group
            )
            parts = [part for part in every if part is not None]
            if self.ctx.is_main and len(parts) < self.ctx.world_size and failure is None:
                failure = OSError("a rank could not write its share")
        else:
            parts = [sums] if sums is not None else []
        for rank_files, rank_items in parts:
            files.update(rank_files)
            items.update(rank_items)
        if self.ctx.is_main and failure is None:
            try:
                atomic_save(stamped({**meta, "shards": files, "items": items}), partial / META)
                if os.path.lexists(final):  # the same step saved again (an epoch end after a step)
                    remove(final)
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


def staging_options(device: torch.device) -> StagingOptions:
    """How a background save copies the state to host memory. On a GPU: into pinned
    buffers, non-blocking, in the stager's own thread (the training thread goes on); on
    a CPU in the training thread, a plain copy (a thread would only copy host memory)."""
    on_gpu = device.type == "cuda"
    return StagingOptions(
        use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=on_gpu,
        use_non_blocking_copy=on_gpu,
    )


def _pointer(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def follow_pointer(path: Path) -> Path:
    """A DCP run's `checkpoints/latest` and `checkpoints/best` are small files that name
    a step directory beside them: given one, the directory it names (every command that
    takes a checkpoint takes them); any other path as it is."""
    if path.name not in (LATEST_DIR, BEST_DIR) or not path.is_file():
        return path
    if path.stat().st_size > 64:
        return path  # not a pointer: refused as what it is by whoever reads it
    name = _pointer(path) or ""
    if not _DIR.match(name):
        return path
    target = path.parent / name
    if not resolve_checkpoint(target).directory:
        raise CheckpointError(
            f"checkpoint {str(path)!r} names {name}, which is not in {str(path.parent)!r} "
            "(removed since): give another step directory, or --resume_from auto"
        )
    return target


@contextlib.contextmanager
def quiet_without_group() -> Iterator[None]:
    """DCP without a process group (one process, on purpose), without its warning that
    it assumes so: a run's stderr keeps to its own lines."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_cause(exc: BaseException, first: type[BaseException] | None = None) -> BaseException:
    """What went wrong inside DCP: the first rank's own error that a
    `CheckpointException` (a `BaseException`, gathered from every rank) wraps; `first`:
    the first rank's error of that kind, where any rank had one."""
    if not isinstance(exc, CheckpointException):
        return exc
    causes = [f[0] for _, f in sorted(exc.failures.items())
              if isinstance(f, tuple) and f and isinstance(f[0], BaseException)]
    return next((c for c in causes if first and isinstance(c, first)), None) or next(
        iter(causes), exc)


def load_sharded(path: Path, state: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
    """Collective: fill `state` (what `Strategy.sharded_state` returns) from `path`, each
    entry checked as it is read against the checksums in `meta` (its `meta.pt`), when
    given: a damaged one is `damaged`, the same error on every rank."""
    sums = {"files": meta.get("shards"), "items": meta.get("items")} if meta else None
    reader = SafeReader(str(path), sums)
    try:
        with quiet_without_group():
            dcp.load(state, checkpoint_id=path, storage_reader=reader,
                     planner=SafeLoadPlanner(reader))
    except (Exception, CheckpointException) as exc:  # DCP's own derives from BaseException
        # every rank's failures, the same on all (DCP's read is collective): damage that
        # any rank read (`SafeReader.read_data`) is every rank's verdict, before any other
        cause = dcp_cause(exc, first=Damaged)
        if isinstance(cause, ForeignMetadata):
            raise refused(path, str(cause)) from None
        if isinstance(cause, Damaged):
            raise damaged(path, str(cause)) from None
        if isinstance(cause, FileNotFoundError) and meta and meta.get("items"):
            raise damaged(path, f"{Path(str(cause.filename)).name} is missing") from None
        text = str(cause).strip()
        reason = text.splitlines()[0][:200] if text else type(cause).__name__
        missing = re.findall(r"Missing key in checkpoint state_dict: ([\w.]+)", str(exc))
        if missing:
            reason = f"it lacks {', '.join(missing[:4])}"
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit this model and optimizer: {reason}; "
            "resume with the same --model, --width, --optimizer and dataset it was trained with"
        ) from None


def model_state_from_dir(path: Path) -> dict[str, torch.Tensor]:
    """The whole model state of a step directory, in one process (no process group),
    whatever world size wrote it."""
    _, chunks = model_chunks_from_dir(path, budget=None)
    return {name: t for chunk in chunks for name, t in chunk.items()}


def model_chunks_from_dir(
    path: Path, budget: int | None = 1 << 30
) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Iterator[dict[str, torch.Tensor]]]:
    """The model tensors of a step directory (name, shape, dtype) and, read a few at a
    time (at most `budget` bytes a read, or one bigger tensor; None: all at once), the
    tensors themselves: `ddptrain export` never holds the whole model."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = check_metadata(path)
    entries = [
        (key.removeprefix("model."), tuple(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    ]

    def chunks() -> Iterator[dict[str, torch.Tensor]]:
        chunk: dict[str, torch.Tensor] = {}
        size = 0
        for i, (name, shape, dtype) in enumerate(entries):
            chunk[name] = torch.empty(shape, dtype=dtype)
            size += chunk[name].numel() * dtype.itemsize
            last = i == len(entries) - 1
            if last or (budget is not None and size + _bytes(entries[i + 1]) > budget):
                state = {"model": chunk}
                with quiet_without_group():
                    dcp.load(state, checkpoint_id=path, no_dist=True,
                             storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
                yield state["model"]
                chunk, size = {}, 0

    return entries, chunks()


def _bytes(entry: tuple[str, tuple[int, ...], torch.dtype]) -> int:
    return math.prod(entry[1]) * entry[2].itemsize
