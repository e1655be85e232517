"""Ray Train: the same training in N Ray workers (`ddptrain ray`).

    ddptrain ray --workers 2 --dataset digits --epochs 3 --output_dir runs/ray     # local
    RAY_ADDRESS=ray://head:10001 ddptrain ray --workers 8 --gpus_per_worker 1 \\
        --dataset mypkg.data:build --output_dir /shared/runs/big                    # a cluster

The flags after the Ray ones are `ddptrain train`'s. With `RAY_ADDRESS` set the command
joins that cluster; without, it starts a local one. Each worker is a
`ray.train.torch.TorchTrainer` worker: Ray starts the process group and sets RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and ddptrain adopts that group
(`process_group.setup_distributed`) and leaves it for Ray to destroy.

The run directory (`--output_dir`) must be on storage every worker sees: rank 0 writes
it and every rank reads its checkpoints. Ray's own files go in `<run dir>/ray/`.
When a worker dies, Ray restarts the whole worker group (up to `--max_failures` times),
and the new group resumes from the newest checkpoint (`--resume_from auto`), as a torchrun
restart does. A worker knows it is such a retry from a marker rank 0 writes once training
began (`attempts` in Ray's directory of this command).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddptrain.config import TrainingConfig
from ddptrain.config_cli import ErrorParser, parse_config
from ddptrain.errors import (
    EXIT_PEER_LOST,
    EXIT_WORKER_LOST,
    ConfigError,
    PeerLost,
    TrainingStopped,
)
from ddptrain.files import atomic_write_text, open_append
from ddptrain.launch.rundir import new_run_id, refuse_occupied, resolve_layout
from ddptrain.observe.hooks import Hook, RunView

log = logging.getLogger("ddptrain")

# A worker's answer when the attempt before it refused the input (`_train_worker`).
REFUSED = "ddptrain_refused"
# How Ray words an actor its memory monitor killed (the raylet's exit type and detail).
OOM_KILLED = ("NODE_OUT_OF_MEMORY", "running low on memory")
INSTALL_HINT = "Ray is not installed: pip install 'ddptrain[ray]' (or pip install 'ray[train]')"

Fit = Callable[..., dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class RayJob:
    """What every worker gets: the train flags, where the driver ran, the retry marker."""

    argv: tuple[str, ...]
    cwd: str
    marker: str
    fit: Fit


class RayFailed(Exception):
    """The worker group failed more often than `--max_failures` allows."""

    def __init__(self, text: str, exit_code: int) -> None:
        super().__init__(text)
        self.exit_code = exit_code


def ray_parser() -> argparse.ArgumentParser:
    parser = ErrorParser(
        prog="ddptrain ray",
        description="Train in N Ray Train workers; the other flags are ddptrain train's "
        "(ddptrain train --help). RAY_ADDRESS names a running cluster; without it a local "
        "one starts.",
    )
    parser.add_argument("--workers", type=int, required=True, help="Ray Train workers (ranks)")
    parser.add_argument("--cpus_per_worker", type=float, default=1.0,
                        help="CPUs Ray reserves for each worker")
    parser.add_argument("--gpus_per_worker", type=float, default=0.0,
                        help="GPUs for each worker (0: train on CPU with gloo)")
    parser.add_argument("--max_failures", type=int, default=2,
                        help="how many times Ray restarts a failed worker group; each "
                        "restart resumes from the newest checkpoint (-1: without limit)")
    return parser


def parse_ray_args(argv: list[str]) -> tuple[argparse.Namespace, TrainingConfig, list[str]]:
    """The Ray flags, the training config (checked here, before any Ray start) and the
    train flags as the workers get them (with the run directory made absolute)."""
    if any(a in ("-h", "--help") for a in argv):
        ray_parser().print_help()
        raise SystemExit(0)
    args, train_argv = ray_parser().parse_known_args(argv)
    if args.workers < 1:
        raise ConfigError(f"--workers {args.workers} is invalid: use a whole number of at least 1")
    if args.cpus_per_worker <= 0 or args.gpus_per_worker < 0:
        raise ConfigError(
            f"--cpus_per_worker {args.cpus_per_worker:g} / --gpus_per_worker "
            f"{args.gpus_per_worker:g} is invalid: give more than 0 CPUs and at least 0 GPUs"
        )
    if args.max_failures < -1:
        raise ConfigError(f"--max_failures {args.max_failures} is invalid: use -1 or more")
    config = resolve_layout(parse_config(train_argv), args.workers)
    run_dir = str(Path(config.output_dir or ".").absolute())
    config = dataclasses.replace(config, output_dir=run_dir)
    if not config.dry_run:
        refuse_occupied(config)  # here, once: a worker's refusal would only be retried
    return args, config, [*train_argv, "--output_dir", run_dir]


def run_on_ray(argv: list[str], fit: Fit) -> tuple[TrainingConfig, dict[str, Any] | None]:
    """`ddptrain ray ARGV`: train in Ray workers; the config and rank 0's summary."""
    args, config, train_argv = parse_ray_args(argv)
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None

    started = _connect(ray, args)
    token = f"ddptrain-{new_run_id()}"
    storage = config.run_dir / "ray"
    job = RayJob(tuple(train_argv), os.getcwd(), str(storage / token / "attempts"), fit)
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if args.gpus_per_worker > 0 else "gloo"
    resources = {"CPU": args.cpus_per_worker}
    if args.gpus_per_worker > 0:
        resources["GPU"] = args.gpus_per_worker
    worker: Any = _train_worker  # Ray's stubs say a worker returns None; v2 passes it on
    trainer = (_on_own_cluster(TorchTrainer) if started else TorchTrainer)(
        worker,
        train_loop_config={"job": job},
        torch_config=TorchConfig(backend=backend, timeout_s=int(config.timeout_s)),
        scaling_config=ScalingConfig(
            num_workers=args.workers, use_gpu=args.gpus_per_worker > 0,
            resources_per_worker=resources,
        ),
        run_config=RunConfig(
            name=token, storage_path=str(storage),
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    try:
        result = trainer.fit()
    except Exception as exc:
        raise _failure(exc, args.max_failures) from None
    finally:
        if started:
            ray.shutdown()
    summary = getattr(result, "return_value", None)  # Ray Train v2: rank 0's return
    if isinstance(summary, dict) and REFUSED in summary:
        raise ConfigError(summary[REFUSED])
    return config, summary if isinstance(summary, dict) else None


def _connect(ray: Any, args: argparse.Namespace) -> bool:
    """Join the cluster RAY_ADDRESS names, or start a local one; True if we started it."""
    if os.environ.get("RAY_ADDRESS"):
        _reachable(os.environ["RAY_ADDRESS"], timeout=10.0)
        ray.init(log_to_driver=True, logging_level=logging.WARNING)
        return False
    # A local cluster gets the CPUs the workers ask for even on a smaller machine (they
    # share the cores), rather than waiting forever for resources that never come.
    need = args.workers * args.cpus_per_worker
    cpus = max(os.cpu_count() or 1, int(need + 0.999))
    gpus = _local_gpus()
    if args.workers * args.gpus_per_worker > gpus:
        raise ConfigError(
            f"--workers {args.workers} x --gpus_per_worker {args.gpus_per_worker:g} needs "
            f"{args.workers * args.gpus_per_worker:g} GPU(s) and this machine has {gpus}: "
            "use fewer workers, or set RAY_ADDRESS to a cluster that has them"
        )
    # "local": a new cluster of our own, never one that another `ray start` left running
    ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False,
             log_to_driver=True, logging_level=logging.WARNING)
    return True


def _on_own_cluster(trainer: Any) -> Any:
    """`trainer` (Ray's TorchTrainer class) without Ray Train's placement-group cleaner, on
    a cluster of our own: it asks the State API, which needs the dashboard this cluster
    runs without, every second whether the controller lives, and logs a warning each time
    it cannot (dozens a run); its groups end with the cluster when the command does. On a
    cluster of someone else's it stays. Ray's private method: a Ray that renames it keeps
    its cleaner, and its noise, nothing else."""

    class OwnClusterTrainer(trainer):
        def _create_default_callbacks(self) -> list[Any]:
            return [c for c in super()._create_default_callbacks()
                    if type(c).__name__ != "PlacementGroupCleanerCallback"]

    return OwnClusterTrainer


def _reachable(address: str, timeout: float) -> None:
    """A cluster address (`ray://host:port`, `host:port`) that nothing answers at is one
    line, at once: `ray.init` would retry it for minutes and end in a traceback. `auto`
    and other forms are Ray's to resolve."""
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(
            f"RAY_ADDRESS {address!r}: nothing answers at {host}:{port} "
            f"({exc.strerror or type(exc).__name__}); start the cluster there (ray start "
            "--head), or unset RAY_ADDRESS to train on a local one"
        ) from None


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _failure(exc: BaseException, max_failures: int) -> BaseException:
    """What the driver says when Ray gives up: ddptrain's own error as a worker raised it
    (one line, its exit code); a worker Ray's memory monitor killed (71, as a process the
    system took); a worker that died otherwise as a lost peer (3); else Ray's error."""
    from ray.exceptions import OutOfMemoryError, RayActorError

    failures: dict[int, BaseException] = getattr(exc, "worker_failures", None) or {0: exc}
    chains = {rank: _chain(error) for rank, error in sorted(failures.items())}
    for chain in chains.values():
        for error in chain:
            # a survivor's lost peer is what a dead worker left: that worker is named below
            if isinstance(error, ConfigError | TrainingStopped) and not isinstance(error, PeerLost):
                return error
    tries = "with no retries" if max_failures == 0 else f"after {max_failures} restart(s)"
    for rank, chain in chains.items():
        if any(isinstance(e, OutOfMemoryError) or any(m in str(e) for m in OOM_KILLED)
               for e in chain):
            return RayFailed(
                f"Ray's memory monitor killed worker rank {rank} (its node ran low on host "
                f"memory) {tries}: lower --batch_size or --num_workers, or give each worker "
                "a node of its own (--cpus_per_worker); the run directory holds the newest "
                "checkpoint, run the command again with --resume_from auto",
                EXIT_WORKER_LOST,
            )
    for rank, chain in chains.items():
        died = next((e for e in chain if isinstance(e, RayActorError)), None)
        if died is not None:
            lines = str(died).strip().splitlines()
            what = lines[0][:160] if lines else type(died).__name__
            return RayFailed(
                f"Ray worker rank {rank} died ({what}) {tries}: the run directory holds the "
                "newest checkpoint; run the command again with --resume_from auto",
                EXIT_PEER_LOST,
            )
    lost = next((e for chain in chains.values() for e in chain if isinstance(e, PeerLost)), None)
    return lost or exc


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and what it wraps: Ray Train hands the driver each worker's exception inside
    its own (`_base_exc`, or `health_check_failure` for a worker that stopped answering;
    no public names for either), task errors carry theirs as `cause`."""
    chain = [exc]
    while len(chain) < 8:
        last = chain[-1]
        inner = (getattr(last, "_base_exc", None) or getattr(last, "health_check_failure", None)
                 or getattr(last, "cause", None) or last.__cause__)
        if not isinstance(inner, BaseException) or inner in chain:
            break
        chain.append(inner)
    return chain


class _MarkStarted(Hook):
    """Rank 0 appends a line to the marker when training begins: a later attempt of the
    same command is then a retry, and resumes."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def on_fit_start(self, run: RunView) -> None:
        if run.is_main:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            with open_append(self.marker) as f:  # the file itself, never a link's target
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} step {run.step}\n")


