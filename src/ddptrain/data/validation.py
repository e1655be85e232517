"""Evaluation batches: rank r takes samples r, r+N, ... with no padding, so every
validation sample counts once on any world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    Dataset,
    IterableDataset,
)

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.arrays import ArrayDataset, as_sliceable
from ddptrain.data.batch import pin_batch
from ddptrain.data.iterable import make_iterable_loader
from ddptrain.data.loader import make_loader


# ---------------------------------------------------------------------- validation
class ShardSampler(torch.utils.data.Sampler[int]):
    """Evaluation shard: rank r takes samples r, r+N, ... with no padding.

    DistributedSampler pads the last round with repeated samples, which would count them
    twice in validation metrics; shards here may differ in length by one instead.
    """

    def __init__(self, n: int, ctx: DistributedContext) -> None:
        self.indices = range(ctx.data_rank, n, ctx.data_world)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def most_val_batches(dataset: Dataset, batch_size: int, ctx: DistributedContext) -> int | None:
    """The most validation batches any rank's shard holds (rank 0's: samples 0, N, 2N,
    ...), which every rank knows without asking its peers; None for a stream, whose
    length no rank knows."""
    if isinstance(dataset, IterableDataset):
        return None
    most = -(-len(dataset) // ctx.data_world)  # type: ignore[arg-type]
    return -(-most // batch_size)


def make_val_loader(
    dataset: Dataset, config: TrainingConfig, ctx: DistributedContext,
    collate: Callable[[list[Any]], Any] | None = None,
) -> Any:
    """`collate`: the user's (`--collate`), given a list of samples."""
    if isinstance(dataset, IterableDataset):
        return make_iterable_loader(dataset, config, ctx, collate=collate)
    indices = torch.arange(ctx.data_rank, len(dataset), ctx.data_world)  # type: ignore[arg-type]
    if collate is None:
        dataset = as_sliceable(dataset)
        if isinstance(dataset, ArrayDataset) and config.num_workers == 0:
            return _ArrayBatches(dataset, indices, config.batch_size, ctx.device.type == "cuda")
    return make_loader(dataset, config, ctx, batch_size=config.batch_size,
                       sampler=ShardSampler(len(dataset), ctx),  # type: ignore[arg-type]
                       collate=collate)


class _ArrayBatches:
    """Validation batches of an in-memory dataset, sliced in-process."""

    def __init__(
        self, dataset: ArrayDataset, indices: torch.Tensor, batch_size: int, pin: bool = False
    ) -> None:
        self.dataset, self.indices, self.batch_size = dataset, indices, batch_size
        self.pin = pin  # page-locked for a GPU's non-blocking copy

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, len(self.indices), self.batch_size):
            batch = self.dataset.batch(self.indices[i : i + self.batch_size])
            yield pin_batch(batch) if self.pin else batch
