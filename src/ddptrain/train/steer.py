"""What a hook may change in a run: stop it after this step, and scale its learning rate.

Hooks ask through their `RunView` (`ddptrain.observe.hooks`, whose docstring shows a
hook doing both), which forwards to this module's `Steering`.

A stop request is made on one rank or several; it rides on the metric all-reduce the
trainer already makes (about every 2 s, and after each validation), so every rank stops
after the same optimizer step and no step waits for the host. A request made in
`on_step_end` on a single process is acted on at once; under several ranks at the next
sync point (the first is due after `--log_interval` steps). Then a checkpoint is written,
the export and `summary.json` as at a normal end (with `stop_reason`), and the run exits
with 0. `request_stop(..., finish=True)` also marks the run finished: a resume of it
has nothing to do (early stopping); without it a resume carries on from the next step.

The learning-rate multiplier scales the warm-up/cosine schedule from the next optimizer
step on; it is kept in every checkpoint. Hooks run on every rank with the same rows, so a
decision taken from them is the same everywhere; set it alike on every rank.

`EarlyStopping` (`--early_stopping N`) and `LossSpikes` (`--spike_factor`, `--on_spike
stop|rollback`) are such hooks.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from ddptrain.context import DistributedContext
from ddptrain.observe.hooks import Hook, RunView

log = logging.getLogger("ddptrain")


class SteeredStop(Exception):
    """Raised inside the loop once every rank agreed to a hook's stop and the checkpoint
    is written: the run ends as a finished one (export, summary, exit 0)."""


class Steering:
    """The run's controls for hooks: a stop request and the learning-rate multiplier."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: LRScheduler) -> None:
        self._optimizer, self._scheduler = optimizer, scheduler
        self._multiplier = 1.0
        self._scaled = False  # are the rates scaled now?
        self.reason: str | None = None  # this rank's request, if any
        self.finish = False
        self.agreed: str | None = None  # the reason of the stop every rank agreed to

    # ------------------------------------------------------------------ stop
    def request_stop(self, reason: str, finish: bool = False) -> None:
        """Stop the run after this step (on every rank, at the next sync point). `finish`:
        the run is over; a resume of it has nothing to do."""
        if self.reason is None:
            self.reason = reason
        self.finish = self.finish or finish

    @property
    def requested(self) -> bool:
        return self.reason is not None

    @property
    def lr(self) -> float:
        """The first parameter group's learning rate now (the rows' `lr`)."""
        return float(self._optimizer.param_groups[0]["lr"])

    def agree(self, ctx: DistributedContext, flags: tuple[bool, bool] | None = None) -> bool:
        """Whether any rank asked to stop; every rank gets the same answer. `flags`: the
        (stop, finish) flags as already all-reduced with the metrics; without them one
        small all-reduce of its own (at an epoch's end: once an epoch, not a step)."""
        if flags is None:
            flags = (self.requested, self.finish)
            if ctx.distributed:
                both = torch.tensor([float(f) for f in flags], device=ctx.device)
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
                stop, finish = both.tolist()
                flags = (stop > 0, finish > 0)
        if not flags[0]:
            return False
        self.finish = flags[1]
        self.agreed = self.reason or "a stop requested by a hook on another rank"
        return True

    # ------------------------------------------------------------------ learning rate
    @property
    def lr_multiplier(self) -> float:
        """The factor on the scheduled learning rate (1.0 unless a hook set it)."""
        return self._multiplier

    @lr_multiplier.setter
    def lr_multiplier(self, value: float) -> None:
        if not value >= 0:
            raise ValueError(f"lr_multiplier {value!r} is invalid: use a factor of 0 or more")
        self._multiplier = float(value)
        self.apply()

    def apply(self) -> None:
        """Put the multiplier on the schedule's current rates (after each schedule step;
        the schedule computes each rate afresh, so factors never compound)."""
        if self._multiplier == 1.0 and not self._scaled:
            return
        for group, lr in zip(
            self._optimizer.param_groups, self._scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = lr * self._multiplier
        self._scaled = self._multiplier != 1.0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"lr_multiplier": self._multiplier}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._multiplier = float(state.get("lr_multiplier", 1.0))
        self.apply()


