"""What every contestant shares: the workloads, the data, the model, the measuring.

Each contestant is a script run under torchrun with OMP_NUM_THREADS=1. It builds the
same dataset and the same seeded model with ddptrain's own builders, trains one untimed
warm-up epoch and then `--timed_epochs` timed epochs with plain SGD and the same
warm-up/cosine schedule, and rank 0 writes one JSON result (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from ddptrain.config import TrainingConfig
from ddptrain.data.arrays import ArrayDataset
from ddptrain.data.bundle import DataBundle
from ddptrain.data.sources import load_data
from ddptrain.train.optim import warmup_cosine

# The contest's workloads: overhead-dominated (a tiny MLP, ~1 ms steps), compute-dominated
# (MiniResNet on 3x32x32 images), and a user's own TensorDataset (`bench/userdata.py`),
# which ddptrain reads through its user-dataset path and the others through a plain
# DataLoader: once in the training process, once with 2 loader workers per rank. Sizes
# are chosen to run in seconds on one CPU thread.
USER_DATASET = "bench.userdata:tabular"
WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp": {"dataset": "breast_cancer", "batch_size": 8, "width": 64},
    "resnet": {"dataset": "synthetic", "synthetic_size": 1280, "width": 16, "batch_size": 32},
    # A TensorDataset carries no class count for ddptrain to read: the user passes it.
    "dataset": {"dataset": USER_DATASET, "num_classes": 2, "batch_size": 32, "width": 64},
    "workers": {
        "dataset": USER_DATASET, "num_classes": 2, "batch_size": 32, "width": 64,
        "num_workers": 2,
    },
}
# Run by ddptrain alone (torch.compile against eager), never by the other contestants.
DDPTRAIN_ONLY: dict[str, dict[str, Any]] = {
    "gpt": {"dataset": "chars", "model": "gpt", "block_size": 64, "width": 64, "batch_size": 16},
}
ALL_WORKLOADS = {**WORKLOADS, **DDPTRAIN_ONLY}
TIMED_EPOCHS = {"mlp": 20, "resnet": 2, "dataset": 2, "workers": 2, "gpt": 2}
LAUNCH_ENV = "BENCH_LAUNCH_T"  # wall-clock time at which the orchestrator started torchrun


def parse_args(
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=sorted(ALL_WORKLOADS), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timed_epochs", type=int, default=None)
    parser.add_argument("--grad_accum_steps", type=int, default=1)
    # Off for the timed runs: the counting hook replaces DDP's built-in C++ all-reduce
    # with a Python one, which Fabric and Accelerate would not pay.
    parser.add_argument("--count_allreduce", action="store_true")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    if args.timed_epochs is None:
        args.timed_epochs = TIMED_EPOCHS[args.workload]
    return args


def workload_config(name: str, **overrides: Any) -> TrainingConfig:
    fields = {**ALL_WORKLOADS[name], "device": "cpu", "use_amp": False, "save_every": 0}
    return TrainingConfig(**{**fields, **overrides}).validate()


def build_data(config: TrainingConfig) -> DataBundle:
    return load_data(config)


def passthrough(batch: Any) -> Any:
    """ddptrain's ArrayDataset returns whole batches from `__getitems__`."""
    return batch


def loader_kwargs(dataset: Dataset, config: TrainingConfig) -> dict[str, Any]:
    """What every hand-built loader shares: the batch, the collate and the workers.

    ddptrain's own arrays hand out whole batches (no collate needed); a user's dataset
    gets the default collate of single samples. Workers persist across epochs, as
    ddptrain's do: respawning them every epoch would be a cost of the setting, not of
    the loop.
    """
    workers = config.num_workers
    return {
        "batch_size": config.batch_size,
        "collate_fn": passthrough if isinstance(dataset, ArrayDataset) else None,
        "num_workers": workers,
        "persistent_workers": workers > 0,
    }


def plain_loader(data: DataBundle, config: TrainingConfig) -> DataLoader:
    """The loader a Fabric or Accelerate user hands over: shuffled, not yet sharded."""
    return DataLoader(data.train, shuffle=True, **loader_kwargs(data.train, config))


def schedule(
    optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(0, total_steps))


def sgd(model: torch.nn.Module, config: TrainingConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum,
        weight_decay=config.weight_decay,
    )


@dataclass
class StepClock:
    """Optimizer-step timestamps: the first step's distance from the launch, and the
    timed window (between two barriers, so it measures the slowest rank)."""

    launch: float = float(os.environ.get(LAUNCH_ENV, time.time()))
    first_step_s: float | None = None
    first_step_at: float | None = None  # perf_counter() at the end of the first step
    steps: int = 0
    timed_steps: int = 0
    t0: float = 0.0
    seconds: float = 0.0

    def step(self) -> None:
        if self.first_step_s is None:
            self.first_step_s = time.time() - self.launch
            self.first_step_at = time.perf_counter()
        self.steps += 1

    def start(self) -> None:
        barrier()
        self.steps_at_start = self.steps
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        barrier()
        self.seconds = time.perf_counter() - self.t0
        self.timed_steps = self.steps - self.steps_at_start


def process_started() -> float | None:
    """Wall-clock time at which this process started, from Linux's /proc (10 ms ticks),
    to tell the launcher's share of the start-up from the interpreter's and the imports'.
    None where /proc is not there."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    # The command name (field 2) may hold spaces; the fields after it are plain numbers.
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def report(out: Path, clock: StepClock, **extra: Any) -> None:
    """Gather every rank's peak RSS; rank 0 writes the result file."""
    rss = [peak_rss_mb()]
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rss[0])
        rss = gathered
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        return
    result = {
        "world_size": len(rss),
        "timed_steps": clock.timed_steps,
        "timed_seconds": clock.seconds,
        "step_time_s": clock.seconds / max(1, clock.timed_steps),
        "first_step_s": clock.first_step_s,
        "peak_rss_mb": rss,
        **extra,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def track(sums: torch.Tensor, logits: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> None:
    """The metric sums every contestant keeps on the device, as ddptrain does:
    (loss sum, correct, count), all-reduced once at the end of each epoch, as the seed's
    loop reports its epoch loss."""
    correct = (logits.argmax(dim=1) == y).sum()
    sums += torch.stack(
        [loss.detach().double() * y.shape[0], correct.double(), torch.tensor(float(len(y)))]
    )


def contestant_main(run: Callable[[argparse.Namespace], None]) -> None:
    """Run a contestant that lets its framework start the process group, then tear down.

    Models and loaders die with `run`'s frame; destroying the group while a DDP reducer
    lived could abort gloo at exit.
    """
    from ddptrain.launch.process_group import teardown_distributed

    try:
        run(parse_args())
    finally:
        teardown_distributed(clean=True)
