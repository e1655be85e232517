"""The run's figures at its end (`summary.json`), across every resume of it.

Built from the trainer's history (carried in every checkpoint), its progress, the last
validation figures and what the run's parts report: the strategy and layout, rank 0's
bytes, stragglers, a data mix, an early stop, and the checkpoints' blocking time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddptrain.checkpoint import Checkpointer
from ddptrain.data import mix_counts

if TYPE_CHECKING:
    from ddptrain.train.trainer import Trainer


def run_summary(trainer: Trainer, val: dict[str, float]) -> dict[str, Any]:
    """The run's figures, across every resume of it."""
    h, task, config, progress = trainer.history, trainer.task, trainer.config, trainer.progress
    steer = trainer.steer
    return {
        "run_id": config.run_id, "run_dir": str(config.run_dir),
        "epochs": config.epochs,
        "steps": progress.step, "world_size": trainer.ctx.world_size, "task": task.name,
        **{f"val_{k}": v for k, v in val.items() if k != "samples"},
        "best_metric": trainer.best_key, f"best_val_{trainer.best_key}": h["best"],
        "best_epoch": h["best_epoch"], "train_time_s": h["train_time_s"],
        "samples": h["samples"],
        "samples_per_sec": h["samples"] / h["train_time_s"] if h["train_time_s"] else 0.0,
        "bad_steps": progress.bad_steps, "first_step_s": trainer.first_step_s,
        "skipped_steps": h.get("skipped_steps", 0), "rollbacks": len(trainer.skips.rollbacks),
        "startup_s": trainer.startup.seconds,
        **({"stragglers": trainer.stragglers.named} if trainer.stragglers.named else {}),
        **({"mix": {"per_epoch": mix}} if (mix := mix_counts(trainer.data.train)) else {}),
        "strategy": trainer.strategy.name, "layout": trainer.choice.label,
        **({"stopped_early": True, "stop_reason": steer.agreed,
            "stopped_at_epoch": progress.epoch} if steer.agreed else {}),
        "rank0_bytes": trainer.strategy.rank_bytes(trainer.module, trainer.optimizer),
        **checkpoint_figures(trainer.checkpoints),
    }


def checkpoint_figures(checkpoints: Checkpointer) -> dict[str, Any]:
    """The median time a checkpoint held up training, when any was written."""
    if not checkpoints.blocking_s:
        return {}
    times = sorted(checkpoints.blocking_s)
    return {"checkpoint_blocking_s_median": times[len(times) // 2]}
