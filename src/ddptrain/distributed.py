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
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ddptrain.config import ConfigError, TrainingConfig

log = logging.getLogger("ddptrain")


@dataclass(frozen=True)
class ClusterEnv:
    """Who this process is, as told by the launcher."""

    rank: int
    local_rank: int
    world_size: int
    source: str  # "torchrun" or "single"


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


_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def _int_env(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"you set {name}={raw!r}, which is not a whole number: unset it or launch with torchrun"
        ) from None


def read_cluster_env(env: Mapping[str, str] | None = None) -> ClusterEnv:
    """Detect the launcher from the environment; refuse half-set or inconsistent identities."""
    env = os.environ if env is None else env
    present = [v for v in _TORCHRUN_VARS if v in env]
    if not present:
        return ClusterEnv(rank=0, local_rank=0, world_size=1, source="single")
    missing = [v for v in _TORCHRUN_VARS if v not in env]
    if missing:
        have = ", ".join(f"{v}={env[v]}" for v in present)
        raise ConfigError(
            f"you set {have} but not {', '.join(missing)}: launch with torchrun, "
            "or set all of RANK, LOCAL_RANK and WORLD_SIZE (or none for one process)"
        )
    rank, local_rank, world_size = (_int_env(env, v) for v in _TORCHRUN_VARS)
    if world_size < 1:
        raise ConfigError(f"you set WORLD_SIZE={world_size}: it must be at least 1")
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"you set RANK={rank} with WORLD_SIZE={world_size}: RANK must be in 0..{world_size - 1}"
        )
    if local_rank < 0 or local_rank > rank:
        raise ConfigError(
            f"you set LOCAL_RANK={local_rank} with RANK={rank}: LOCAL_RANK must be in 0..RANK"
        )
    if world_size > 1:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in env:
                raise ConfigError(
                    f"WORLD_SIZE={world_size} but {var} is not set: launch with torchrun, "
                    "which sets it, or export MASTER_ADDR and MASTER_PORT"
                )
    return ClusterEnv(rank=rank, local_rank=local_rank, world_size=world_size, source="torchrun")


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
