"""What a user's hook sees of a run (`ddptrain.RunView`) and what it may ask of it, over a
small in-process run; and that the view reaches no part of the trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddptrain import Hook, RunView, TrainingConfig, fit
from ddptrain.checkpoint import Progress
from ddptrain.observe.hooks import TrainerHook
from ddptrain.parallel.base import Strategy
from ddptrain.train import Trainer
from ddptrain.train.steer import Steering


class Looks(Hook):
    """Records what the view says at every call; asks for a stop at step 3 of epoch 2."""

    def __init__(self) -> None:
        self.stop = 0
        self.run: RunView | None = None
        self.start: tuple[int, int, int] | None = None
        self.epochs: list[tuple[int, int, int]] = []  # (argument, run.epoch, step_in_epoch)
        self.steps: list[tuple[int, int, int, float]] = []  # step, epoch, in epoch, lr
        self.rows: list[tuple[dict[str, Any], Mapping[str, Any] | None]] = []
        self.asked: list[bool] = []
        self.end: tuple[int, dict[str, Any]] | None = None

    def on_fit_start(self, run: RunView) -> None:
        self.run, self.start = run, (run.step, run.epoch, run.step_in_epoch)
        self.stop = (run.steps_per_epoch or 0) + 3

    def on_epoch_start(self, run: RunView, epoch: int) -> None:
        self.epochs.append((epoch, run.epoch, run.step_in_epoch))

    def on_step_end(self, run: RunView) -> None:
        self.steps.append((run.step, run.epoch, run.step_in_epoch, run.lr))
        if run.step == self.stop:
            assert not run.stop_requested
            run.request_stop(f"asked at step {run.step}")
        self.asked.append(run.stop_requested)

    def on_row(self, run: RunView, row: dict[str, Any]) -> None:
        self.rows.append((dict(row), run.last_row))

    def on_fit_end(self, run: RunView, summary: dict[str, Any]) -> None:
        self.end = (run.step, summary)


class Inside(TrainerHook):
    """ddptrain's own kind of hook, which gets the trainer: what the view is a view of."""

    trainer: Trainer | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        self.trainer = trainer


def _fit(tmp_path: Path, hooks: list[Any]) -> dict[str, Any]:
    config = TrainingConfig(dataset="digits", model="mlp", width=16, batch_size=64, epochs=2,
                            log_interval=4, save_every=0, tensorboard=False, curves=False,
                            output_dir=str(tmp_path / "run"))
    return fit(config, hooks=hooks)


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> tuple[Looks, Inside, dict[str, Any]]:
    """One run of 2 epochs, stopped by the hook at step 3 of epoch 2."""
    inside, looks = Inside(), Looks()
    summary = _fit(tmp_path_factory.mktemp("hooked"), [inside, looks])
    return looks, inside, summary


def test_a_hook_sees_the_step_epoch_and_rank_on_every_call(
    seen: tuple[Looks, Inside, dict[str, Any]],
) -> None:
    looks = seen[0]
    run = looks.run
    assert run is not None
    per_epoch = run.steps_per_epoch
    assert per_epoch is not None and per_epoch > 4
    assert run.total_steps == 2 * per_epoch
    assert looks.start == (0, 1, 0)
    assert looks.epochs == [(1, 1, 0), (2, 2, 0)]
    stop = per_epoch + 3
    want = [(k, 1 if k <= per_epoch else 2, (k - 1) % per_epoch + 1) for k in range(1, stop + 1)]
    assert [s[:3] for s in looks.steps] == want
    assert (run.rank, run.local_rank, run.world_size, run.is_main) == (0, 0, 1, True)
    assert run.device == torch.device("cpu")
    assert (run.best_metric, run.best_mode) == ("accuracy", "max")
    # each train row's lr is the one the view gave at that row's step
    lrs = {k: lr for k, _, _, lr in looks.steps}
    train = [row for row, _ in looks.rows if row["split"] == "train"]
    assert train and all(row["lr"] == lrs[row["step"]] for row in train)
    assert all(last == row for row, last in looks.rows)  # the newest row, as on_row got it
    assert run.last_row is not None and run.last_row == looks.rows[-1][0]
    with pytest.raises(TypeError):
        run.last_row["loss"] = 0.0  # type: ignore[index]


def test_a_hooks_stop_ends_the_run_after_that_step(
    seen: tuple[Looks, Inside, dict[str, Any]],
) -> None:
    looks, _, summary = seen
    run = looks.run
    assert run is not None and run.steps_per_epoch is not None
    stop = run.steps_per_epoch + 3
    assert looks.steps[-1][0] == stop and looks.asked == [k >= stop for k in range(1, stop + 1)]
    assert summary["steps"] == stop and summary["stop_reason"] == f"asked at step {stop}"
    assert looks.end is not None and looks.end[0] == stop and looks.end[1] == summary
    assert run.lr_multiplier == 1.0
    run.lr_multiplier = 0.5  # the view's control is the run's
    assert run.lr_multiplier == 0.5
    with pytest.raises(ValueError, match="lr_multiplier -1"):
        run.lr_multiplier = -1


def test_the_view_reaches_no_part_of_the_trainer(
    seen: tuple[Looks, Inside, dict[str, Any]],
) -> None:
    looks, inside, _ = seen
    run, trainer = looks.run, inside.trainer
    assert run is not None and trainer is not None
    internal = (Trainer, nn.Module, torch.optim.Optimizer, Strategy, Steering, Progress)
    for name in (n for n in dir(run) if not n.startswith("_")):
        value = getattr(run, name)
        assert not isinstance(value, internal), name
    for name in ("trainer", "model", "module", "optimizer", "scheduler", "strategy", "steer"):
        assert not hasattr(run, name), name
    with pytest.raises(AttributeError):
        run.step = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        run.anything = 1  # type: ignore[attr-defined]
    # the config: equal to the run's, not the run's own object, and read-only
    assert run.config == trainer.config and run.config is not trainer.config
    assert run.config.epochs == 2 and run.config.run_dir == trainer.config.run_dir
    with pytest.raises(AttributeError, match="read-only"):
        run.config.lr = 1.0
    assert dataclasses.replace(run.config, lr=1.0).lr == 1.0  # a changed copy is the hook's
    assert trainer.config.lr != 1.0
