"""A user's own dataset and model: `--dataset userplug:datasets --model userplug:model`."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddptrain.config import TrainingConfig


class _Labelled(TensorDataset):
    num_classes = 2


def datasets(config: TrainingConfig) -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(config.seed)
    x = torch.randn(256, 4, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return _Labelled(x[:192], y[:192]), _Labelled(x[192:], y[192:])


def model(config: TrainingConfig) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
