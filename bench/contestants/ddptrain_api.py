"""Contestant `ddptrain`: the real `ddptrain.trainer.Trainer`, as `ddptrain train` runs it.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/contestants/ddptrain_api.py \
        --workload mlp --out ddptrain.json

The trainer keeps its defaults (metric rows every 10 steps into metrics.jsonl and
TensorBoard); only the timing is added, through the hook `train_epoch` calls after each
optimizer step. After the timed epochs it also times a checkpoint save and a resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench`

import torch
import torch.distributed as dist

from bench.allreduce import AllReduceCounter
from bench.common import StepClock, build_data, parse_args, report, workload_config
from ddptrain.config import TrainingConfig
from ddptrain.distributed import read_cluster_env, setup_distributed, teardown_distributed
from ddptrain.hooks import Hook
from ddptrain.trainer import Trainer


class ClockHook(Hook):
    """Timestamps every optimizer step, through the same hook interface users have."""

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_step_end(self, trainer: object) -> None:
        self.clock.step()


def main() -> None:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--run_dir", type=Path, required=True)
        parser.add_argument("--log_interval", type=int, default=TrainingConfig.log_interval)
        parser.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True)

    args = parse_args(extra)
    clock = StepClock()
    cluster = read_cluster_env()
    run_dir = args.run_dir
    config = workload_config(
        args.workload, grad_accum_steps=args.grad_accum_steps,
        epochs=1 + args.timed_epochs, output_dir=str(run_dir),
        log_interval=args.log_interval, tensorboard=args.tensorboard,
    )
    data = build_data(config)
    if cluster.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    ctx = setup_distributed(config, cluster)
    try:
        extra = run(config, ctx, data, args.count_allreduce, clock)
        report(args.out, clock, **extra)
    finally:
        teardown_distributed(True)


def run(config, ctx, data, count_allreduce: bool, clock: StepClock) -> dict:  # type: ignore[no-untyped-def]
    trainer = Trainer(config, ctx, data, hooks=[ClockHook(clock)])
    counting = count_allreduce and ctx.distributed
    counter = AllReduceCounter().attach(trainer.model) if counting else None  # type: ignore[arg-type]
    trainer.writer.start(keep_step=None, keep_epoch=None)
    for epoch in range(1, config.epochs + 1):
        if epoch == 2:
            clock.start()
        trainer.train_epoch(epoch)
        trainer.progress.epoch, trainer.progress.samples_in_epoch = epoch, 0
    clock.stop()
    trainer.writer.close()
    allreduce_ms = bare_allreduce_ms(trainer.module) if ctx.distributed else None

    t0 = time.perf_counter()
    trainer.save()
    save_s = time.perf_counter() - t0
    latest = config.ckpt_dir / "latest.pt"
    del trainer  # the DDP reducer holds the process group; drop it before the next build
    resumed = dataclasses.replace(config, resume_from=str(latest), tensorboard=False)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    again = Trainer(resumed, ctx, data)
    resume_s = time.perf_counter() - t0
    del again

    rows = []
    if ctx.is_main:
        lines = (config.run_dir / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
    waits = [r["data_wait_frac"] for r in rows if r.get("split") == "train" and r["epoch"] > 1]
    rounds = counter.rounds / clock.steps if counter is not None else None
    return {
        "allreduce_rounds_per_step": rounds,
        "bare_allreduce_ms": allreduce_ms,
        "data_wait_frac": statistics.median(waits) if waits else None,
        "checkpoint_save_s": save_s,
        "resume_s": resume_s,
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
