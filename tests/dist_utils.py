"""Run a function on N real gloo ranks (processes on loopback).

Each child gets the variables torchrun would set, so the code under test takes its
normal path: `read_cluster_env` -> `setup_distributed` -> ... -> `teardown_distributed`.

The ranks are forked from one server process that imported torch and ddptrain once for
the whole pytest session (`multiprocessing`'s forkserver): a spawned rank pays those
imports itself, 4-5 CPU-seconds, most of a small test's time on 2 cores. A forked rank is
as fresh as a spawned one where it matters: nothing of the test process (its threads, its
process group, its patched modules) reaches it, and it gets the test process's
environment as it is now. Only a variable read when a process starts (glibc's `MALLOC_*`)
needs a process of its own: then the ranks are spawned.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# What every rank imports anyway, imported once by the fork server.
PRELOAD = [
    "numpy", "torch", "torch.distributed", "torch._dynamo", "safetensors.torch",
    "ddptrain.api", "ddptrain.train.trainer", "ddptrain.launch.process_group",
    "ddptrain.data.sources", "ddptrain.checkpoint",
]
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], out: str,
           env: dict[str, str], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
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
    env = dict(os.environ)
    how = "spawn" if any(k.startswith("MALLOC_") for k in env) else "forkserver"
    mp.start_processes(_entry, args=(world_size, free_port(), fn, str(out), env, args),
                       nprocs=world_size, start_method=how)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