def _train_worker(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    """One Ray Train worker: the process group is Ray's, the rest is `ddptrain train`."""
    job: RayJob = loop_config["job"]
    if os.path.isdir(job.cwd):  # relative paths in the flags mean what they meant to the driver
        os.chdir(job.cwd)
    config = parse_config(list(job.argv))
    marker = Path(job.marker)
    # Every rank reads the marker before rank 0 can write it in this attempt: rank 0
    # writes when training begins, after the collectives of building the trainer, which
    # wait for every rank. So all ranks of an attempt agree on whether it is a retry.
    refused = marker.with_name("refused")
    if refused.exists():  # the last attempt's bad input: every rank ends the job with it
        return {REFUSED: refused.read_text()}
    if marker.exists():
        if os.environ.get("RANK", "0") == "0":
            log.warning("Ray restarted the worker group: resuming from the newest checkpoint")
        config = dataclasses.replace(config, resume_from="auto")
    try:
        summary = job.fit(config, hooks=[_MarkStarted(marker)])
    except (ConfigError, TrainingStopped) as exc:
        if isinstance(exc, ConfigError):  # bad input: a retry would only say it again
            refused.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(refused, str(exc))
        # ddptrain's own end, one line: Ray logs a worker's traceback, so it starts here
        raise exc.with_traceback(None) from None
    return summary if os.environ.get("RANK", "0") == "0" else None
