"""Mixed precision: which autocast dtype a run uses, and whether it needs a GradScaler."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ddptrain.config import TrainingConfig
from ddptrain.errors import ConfigError
from ddptrain.parallel import NO_CONTEXT


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype | None  # autocast dtype; None: full precision
    scaler: bool  # a GradScaler only earns its cost for float16
    device_type: str = "cpu"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return NO_CONTEXT
        return torch.autocast(self.device_type, dtype=self.dtype)

    def describe(self) -> str:
        if self.dtype is None:
            return "float32"
        name = str(self.dtype).removeprefix("torch.")
        return f"{name} autocast" + (" + GradScaler" if self.scaler else "")


def native_bf16(device: torch.device) -> bool:
    """Whether this CUDA device computes bfloat16 in hardware (compute capability 8.0+)."""
    try:
        return torch.cuda.get_device_capability(device) >= (8, 0)
    except (RuntimeError, AssertionError, ValueError):
        return False


def resolve_precision(config: TrainingConfig, device: torch.device) -> Precision:
    kind = device.type
    if not config.use_amp:
        return Precision(None, False, kind)
    if kind == "cuda":
        # auto: bfloat16 where the GPU computes it natively (Ampere and later: fp32's range,
        # no loss scaling), float16 + GradScaler on older GPUs.
        bf16 = config.amp_dtype == "bfloat16" or (
            config.amp_dtype == "auto" and native_bf16(device)
        )
        dtype = torch.bfloat16 if bf16 else torch.float16
        return Precision(dtype, dtype == torch.float16, kind)
    if config.amp_dtype == "bfloat16":
        return Precision(torch.bfloat16, False, kind)
    if config.amp_dtype == "float16":
        raise ConfigError(
            "--amp_dtype 'float16' is invalid on CPU: float16 autocast is a GPU feature; "
            "use --amp_dtype bfloat16 or --no-use_amp"
        )
    return Precision(None, False, kind)  # auto on CPU: fp32, as mixed precision rarely pays there
