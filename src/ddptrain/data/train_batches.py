"""This rank's training batches of a map-style dataset, epoch by epoch, in the planned
layout (`ddptrain.data.epoch`): sliced in-process for in-memory arrays, else a DataLoader
over the plan's index lists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch.utils.data import (
    Dataset,
    IterableDataset,
)

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.arrays import ArrayDataset, as_sliceable
from ddptrain.data.batch import pin_batch
from ddptrain.data.epoch import Micro, epoch_order, plan_epoch, steps_per_epoch
from ddptrain.data.iterable import IterableBatches
from ddptrain.data.loader import make_loader, read
from ddptrain.errors import ConfigError


class PlanSampler(torch.utils.data.Sampler[list[int]]):
    """Yields the index lists of the current epoch's plan (for a DataLoader)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class Batches(Protocol):
    """This rank's training batches, whatever the dataset: what the loop and a resume use."""

    steps_per_epoch: int
    stateful: bool  # whether `state_dict` holds a position inside an epoch

    def epoch(self, epoch: int, start: int) -> Iterator[tuple[Any, Micro, float]]:
        """(batch, its place in the epoch, seconds waited for it), from position `start`."""
        ...

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainBatches:
    """The training batches of this rank, epoch by epoch, in the planned layout."""

    def __init__(
        self, dataset: Dataset, config: TrainingConfig, ctx: DistributedContext,
        collate: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.dataset, self.config, self.ctx = dataset, config, ctx
        self.n = len(dataset)  # type: ignore[arg-type]
        if config.drop_last and self.n < ctx.data_world * config.batch_size:
            raise ConfigError(
                f"--drop_last with --batch_size {config.batch_size} on {ctx.data_world} "
                f"rank(s) drops all {self.n} training samples: lower --batch_size"
            )
        self.steps_per_epoch = steps_per_epoch(
            self.n, ctx.data_world, config.batch_size, config.grad_accum_steps, config.drop_last
        )
        # A TensorDataset is sliced a batch at a time, in this process or in each worker,
        # instead of collated sample by sample; a user's collate gets samples instead.
        if collate is None:
            dataset = self.dataset = as_sliceable(dataset)
        self.in_process = (
            isinstance(dataset, ArrayDataset) and config.num_workers == 0 and collate is None
        )
        self.sampler = PlanSampler()
        self.loader = None if self.in_process else make_loader(
            dataset, config, ctx, batch_sampler=self.sampler, collate=collate
        )

    def plan(self, epoch: int, start: int) -> tuple[torch.Tensor, list[Micro]]:
        # The config's batch layout as it is now: `--oom_backoff` lowers --batch_size (and
        # raises --grad_accum_steps as much) mid-epoch, and plans again from `start`, the
        # global sample its window began at; the steps of an epoch stay as they were.
        cfg, ctx = self.config, self.ctx
        plan = plan_epoch(
            self.n, ctx.data_world, ctx.data_rank, cfg.batch_size, cfg.grad_accum_steps,
            cfg.drop_last, start,
        )
        return epoch_order(self.n, cfg.seed, epoch), plan

    stateful = False  # the position in the plan is all a resume needs

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # nothing to restore: the plan is a function of (seed, epoch, position)

    def epoch(self, epoch: int, start: int) -> Iterator[tuple[Any, Micro, float]]:
        """(batch, its place in the plan, seconds waited for it) from position `start`."""
        order, plan = self.plan(epoch, start)
        it = self.batches(order, plan)
        try:
            for micro in plan:
                t0 = time.perf_counter()
                batch = next(it)
                yield batch, micro, time.perf_counter() - t0
        finally:
            it.close()  # now, not when collected: a prefetching thread ends with it

    def batches(self, order: torch.Tensor, plan: list[Micro]) -> Generator[Any, None, None]:
        if self.in_process:
            dataset: ArrayDataset = self.dataset  # type: ignore[assignment]
            if self.ctx.device.type != "cuda":
                for m in plan:
                    yield dataset.batch(order[m.lo : m.hi])
                return
            # Pinned for a GPU, as a DataLoader's are: the copy then overlaps the step.
            # The batches are a function of the plan alone, so the next one is sliced and
            # pinned in a thread while the step runs, off the training thread's path.
            yield from ahead(lambda m: pin_batch(dataset.batch(order[m.lo : m.hi])), plan)
            return
        assert self.loader is not None  # not in-process: a DataLoader was built
        self.sampler.batches = [order[m.lo : m.hi].tolist() for m in plan]
        yield from read(self.loader)


def ahead(make: Callable[[Micro], Any], plan: list[Micro]) -> Iterator[Any]:
    """`make(m)` for each micro-batch of `plan` in turn, the next one made in a
    background thread while the caller holds the one before. The thread ends with the
    generator, whether it is exhausted or closed."""
    if not plan:
        return
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddptrain-batches")
    try:
        pending = pool.submit(make, plan[0])
        for following in plan[1:]:
            ready = pending.result()
            pending = pool.submit(make, following)
            yield ready
        yield pending.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def make_train_batches(
    dataset: Dataset, config: TrainingConfig, ctx: DistributedContext,
    collate: Callable[[list[Any]], Any] | None = None,
) -> Batches:
    """`collate`: the user's (`--collate`), given a list of samples."""
    if isinstance(dataset, IterableDataset):
        return IterableBatches(dataset, config, ctx, collate)
    return TrainBatches(dataset, config, ctx, collate)
