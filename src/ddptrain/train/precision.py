"""Precision: which autocast dtype a run uses, whether it needs a GradScaler, and whether
float32 matmuls and convolutions run in TF32."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ddptrain.config import TrainingConfig
from ddptrain.errors import ConfigError
from ddptrain.layout import Layout
from ddptrain.parallel import NO_CONTEXT

log = logging.getLogger("ddptrain")


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype | None  # autocast dtype; None: full precision
    scaler: bool  # a GradScaler only earns its cost for float16
    device_type: str = "cpu"
    tf32: bool = False  # float32 matmuls and convolutions in TF32 (CUDA, capability 8.0+)
    float8: str = "off"  # the linears' float8 recipe (`ddptrain.parallel.parts.to_float8`)

    def apply(self) -> None:
        """Set the process's float32 matmul and convolution precision (CUDA only: on CPU
        nothing is touched)."""
        if self.device_type != "cuda":
            return
        mode = "tf32" if self.tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode  # type: ignore[attr-defined]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return NO_CONTEXT
        return torch.autocast(self.device_type, dtype=self.dtype)

    def describe(self) -> str:
        if self.dtype is None:
            text, matmuls = "float32", "matmuls"
        else:
            text = str(self.dtype).removeprefix("torch.") + " autocast"
            text, matmuls = text + (" + GradScaler" if self.scaler else ""), "float32 matmuls"
        if self.device_type == "cuda":
            text += f" ({matmuls} {'TF32' if self.tf32 else 'IEEE'})"
        emulated = " (emulated: slower, not faster)" if self.device_type == "cpu" else ""
        return text + (f", float8 {self.float8} linears{emulated}" if self.float8 != "off"
                       else "")


def native_bf16(device: torch.device) -> bool:
    """Whether this CUDA device computes bfloat16 in hardware (compute capability 8.0+)."""
    try:
        return torch.cuda.get_device_capability(device) >= (8, 0)
    except (RuntimeError, AssertionError, ValueError):
        return False


def resolve_tf32(config: TrainingConfig, device: torch.device) -> bool:
    """Whether float32 matmuls run in TF32: on GPUs that have it unless --tf32 off;
    --tf32 on where there is none is one line."""
    has = device.type == "cuda" and native_bf16(device)  # TF32 came with bf16 (Ampere)
    if config.tf32 == "on" and not has:
        where = "on CPU" if device.type != "cuda" else "on this GPU (before Ampere)"
        raise ConfigError(f"--tf32 on is invalid {where}: TF32 needs a GPU of compute "
                          "capability 8.0 or later; leave --tf32 auto, or use --tf32 off")
    return has and config.tf32 != "off"


def check_float8(config: TrainingConfig, device: torch.device) -> str:
    """--float8's recipe, refused in one line where it cannot run: a GPU before compute
    capability 8.9 (no float8 matmuls), tensor or pipeline parallelism (not composed
    yet), or no torchao."""
    if config.float8 == "off":
        return "off"
    if device.type == "cuda":
        try:
            capability = torch.cuda.get_device_capability(device)
        except (RuntimeError, AssertionError, ValueError):
            capability = (0, 0)
        if capability < (8, 9):
            raise ConfigError(
                f"--float8 {config.float8} is invalid on this GPU (compute capability "
                f"{capability[0]}.{capability[1]}): float8 matmuls need 8.9 or later (H100, "
                "L4, RTX 4090); drop --float8 and train in bf16"
            )
    if Layout.of(config).splits_model:
        raise ConfigError(
            "--float8 with --tp/--pp is not supported yet: float8 runs under ddp, zero and "
            "fsdp; drop --float8 or the model split"
        )
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"--float8 {config.float8} needs torchao: pip install torchao "
                          "(beside your torch), or drop --float8")
    if device.type == "cuda" and not config.compile:
        # make gpu-check, one H200, a 1.1B Llama at batch 8: bf16 44k tokens/s, float8
        # tensorwise without compilation 22k (its scaling and casts are kernels of their own)
        log.warning("--float8 %s without --compile: the float8 casts run as kernels of "
                    "their own and the step is slower than bf16 (about half its speed on "
                    "an H200); add --compile", config.float8)
    if device.type == "cpu":
        # a CPU has no float8 matmuls: torchao emulates them, a 4-rank Llama-style run
        # took 157.5 s against 42.8 s without --float8 on 2 cores
        log.warning("--float8 %s on the CPU is emulated (no float8 matmuls): the step is "
                    "several times slower than without it; use it here to check the "
                    "numbers, and a GPU of compute capability 8.9 or later for speed",
                    config.float8)
    return config.float8


def resolve_precision(config: TrainingConfig, device: torch.device) -> Precision:
    kind, tf32 = device.type, resolve_tf32(config, device)
    float8 = check_float8(config, device)
    if not config.use_amp:
        return Precision(None, False, kind, tf32, float8)
    if kind == "cuda":
        # auto: bfloat16 where the GPU computes it natively (Ampere and later: fp32's range,
        # no loss scaling), float16 + GradScaler on older GPUs.
        bf16 = config.amp_dtype == "bfloat16" or (
            config.amp_dtype == "auto" and native_bf16(device)
        )
        dtype = torch.bfloat16 if bf16 else torch.float16
        return Precision(dtype, dtype == torch.float16, kind, tf32, float8)
    if config.amp_dtype == "bfloat16":
        return Precision(torch.bfloat16, False, kind, tf32, float8)
    if config.amp_dtype == "float16":
        raise ConfigError(
            "--amp_dtype 'float16' is invalid on CPU: float16 autocast is a GPU feature; "
            "use --amp_dtype bfloat16 or --no-use_amp"
        )
    # auto on CPU: fp32, as mixed precision rarely pays there
    return Precision(None, False, kind, tf32, float8)
