"""A model with every kind of tensor fsdp must fill at start-up, and a rank's worker that
watches how much of it the training module holds meanwhile: `--model metaplug:wide`.

`Wide`: a first layer, `depth` blocks (Linear + BatchNorm, what fsdp shards one by one)
and a head; its BatchNorm statistics are drawn from the seeded generator (a template's
persistent buffers must arrive as they are), and it keeps a buffer outside the state dict,
also drawn (only a copy of rank 0's gives it the eager value).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ddptrain.config import TrainingConfig
from ddptrain.data.sources import load_data
from ddptrain.launch.process_group import setup_distributed, teardown_distributed
from ddptrain.parallel import DDP, FSDP, Strategy
from ddptrain.train.plan import resolve
from ddptrain.train.trainer import Trainer


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        with torch.no_grad():
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.fc(x)))


class Wide(nn.Module):
    def __init__(self, features: int, outputs: int, width: int, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, outputs)
        self.register_buffer("gain", torch.rand(width) + 0.5, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * self.gain
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def wide(config: TrainingConfig, input_shape: tuple[int, ...], outputs: int) -> Wide:
    return Wide(math.prod(input_shape), outputs, config.width)


def held_bytes(module: nn.Module) -> int:
    """Bytes of the storage behind `module`'s parameters and buffers that is real (not on
    the meta device): a sharded parameter counts its local shard (padding included)."""
    seen: set[int] = set()
    total = 0
    for t in itertools.chain(module.parameters(), module.buffers()):
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.is_meta:
            continue
        storage = local.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


class _Watch(TorchDispatchMode):
    """After every tensor operation, how much the watched module holds (the peak)."""

    def __init__(self) -> None:
        super().__init__()
        self.module: nn.Module | None = None
        self.peak = self.samples = 0

    def sample(self) -> None:
        if self.module is not None:
            self.peak = max(self.peak, held_bytes(self.module))
            self.samples += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


def watch_setups(rank: int, jobs: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
    """For each job (the config's fields, and `"flag"`: the model from `--model`, or
    `"factory"`: handed to the trainer as a factory, as `fit(model=fn)` does), build the
    trainer in one process group and report the peak bytes its training module held from
    the moment the strategy receives it until the trainer is built, sampled after every
    tensor operation; then the whole weights (rank 0) and this rank's buffers.

    The training module is the one object the strategy sets up: on a GPU it lives on the
    device. Rank 0's template (fsdp) is another module, in host memory, and not counted:
    on this CPU-only machine both are host memory, hence the module's own storage is
    counted, not the process's."""
    configs = [TrainingConfig(**overrides).validate() for overrides, _ in jobs]
    ctx = setup_distributed(configs[0])
    originals = {c: c.__dict__.get("setup_module") for c in (Strategy, DDP, FSDP)}
    clean = False
    try:
        results = [_watch_one(ctx, config, given, originals)
                   for config, (_, given) in zip(configs, jobs, strict=True)]
        clean = True
    finally:
        for c, real in originals.items():
            if real is not None:
                c.setup_module = real  # type: ignore[method-assign]
        teardown_distributed(clean)
    return results


def _watch_one(ctx: Any, config: TrainingConfig, given: str, originals: dict[type, Any]
               ) -> dict[str, Any]:
    watch = _Watch()

    def watched(self: Strategy, module: nn.Module, _real: Any) -> nn.Module:
        watch.module = module
        watch.sample()  # what the strategy was handed
        watch.__enter__()
        return _real(self, module)

    for c, real in originals.items():
        if real is not None:
            c.setup_module = functools.partialmethod(watched, _real=real)  # type: ignore[method-assign]
    data = load_data(config)
    module = None
    if given == "factory":
        module = functools.partial(wide, config, data.facts.input_shape, 3)
    try:
        trainer = Trainer(resolve(config, data, ctx.world_size, ctx.device), ctx, module=module)
    finally:
        if watch.module is not None:
            watch.__exit__(None, None, None)
    watch.sample()
    state = trainer.strategy.model_state(trainer.module)  # collective under fsdp
    return {
        "peak": watch.peak, "samples": watch.samples,
        "state": {k: v.detach().cpu().clone() for k, v in state.items()},
        "buffers": {k: v.detach().cpu().clone() for k, v in trainer.module.named_buffers()},
    }
