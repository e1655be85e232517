"""Who this process is in the job: the frozen context every part of a run receives.

`ddptrain.launch.process_group.setup_distributed` builds it once, after the device is
pinned and the process group is up; nothing reads distributed state from globals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedContext:
    """Immutable snapshot of this process's distributed identity."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None = None  # None: world size 1, no process group
    # An n-D layout (--tp, --dp_replicate; `parallel/mesh.py`): its DeviceMesh, and this
    # rank's data-parallel rank and size. None: every rank is a data-parallel rank.
    mesh: Any = None
    data_parallel: tuple[int, int] | None = None
    context_parallel: int = 1  # ranks that split each sequence (`parallel.cp`)
    owns_group: bool = True  # False: the group was adopted (Ray Train made it), not ours to end

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which share of the data this rank trains and evaluates: ranks that split one
        model replica's layers (tensor parallelism) share it, and see the same batches."""
        return self.rank if self.data_parallel is None else self.data_parallel[0]

    @property
    def data_world(self) -> int:
        """How many shares the data is split into (the data-parallel ranks)."""
        return self.world_size if self.data_parallel is None else self.data_parallel[1]

    @property
    def grad_world(self) -> int:
        """Over how many ranks gradients are averaged: the data-parallel ones, each with
        its cp peers (whose losses are sums over their own slices of the same rows)."""
        return self.data_world * self.context_parallel

    @property
    def counts_data(self) -> bool:
        """Whether this rank's loss and metric sums count in a global sum: one rank of
        each group that shares a batch does (the last pipeline stage, the first tensor-
        parallel rank), so every sample counts once."""
        if self.mesh is None:
            return True
        # The last pipeline stage scores the batch; one rank of a tensor-parallel group.
        last_stage = self.mesh.get_local_rank("pp") == self.mesh.size(0) - 1
        return last_stage and self.mesh.get_local_rank("tp") == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def gather_to_main(value: Any, ctx: DistributedContext) -> list[Any] | None:
    """Every rank's `value` (plain data, CPU tensors), as a list on rank 0; None elsewhere."""
    if not ctx.distributed:
        return [value]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(value, out, dst=0)
    return out


def from_main(compute: Callable[[], Any], ctx: DistributedContext) -> Any:
    """What rank 0 computes (`compute()`, called there alone: plain data), on every rank.
    Collective."""
    box = [compute() if ctx.is_main else None]
    if ctx.distributed:
        dist.broadcast_object_list(box, src=0)
    return box[0]
