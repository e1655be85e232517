"""Iterable datasets: sharded over rank x DataLoader worker so every sample is seen once
per epoch, and ranks that agree before each micro-batch that every one has another.
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

    A stream that shards itself (`shards_itself`) is split at its source: each (rank,
    worker) reads only its own shard, so at 64 GPUs x 4 workers every sample is still read
    once. Any other stream is read whole by each of them, keeping every (world_size x
    workers)-th item."""

    def __init__(self, dataset: IterableDataset, world_size: int, rank: int) -> None:
        self.dataset, self.world_size, self.rank = dataset, world_size, rank
        self.consumed = 0  # items of the underlying stream read in this epoch
        self._start = 0  # where the next iteration starts (a resume)
        self.epoch: int | None = None

    def __iter__(self) -> Iterator[Any]:
        if is_hf_iterable(self.dataset):
            yield from self._hf_split()
            return
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info else (1, 0)
        stride = self.world_size * workers
        offset = self.rank * workers + wid
        if shards_itself(self.dataset):
            try:
                source = self.dataset.shard(num_shards=stride, index=offset)  # type: ignore[attr-defined]
            except (ValueError, IndexError):  # fewer source shards than readers: stride
                source = None
            if source is not None:
                yield from self._at_epoch(source)
                return
        start, self._start = self._start, 0
        self.consumed = start
        for i, item in enumerate(self.dataset, start=start):
            self.consumed = i + 1
            if i % stride == offset:
                yield item

    def _hf_split(self) -> Any:
        """A `datasets.IterableDataset`, split as `split_dataset_by_node` splits it: by
        its shards when they divide among the ranks, else every rank keeps every
        world_size-th row; the dataset itself then splits a rank's part among DataLoader
        workers (it does so whenever it runs in one)."""
        from datasets.distributed import split_dataset_by_node

        part = split_dataset_by_node(self.dataset, rank=self.rank, world_size=self.world_size)
        return self._at_epoch(part)

    def _at_epoch(self, source: Any) -> Any:
        """A shard made from the stream starts at epoch 0 (Hugging Face's do): it is told
        the stream's epoch, so a stream that shuffles by epoch keeps doing so."""
        if self.epoch is not None and hasattr(source, "set_epoch"):
            source.set_epoch(self.epoch)
        return source

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "dataset": self.dataset.state_dict()}  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])  # type: ignore[attr-defined]
        self._start = int(state["consumed"])

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
        # Exact mid-epoch resume needs the dataset's own position: read in this process,
        # or in each DataLoader worker by torchdata's StatefulDataLoader, which hands
        # each its own again; a stream split at its source has a position per shard,
        # which it does not share.
        has_state = not shards_itself(dataset) and all(
            hasattr(dataset, name) for name in ("state_dict", "load_state_dict")
        )
        stateful_loader = _stateful_loader() if has_state and config.num_workers else None
        self.loader = make_iterable_loader(dataset, config, ctx, collate=collate,
                                           kind=stateful_loader or DataLoader)
        self.shard: RankShard = self.loader.dataset  # type: ignore[assignment]
        self.ctx, self.accum = ctx, config.grad_accum_steps
        self._flag = torch.zeros(1, device=ctx.device)
        self.stateful = has_state and (config.num_workers == 0 or stateful_loader is not None)
        self._workers = stateful_loader is not None  # the position is the loader's
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

    def fits(self, state: Any) -> bool:
        """Whether `state` (what `state_dict` saved) is a position this loader can take:
        the shard's own without workers, else torchdata's, of as many workers as now."""
        if not isinstance(state, dict):
            return False
        if not self._workers:
            return {"consumed", "dataset"} <= state.keys()
        snapshot = state.get("_snapshot")
        main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else None
        return isinstance(main, dict) and main.get("_num_workers") == self.loader.num_workers

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


def _stateful_loader() -> type[DataLoader] | None:
    """torchdata's StatefulDataLoader (`pip install 'ddptrain[streams]'`), or None."""
    try:
        with warnings.catch_warnings():  # torchdata 0.11 announces its next major version
            warnings.simplefilter("ignore")
            from torchdata import stateful_dataloader  # type: ignore[import-untyped]
    except ImportError:
        return None
    # each epoch's iterator calls a torch API torch 2.13 deprecates: nothing for the user
    warnings.filterwarnings("ignore", r"'set_vital' is deprecated", UserWarning)
    loader: type[DataLoader] = stateful_dataloader.StatefulDataLoader
    return loader
