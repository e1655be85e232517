"""Iterable datasets: sharded over rank x DataLoader worker so every sample is seen once
per epoch, ranks that agree before each micro-batch that every one has another, and each
(rank, worker)'s position in its shard saved with a checkpoint, so that a resume at the
same layout and `--num_workers` continues mid-epoch exactly.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    IterableDataset,
    get_worker_info,
)

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.batch import num_samples, split
from ddptrain.data.epoch import Micro, steps_per_epoch
from ddptrain.data.hf import is_hf_iterable
from ddptrain.data.loader import make_loader, read
from ddptrain.errors import ConfigError

log = logging.getLogger("ddptrain")


# ---------------------------------------------------------------------- iterable data
def shards_itself(dataset: Any) -> bool:
    """Whether a stream splits at its source: `shard(num_shards, index)`, the convention of
    Hugging Face `datasets` (and of webdataset-style readers built on it)."""
    return callable(getattr(dataset, "shard", None))


class RankShard(IterableDataset):
    """One (rank, DataLoader worker)'s share of an iterable dataset: every item lands on
    exactly one of them.

    A stream that shards itself (`shards_itself`, or a Hugging Face `IterableDataset`) is
    split at its source: each (rank, worker) reads only its own shard, so at 64 GPUs x 4
    workers every sample is still read once. Any other stream is read whole by each of
    them, keeping every (world_size x workers)-th item.

    Its position (`state_dict`) is that of the stream it reads: the shard's own where the
    stream splits at its source, else the whole stream's and the items read of it. It
    names the reader it belongs to, `[world_size, rank, workers, worker]`: the shard it
    reads is that reader's alone. A position loaded (`load_state_dict`) is taken up when
    the next iteration starts, in the DataLoader worker that reads it."""

    def __init__(self, dataset: IterableDataset, world_size: int, rank: int) -> None:
        self.dataset, self.world_size, self.rank = dataset, world_size, rank
        self.consumed = 0  # items of the underlying stream read in this epoch
        self.epoch: int | None = None
        self._pending: dict[str, Any] | None = None  # a position to start from (a resume)
        self._source: Any = None  # the shard being read, when the stream splits itself
        self._reader: list[int] | None = None  # [world_size, rank, workers, worker]

    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info else (1, 0)
        self._source, self._reader = None, [self.world_size, self.rank, workers, wid]
        if pending is not None and pending.get("reader") not in (None, self._reader):
            raise AssertionError(  # resume.py takes only positions of this layout
                f"a stream position of reader {pending['reader']} given to {self._reader}"
            )
        source = self._split(workers, wid)
        saved = pending.get("dataset") if pending is not None else None
        if source is not None:
            if saved is not None:
                source.load_state_dict(saved)
            self._source = source
            yield from source
            return
        if saved is not None:
            self.dataset.load_state_dict(saved)  # type: ignore[attr-defined]
        start = int(pending["consumed"]) if pending is not None and saved is not None else 0
        stride, offset = self.world_size * workers, self.rank * workers + wid
        self.consumed = start
        for i, item in enumerate(self.dataset, start=start):
            self.consumed = i + 1
            if i % stride == offset:
                yield item

    def _split(self, workers: int, wid: int) -> Any:
        """This reader's shard of a stream that splits at its source, told the epoch; None
        when the stream is read whole (it does not shard itself, or has fewer shards than
        there are readers)."""
        if is_hf_iterable(self.dataset):
            return self._at_epoch(self._hf_split())
        if not shards_itself(self.dataset):
            return None
        stride, offset = self.world_size * workers, self.rank * workers + wid
        try:
            source = self.dataset.shard(num_shards=stride, index=offset)  # type: ignore[attr-defined]
        except (ValueError, IndexError):  # fewer source shards than readers: stride
            return None
        return self._at_epoch(source)

    def _hf_split(self) -> Any:
        """A `datasets.IterableDataset`, split as `split_dataset_by_node` splits it: by
        its shards when they divide among the ranks, else every rank keeps every
        world_size-th row; the dataset itself then splits a rank's part among DataLoader
        workers (it does so whenever it runs in one), and keeps each worker's position."""
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(self.dataset, rank=self.rank, world_size=self.world_size)

    def _at_epoch(self, source: Any) -> Any:
        """A shard made from the stream starts at epoch 0 (Hugging Face's do): it is told
        the stream's epoch, so a stream that shuffles by epoch keeps doing so."""
        if self.epoch is not None and hasattr(source, "set_epoch"):
            source.set_epoch(self.epoch)
        return source

    def state_dict(self) -> dict[str, Any]:
        """Where this reader stands: before its first item, where it will start."""
        if self._reader is None:  # not started (a DataLoader worker's first snapshot)
            return self._pending or {"consumed": 0, "dataset": None, "reader": None}
        if self._source is not None:
            if not callable(getattr(self._source, "state_dict", None)):
                raise ConfigError(
                    f"the stream ({type(self.dataset).__name__}) has state_dict, but the "
                    f"shards its shard() makes ({type(self._source).__name__}) do not: give "
                    "them state_dict/load_state_dict too"
                )
            return {"consumed": 0, "dataset": self._source.state_dict(), "reader": self._reader}
        return {
            "consumed": self.consumed, "dataset": self.dataset.state_dict(),  # type: ignore[attr-defined]
            "reader": self._reader,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state)
        self._source, self._reader = None, None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


