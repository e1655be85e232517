"""A model with a branch that some steps leave out, named as `--model unusedplug:branchy`:
the parameters DDP waits for in vain unless told (`--find_unused_parameters`), or, with
`--model_args every=0`, a branch that is never taken (the same graph on every step:
`--static_graph` fits it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Branchy(nn.Module):
    """A linear model plus a branch taken on every `every`-th training forward (0: never).
    The count runs over this process's forwards, so a rank and a single process with the
    same global micro-batches take it on the same ones."""

    def __init__(self, in_features: int, outputs: int, every: int) -> None:
        super().__init__()
        self.body = nn.Linear(in_features, outputs)
        self.branch = nn.Linear(in_features, outputs)
        self.every, self.forwards = every, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.training:
            take = self.every > 0 and self.forwards % self.every == 0
            self.forwards += 1
            if take:
                out = out + self.branch(x)
        return out


def branchy(config: Any, input_shape: tuple[int, ...], outputs: int, every: int = 2) -> nn.Module:
    return Branchy(input_shape[0], outputs, int(every))
