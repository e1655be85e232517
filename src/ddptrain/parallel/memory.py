"""Bytes per rank a strategy implies for a model: parameters, gradients and optimizer state,
before anything is built (the plan, `--dry_run`, `ddptrain doctor --parameters`).
"""

from __future__ import annotations

import math

from ddptrain.config import TrainingConfig


def optimizer_slots(config: TrainingConfig) -> int:
    """Tensors of a parameter's size the optimizer keeps: AdamW's two moments, SGD's
    momentum buffer (none without momentum)."""
    if config.optimizer == "adamw":
        return 2
    return 1 if config.momentum else 0


def implied_bytes(strategy: str, world_size: int, parameters: int, slots: int) -> dict[str, int]:
    """fp32 bytes of parameters, gradients and optimizer state one rank holds."""
    full, shard = 4 * parameters, 4 * math.ceil(parameters / world_size)
    if strategy == "fsdp":
        return {"params": shard, "grads": shard, "optimizer": slots * shard}
    if strategy == "zero":
        return {"params": full, "grads": full, "optimizer": slots * shard}
    return {"params": full, "grads": full, "optimizer": slots * full}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_bytes(figures: dict[str, int]) -> str:
    total = sum(figures.values())
    return (
        f"params {human_bytes(figures['params'])}, grads {human_bytes(figures['grads'])}, "
        f"optimizer {human_bytes(figures['optimizer'])} = {human_bytes(total)} per rank"
    )
