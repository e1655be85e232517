"""Hooks that steer a run, for tests/test_steer.py (also importable by a rank's process)."""

from __future__ import annotations

from typing import Any

import torch

from ddptrain import Hook


class StopAt(Hook):
    """Ask for a stop at optimizer step `step` (or at epoch `epoch`'s validation row), on
    rank `rank` alone when given."""

    def __init__(
        self, step: int | None = None, epoch: int | None = None, rank: int | None = None,
        finish: bool = False,
    ) -> None:
        self.step, self.epoch, self.rank, self.finish = step, epoch, rank, finish

    def _mine(self, trainer: Any) -> bool:
        return self.rank is None or trainer.ctx.rank == self.rank

    def on_step_end(self, trainer: Any) -> None:
        if self._mine(trainer) and trainer.progress.step == self.step:
            trainer.steer.request_stop(f"asked at step {self.step}", finish=self.finish)

    def on_row(self, trainer: Any, row: dict[str, Any]) -> None:
        if self._mine(trainer) and row["split"] == "val" and row["epoch"] == self.epoch:
            trainer.steer.request_stop(f"asked at epoch {self.epoch}", finish=self.finish)


class Record(Hook):
    """What this rank saw: each step's number, the rows, and (with `weights`) the
    module's parameters at the start and after every optimizer step."""

    def __init__(self, weights: bool = False) -> None:
        self.weights = weights
        self.steps: list[int] = []
        self.rows: list[dict[str, Any]] = []
        self.params: list[dict[str, torch.Tensor]] = []
        self.lrs: list[float] = []

    def _snapshot(self, trainer: Any) -> None:
        if self.weights:
            self.params.append(
                {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
            )

    def on_fit_start(self, trainer: Any) -> None:
        self._snapshot(trainer)

    def on_step_end(self, trainer: Any) -> None:
        self.steps.append(trainer.progress.step)
        self.lrs.append(trainer.optimizer.param_groups[0]["lr"])
        self._snapshot(trainer)

    def on_row(self, trainer: Any, row: dict[str, Any]) -> None:
        self.rows.append(dict(row))


class HalveLR(Hook):
    """From step `step` on, the learning rate at half its schedule."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Any) -> None:
        if trainer.progress.step == self.step:
            assert trainer.steer.lr_multiplier == 1.0
            trainer.steer.lr_multiplier = 0.5
