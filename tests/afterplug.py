"""A run to evaluate and predict with: `--dataset afterplug:pair --model afterplug:net`,
whose validation set has 101 samples (an odd count: shards of 51 and 50 on 2 ranks)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddptrain.config import TrainingConfig

FEATURES = 5


def samples(n_train: int = 64, n_val: int = 101) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_val, FEATURES, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def pair(config: TrainingConfig, n_val: int = 101) -> tuple[TensorDataset, TensorDataset]:
    x, y = samples(n_val=n_val)
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


def net(config: TrainingConfig, outputs: int = 2) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, outputs))


def whole(config: TrainingConfig, n: int = 37) -> TensorDataset:
    """New data, one dataset (which training would split by --val_fraction): 37 samples."""
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(1))
    return TensorDataset(x, (x[:, 0] > 0).long())