class IterableBatches:
    """An iterable dataset's batches on this rank. Ranks agree before each micro-batch on
    whether every rank has one more (one small all-reduce), so all run the same steps: the
    shortest shard decides, and what the others hold beyond it is counted as dropped."""

    def __init__(
        self, dataset: IterableDataset, config: TrainingConfig, ctx: DistributedContext,
        collate: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        # Exact mid-epoch resume needs the stream's own position: read in this process,
        # or in each DataLoader worker, whose positions torchdata's StatefulDataLoader
        # gathers after every batch and hands back to the same workers. A stream split
        # at its source has a position per (rank, worker) shard, each saved that way.
        self.no_position = no_position(dataset)  # why a resume restarts the epoch
        self.stateful = self.no_position is None
        self._workers = self.stateful and config.num_workers > 0  # the loader's position
        self.loader = make_iterable_loader(
            dataset, config, ctx, collate=collate,
            kind=stateful_loader() if self._workers else DataLoader,
        )
        self.shard: RankShard = self.loader.dataset  # type: ignore[assignment]
        self.ctx, self.accum = ctx, config.grad_accum_steps
        self._flag = torch.zeros(1, device=ctx.device)
        self.state: dict[str, Any] | None = None  # after the last batch handed out
        self._resumed = False
        try:
            n = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            n = 0
        if not n and config.warmup_epochs:
            raise ConfigError(
                f"--warmup_epochs {config.warmup_epochs} needs the length of an epoch, and "
                f"--dataset {config.dataset!r} is an IterableDataset without __len__: give "
                "it __len__ (its number of samples) or drop the flag"
            )
        if not n:
            log.warning("IterableDataset without __len__: the learning rate stays at --lr")
        self.steps_per_epoch = steps_per_epoch(
            n, ctx.data_world, config.batch_size, config.grad_accum_steps, config.drop_last
        )

    def state_dict(self) -> dict[str, Any] | None:
        return self.state

    def fits(self, state: Any, rank: int) -> bool:
        """Whether `state`, what `state_dict` saved on `rank`, is a position this loader
        would take there: the stream's own without workers, else torchdata's, of as many
        workers as now; each of them a position of the reader that reads it now."""
        if not isinstance(state, dict):
            return False
        if not self._workers:
            return {"consumed", "dataset"} <= state.keys() and self._ours(state, rank, 1, 0)
        snapshot = state.get("_snapshot")
        main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else None
        workers = self.loader.num_workers
        if not isinstance(main, dict) or main.get("_num_workers") != workers:
            return False
        kept = snapshot.get("_worker_snapshots") or {}  # type: ignore[union-attr]
        return len(kept) == workers and all(
            self._ours((kept.get(f"worker_{w}") or {}).get("dataset_state"), rank, workers, w)
            for w in range(workers)
        )

    def _ours(self, position: Any, rank: int, workers: int, worker: int) -> bool:
        """A (rank, worker)'s position names its reader once it has read (older
        checkpoints name none): that reader's shard is the one this run reads there."""
        if not isinstance(position, dict):
            return False
        reader = position.get("reader")
        return reader is None or reader == [self.shard.world_size, rank, workers, worker]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the interrupted epoch where this rank's shard (or each of its
        workers' shards) stood."""
        if self._workers:
            self.loader.load_state_dict(state)  # type: ignore[attr-defined]
        else:
            self.shard.load_state_dict(state)
        self._resumed = True

    def _position(self) -> dict[str, Any] | None:
        if not self.stateful:
            return None
        if self._workers:
            return self.loader.state_dict()  # type: ignore[attr-defined]
        return self.shard.state_dict()

    def _pull(self, it: Iterator[Any]) -> tuple[Any, bool, float, Any]:
        t0 = time.perf_counter()
        batch = next(it, None)
        state = self._position()  # right after this batch
        more = batch is not None
        if self.ctx.distributed:  # the one host read per micro-batch a stream needs
            self._flag.fill_(float(more))
            dist.all_reduce(self._flag, op=dist.ReduceOp.MIN)
            more = bool(self._flag.item())
        return batch, more, time.perf_counter() - t0, state

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[Any, Micro, float]]:
        """(batch, its place, seconds waited) for each micro-batch of the epoch. The
        position counts micro-batches; `start` > 0 continues a resumed epoch."""
        # Told the epoch also when it resumes part-way: a stream that shuffles by epoch
        # continues the same order from its restored position.
        self.shard.set_epoch(epoch)
        if not self._resumed:
            start = 0
        self._resumed = False
        it = read(self.loader)
        batch, ok, waited, state = self._pull(it)
        i = start
        while ok:
            nxt, more, wait_next, state_next = self._pull(it)  # one ahead: the last one?
            micro = Micro(0, 0, False, 0, 0, not more or (i + 1) % self.accum == 0, i + 1)
            self.state = state
            yield batch, micro, waited
            batch, ok, waited, state, i = nxt, more, wait_next, state_next, i + 1
        self.state = None
        self._count_dropped(epoch, [batch] if batch is not None else [], it)

    def _count_dropped(self, epoch: int, held: list[Any], it: Iterator[Any]) -> None:
        left = sum(num_samples(*split(b)) for b in [*held, *it])
        total = torch.tensor([float(left)], device=self.ctx.device)
        if self.ctx.distributed:
            dist.all_reduce(total)
        if total.item():
            log.info(
                "epoch %d: %d samples of the longer shards dropped so that every rank ran "
                "the same number of steps", epoch, int(total.item()),
            )


