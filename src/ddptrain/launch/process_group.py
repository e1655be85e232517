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
import re
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.config import ConfigError, TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.launch.cluster import ClusterEnv, read_cluster_env
from ddptrain.launch.signals import exit_at_once_on_signals
from ddptrain.layout import Layout
from ddptrain.observe.hang import enable_flight_recorder

log = logging.getLogger("ddptrain")


def resolve_device(
    config: TrainingConfig, local_rank: int, local_world_size: int = 1
) -> torch.device:
    """This rank's device. With as many visible CUDA devices as ranks on the node (or more),
    rank i takes `cuda:i`; with one visible device (Slurm's `--gpus-per-task=1`, device
    plugins that give each process its own GPU through CUDA_VISIBLE_DEVICES) every rank
    takes `cuda:0`, its own. Between the two the count does not fit: one line."""
    cuda = torch.cuda.is_available()
    if config.device == "cuda" and not cuda:
        raise ConfigError("--device 'cuda' is invalid: no CUDA device is visible; use --device cpu")
    if config.device == "cpu" or not cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this process sees {count} CUDA devices "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) for "
            f"{local_world_size} ranks on this node: start at most {count} processes per node "
            "(--nproc_per_node), or give each process one device"
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
    if config.backend == "gloo" and device.type == "cuda" and Layout.of(config).splits_model:
        # Measured on an H200: gloo's send of a CUDA tensor fails (writev: Bad address) and
        # DTensor's functional all-gather over gloo on CUDA crashes the process.
        raise ConfigError(
            f"--backend gloo with --tp {config.tp} --pp {config.pp} on CUDA is unsupported: "
            "gloo cannot send CUDA tensors between pipeline stages nor run tensor "
            "parallelism's collectives on them; use --backend nccl (or auto) with one GPU "
            "per rank, or --device cpu"
        )
    return config.backend


