"""A user's own dataset, as `--dataset bench.userdata:tabular` hands it to ddptrain.

    torchrun --standalone --nproc_per_node=2 -m ddptrain train \
        --dataset bench.userdata:tabular --num_classes 2 --batch_size 32

Plain map-style `TensorDataset`s, nothing ddptrain-specific: ddptrain meets them through
its user-dataset path (`--dataset module:fn`), while the hand-written loop, Fabric and
Accelerate read the same datasets through a plain DataLoader with the default collate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset


def tabular(
    config: Any, n: int = 20_000, features: int = 30, classes: int = 2,
    val_fraction: float = 0.2,
) -> tuple[TensorDataset, TensorDataset]:
    """`(train, val)`: standard-normal features whose classes follow a fixed random linear
    map, with label noise, so there is something to learn but no run reaches 100 %."""
    g = torch.Generator().manual_seed(getattr(config, "seed", 0))
    x = torch.randn(n, features, generator=g)
    weights = torch.randn(features, classes, generator=g)
    logits = x @ weights + 0.5 * torch.randn(n, classes, generator=g)
    y = logits.argmax(dim=1)
    n_val = round(n * val_fraction)
    # A fixed permutation: every rank and every contestant get the same split.
    perm = torch.randperm(n, generator=g)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[val_idx], y[val_idx])
