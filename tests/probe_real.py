"""The step `ddptrain plan` measures, run for real on this job's ranks (torchrun's script):

    torchrun --standalone --nproc_per_node=2 tests/probe_real.py OUT ddp fsdp tp2 pp2 ...

For each layout named (`LAYOUTS`), every rank's peak by kind in one real training step
(the same step, the same trackers as on fake ranks) and the collectives it ran in that
step (torch's flight recorder; a pipeline's sends and receives, which gloo's recorder
does not keep, counted by the dispatch mode the fake ranks use). Once the group is gone,
each rank measures the same layouts on fake ranks as itself, in its own process, and
writes both to OUT.<rank>.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

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
from ddptrain.train.collectives import (
    P2P,
    CountCollectives,
    recorded_calls,
    recorder_mark,
    traffic,
)
from ddptrain.train.optim import build_optimizer

VOCAB, SEQ, BATCH, WIDTH = 512, 64, 4, 128
# name: (the layout's flags, the model has experts)
LAYOUTS: dict[str, tuple[dict[str, Any], bool]] = {
    "ddp": ({"strategy": "ddp"}, False), "zero": ({"strategy": "zero"}, False),
    "fsdp": ({"strategy": "fsdp"}, False), "tp2": ({"strategy": "ddp", "tp": 2}, False),
    "pp2": ({"strategy": "ddp", "pp": 2}, False),
    "hsdp": ({"strategy": "fsdp", "dp_replicate": 2}, False),
    "fsdp_tp": ({"strategy": "fsdp", "tp": 2}, False),
    "ep2": ({"strategy": "fsdp", "ep": 2}, True),
    "fsdp_pp": ({"strategy": "fsdp", "pp": 2}, False),
}


def builder(experts: bool) -> Any:
    def build(device: torch.device) -> torch.nn.Module:
        with torch.device(device):
            return build_gpt(VOCAB, SEQ, WIDTH, experts=4 if experts else 0, top_k=2)

    return build


def config_of(name: str) -> TrainingConfig:
    flags, _ = LAYOUTS[name]
    return TrainingConfig(optimizer="adamw", batch_size=BATCH, **flags)


def real(name: str, rank: int, world: int) -> dict[str, Any]:
    config = config_of(name)
    ctx = DistributedContext(rank, rank, world, torch.device("cpu"), backend="gloo")
    choice = resolve_strategy(config, world, "cpu", world)
    ctx = attach_mesh(ctx, choice.layout)
    strategy = choice.build(ctx, config, probe.amp_dtype(config))
    module = strategy.build_module(builder(LAYOUTS[name][1]))
    model, _ = parallelize(module, strategy, config, ctx)
    optimizer = build_optimizer(config, module, strategy, ctx.data_world).optimizer
    local = strategy.local_optimizer(optimizer)
    init_optimizer_state(local)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(0))
    autocast = probe.autocast_of(config)
    probe.warm_up(strategy, model, tokens, autocast, module)
    tracker = probe._tracker(module, local)
    p2p = CountCollectives(p2p_only=True)
    since = recorder_mark()
    with p2p, tracker:
        probe.one_step(strategy, model, optimizer, tokens, autocast)
    calls = recorded_calls(since)
    if not any(op in P2P for op, _ in calls):  # gloo's recorder keeps none
        calls += p2p.calls
    peak = probe.by_kind(tracker.get_tracker_snapshot("peak"))
    del model, module, optimizer, strategy, local
    gc.collect()
    dist.barrier()
    return {"peak": peak, "collectives": traffic(calls)}


def fake(name: str, rank: int, world: int) -> dict[str, Any]:
    figures = probe.fake_step(config_of(name), world, rank, world,
                              builder(LAYOUTS[name][1]), BATCH, SEQ, VOCAB)
    return {"peak": dict(figures), "collectives": figures.collectives,
            "stage": figures.stage}


def main() -> None:
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "20000")  # before the group starts
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    names = sys.argv[2:]
    measured = {n: real(n, rank, world) for n in names}
    dist.destroy_process_group()
    faked = {n: fake(n, rank, world) for n in names}
    with open(f"{sys.argv[1]}.{rank}.json", "w") as f:
        json.dump({"real": measured, "fake": faked}, f)


if __name__ == "__main__":
    main()
