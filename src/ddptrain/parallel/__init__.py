"""How the model is spread over the ranks: the passes in their one order (`parallelize`),
then one `Strategy` for what differs at run time (`ddp` with `zero`'s optimizer, `fsdp`,
`pp`), chosen once by `resolve_strategy`; `memory` says what each implies per rank. A new
dimension is a pass in `parallelize.PASSES` and a degree in `ddptrain.layout.Layout`."""

from __future__ import annotations

from ddptrain.parallel.base import NO_CONTEXT, OptimizerSpec, Strategy
from ddptrain.parallel.ddp import DDP
from ddptrain.parallel.fsdp import FSDP, fsdp_blocks
from ddptrain.parallel.memory import format_bytes, implied_bytes
from ddptrain.parallel.parallelize import PASSES, parallelize
from ddptrain.parallel.resolve import StrategyChoice, resolve_strategy

__all__ = [
    "DDP",
    "FSDP",
    "NO_CONTEXT",
    "PASSES",
    "OptimizerSpec",
    "Strategy",
    "StrategyChoice",
    "format_bytes",
    "fsdp_blocks",
    "implied_bytes",
    "parallelize",
    "resolve_strategy",
]