class EarlyStopping(Hook):
    """`--early_stopping N`: finish the run once the best metric (the task's, or
    `--best_metric`) has not improved
    by more than `min_delta` for `patience` validations in a row. Its decision is taken
    from the global validation row, the same on every rank; the trainer still agrees on
    it, so no rank ever stops alone."""

    def __init__(self, patience: int, min_delta: float = 0.0) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best: float | None = None
        self.best_epoch = 0
        self.waited = 0

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch = state.get("best"), int(state.get("best_epoch", 0))
        self.waited = int(state.get("waited", 0))

    def on_row(self, run: RunView, row: dict[str, Any]) -> None:
        if row["split"] != "val":
            return
        name, mode = run.best_metric, run.best_mode  # the task's, or --best_metric
        score = row.get(name, float("nan"))
        if self.best is None or _improves(score, self.best, mode, self.min_delta):
            self.best, self.best_epoch, self.waited = score, row["epoch"], 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            run.request_stop(
                f"early stopping: val {name} did not improve for {self.waited} epochs "
                f"(best {self.best:.6g} at epoch {self.best_epoch})",
                finish=True,
            )


def _improves(score: float, best: float, mode: str, min_delta: float) -> bool:
    if score != score:  # NaN never improves
        return False
    if best != best:
        return True
    return score > best + min_delta if mode == "max" else score < best - min_delta


class SpikeRollback(Exception):
    """A loss spike under `--on_spike rollback`, raised on every rank at the same row (rows
    are global figures): the run goes back to before step `first` (`train.rollback`)."""

    def __init__(self, first: int, last: int, what: str) -> None:
        super().__init__(what)
        self.first, self.last, self.what = first, last, what


class LossSpikes(Hook):
    """`--spike_factor K`: a train row whose loss is above K times the median of the train
    rows before it (the last `HISTORY`, once there are `MIN_HISTORY`) for `--spike_rows`
    rows running is a loss spike: one warning, naming the steps, the loss and the median.
    With `--on_spike stop` every rank then stops at the next agreed step, with a
    checkpoint and the spike as `stop_reason`; the step files before it are the last good
    ones to resume from. With `--on_spike rollback` every rank raises `SpikeRollback` with
    the steps of the spiking rows (a row covers the `interval` steps up to its own). Rows
    are global figures, so every rank decides alike; the history is in every checkpoint,
    so a resumed run judges as the uninterrupted one."""

    HISTORY, MIN_HISTORY = 20, 5

    def __init__(self, factor: float, rows: int, on_spike: str = "warn", interval: int = 1
                 ) -> None:
        self.factor, self.rows, self.on_spike, self.interval = factor, rows, on_spike, interval
        self.losses: list[float] = []
        self.streak: list[int] = []  # steps of the rows above the bar, running

    def state_dict(self) -> dict[str, Any]:
        return {"losses": self.losses, "streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = [float(x) for x in state.get("losses", [])]
        self.streak = [int(x) for x in state.get("streak", [])]

    def on_row(self, run: RunView, row: dict[str, Any]) -> None:
        loss = row.get("loss") if row["split"] == "train" else None
        if loss is None or loss != loss:
            return
        history = sorted(self.losses[-self.HISTORY:])
        median = history[len(history) // 2] if len(history) >= self.MIN_HISTORY else None
        if median is not None and median > 0 and loss > self.factor * median:
            self.streak.append(int(row["step"]))
        else:
            self.streak = []
            self.losses.append(float(loss))  # a spike does not raise the bar it is judged by
        if len(self.streak) == self.rows:
            steps = ", ".join(map(str, self.streak))
            what = (f"loss spike: train loss {loss:.4g} at step(s) {steps} is above "
                    f"{self.factor:g}x the running median {median:.4g}")
            log.warning("%s%s", what, {"stop": "; stopping (--on_spike stop)",
                                       "rollback": "; rolling back (--on_spike rollback)",
                                       }.get(self.on_spike, ""))
            if self.on_spike == "stop":
                run.request_stop(what)
            elif self.on_spike == "rollback":
                first = max(1, self.streak[0] - self.interval + 1)
                raise SpikeRollback(first, self.streak[-1], what)


def steering_hooks(config: Any) -> list[Hook]:
    """The hooks the config asks for (every rank): `--early_stopping N`, `--spike_factor`."""
    hooks: list[Hook] = []
    if config.early_stopping:
        hooks.append(EarlyStopping(config.early_stopping, config.early_stopping_min_delta))
    if config.spike_factor:
        hooks.append(LossSpikes(config.spike_factor, config.spike_rows, config.on_spike,
                                config.log_interval))
    return hooks
