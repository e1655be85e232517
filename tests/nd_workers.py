"""Rank functions for the n-D layout tests (tests/test_parallel_nd.py): several runs in
one process group, since starting a group of 4 ranks is most of such a test's time."""

from __future__ import annotations

import gc
from typing import Any

from torch.distributed.tensor import DTensor

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.sources import load_data
from ddptrain.launch.process_group import setup_distributed, teardown_distributed
from ddptrain.train.plan import resolve
from ddptrain.train.trainer import Trainer

# The layout tests' job (tests/test_parallel_nd.py, test_pipeline.py, test_tp_compose.py):
# the built-in GPT on 530 training windows of 64 characters, a global batch of 128 (5
# optimizer steps). The gradient norms are 2.2, 2.1, 1.7, 1.6, 1.8: the clip at 1.9 acts on
# some steps only, so a wrong norm changes which, and a wrong gradient scale is not
# clipped away.
GPT = dict(
    dataset="chars", block_size=64, width=64, epochs=1, optimizer="sgd", lr=0.5,
    momentum=0.9, max_grad_norm=1.9, log_interval=1, seed=3, curves=False,
)
GLOBAL_BATCH = 128


def fit_runs(rank: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fit each config in turn in one process group; for each: the whole model's weights
    (gathered, the user module's names), the summary and the bytes this rank held."""
    ctx = setup_distributed(TrainingConfig(**runs[0]).validate())
    clean = False
    try:
        results = fit_in_group(ctx, runs)
        clean = True
    finally:
        teardown_distributed(clean)
    return results


def fit_in_group(ctx: DistributedContext, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`fit_runs` in a process group already up. Under tp, also the parameters this rank
    holds whole (not split over the tp ranks), as it holds them: its peers' must match."""
    results = []
    for overrides in runs:  # checked in turn: a resume names an earlier run's checkpoint
        config = TrainingConfig(**overrides).validate()
        trainer = Trainer(resolve(config, load_data(config), ctx.world_size, ctx.device), ctx)
        summary = trainer.fit()
        weights = trainer.strategy.model_state(trainer.module)  # collective
        results.append({
            "weights": {k: v.clone() for k, v in weights.items()},
            "summary": summary,
            "bytes": trainer.strategy.rank_bytes(trainer.module, trainer.optimizer),
            "resumed_from": trainer.resumed_from,
            "held_whole": held_whole(trainer.module) if config.tp > 1 else {},
        })
        del trainer, weights
        gc.collect()
    return results


def held_whole(module: Any) -> dict[str, Any]:
    # The parameters tp does not split: plain tensors (DTensors on the data-parallel mesh
    # alone under FSDP); the tp-split ones name "tp" in their mesh.
    return {
        name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in module.named_parameters()
        if not isinstance(p, DTensor) or "tp" not in (p.device_mesh.mesh_dim_names or ())
    }
