"""Counting gradient all-reduce rounds with a DDP communication hook.

DDP hands its gradient buckets to the hook one by one during each backward that
synchronises; the last bucket of a backward marks one all-reduce round. The hook then
runs DDP's default all-reduce, so training is unchanged.

No `from __future__ import annotations` here: DDP checks the hook's annotations at
registration, and they must be real types, not strings.
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


class AllReduceCounter:
    """`rounds`: backward passes that all-reduced; `buckets`: bucket all-reduces."""

    def __init__(self) -> None:
        self.rounds = 0
        self.buckets = 0

    def attach(self, model: DDP) -> "AllReduceCounter":
        model.register_comm_hook(self, _counting_hook)
        return self


def _counting_hook(
    state: AllReduceCounter, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    state.buckets += 1
    if bucket.is_last():
        state.rounds += 1
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
