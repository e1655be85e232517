"""A CUDA stand-in for the GPU figures of the train rows, run as torchrun's script:

    torchrun --standalone --nproc_per_node=2 tests/cuda_standin.py train --strategy fsdp ...

The run is real (CPU, gloo); `gpu_fields` and `peak_fields` see this rank's device as
cuda, and the CUDA queries they make (peak memory, device name) are faked. So the path
only a GPU reaches, counting the model's FLOPs for MFU, runs under every strategy. Those
fakes are installed when this file runs as a script; imported, it only offers
`fake_pinning`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch

import ddptrain.observe.flops as flops

PEAK_MB = 64
_real, _real_peak = flops.gpu_fields, flops.peak_fields


def _standin(model: Any, batch: Any, samples_per_sec: float, ctx: Any, dtype: Any) -> Any:
    cuda = dataclasses.replace(ctx, device=torch.device("cuda", ctx.local_rank))
    return _real(model, batch, samples_per_sec, cuda, dtype)


def _standin_peak(ctx: Any) -> Any:
    return _real_peak(dataclasses.replace(ctx, device=torch.device("cuda", ctx.local_rank)))


def install() -> None:
    torch.cuda.max_memory_allocated = lambda device=None: PEAK_MB * 2**20  # type: ignore[assignment]
    torch.cuda.reset_peak_memory_stats = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3"  # type: ignore[assignment]
    flops.gpu_fields, flops.peak_fields = _standin, _standin_peak  # before the trainer imports them


@contextlib.contextmanager
def fake_pinning() -> Iterator[set[int]]:
    """Page-locked memory needs CUDA: inside, `Tensor.pin_memory()` returns a copy and
    adds its data pointer to the set it yields (what was pinned), and `is_pinned()` asks
    that set."""
    pinned: set[int] = set()
    real_pin, real_is = torch.Tensor.pin_memory, torch.Tensor.is_pinned

    def pin(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        copy = t.clone()
        pinned.add(copy.data_ptr())
        return copy

    torch.Tensor.pin_memory = pin  # type: ignore[method-assign]
    torch.Tensor.is_pinned = lambda t, *a, **k: t.data_ptr() in pinned  # type: ignore[method-assign]
    try:
        yield pinned
    finally:
        torch.Tensor.pin_memory, torch.Tensor.is_pinned = real_pin, real_is  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from ddptrain.cli import main

    sys.exit(main(sys.argv[1:]))