def setup_distributed(
    config: TrainingConfig, cluster: ClusterEnv | None = None,
    device: torch.device | None = None, backend: str | None = None,
) -> DistributedContext:
    """Pin the device, start the process group (if world size > 1 and none exists yet:
    one that does is adopted), return the context.
    `device` and `backend` come resolved from `ddptrain.fit`; left out, they are resolved
    here."""
    cluster = cluster or read_cluster_env()
    device = device or resolve_device(config, cluster.local_rank, cluster.local_world_size)
    backend = backend or resolve_backend(config, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return _adopt_group(cluster, device)
    if cluster.world_size == 1:
        return DistributedContext(0, 0, 1, device, backend=None)
    cluster.export_rendezvous()  # srun tasks: env:// needs MASTER_ADDR/PORT
    enable_flight_recorder()  # a lost peer's report names the collective (observe.hang)
    if backend == "nccl":
        abort_hung_collectives()
    try:
        with exit_at_once_on_signals(cluster.rank):  # the rendezvous blocks in C++
            _wait_for_the_master_name(config.timeout_s)
            dist.init_process_group(
                backend=backend,
                store=_attempt_store(cluster, config.timeout_s),
                rank=cluster.rank,
                world_size=cluster.world_size,
                timeout=timedelta(seconds=config.timeout_s),
                # Binding NCCL to the device up front makes its first collective eager
                # and avoids a guess at the device from the rank. Gloo is never bound:
                # bound, DeviceMesh splits its groups by deep-copying gloo's options,
                # which cannot be copied (tp/pp over gloo on CUDA failed so).
                device_id=device if backend == "nccl" else None,
            )
    except (dist.DistError, RuntimeError) as exc:
        raise ConfigError(_rendezvous_advice(exc, cluster, config.timeout_s)) from None
    return DistributedContext(
        cluster.rank, cluster.local_rank, cluster.world_size, device, backend=backend
    )


def _adopt_group(cluster: ClusterEnv, device: torch.device) -> DistributedContext:
    """The process group a host framework already started (a Ray Train worker's): used as
    it is, and left for its maker to destroy (`teardown_distributed` with `owns_group`
    False)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if (rank, world_size) != (cluster.rank, cluster.world_size):
        raise ConfigError(
            f"a process group of rank {rank} of {world_size} already exists, but RANK="
            f"{cluster.rank} and WORLD_SIZE={cluster.world_size} say otherwise: start "
            "ddptrain without a process group of its own, or with the launcher's variables"
        )
    if world_size == 1:  # a group of one: trained like a plain single process
        return DistributedContext(0, 0, 1, device, backend=None, owns_group=False)
    return DistributedContext(
        rank, cluster.local_rank, world_size, device, backend=str(dist.get_backend()),
        owns_group=False,
    )


def lost_peer(exc: BaseException) -> bool:
    """A collective or the rendezvous store failed: a peer, not this process, is at fault."""
    if isinstance(exc, dist.DistError):
        return True
    # gloo reports a dead or silent peer as a plain RuntimeError from its transport; NCCL's
    # watchdog (a collective past --timeout_s, or a failed one) aborts the communicators,
    # and the next wait or collective raises (DistBackendError, or a RuntimeError).
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        any(sign in text for sign in _PEER_SIGNS) or bool(_NCCL_TIMEOUT.search(text))
    )


_PEER_SIGNS = (
    "gloo/transport", "pair closure", "Connection closed by peer", "Connection reset",
    "Watchdog caught collective operation timeout", "NCCL communicator was aborted",
)
_NCCL_TIMEOUT = re.compile(r"ProcessGroupNCCL.*(timed out|timeout)", re.IGNORECASE)


# How ProcessGroupNCCL's watchdog answers a collective that failed or ran past --timeout_s.
# 2 (CleanUpOnly) aborts the communicators and leaves the process alive: the main thread's
# wait or next collective raises DistBackendError, and the run ends with exit 3 and one
# line. torchrun sets 1 and torch defaults to 3: the watchdog then kills the process
# (SIGABRT, its own traceback). A value of 0, 2 or 3 set by the user is kept.
ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def abort_hung_collectives(environ: dict[str, str] | None = None) -> None:
    """Before an NCCL process group starts: a hung collective is aborted, and raises."""
    env: Any = os.environ if environ is None else environ
    if env.get(ASYNC_ERROR_HANDLING, "1") == "1" and "NCCL_ASYNC_ERROR_HANDLING" not in env:
        env[ASYNC_ERROR_HANDLING] = "2"


def _wait_for_the_master_name(timeout_s: float) -> None:
    """Wait, quietly, until MASTER_ADDR resolves (a Kubernetes Service's name appears once
    its pod runs); one line after `timeout_s` if it never does. c10d would retry the name
    itself, with a warning line each second before any error of ours."""
    addr = os.environ.get("MASTER_ADDR")
    if not addr:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.getaddrinfo(addr, None)
            return
        except (socket.gaierror, UnicodeError):
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"MASTER_ADDR={addr} does not resolve to an address (waited "
                    f"{timeout_s:g}s): check the host name, or raise --timeout_s while the "
                    "master's host (a Kubernetes Service: its pod) comes up"
                ) from None
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _attempt_store(cluster: ClusterEnv, timeout_s: float) -> dist.Store | None:
    """Under torchrun, the agent's store with a namespace per restart attempt.

    The torchrun agent hosts the store the workers meet in, and keeps it when it restarts
    a failed worker group (`--max_restarts`). The restarted workers would then read the
    dead workers' addresses from it and fail to connect, so each attempt gets its own key
    prefix. Elsewhere (`None`) init_process_group builds its store from MASTER_ADDR/PORT.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), cluster.world_size,
        is_master=False, timeout=timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"ddptrain/attempt_{attempt}", base)


def _rendezvous_advice(exc: BaseException, cluster: ClusterEnv, timeout_s: float) -> str:
    """Turn a failed process-group start into what happened and what to do."""
    addr = os.environ.get("MASTER_ADDR", "?")
    port = os.environ.get("MASTER_PORT", "?")
    text = str(exc)
    where = f"MASTER_ADDR={addr} MASTER_PORT={port}"
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (
            f"you set {where}, but that port is already in use on this host: choose a free "
            "MASTER_PORT (torchrun --standalone picks one for you)"
        )
    if "refused" in text.lower():
        return (
            f"rank {cluster.rank} of {cluster.world_size} could not connect to its peers via "
            f"{where} (connection refused): check that every rank runs, and the addresses "
            "and firewalls between the hosts (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)"
        )
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (
            f"rank {cluster.rank} of {cluster.world_size} waited {timeout_s:g}s at {where} and "
            "not every rank arrived: start all ranks (torchrun does), check MASTER_ADDR/"
            "MASTER_PORT and firewalls, or raise --timeout_s"
        )
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    return f"the process group could not start at {where} ({first}): check the launcher settings"


def teardown_distributed(clean: bool, ctx: DistributedContext | None = None) -> None:
    """Destroy the process group without tripping gloo's exit-time abort; a group this
    process adopted (`ctx.owns_group` False) stays up for the framework that made it.

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
    if ctx is not None and not ctx.owns_group:
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # after a failure (an aborted NCCL communicator): best effort
        if clean:
            raise
        log.debug("destroying the process group after a failure: %s", exc)
