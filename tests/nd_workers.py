"""Rank functions for the n-D layout tests (tests/test_parallel_nd.py): several runs in
one process group, since starting a group of 4 ranks is most of such a test's time."""

from __future__ import annotations

import gc
from typing import Any

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.sources import load_data
from ddptrain.launch.process_group import setup_distributed, teardown_distributed
from ddptrain.train.trainer import Trainer


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
    """`fit_runs` in a process group already up."""
    results = []
    for overrides in runs:  # checked in turn: a resume names an earlier run's checkpoint
        config = TrainingConfig(**overrides).validate()
        trainer = Trainer(config, ctx, load_data(config))
        summary = trainer.fit()
        weights = trainer.strategy.model_state(trainer.module)  # collective
        results.append({
            "weights": {k: v.clone() for k, v in weights.items()},
            "summary": summary,
            "bytes": trainer.strategy.rank_bytes(trainer.module, trainer.optimizer),
            "resumed_from": trainer.resumed_from,
        })
        del trainer, weights
        gc.collect()
    return results
