"""Contestant `ddptrain`: the real `ddptrain.train.trainer.Trainer`, as `ddptrain train` runs it.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/contestants/ddptrain_api.py \
        --workload mlp --out ddptrain.json

The trainer keeps its defaults (metric rows every 10 steps into metrics.jsonl and
TensorBoard); only the timing is added, through the hook `train_epoch` calls after each
optimizer step. After the timed epochs it also times a checkpoint save and a resume.
It reports where its start-up went (`startup`): the launcher, the imports, data, process
group, Trainer, logging start and the first step, the same phases `ddptrain train` runs.
`--compile` and `--channels_last` set the config fields of the same names.
"""

from __future__ import annotations

import time

IMPORTS_START = time.time()  # before the imports below: the interpreter's start ends here

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.allreduce import AllReduceCounter  # noqa: E402
from bench.common import (  # noqa: E402
    StepClock,
    barrier,
    build_data,
    parse_args,
    process_started,
    report,
    workload_config,
)
from ddptrain.config import TrainingConfig  # noqa: E402
from ddptrain.launch.cluster import read_cluster_env  # noqa: E402
from ddptrain.launch.process_group import setup_distributed, teardown_distributed  # noqa: E402
from ddptrain.observe.hooks import Hook  # noqa: E402
from ddptrain.train.plan import resolve  # noqa: E402
from ddptrain.train.trainer import Trainer  # noqa: E402

IMPORTS_DONE = time.time()
# The first torch.optim optimizer imports torch._dynamo (its methods are wrapped to keep
# dynamo out), seconds on a small CPU, in every contestant alike. Imported here, its
# cost is a phase of its own instead of most of `Trainer(...)`.
import torch._dynamo  # noqa: E402

DYNAMO_DONE = time.time()


class ClockHook(Hook):
    """Timestamps every optimizer step, through the same hook interface users have."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_step_end(self, run: object) -> None:
        self.clock.step()


class Marks:
    """perf_counter() timestamps of the start-up phases, in the order they happen."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.phases: dict[str, float] = {}

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self.t
        self.t = now


def main() -> None:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--run_dir", type=Path, required=True)
        parser.add_argument("--log_interval", type=int, default=TrainingConfig.log_interval)
        parser.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True)
        parser.add_argument("--compile", action="store_true", help="torch.compile the model")
        parser.add_argument("--channels_last", action="store_true")

    args = parse_args(extra)
    clock = StepClock()
    marks = Marks()
    cluster = read_cluster_env()
    run_dir = args.run_dir
    config = workload_config(
        args.workload, grad_accum_steps=args.grad_accum_steps,
        epochs=1 + args.timed_epochs, output_dir=str(run_dir),
        log_interval=args.log_interval, tensorboard=args.tensorboard,
        compile=args.compile, channels_last=args.channels_last,
    )
    # The order of `ddptrain.api.fit`: data first, so that a bad dataset ends the job
    # before any peer waits in the rendezvous.
    data = build_data(config)
    marks("data_s")
    if cluster.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    ctx = setup_distributed(config, cluster)
    # Not in `fit()`: the barrier makes the phase end when every rank has joined, so the
    # wait for a slower peer lands here and not in the Trainer's first collective.
    barrier()
    marks("process_group_s")
    try:
        extra = run(config, ctx, data, args.count_allreduce, clock, marks)
        report(args.out, clock, **extra)
    finally:
        teardown_distributed(True)


def run(  # type: ignore[no-untyped-def]
    config, ctx, data, count_allreduce: bool, clock: StepClock, marks: Marks
) -> dict:
    run = resolve(config, data, ctx.world_size, ctx.device)
    trainer = Trainer(run, ctx, hooks=[ClockHook(clock)])
    marks("trainer_s")
    counting = count_allreduce and ctx.distributed
    counter = AllReduceCounter().attach(trainer.model) if counting else None  # type: ignore[arg-type]
    trainer.writer.start(keep_step=None, keep_epoch=None)
    marks("writer_start_s")
    # `Trainer.first_step_s` counts from the start of `fit()`, which this loop does not
    # call (otherwise from the Trainer's construction, or not at all in older versions):
    # set that start to the first epoch's, so that it times what `ddptrain train` times.
    epoch_start = time.perf_counter()
    trainer._t_fit = epoch_start  # type: ignore[attr-defined]
    for epoch in range(1, config.epochs + 1):
        if epoch == 2:
            clock.start()
        trainer.train_epoch(epoch)
        trainer.progress.epoch, trainer.progress.samples_in_epoch = epoch, 0
    clock.stop()
    trainer.writer.close()
    assert clock.first_step_at is not None
    marks.phases["first_step_s"] = clock.first_step_at - epoch_start
    # The untimed first epoch ends at the barrier that starts the timed window.
    warmup_epoch_s = clock.t0 - epoch_start if config.epochs > 1 else None
    allreduce_ms = bare_allreduce_ms(trainer.module) if ctx.distributed else None

    t0 = time.perf_counter()
    trainer.save()
    save_s = time.perf_counter() - t0
    latest = config.ckpt_dir / "latest.pt"
    first_step_s = trainer.first_step_s
    del trainer  # the DDP reducer holds the process group; drop it before the next build
    resumed = dataclasses.replace(config, resume_from=str(latest), tensorboard=False)
    barrier()
    t0 = time.perf_counter()
    again = Trainer(resolve(resumed, data, ctx.world_size, ctx.device), ctx)
    resume_s = time.perf_counter() - t0
    del again

    rows = []
    if ctx.is_main:
        lines = (config.run_dir / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
    waits = [r["data_wait_frac"] for r in rows if r.get("split") == "train" and r["epoch"] > 1]
    rounds = counter.rounds / clock.steps if counter is not None else None
    started = process_started()
    return {
        "allreduce_rounds_per_step": rounds,
        "bare_allreduce_ms": allreduce_ms,
        "data_wait_frac": statistics.median(waits) if waits else None,
        "checkpoint_save_s": save_s,
        "resume_s": resume_s,
        "compile": config.compile,
        "channels_last": config.channels_last,
        "trainer_first_step_s": first_step_s,
        "warmup_epoch_s": warmup_epoch_s,
        "startup": {
            # From the orchestrator's launch of torchrun to this worker's start, then the
            # interpreter's start-up, then the imports of torch, ddptrain and the bench.
            "launcher_s": None if started is None else started - clock.launch,
            "interpreter_s": None if started is None else IMPORTS_START - started,
            "imports_s": IMPORTS_DONE - IMPORTS_START,
            "dynamo_import_s": DYNAMO_DONE - IMPORTS_DONE,
            **marks.phases,
        },
    }


def bare_allreduce_ms(module: torch.nn.Module, repeats: int = 200) -> float:
    """Milliseconds of one all-reduce of a gradient-sized buffer, with nothing else
    running: the floor that communication puts under a 2-rank step."""
    numel = sum(p.numel() for p in module.parameters())
    buf = torch.zeros(numel)
    for _ in range(10):
        dist.all_reduce(buf)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buf)
    return (time.perf_counter() - t0) / repeats * 1e3


if __name__ == "__main__":
    main()
