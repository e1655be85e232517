"""The DataLoader every path uses: seeded per rank, workers that leave signals to the main
process, pinned memory on a GPU, pre-batched datasets passed through.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    default_collate,
)

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.arrays import pass_through
from ddptrain.errors import ConfigError


def seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; python and numpy follow it
    # so that augmentations in user datasets differ across workers and ranks. Workers
    # leave SIGINT/SIGTERM to the main process, which decides when to stop.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


class CollateError(ConfigError):
    """Samples that do not make a batch. Raised in a DataLoader worker, it comes back to
    the main process wrapped in the worker's traceback: its own line is kept."""

    def __init__(self, message: str) -> None:
        if message.startswith("Caught "):  # the worker's wrapping: keep the last line
            message = message.rstrip().splitlines()[-1].partition(": ")[2] or message
        super().__init__(message)


def stack_samples(samples: list[Any]) -> Any:
    """torch's default collate, with samples of unequal sizes told as one line."""
    try:
        return default_collate(samples)
    except RuntimeError:
        where = _unequal(samples)
        if where is None:
            raise
        raise CollateError(
            f"the samples of a batch differ in size ({where}), so they cannot be stacked: "
            "pad them with --collate package.module:fn (collate= in ddptrain.fit), a "
            "function from a list of samples to a batch"
        ) from None


def _unequal(samples: list[Any]) -> str | None:
    """Where the samples' tensors first differ in shape: 'input_ids: (7,) and (4,)'."""
    shapes: dict[str, tuple[int, ...]] = {}
    for sample in samples:
        for name, shape in _shapes(sample, ""):
            if shapes.setdefault(name, shape) != shape:
                label = f"{name}: " if name else ""
                return f"{label}{tuple(shapes[name])} and {tuple(shape)}"
    return None


def _shapes(value: Any, name: str) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(value, torch.Tensor):
        return [(name, tuple(value.shape))]
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in _shapes(v, f"{name}.{k}" if name else k)]
    if isinstance(value, (list, tuple)):
        return [s for i, v in enumerate(value) for s in _shapes(v, f"{name}[{i}]")]
    return []


def is_batched(dataset: Any) -> bool:
    """ddptrain's pre-batched protocol: `__getitems__` returns a whole batch, `batch`."""
    return hasattr(dataset, "__getitems__") and hasattr(dataset, "batch")


class Samples(Dataset):
    """A pre-batched dataset read sample by sample, for a user's collate."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]


def make_loader(
    dataset: Dataset, config: TrainingConfig, ctx: DistributedContext, persistent: bool = True,
    collate: Callable[[list[Any]], Any] | None = None, **kwargs: Any,
) -> DataLoader:
    """`collate`: the user's, given a list of samples (a pre-batched dataset is then read
    sample by sample); without it, pre-batched data passes through and other samples are
    stacked."""
    generator = torch.Generator()
    generator.manual_seed(config.seed + ctx.data_rank)
    workers = config.num_workers
    if collate is not None and is_batched(dataset):
        dataset = Samples(dataset)
    collate_fn = collate or (pass_through if is_batched(dataset) else stack_samples)
    return DataLoader(
        dataset,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=ctx.device.type == "cuda",  # page-locked memory only helps a GPU copy
        persistent_workers=persistent and workers > 0,
        worker_init_fn=seed_worker if workers > 0 else None,
        generator=generator,
        **kwargs,
    )


def stop_workers(*loaders: Any) -> None:
    """Shut down the persistent workers of these DataLoaders. A run that ends on an error
    may leave their iterator to the cyclic collector, and the workers, which leave SIGTERM
    to the main process, would keep the interpreter's exit waiting for them."""
    for loader in loaders:
        it = getattr(loader, "_iterator", None)
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
