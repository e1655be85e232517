"""User code for tests/test_finetune_parts.py: an optimizer factory with groups of its
own, a scheduler factory, and a model of repeated blocks that counts their forwards.

    --optimizer optimplug:grouped --optimizer_args head=net.5 backbone_scale=0.1
    --scheduler optimplug:halving --scheduler_args every=4
    --model optimplug:stack --model_args depth=4
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from torch import nn


def grouped(
    config: Any, model: nn.Module, head: str = "head", backbone_scale: float = 0.1,
    weight_decay: float = 0.01,
) -> torch.optim.Optimizer:
    """AdamW in four groups: the backbone (every parameter outside `head`) at
    `backbone_scale` x --lr, the head at --lr; no weight decay on biases."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        in_head = name == head or name.startswith(head + ".")
        groups.setdefault((in_head, name.endswith("bias")), []).append(p)
    return torch.optim.AdamW(
        [
            {"params": params, "lr": config.lr * (1.0 if in_head else backbone_scale),
             "weight_decay": 0.0 if bias else weight_decay}
            for (in_head, bias), params in sorted(groups.items())
        ],
        lr=config.lr,
    )


def halving(
    config: Any, optimizer: torch.optim.Optimizer, total_steps: int, steps_per_epoch: int,
    warmup_steps: float, every: int = 4,
) -> torch.optim.lr_scheduler.LRScheduler:
    """Halve every group's LR every `every` steps (a chainable scheduler: it reads each
    group's current LR, so a resume must give it back exactly)."""
    assert total_steps == steps_per_epoch * config.epochs, (total_steps, steps_per_epoch)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=every, gamma=0.5)


def not_an_optimizer(config: Any, model: nn.Module) -> object:
    return object()


class Block(nn.Module):
    """Linear, LayerNorm, GELU, dropout, residual; counts its forwards (a recomputed
    forward in backward counts too)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(0.1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(torch.nn.functional.gelu(self.norm(self.fc(x))))


class Stack(nn.Module):
    def __init__(self, features: int, outputs: int, depth: int, width: int) -> None:
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, outputs)
        self.kill_at = int(os.environ.get("GUARD_KILL_AT", "0"))
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.kill_at and os.environ.get("RANK", "0") == "1":
            self.forwards += 1  # SIGKILL this rank at its GUARD_KILL_AT-th training forward
            if self.forwards == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stack(
    config: Any, input_shape: tuple[int, ...], outputs: int, depth: int = 4, width: int = 32
) -> nn.Module:
    return Stack(input_shape[0], outputs, depth, width)
