"""Run a function on N real gloo ranks (spawned processes on loopback).

Each child gets the variables torchrun would set, so the code under test takes its
normal path: `read_cluster_env` -> `setup_distributed` -> ... -> `teardown_distributed`.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], out: str, args: tuple):
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    })
    torch.set_num_threads(1)
    result = fn(rank, *args)
    torch.save(result, Path(out) / f"rank{rank}.pt")


def run_ranks(fn: Callable[..., Any], world_size: int, tmp: Path, *args: Any) -> list[Any]:
    """Call `fn(rank, *args)` on `world_size` ranks; return each rank's return value."""
    out = Path(tempfile.mkdtemp(prefix="ranks-", dir=tmp))
    mp.spawn(_entry, args=(world_size, free_port(), fn, str(out), args), nprocs=world_size)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
