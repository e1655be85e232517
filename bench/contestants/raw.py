"""Contestant `raw`: a minimal hand-written DDP loop, the physical reference.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/contestants/raw.py \
        --workload mlp --out raw.json

`--seed_style` runs the seed's loop instead (no `no_sync`), to count its all-reduces.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench`

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from bench.allreduce import AllReduceCounter
from bench.common import (
    StepClock,
    build_data,
    loader_kwargs,
    parse_args,
    report,
    schedule,
    sgd,
    workload_config,
)
from bench.loops import hand_written_epoch
from ddptrain.launch.process_group import teardown_distributed
from ddptrain.models.factory import create_model


def main() -> None:
    args = parse_args(lambda p: p.add_argument("--seed_style", action="store_true"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    try:
        run(args, world)
    finally:
        # The DDP model died with run()'s frame; destroying the group while its reducer
        # lived could abort gloo at exit.
        teardown_distributed(clean=True)


def run(args: argparse.Namespace, world: int) -> None:
    clock = StepClock()
    rank = dist.get_rank() if world > 1 else 0
    config = workload_config(args.workload, grad_accum_steps=args.grad_accum_steps)
    data = build_data(config)
    torch.manual_seed(config.seed)
    module = create_model(config, data, data.num_classes, torch.device("cpu"))
    model: nn.Module = DDP(module, gradient_as_bucket_view=True) if world > 1 else module
    counting = args.count_allreduce and isinstance(model, DDP)
    counter = AllReduceCounter().attach(model) if counting else None  # type: ignore[arg-type]
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, seed=config.seed)
    loader = DataLoader(data.train, sampler=sampler, **loader_kwargs(data.train, config))
    epochs = 1 + args.timed_epochs
    steps_per_epoch = -(-len(loader) // config.grad_accum_steps)
    optimizer = sgd(model, config)
    scheduler = schedule(optimizer, steps_per_epoch * epochs)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        if epoch == 1:
            clock.start()
        sampler.set_epoch(epoch)
        sums = hand_written_epoch(
            model, loader, optimizer, scheduler, criterion, config.grad_accum_steps,
            no_sync=not args.seed_style, keep_last_window=not args.seed_style,
            on_step=clock.step,
        )
        if world > 1:
            dist.all_reduce(sums)  # the epoch's global train loss, as the seed's loop reports
    clock.stop()
    rounds = counter.rounds / clock.steps if counter is not None else None
    report(args.out, clock, allreduce_rounds_per_step=rounds)


if __name__ == "__main__":
    main()
