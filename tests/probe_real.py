"""The step `ddptrain plan` measures, run for real on this job's ranks (torchrun's script):

    torchrun --standalone --nproc_per_node=2 tests/probe_real.py OUT.json ddp fsdp ...

For each layout named (`ddp`, `zero`, `fsdp`, `tp2`), rank 0's peak by kind in one real
training step (the same step, the same trackers as on fake ranks), then, once the group
is gone, the same layout measured on fake ranks in this process; rank 0 writes both to
OUT.json."""

from __future__ import annotations

import gc
import json
import sys

import torch
import torch.distributed as dist

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.models.gpt import build_gpt
from ddptrain.parallel.base import init_optimizer_state
from ddptrain.parallel.mesh import attach_mesh
from ddptrain.parallel.parallelize import parallelize
from ddptrain.parallel.resolve import resolve_strategy
from ddptrain.train import probe
from ddptrain.train.optim import build_optimizer

VOCAB, SEQ, BATCH = 512, 64, 4
LAYOUTS = {"ddp": {"strategy": "ddp"}, "zero": {"strategy": "zero"},
           "fsdp": {"strategy": "fsdp"}, "tp2": {"strategy": "ddp", "tp": 2}}


def build(device: torch.device) -> torch.nn.Module:
    with torch.device(device):
        return build_gpt(VOCAB, SEQ, 128)


def real(config: TrainingConfig, rank: int, world: int) -> dict[str, int]:
    ctx = DistributedContext(rank, rank, world, torch.device("cpu"), backend="gloo")
    choice = resolve_strategy(config, world, "cpu", world)
    ctx = attach_mesh(ctx, choice.layout)
    strategy = choice.build(ctx, config, probe.amp_dtype(config))
    module = strategy.build_module(build)
    model, _ = parallelize(module, strategy, config, ctx)
    optimizer = build_optimizer(config, module, strategy, ctx.data_world).optimizer
    init_optimizer_state(strategy.local_optimizer(optimizer))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    tracker = probe._tracker(module, strategy.local_optimizer(optimizer))
    with tracker:
        probe.one_step(model, optimizer, tokens, probe.autocast_of(config))
    peak = probe.by_kind(tracker.get_tracker_snapshot("peak"))
    del model, module, optimizer, strategy
    gc.collect()
    dist.barrier()
    return peak


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    names = sys.argv[2:]
    configs = {n: TrainingConfig(optimizer="adamw", **LAYOUTS[n]) for n in names}
    measured = {n: real(c, rank, world) for n, c in configs.items()}
    dist.destroy_process_group()
    if rank == 0:
        fake = {n: probe.fake_step(c, world, 0, world, build, BATCH, SEQ, VOCAB)
                for n, c in configs.items()}
        with open(sys.argv[1], "w") as f:
            json.dump({"real": measured, "fake": fake}, f)


if __name__ == "__main__":
    main()