def make_iterable_loader(
    dataset: IterableDataset, config: TrainingConfig, ctx: DistributedContext,
    batch_size: int | None = None, collate: Callable[[list[Any]], Any] | None = None,
    kind: type[DataLoader] = DataLoader,
) -> DataLoader:
    shard = RankShard(dataset, ctx.data_world, ctx.data_rank)
    # Workers that persisted across epochs would keep the copy of the stream they started
    # with, and never hear of `set_epoch`: an iterable's workers start anew each epoch.
    return make_loader(
        shard, config, ctx, batch_size=batch_size or config.batch_size, persistent=False,
        collate=collate, kind=kind,
    )


def no_position(dataset: Any) -> str | None:
    """Why a stream cannot say where it stands and start there again, or None when it can
    (`state_dict` and `load_state_dict`; one that shards itself is taken to make shards
    that can too)."""
    if not all(callable(getattr(dataset, n, None)) for n in ("state_dict", "load_state_dict")):
        return (f"the stream ({type(dataset).__name__}) keeps no position: an IterableDataset "
                "needs state_dict/load_state_dict to continue part-way")
    if is_hf_iterable(dataset) and _buffer_shuffled(getattr(dataset, "_ex_iterable", None)):
        return ("the Hugging Face stream is shuffled through a buffer (.shuffle(buffer_size=...)"
                "), whose samples its position leaves out: they would never train this epoch")
    return None


def _buffer_shuffled(node: Any) -> bool:
    """Whether a `datasets` stream's pipeline of example iterables holds a shuffle buffer
    (its state does not: `datasets` refills the buffer on a resume)."""
    if node is None:
        return False
    if type(node).__name__ == "BufferShuffledExamplesIterable":
        return True
    inner = [getattr(node, "ex_iterable", None), *(getattr(node, "ex_iterables", None) or [])]
    return any(_buffer_shuffled(n) for n in inner)


def stateful_loader() -> type[DataLoader]:
    """torchdata's StatefulDataLoader: a DataLoader whose `state_dict` holds each worker's
    position in its stream."""
    with warnings.catch_warnings():  # torchdata 0.11 announces its next major version
        warnings.simplefilter("ignore")
        from torchdata import stateful_dataloader  # type: ignore[import-untyped]
    # each epoch's iterator calls a torch API torch 2.13 deprecates: nothing for the user
    warnings.filterwarnings("ignore", r"'set_vital' is deprecated", UserWarning)
    loader: type[DataLoader] = stateful_dataloader.StatefulDataLoader
    return loader
