"""Model FLOPs and MFU for the train rows, and CUDA peak memory.

Model FLOPs utilisation (MFU) is the share of the GPUs' peak arithmetic that the training
step turns into model FLOPs:

    MFU = FLOPs per sample (forward + backward, counted) x global samples/s
          / (world size x peak FLOP/s of one GPU)

The FLOPs are counted once, with `torch.utils.flop_counter.FlopCounterMode`, on one
forward and backward pass of a shadow of the model on the meta device (`meta_shadow`):
its structure with shapes and no data, taken before a strategy wraps or shards the
model. It costs no device memory and no random numbers, and the real model keeps its
gradients and BatchNorm statistics untouched; an FSDP module, which cannot be copied, is
never touched. On CPU there is no meaningful peak to divide by, so the rows carry no MFU
there.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from ddptrain.context import DistributedContext
from ddptrain.data.batch import parse_output

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


def meta_shadow(model: nn.Module) -> nn.Module | None:
    """`model`'s structure with every parameter and buffer on the meta device: the same
    modules and shapes, tied weights still tied, no data copied. None for a model that
    cannot be copied at all (it then gets no MFU)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for module in model.modules():  # buffers, and tensors kept as plain attributes
        for value in [*module._buffers.values(), *vars(module).values()]:
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = torch.empty_like(value, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # a module holding something uncopyable (a lock, a process group)
        return None


def count_flops(model: nn.Module, batch: torch.Tensor) -> float:
    """FLOPs of one forward and backward pass over `batch`, counted on the meta device
    (`model` itself when it is a meta shadow already, else a shadow of it)."""
    shadow = model if _on_meta(model) else meta_shadow(model)
    if shadow is None:
        return 0.0
    shadow.train()
    counter = FlopCounterMode(display=False)
    # Under fake mode the inputs (and what the model makes of them, a Hugging Face model's
    # masks) are fake tensors, whose data-dependent checks torch and transformers skip;
    # on plain meta tensors a Llama's mask check (`.all()`) cannot be answered.
    with FakeTensorMode(allow_non_fake_inputs=True), counter:
        out = parse_output(shadow(torch.empty_like(batch, device="meta")))  # a HF model's too
        result = out.prediction if out.prediction is not None else out.loss
        assert result is not None  # parse_output refuses an output with neither
        result.float().sum().backward()
    return float(counter.get_total_flops())


def _on_meta(model: nn.Module) -> bool:
    return all(p.device.type == "meta" for p in model.parameters())


def peak_flops(device_name: str, half_precision: bool) -> float | None:
    """Peak dense FLOP/s of one GPU by name, None for a GPU the table does not know."""
    for fragment, fp32, half in PEAK_FLOPS:
        if fragment in device_name:
            return half if half_precision else fp32
    return None


def mfu(flops_per_sample: float, samples_per_sec: float, world_size: int, peak: float) -> float:
    return flops_per_sample * samples_per_sec / (world_size * peak)


def peak_fields(ctx: DistributedContext) -> dict[str, float]:
    """CUDA peak memory since the previous log point, read at this one; empty on CPU.

    Read as each row is taken, not when rows are written: rows are written in batches
    (one all-reduce for several), and a reading at the write would give the batch's first
    row the whole interval's peak and the others the memory held between two readings.
    Both calls ask the caching allocator's counters: no device sync.
    """
    if ctx.device.type != "cuda":
        return {}
    row = {"peak_cuda_mb": torch.cuda.max_memory_allocated(ctx.device) / 2**20}
    torch.cuda.reset_peak_memory_stats(ctx.device)
    return row


def gpu_fields(
    model: nn.Module | None,
    batch: Any,
    samples_per_sec: float,
    ctx: DistributedContext,
    amp_dtype: torch.dtype | None,
) -> dict[str, float]:
    """TFLOP/s and MFU for a train row; empty on CPU.

    `model` is the model's meta shadow (`meta_shadow`, taken before the strategy wrapped
    it). `samples_per_sec` is the global rate (all ranks). The FLOPs are counted at the
    first call per model and reused after.
    """
    row: dict[str, float] = {}
    if ctx.device.type != "cuda":
        return row
    if model is None or not isinstance(batch, torch.Tensor):
        return row  # dict inputs: FLOPs are counted for a plain tensor batch only
    if model not in _flops_per_sample:
        _flops_per_sample[model] = count_flops(model, batch) / batch.shape[0]
    per_sample = _flops_per_sample[model]
    row["tflops_per_sec"] = per_sample * samples_per_sec / 1e12
    peak = peak_flops(torch.cuda.get_device_name(ctx.device), amp_dtype is not None)
    if peak is not None:
        row["mfu"] = mfu(per_sample, samples_per_sec, ctx.world_size, peak)
    return row
