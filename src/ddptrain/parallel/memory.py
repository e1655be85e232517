"""Bytes per rank a strategy implies for a model: parameters, gradients and optimizer state,
before anything is built (the plan, `--dry_run`, `ddptrain doctor --parameters`), and so
the largest model each strategy fits on one device.
"""

from __future__ import annotations

import math
import os

import torch

from ddptrain.config import TrainingConfig

STRATEGY_NAMES = ("ddp", "zero", "fsdp")


def optimizer_slots(config: TrainingConfig) -> int:
    """Tensors of a parameter's size the optimizer keeps: AdamW's two moments, SGD's
    momentum buffer (none without momentum); a user's optimizer is counted as Adam-like."""
    if config.optimizer != "sgd":
        return 2
    return 1 if config.momentum else 0


def implied_bytes(strategy: str, world_size: int, parameters: int, slots: int,
                  trained: int | None = None, freed: int = 0) -> dict[str, int]:
    """fp32 bytes of parameters, gradients and optimizer state one rank holds; gradients
    and optimizer state only of the `trained` parameters (default: all of them); the
    parameters `freed` bytes fewer (`--lora_quantize nf4`'s 4-bit base, whole model)."""
    trained = parameters if trained is None else trained
    full = 4 * parameters - freed
    shard = 4 * math.ceil(parameters / world_size) - math.ceil(freed / world_size)
    grads, grad_shard = 4 * trained, 4 * math.ceil(trained / world_size)
    if strategy == "fsdp":
        return {"params": shard, "grads": grad_shard, "optimizer": slots * grad_shard}
    if strategy == "zero":
        return {"params": full, "grads": grads, "optimizer": slots * grad_shard}
    return {"params": full, "grads": grads, "optimizer": slots * grads}


def device_memory(device: torch.device | str, local_ranks: int = 1) -> int | None:
    """Bytes one rank's device has: a GPU's total memory; on CPU the host's memory shared
    by the `local_ranks` ranks on it. None where it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device() if device.index is None else device.index
        return int(torch.cuda.get_device_properties(index).total_memory)
    if device.type == "cpu":
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not a POSIX host
            return None
        return host // max(1, local_ranks)
    return None


def largest_models(device_bytes: int, world_size: int, slots: int) -> dict[str, int]:
    """Parameters each strategy fits in `device_bytes` per rank: its fp32 parameters,
    gradients and optimizer state (activations and workspace not counted)."""
    probe = 10**9  # large enough that the rounding of a shard does not show
    held = {n: sum(implied_bytes(n, world_size, probe, slots).values()) for n in STRATEGY_NAMES}
    return {name: device_bytes * probe // b for name, b in held.items()}


def human_count(n: float) -> str:
    """125M, 1.3B: a parameter count as people say it."""
    if n >= 10**9:
        return f"{n / 10**9:.1f}B"
    return f"{n / 10**6:.0f}M" if n >= 10**7 else f"{n / 10**6:.1f}M"


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
