"""The optimizer and the learning-rate schedule: linear warm-up, then cosine decay to 0."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from ddptrain.config import TrainingConfig


def warmup_cosine(warmup_steps: float, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warm-up to 1, then cosine decay to 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        span = max(1.0, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def peak_lr(config: TrainingConfig, world_size: int) -> float:
    """`--lr`, times the global/per-rank batch ratio under the linear scaling rule."""
    return config.lr * (world_size * config.grad_accum_steps if config.scale_lr else 1)


def optimizer_spec(config: TrainingConfig, lr: float) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and its arguments (a sharding strategy builds it its own way)."""
    if config.optimizer == "adamw":
        return torch.optim.AdamW, {"lr": lr, "weight_decay": config.weight_decay}
    return torch.optim.SGD, {
        "lr": lr, "momentum": config.momentum, "weight_decay": config.weight_decay
    }


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: float, total_steps: int
) -> LambdaLR:
    return LambdaLR(optimizer, warmup_cosine(warmup_steps, total_steps))
