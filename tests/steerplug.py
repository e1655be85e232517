"""Hooks that steer a run, for tests/test_steer.py (also importable by a rank's process)."""

from __future__ import annotations

from typing import Any

import torch

from ddptrain import Hook, RunView
from ddptrain.observe.hooks import TrainerHook


class StopAt(Hook):
    """Ask for a stop at optimizer step `step` (or at epoch `epoch`'s validation row), on
    rank `rank` alone when given."""

    def __init__(
        self, step: int | None = None, epoch: int | None = None, rank: int | None = None,
        finish: bool = False,
    ) -> None:
        self.step, self.epoch, self.rank, self.finish = step, epoch, rank, finish

    def _mine(self, run: RunView) -> bool:
        return self.rank is None or run.rank == self.rank

    def on_step_end(self, run: RunView) -> None:
        if self._mine(run) and run.step == self.step:
            run.request_stop(f"asked at step {self.step}", finish=self.finish)

    def on_row(self, run: RunView, row: dict[str, Any]) -> None:
        if self._mine(run) and row["split"] == "val" and row["epoch"] == self.epoch:
            run.request_stop(f"asked at epoch {self.epoch}", finish=self.finish)


class Record(Hook):
    """What this rank saw: each step's number, learning rate and place in the run (as
    `(step, epoch, step_in_epoch, rank, world_size, is_main)`), and the rows."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.rows: list[dict[str, Any]] = []
        self.lrs: list[float] = []
        self.places: list[tuple[int, int, int, int, int, bool]] = []

    def on_step_end(self, run: RunView) -> None:
        self.steps.append(run.step)
        self.lrs.append(run.lr)
        self.places.append((run.step, run.epoch, run.step_in_epoch, run.rank, run.world_size,
                            run.is_main))

    def on_row(self, run: RunView, row: dict[str, Any]) -> None:
        self.rows.append(dict(row))


class Weights(TrainerHook):
    """The module's parameters at the start and after every optimizer step (the loop's
    internals: a `TrainerHook`)."""

    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []

    def _snapshot(self, trainer: Any) -> None:
        self.params.append({n: p.detach().clone() for n, p in trainer.module.named_parameters()})

    def on_fit_start(self, trainer: Any) -> None:
        self._snapshot(trainer)

    def on_step_end(self, trainer: Any) -> None:
        self._snapshot(trainer)


class HalveLR(Hook):
    """From step `step` on, the learning rate at half its schedule."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, run: RunView) -> None:
        if run.step == self.step:
            assert run.lr_multiplier == 1.0
            run.lr_multiplier = 0.5
