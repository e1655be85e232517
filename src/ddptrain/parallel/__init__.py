"""How the model is spread over the ranks: one `Strategy` interface, one file per way
(`ddp`, `zero`, `fsdp`), chosen once by `resolve_strategy`; `memory` says what each implies
per rank. A new parallelism is a new file here and a line in `resolve.STRATEGIES`."""

from __future__ import annotations

from ddptrain.parallel.base import NO_CONTEXT, OptimizerSpec, Strategy
from ddptrain.parallel.ddp import DDP
from ddptrain.parallel.fsdp import FSDP, fsdp_blocks
from ddptrain.parallel.memory import format_bytes, implied_bytes
from ddptrain.parallel.resolve import StrategyChoice, resolve_strategy
from ddptrain.parallel.zero import Zero

__all__ = [
    "DDP",
    "FSDP",
    "NO_CONTEXT",
    "OptimizerSpec",
    "Strategy",
    "StrategyChoice",
    "Zero",
    "format_bytes",
    "fsdp_blocks",
    "implied_bytes",
    "resolve_strategy",
]
