"""Contestant `accelerate`: the same loop written for HF Accelerate (multi-CPU, gloo).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \
        bench/contestants/accelerate_loop.py --workload mlp --out accelerate.json

Accelerate shards the plain loader itself (`prepare`) and handles accumulation with
`accumulate`, which skips the all-reduce of non-final micro-batches, as its docs show.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench`

import torch
from accelerate import Accelerator
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
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.grad_accum_steps)
    config = workload_config(args.workload, grad_accum_steps=args.grad_accum_steps)
    data = build_data(config)
    torch.manual_seed(config.seed)
    module = create_model(config, data, data.num_classes, torch.device("cpu"))
    optimizer = sgd(module, config)
    loader = plain_loader(data, config)
    k = config.grad_accum_steps
    epochs = 1 + args.timed_epochs
    # Sized after `prepare`, which shards the loader across the ranks.
    model, optimizer, loader = accelerator.prepare(module, optimizer, loader)
    scheduler = accelerator.prepare(schedule(optimizer, -(-len(loader) // k) * epochs))
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        if epoch == 1:
            clock.start()
        model.train()
        loader.set_epoch(epoch)
        sums = torch.zeros(3, dtype=torch.float64)
        for x, y in loader:
            with accelerator.accumulate(model):
                logits = model(x)
                loss = criterion(logits, y)
                accelerator.backward(loss)  # divided by k inside, as `accumulate` expects
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            track(sums, logits, y, loss)
            if accelerator.sync_gradients:
                clock.step()
        accelerator.reduce(sums, reduction="sum")  # the epoch's global train loss
    clock.stop()
    report(args.out, clock)


if __name__ == "__main__":
    contestant_main(run)
