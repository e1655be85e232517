"""Contestant `fabric`: the same loop written for Lightning Fabric (strategy ddp, CPU).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/contestants/fabric.py \
        --workload mlp --out fabric.json

Fabric shards the plain loader itself (`setup_dataloaders`) and skips the gradient
all-reduce of non-final micro-batches with `no_backward_sync`, as its docs show.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench`

import torch
from lightning.fabric import Fabric
from torch import nn

from bench.common import (
    StepClock,
    build_data,
    contestant_main,
    plain_loader,
    report,
    schedule,
    sgd,
    track,
    workload_config,
)
from ddptrain.models.factory import create_model


def run(args: argparse.Namespace) -> None:
    clock = StepClock()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
    fabric.launch()
    config = workload_config(args.workload, grad_accum_steps=args.grad_accum_steps)
    data = build_data(config)
    torch.manual_seed(config.seed)
    module = create_model(config, data, data.num_classes, torch.device("cpu"))
    optimizer = sgd(module, config)
    model, optimizer = fabric.setup(module, optimizer)
    loader = fabric.setup_dataloaders(plain_loader(data, config))
    k = config.grad_accum_steps
    epochs = 1 + args.timed_epochs
    scheduler = schedule(optimizer, -(-len(loader) // k) * epochs)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        if epoch == 1:
            clock.start()
        model.train()
        sums = torch.zeros(3, dtype=torch.float64)
        n_batches = len(loader)
        for i, (x, y) in enumerate(loader):  # Fabric's loader calls set_epoch itself
            ends_window = (i + 1) % k == 0 or i + 1 == n_batches
            with fabric.no_backward_sync(model, enabled=not ends_window):
                logits = model(x)
                loss = criterion(logits, y)
                fabric.backward(loss / k)
            track(sums, logits, y, loss)
            if ends_window:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                clock.step()
        fabric.all_reduce(sums, reduce_op="sum")  # the epoch's global train loss
    clock.stop()
    report(args.out, clock)


if __name__ == "__main__":
    contestant_main(run)
