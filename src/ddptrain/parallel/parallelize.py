"""One order for every layout: the passes that turn the user's module into the model a rank
trains, each applied where its flag or the layout asks for it.

    parallelize(module, strategy, config, ctx)  # -> the model the step calls, frozen count

1. freeze (`--freeze`, a LoRA run): `requires_grad` off by name (`parts.freeze`)
2. float8 (`--float8`): linears swapped for torchao's, before any split (`parts.to_float8`)
3. tp (`--tp`): layers split over the mesh's tp ranks (`tp.tensor_parallel`)
4. cp (`--cp`): attention over the sequence slices of the cp ranks
   (`cp.context_parallel`; after tp: it divides a rank's heads)
5. ep (`--ep`): each rank keeps its experts (`ep.expert_parallel`)
6. activation checkpointing (`--activation_checkpointing`): blocks recompute in backward
   (`parts.checkpoint_activations`)
7. the strategy (always, `Strategy.setup_module`): pp's stages cut; FSDP/HSDP shards, or
   DDP/ZeRO wraps; each rank's weights allocated and filled
8. compile (`--compile`, `compile_pass`): once a checkpoint is loaded, as a resume may
   build DDP's wrapper again

Each pass takes the module as the one before left it, on the meta device where the
strategy builds it there (fsdp, tp, pp): nothing is allocated before the strategy's pass
allocates each rank's own part. A new dimension is a pass here, in its place in
`PASSES`, and a degree in `ddptrain.layout.Layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.layout import Layout
from ddptrain.parallel.base import Strategy
from ddptrain.parallel.cp import context_parallel
from ddptrain.parallel.ep import expert_parallel
from ddptrain.parallel.parts import checkpoint_activations, freeze, to_float8
from ddptrain.parallel.tp import tensor_parallel


@dataclass(frozen=True)
class Step:
    """What a pass sees: the run's flags, this rank's place, the job's layout, the
    float8 recipe (`Precision.float8`)."""

    config: TrainingConfig
    ctx: DistributedContext
    layout: Layout
    float8: str


@dataclass(frozen=True)
class Pass:
    name: str
    applies: Callable[[Step], bool]
    run: Callable[[nn.Module, Step], Any]


PASSES: tuple[Pass, ...] = (
    Pass("freeze", lambda s: bool(s.config.freeze),
         lambda m, s: freeze(m, s.config.freeze)),
    # torchao swaps whole modules: before any split, as its tensor-parallel styles expect;
    # under fsdp the tensorwise all-gather then sends float8
    Pass("float8", lambda s: s.float8 != "off",
         lambda m, s: to_float8(m, s.float8, s.config.strategy == "fsdp"
                                and s.ctx.world_size > 1)),
    Pass("tp", lambda s: s.layout.tp > 1,
         lambda m, s: tensor_parallel(m, s.config, s.ctx)),
    Pass("cp", lambda s: s.layout.cp > 1,
         lambda m, s: context_parallel(m, s.ctx, s.layout.cp)),
    Pass("ep", lambda s: s.layout.ep > 1,
         lambda m, s: expert_parallel(m, s.ctx, s.layout.ep)),
    Pass("activation checkpointing", lambda s: s.config.activation_checkpointing != "off",
         lambda m, s: checkpoint_activations(m, s.config.fsdp_wrap,
                                             s.config.activation_checkpointing)),
)


def parallelize(
    module: nn.Module, strategy: Strategy, config: TrainingConfig, ctx: DistributedContext,
    float8: str = "off",
) -> tuple[Any, int]:
    """`PASSES` in order on `module` (in place), then the strategy's: returns the model the
    step calls (a wrapper of `module`, or itself) and the element count that does not
    train (`--freeze`'s, a LoRA run's base)."""
    step = Step(config, ctx, Layout.of(config, ctx.world_size), float8)
    for p in PASSES:
        if p.applies(step):
            p.run(module, step)
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return strategy.setup_module(module), frozen


def compile_pass(strategy: Strategy, model: Any) -> Any:
    """The last pass, `--compile`: ddp, zero compile the wrapper; fsdp, tp each block
    (`Strategy.compile`)."""
    return strategy.compile(model)


def applied(config: TrainingConfig, world_size: int, float8: str = "off") -> list[str]:
    """The names of the passes a run of `config` on `world_size` ranks applies, in order
    (the strategy's last): what `ddptrain plan` and the docs show."""
    step = Step(config, DistributedContext(0, 0, world_size, torch.device("cpu")),
                Layout.of(config, world_size), float8)
    names = [p.name for p in PASSES if p.applies(step)]
    return [*names, "strategy", *(["compile"] if config.compile else [])]
