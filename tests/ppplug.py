"""A user model and its pipeline split: `--model ppplug:mlp --pp_split ppplug:split`.

`mlp` is a plain `nn.Sequential` of Linear + Tanh layers; `split` gives stage `s` of `n`
its share of the layers as a new Sequential over the model's own layer modules (not
copies), so the names the model gives them stay those of the checkpoint.
"""

from __future__ import annotations

import math

from torch import nn

from ddptrain.config import TrainingConfig


def mlp(config: TrainingConfig, input_shape: tuple[int, ...], outputs: int) -> nn.Sequential:
    width = config.width
    return nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.Tanh(),
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, outputs),
    )


def split(model: nn.Module, stage: int, stages: int) -> nn.Module:
    layers = list(model.children())
    lo, hi = stage * len(layers) // stages, (stage + 1) * len(layers) // stages
    return nn.Sequential(*layers[lo:hi])
