"""A whole training run written by hand: the reference for `ddptrain train` as a process.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/contestants/raw_script.py \
        --epochs 5 --out_dir runs/raw-script

What a user writes without a framework for the work `ddptrain train --dataset
bench.userdata:tabular` does: start the process group, build the same datasets and the
same seeded MLP, train with SGD (momentum, weight decay) on a cosine schedule, validate on
a shard of the validation set after every epoch and all-reduce the sums, print and log a
line per epoch, and save a final checkpoint. It imports nothing from ddptrain or the
bench's shared module, so its start-up is torch's alone; the orchestrator times it from
launch to exit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench`

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from bench.userdata import tabular


def mlp(in_features: int, classes: int, hidden: int) -> nn.Module:
    """ddptrain's MLP, layer for layer, so that the seeded weights are the same."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out_dir", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, val_set = tabular(SimpleNamespace(seed=args.seed))
    torch.manual_seed(args.seed)
    module = mlp(train_set.tensors[0].shape[1], 2, args.width)
    model = DDP(module)
    sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    val_loader = DataLoader(
        val_set, batch_size=args.batch_size,
        sampler=DistributedSampler(val_set, shuffle=False),
    )
    optimizer = torch.optim.SGD(
        model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4
    )
    total = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    )
    criterion = nn.CrossEntropyLoss()
    if rank == 0:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        log = (args.out_dir / "metrics.jsonl").open("w")
    t_train = time.perf_counter()
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        # Validation on the plain module: DDP's forward would broadcast buffers.
        module.eval()
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for x, y in val_loader:
                logits = module(x)
                sums += torch.tensor([
                    nn.functional.cross_entropy(logits, y, reduction="sum").item(),
                    (logits.argmax(1) == y).sum().item(), len(y),
                ], dtype=torch.float64)
        dist.all_reduce(sums)
        if rank == 0:
            row = {
                "epoch": epoch + 1, "val_loss": sums[0].item() / sums[2].item(),
                "val_accuracy": sums[1].item() / sums[2].item(),
                "epoch_time_s": time.perf_counter() - t0,
            }
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
    train_time = time.perf_counter() - t_train
    if rank == 0:
        log.close()
        torch.save(
            {"model": module.state_dict(), "optimizer": optimizer.state_dict(),
             "epoch": args.epochs},
            args.out_dir / "checkpoint.pt",
        )
        summary = {"train_time_s": train_time, "steps": total, "world_size": world}
        (args.out_dir / "summary.json").write_text(json.dumps(summary) + "\n")
    dist.barrier()
    del model  # the DDP reducer must go before the process group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
