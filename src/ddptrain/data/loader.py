"""The DataLoader every path uses: seeded per rank, workers that leave signals to the main
process, pinned memory on a GPU, pre-batched datasets passed through.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
)

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.arrays import pass_through


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


def make_loader(
    dataset: Dataset, config: TrainingConfig, ctx: DistributedContext, persistent: bool = True,
    **kwargs: Any,
) -> DataLoader:
    generator = torch.Generator()
    generator.manual_seed(config.seed + ctx.rank)
    workers = config.num_workers
    batched = hasattr(dataset, "__getitems__") and hasattr(dataset, "batch")
    return DataLoader(
        dataset,
        num_workers=workers,
        collate_fn=pass_through if batched else None,
        pin_memory=ctx.device.type == "cuda",  # page-locked memory only helps a GPU copy
        persistent_workers=persistent and workers > 0,
        worker_init_fn=seed_worker if workers > 0 else None,
        generator=generator,
        **kwargs,
    )
