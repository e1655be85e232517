"""A CUDA stand-in for the GPU figures of the train rows, run as torchrun's script:

    torchrun --standalone --nproc_per_node=2 tests/cuda_standin.py train --strategy fsdp ...

The run is real (CPU, gloo); `gpu_fields` sees this rank's device as cuda, and the CUDA
queries it makes (peak memory, device name) are faked. So the path only a GPU reaches,
counting the model's FLOPs for MFU, runs under every strategy.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

import ddptrain.observe.flops as flops

PEAK_MB = 64
_real = flops.gpu_fields


def _standin(model: Any, batch: Any, samples_per_sec: float, ctx: Any, dtype: Any) -> Any:
    cuda = dataclasses.replace(ctx, device=torch.device("cuda", ctx.local_rank))
    return _real(model, batch, samples_per_sec, cuda, dtype)


torch.cuda.max_memory_allocated = lambda device=None: PEAK_MB * 2**20  # type: ignore[assignment]
torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3"  # type: ignore[assignment]
flops.gpu_fields = _standin  # before the trainer imports it

if __name__ == "__main__":
    from ddptrain.cli import main

    sys.exit(main(sys.argv[1:]))
