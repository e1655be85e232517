"""Functions that run on each spawned rank (see dist_utils.run_ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ddptrain.cli import train
from ddptrain.config import TrainingConfig
from ddptrain.data.sources import load_data
from ddptrain.launch.process_group import setup_distributed, teardown_distributed
from ddptrain.train.plan import resolve
from ddptrain.train.trainer import Trainer


def run_training(rank: int, overrides: dict[str, Any]) -> dict[str, Any] | None:
    """The normal `ddptrain train` path on this rank."""
    return train(TrainingConfig(**overrides).validate())


def _with_trainer(overrides: dict[str, Any], body: Any) -> Any:
    config = TrainingConfig(**overrides).validate()
    ctx = setup_distributed(config)
    clean = False
    try:
        trainer = Trainer(resolve(config, load_data(config), ctx.world_size, ctx.device), ctx)
        result = body(trainer)
        del trainer
        clean = True
    finally:
        teardown_distributed(clean)
    return result


def count_allreduces(rank: int, overrides: dict[str, Any]) -> dict[str, int]:
    """Gradient all-reduce calls during ddptrain's fit, and during a seed-style loop that
    calls backward K times without no_sync (the counter must see those too)."""

    def body(trainer: Trainer) -> dict[str, int]:
        calls = [0]

        # No annotations: DDP checks them against dist.GradBucket at registration.
        def counting_hook(state, bucket):  # type: ignore[no-untyped-def]
            calls[0] += 1
            return allreduce_hook(state, bucket)

        trainer.model.register_comm_hook(None, counting_hook)
        trainer.fit()
        ours, steps = calls[0], trainer.progress.step
        # Seed-style accumulation: every micro-step's backward all-reduces.
        calls[0] = 0
        k = trainer.config.grad_accum_steps
        x, y = next(trainer.train_batches.batches(*trainer.train_batches.plan(1, 0)))
        for _ in range(k):
            loss = torch.nn.functional.cross_entropy(trainer.model(x), y) / k
            loss.backward()
        return {"calls": ours, "steps": steps, "seed_style_calls": calls[0]}

    return _with_trainer(overrides, body)


def epoch_indices(rank: int, overrides: dict[str, Any], n: int) -> dict[int, list[int]]:
    """Sample ids (feature 0 x n) this rank's train loader yields in epochs 1..3."""

    def body(trainer: Trainer) -> dict[int, list[int]]:
        batches = trainer.train_batches
        seen: dict[int, list[int]] = {}
        for epoch in (1, 2, 3):
            ids: list[int] = []
            order, plan = batches.plan(epoch, 0)
            for (x, _), micro in zip(batches.batches(order, plan), plan, strict=True):
                if not micro.pad:
                    ids += torch.round(x[:, 0] * n).long().tolist()
            seen[epoch] = ids
        return seen

    return _with_trainer(overrides, body)


def evaluate_fresh(rank: int, overrides: dict[str, Any]) -> dict[str, float]:
    """Validation metrics of the freshly initialised model (same weights on any world size)."""
    return _with_trainer(overrides, lambda trainer: trainer.evaluate())


def train_and_report(rank: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """Fit, then return this rank's own weights and skipped-step count."""

    def body(trainer: Trainer) -> dict[str, Any]:
        trainer.fit()
        state = trainer.module.state_dict()  # fsdp: DTensor shards, gathered whole
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                   for k, v in state.items()}
        return {"weights": weights, "bad_steps": trainer.progress.bad_steps}

    return _with_trainer(overrides, body)


def fit_and_measure(rank: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """Fit, counting FSDP's gradient reduce-scatters; return this rank's figures: the
    calls, the steps, the bytes it holds, its peak RSS, the run's summary and the
    all-reduces of one more evaluation."""
    import torch.distributed as dist

    from ddptrain.train.metrics import peak_rss_mb

    def body(trainer: Trainer) -> dict[str, Any]:
        calls = [0]
        original = dist.reduce_scatter_single

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return original(*args, **kwargs)

        dist.reduce_scatter_single = counting  # FSDP2 looks it up on every call
        try:
            summary = trainer.fit()
        finally:
            dist.reduce_scatter_single = original
        reduces, all_reduce = [0], dist.all_reduce

        def counting_reduce(*args: Any, **kwargs: Any) -> Any:
            reduces[0] += 1
            return all_reduce(*args, **kwargs)

        dist.all_reduce = counting_reduce
        try:
            trainer.evaluate()
        finally:
            dist.all_reduce = all_reduce
        return {
            "reduce_scatters": calls[0], "steps": trainer.progress.step, "summary": summary,
            "eval_all_reduces": reduces[0],
            "bytes": trainer.strategy.rank_bytes(trainer.module, trainer.optimizer),
            "peak_rss_mb": peak_rss_mb(),
        }

    return _with_trainer(overrides, body)


def count_metric_collectives(rank: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The metric all-reduces of a fit (train rows, epoch totals, validation), with the
    cadence pinned far beyond the run so that only the first batch and the epoch ends
    reduce; and the train rows rank 0 wrote."""
    import sys

    import torch.distributed as dist

    import ddptrain.train.trainer

    ddptrain.train.trainer.SYNC_EVERY_S = 3600.0
    calls = [0]
    real = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += sys._getframe(1).f_code.co_name == "reduce_snapshots"
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        def body(trainer: Trainer) -> dict[str, Any]:
            trainer.fit()
            return {"calls": calls[0], "steps": trainer.progress.step}

        return _with_trainer(overrides, body)
    finally:
        dist.all_reduce = real


def fit_syncing_every_step(rank: int, overrides: dict[str, Any]) -> dict[str, Any] | None:
    """`ddptrain train` on this rank with a metric sync at every step."""
    import ddptrain.train.trainer as loop

    loop.SYNC_EVERY_S = 1e-9
    return train(TrainingConfig(**overrides).validate())


def count_step_collectives(rank: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The all-reduces each optimizer step makes (`stepping.optimizer_step`: the
    window's count and the non-finite flag; not the gradient reduction, which is the
    strategy's own reduce-scatter or bucket hook), per step, and the skipped steps."""
    import torch.distributed as dist

    import ddptrain.train.trainer as loop

    def body(trainer: Trainer) -> dict[str, Any]:
        per_step: list[int] = []
        real_reduce, real_step = dist.all_reduce, loop.optimizer_step

        def reduce(*args: Any, **kwargs: Any) -> Any:
            if per_step and per_step[-1] >= 0:
                per_step[-1] += 1
            return real_reduce(*args, **kwargs)

        def step(*args: Any, **kwargs: Any) -> Any:
            per_step.append(0)
            try:
                return real_step(*args, **kwargs)
            finally:
                per_step.append(-1)  # outside a step: not counted

        dist.all_reduce, loop.optimizer_step = reduce, step  # type: ignore[assignment]
        try:
            trainer.fit()
        finally:
            dist.all_reduce, loop.optimizer_step = real_reduce, real_step  # type: ignore[assignment]
        return {"per_step": [n for n in per_step if n >= 0], "steps": trainer.progress.step}

    return _with_trainer(overrides, body)
