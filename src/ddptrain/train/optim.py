"""The optimizer, its parameter groups, and the learning-rate schedule.

Built in: SGD or AdamW over parameter groups. Weight decay is off for biases and
normalisation weights (every parameter of fewer than 2 dimensions, and every parameter of a
normalisation layer), as the Hugging Face Trainer and torchtitan do; `--decay_all` puts it
back on everything. `--lr_scale GLOB=FACTOR` gives the matching parameters FACTOR times
the learning rate (the first matching pattern counts). Parameters of one (scale, decay)
pair form one group; the schedule scales every group's own peak.

Yours: `--optimizer package.module:fn` is called `fn(config, model, **optimizer_args)` and
returns a torch optimizer over `model.parameters()` (or groups of them; the model's own
parameter names, whatever the strategy: under fsdp its parameters are already the
shards); `--scheduler package.module:fn` is called `fn(config, optimizer, total_steps=,
steps_per_epoch=, warmup_steps=, **scheduler_args)` and returns an LR scheduler, stepped
once per optimizer step. Both are checkpointed (their `state_dict`) and resumed exactly.

    ddptrain train --optimizer adamw --lr_scale 'layers.0.*=0.1' --weight_decay 0.05
    ddptrain train --optimizer mypkg.optim:build --optimizer_args backbone_lr=1e-4
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from ddptrain.config import BUILTIN_OPTIMIZERS, TrainingConfig
from ddptrain.errors import ConfigError
from ddptrain.parallel import Strategy
from ddptrain.parallel.parts import matches
from ddptrain.plugins import call_factory

log = logging.getLogger("ddptrain")

# Layers whose weights are gains and offsets, not projections: no weight decay.
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm,
    *([nn.RMSNorm] if hasattr(nn, "RMSNorm") else []),
)


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


@dataclass
class Group:
    """One parameter group of the built-in optimizer: its parameters' names, its LR
    factor and whether it decays."""

    scale: float
    decay: bool
    names: list[str] = field(default_factory=list)
    count: int = 0  # elements

    def describe(self, peak: float, weight_decay: float) -> str:
        decay = f"weight decay {weight_decay:g}" if self.decay else "no weight decay"
        return (f"{len(self.names)} tensors ({self.count:,} parameters): lr {peak * self.scale:g}"
                f"{f' (x{self.scale:g})' if self.scale != 1 else ''}, {decay}")


def param_groups(module: nn.Module, config: TrainingConfig) -> list[Group]:
    """The trainable parameters of `module` in groups of one LR factor and one decay
    setting, each in parameter order."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    scales = matches([n for n, _ in named], config.lr_scale, "lr_scale")
    no_decay = set() if config.decay_all else _no_decay(module)
    groups: dict[tuple[float, bool], Group] = {}
    for name, p in named:
        scale = next((float(f) for g, f in config.lr_scale.items() if name in scales[g]), 1.0)
        decay = id(p) not in no_decay
        group = groups.setdefault((scale, decay), Group(scale, decay))
        group.names.append(name)
        group.count += p.numel()
    # The main group (x1, with decay) first: the logged `lr` is group 0's.
    return sorted(groups.values(), key=lambda g: (g.scale != 1, not g.decay))


def _no_decay(module: nn.Module) -> set[int]:
    """ids of biases and normalisation weights: 1-D (or 0-D) parameters and every
    parameter of a normalisation layer."""
    ids = {id(p) for p in module.parameters() if p.dim() < 2}
    for mod in module.modules():
        if isinstance(mod, NORM_LAYERS):
            ids.update(id(p) for p in mod.parameters(recurse=False))
    return ids


@dataclass
class Optimization:
    """What the trainer steps, and how it was made (the plan's lines, the resume)."""

    optimizer: torch.optim.Optimizer
    groups: list[Group] | None  # the built-in optimizer's groups; None: the user's own
    lines: list[str]


def build_optimizer(
    config: TrainingConfig, module: nn.Module, strategy: Strategy, world_size: int
) -> Optimization:
    """The optimizer over `module`'s trainable parameters (after `setup_module`: under
    fsdp they are its shards, under the same names)."""
    peak = peak_lr(config, world_size)
    if config.optimizer in BUILTIN_OPTIMIZERS:
        groups = param_groups(module, config)
        named = dict(module.named_parameters())
        torch_groups = [
            {"params": [named[n] for n in g.names], "lr": peak * g.scale,
             "weight_decay": config.weight_decay if g.decay else 0.0}
            for g in groups
        ]
        optimizer = strategy.build_optimizer(module, optimizer_spec(config, peak), torch_groups)
        return Optimization(optimizer, groups, [g.describe(peak, config.weight_decay)
                                                for g in groups])
    made = call_factory(config.optimizer, "optimizer", config, config.optimizer_args, {},
                        positional=(module,))
    if not isinstance(made, torch.optim.Optimizer):
        raise ConfigError(
            f"--optimizer {config.optimizer!r} returned {type(made).__name__}, not a "
            "torch.optim.Optimizer: return e.g. torch.optim.AdamW(model.parameters())"
        )
    _drop_frozen(made, module)
    lines = _describe(made)
    return Optimization(strategy.adopt_optimizer(made), None, lines)


def _drop_frozen(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """A user's optimizer over every parameter keeps only those that train (`--freeze`),
    and only the module's own: anything else could not be checkpointed by name."""
    own = {id(p) for p in module.parameters()}
    strangers = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
    if strangers:
        raise ConfigError(
            f"the optimizer from --optimizer holds {len(strangers)} tensor(s) that are not "
            "parameters of the model it was given: build it over model.parameters()"
        )
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if p.requires_grad]
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]


def _describe(optimizer: torch.optim.Optimizer) -> list[str]:
    lines = []
    for group in optimizer.param_groups:
        count = sum(p.numel() for p in group["params"])
        wd = group.get("weight_decay")
        decay = "no weight decay" if not wd else f"weight decay {wd:g}"
        lines.append(f"{len(group['params'])} tensors ({count:,} parameters): "
                     f"lr {group['lr']:g}, {decay}")
    return lines


def build_scheduler(
    config: TrainingConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
    total_steps: int,
) -> LRScheduler:
    """Built in: linear warm-up over `--warmup_epochs`, then cosine to 0 at the end."""
    warmup_steps = config.warmup_epochs * steps_per_epoch
    if config.scheduler == "cosine":
        return LambdaLR(optimizer, warmup_cosine(warmup_steps, total_steps))
    made = call_factory(
        config.scheduler, "scheduler", config, config.scheduler_args,
        {"total_steps": total_steps, "steps_per_epoch": steps_per_epoch,
         "warmup_steps": warmup_steps},
        positional=(optimizer,),
    )
    if not isinstance(made, LRScheduler):
        raise ConfigError(
            f"--scheduler {config.scheduler!r} returned {type(made).__name__}, not a "
            "torch.optim.lr_scheduler.LRScheduler"
        )
    return made
