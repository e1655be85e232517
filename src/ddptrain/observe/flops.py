"""Model FLOPs and MFU for the train rows, and CUDA peak memory.

Model FLOPs utilisation (MFU) is the share of the GPUs' peak arithmetic that the training
step turns into model FLOPs:

    MFU = FLOPs per sample (forward + backward, counted) x global samples/s
          / (world size x peak FLOP/s of one GPU)

The FLOPs are counted once, with `torch.utils.flop_counter.FlopCounterMode`, on one
forward and backward pass of a copy of the model (the real one keeps its gradients and
BatchNorm statistics untouched). On CPU there is no meaningful peak to divide by, so
the rows carry no MFU there.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ddptrain.context import DistributedContext

# Dense peak FLOP/s per GPU from the vendors' datasheets: (name fragment, fp32, fp16/bf16
# tensor cores). Matched in order against `torch.cuda.get_device_name`, so the more
# specific names come first. Sparse figures are not used: training does not run sparse.
PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200", 67e12, 989e12),
    ("H100 PCIe", 51e12, 756e12),
    ("H100", 67e12, 989e12),
    ("A100", 19.5e12, 312e12),
    ("L40S", 91.6e12, 362e12),
    ("L4", 30.3e12, 121e12),
    ("A6000", 38.7e12, 154.8e12),
    ("RTX 4090", 82.6e12, 165.2e12),
    ("V100", 15.7e12, 125e12),
    ("T4", 8.1e12, 65e12),
)


_flops_per_sample: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()


def count_flops(model: nn.Module, batch: torch.Tensor) -> float:
    """FLOPs of one forward and backward pass over `batch`, counted on a copy of `model`."""
    shadow = copy.deepcopy(model)
    shadow.train()
    counter = FlopCounterMode(display=False)
    with counter:
        shadow(batch).float().sum().backward()
    return float(counter.get_total_flops())


def peak_flops(device_name: str, half_precision: bool) -> float | None:
    """Peak dense FLOP/s of one GPU by name, None for a GPU the table does not know."""
    for fragment, fp32, half in PEAK_FLOPS:
        if fragment in device_name:
            return half if half_precision else fp32
    return None


def mfu(flops_per_sample: float, samples_per_sec: float, world_size: int, peak: float) -> float:
    return flops_per_sample * samples_per_sec / (world_size * peak)


def gpu_fields(
    model: nn.Module,
    batch: Any,
    samples_per_sec: float,
    ctx: DistributedContext,
    amp_dtype: torch.dtype | None,
) -> dict[str, float]:
    """CUDA peak memory and MFU for a train row; empty on CPU.

    `samples_per_sec` is the global rate (all ranks). The FLOPs are counted at the first
    call per model and reused after.
    """
    if ctx.device.type != "cuda":
        return {}
    row = {"peak_cuda_mb": torch.cuda.max_memory_allocated(ctx.device) / 2**20}
    if not isinstance(batch, torch.Tensor):
        return row  # dict inputs: FLOPs are counted for a plain tensor batch only
    if model not in _flops_per_sample:
        _flops_per_sample[model] = count_flops(model, batch) / batch.shape[0]
    per_sample = _flops_per_sample[model]
    row["tflops_per_sec"] = per_sample * samples_per_sec / 1e12
    peak = peak_flops(torch.cuda.get_device_name(ctx.device), amp_dtype is not None)
    if peak is not None:
        row["mfu"] = mfu(per_sample, samples_per_sec, ctx.world_size, peak)
    return row
