"""Process identity, process-group start-up and teardown.

torchrun (torch.distributed.elastic) sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT for each worker; `read_cluster_env` turns them into a `ClusterEnv`, and a plain
`ddptrain train` with none of them is a single process of world size 1 that needs no
process group at all. `setup_distributed` pins the device *before* the process group starts
(NCCL binds its communicator to the current device) and returns a frozen
`DistributedContext` that the rest of the code receives explicitly.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ddptrain.cluster import ClusterEnv, read_cluster_env
from ddptrain.config import ConfigError, TrainingConfig

log = logging.getLogger("ddptrain")


@dataclass(frozen=True)
class DistributedContext:
    """Immutable snapshot of this process's distributed identity."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None = None  # None: world size 1, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def resolve_device(config: TrainingConfig, local_rank: int) -> torch.device:
    cuda = torch.cuda.is_available()
    if config.device == "cuda" and not cuda:
        raise ConfigError("--device 'cuda' is invalid: no CUDA device is visible; use --device cpu")
    if config.device == "cpu" or not cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this node has {count} CUDA device(s): "
            f"start at most {count} processes per node (--nproc_per_node)"
        )
    return torch.device("cuda", local_rank)


def resolve_backend(config: TrainingConfig, device: torch.device) -> str:
    if config.backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if config.backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "--backend 'nccl' is invalid: NCCL needs CUDA devices and this process runs on CPU; "
            "use --backend gloo (or auto)"
        )
    return config.backend


def setup_distributed(config: TrainingConfig, cluster: ClusterEnv | None = None) -> DistributedContext:
    """Pin the device, start the process group (if world size > 1), return the context."""
    cluster = cluster or read_cluster_env()
    device = resolve_device(config, cluster.local_rank)
    backend = resolve_backend(config, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if cluster.world_size == 1:
        return DistributedContext(0, 0, 1, device, backend=None)
    cluster.export_rendezvous()  # srun tasks: env:// needs MASTER_ADDR/PORT
    dist.init_process_group(
        backend=backend,
        rank=cluster.rank,
        world_size=cluster.world_size,
        timeout=timedelta(seconds=config.timeout_s),
        # Binding NCCL to the device up front makes its first collective eager and
        # avoids a guess at the device from the rank.
        device_id=device if device.type == "cuda" else None,
    )
    return DistributedContext(
        cluster.rank, cluster.local_rank, cluster.world_size, device, backend=backend
    )


def teardown_distributed(clean: bool) -> None:
    """Destroy the process group without tripping gloo's exit-time abort.

    With gloo, destroying the group while DDP's reducer, the optimizer or loader
    iterators still hold communication state lets a background thread die at interpreter
    exit ("terminate called without an active exception"). The caller drops those
    objects first; here we collect them, and after a clean finish meet every rank at a
    barrier so that none tears down while a peer still sends. After a failure a barrier
    could wait for a dead peer, so we skip it.
    """
    gc.collect()
    if not dist.is_initialized():
        return
    if clean:
        try:
            dist.barrier()
        except Exception as exc:  # a peer died after our last collective
            log.warning("barrier before teardown failed: %s", exc)
    dist.destroy_process_group()


def broadcast_object(obj: object, ctx: DistributedContext) -> object:
    """Rank 0's `obj` on every rank (a no-op in a single process)."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
