"""`--strategy ddp`: DistributedDataParallel, a full replica per rank, gradients
all-reduced in buckets during backward.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddptrain.parallel.base import NO_CONTEXT, Strategy


class DDP(Strategy):
    """DistributedDataParallel: a full replica per rank, gradients all-reduced in backward."""

    name = "ddp"

    def setup_module(self, module: nn.Module) -> nn.Module:
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # Gradients written straight into the all-reduce buckets save a copy per step.
        return DistributedDataParallel(
            module, device_ids=device_ids, gradient_as_bucket_view=True,
            find_unused_parameters=self.config.find_unused_parameters,
            static_graph=self.config.static_graph,
        )

    def no_backward_sync(self, model: nn.Module, skip: bool) -> AbstractContextManager[Any]:
        return model.no_sync() if skip else NO_CONTEXT  # type: ignore[operator]
