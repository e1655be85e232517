"""Step hooks: what observes training, and what steers it.

The trainer calls every hook, on every rank, at the same points: `on_fit_start`,
`on_epoch_start`, `on_step_end` (after each optimizer step), `on_row` (each train or
validation metrics row, with its global figures: the same on every rank), `on_fit_end`
(with the summary) and `close` (always, also after a failure). The metrics file,
TensorBoard, the console, the progress bar, the profiler, the trackers and early stopping
are hooks; so is anything a user passes to `ddptrain.fit(hooks=[...])`.

Each call gets a `RunView`: where the run stands (`step`, `epoch`, `step_in_epoch`,
`steps_per_epoch`, `total_steps`), who this rank is (`rank`, `world_size`, `is_main`),
the config (read-only), the newest row, and what a hook may ask of the run: to stop after
this step (`request_stop`: every rank agrees, a checkpoint is written, the run ends with
0) and a factor on the scheduled learning rate (`lr_multiplier`). It does not reach the
model, the optimizer or the strategy.

    import ddptrain

    class StopAtStep(ddptrain.Hook):
        def on_step_end(self, run):
            if run.step == 7:
                run.request_stop("enough")            # after this step, on every rank
        def on_row(self, run, row):                     # global figures, every rank
            if row["split"] == "val" and row["loss"] > 1.0:
                run.lr_multiplier = 0.5               # from the next step on

    ddptrain.fit(dataset="digits", epochs=2, output_dir="runs/hooked", hooks=[StopAtStep()])
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ddptrain.config import TrainingConfig

if TYPE_CHECKING:
    import torch

    from ddptrain.checkpoint import Progress
    from ddptrain.context import DistributedContext
    from ddptrain.train import Trainer
    from ddptrain.train.steer import Steering


class _ReadOnlyConfig(TrainingConfig):
    """A copy of the run's config that refuses assignments: a hook reads it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if "_sealed" in self.__dict__:
            raise AttributeError(
                f"the run's config is read-only to hooks (setting {name!r}): a hook steers "
                "through request_stop and lr_multiplier"
            )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"the run's config is read-only to hooks (deleting {name!r})")

    def __eq__(self, other: object) -> bool:  # equal to a plain config of the same values
        if not isinstance(other, TrainingConfig):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(self))


def _read_only(config: TrainingConfig) -> TrainingConfig:
    sealed = object.__new__(_ReadOnlyConfig)
    sealed.__dict__.update(copy.deepcopy(vars(config)))
    sealed.__dict__["_sealed"] = True
    return sealed


class RunView:
    """What a hook sees of the run and may ask of it. Built once per run; each read is
    an attribute read (no allocation, no device sync).

    Where the run stands:
      `step`            optimizer steps taken in total (in `on_step_end`: the step just taken)
      `epoch`           the epoch in progress, from 1 (between epochs: the one just ended;
                        in `on_fit_start`: the one the run starts or resumes in)
      `step_in_epoch`   optimizer steps of `epoch` taken so far (without a length: since this
                        process began the epoch)
      `steps_per_epoch`, `total_steps`   None when the data has no length
      `lr`              the learning rate now (the first parameter group's, as in the rows)
      `last_row`        the newest metrics row (train or val, read-only), None before one
    Who this rank is: `rank`, `local_rank`, `world_size`, `is_main` (rank 0), `device`.
    The run: `config` (a read-only copy), `best_metric` and `best_mode` ("max" or "min":
    the metric that ranks epochs, the task's or `--best_metric`).
    What it may ask: `request_stop(reason, finish=False)`, `lr_multiplier` (read, set),
    `stop_requested`.
    """

    __slots__ = ("_base", "_best", "_config", "_ctx", "_epoch", "_progress", "_row",
                 "_spe", "_steer", "_total")

    def __init__(
        self, config: TrainingConfig, ctx: DistributedContext, steer: Steering,
        progress: Progress, steps_per_epoch: int, total_steps: int,
        best: tuple[str, str] = ("loss", "min"),
    ) -> None:
        self._config, self._ctx, self._steer = _read_only(config), ctx, steer
        self._progress, self._best = progress, best
        # An IterableDataset without __len__ has 0 steps an epoch and no planned end.
        self._spe, self._total = steps_per_epoch, total_steps if steps_per_epoch else None
        self._row: Mapping[str, Any] | None = None
        self._epoch = self._base = 0
        self._begin_epoch(min(progress.epoch + 1, max(config.epochs, 1)))

    @classmethod
    def _of(cls, trainer: Trainer) -> RunView:
        return cls(trainer.config, trainer.ctx, trainer.steer, trainer.progress,
                   trainer.steps_per_epoch, trainer.total_steps,
                   (trainer.best_key, trainer.best_mode))

    def _begin_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._base = (epoch - 1) * self._spe if self._spe else self._progress.step

    # ------------------------------------------------------------------ where it stands
    @property
    def step(self) -> int:
        return self._progress.step

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        return self._progress.step - self._base

    @property
    def steps_per_epoch(self) -> int | None:
        return self._spe or None

    @property
    def total_steps(self) -> int | None:
        return self._total

    @property
    def lr(self) -> float:
        return self._steer.lr

    @property
    def last_row(self) -> Mapping[str, Any] | None:
        return self._row

    # ------------------------------------------------------------------ who this rank is
    @property
    def rank(self) -> int:
        return self._ctx.rank

    @property
    def local_rank(self) -> int:
        return self._ctx.local_rank

    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def is_main(self) -> bool:
        return self._ctx.is_main

    @property
    def device(self) -> torch.device:
        return self._ctx.device

    # ------------------------------------------------------------------ the run
    @property
    def config(self) -> TrainingConfig:
        return self._config

    @property
    def best_metric(self) -> str:
        return self._best[0]

    @property
    def best_mode(self) -> str:
        return self._best[1]

    # ------------------------------------------------------------------ requests
    def request_stop(self, reason: str, finish: bool = False) -> None:
        """Stop the run after this step: every rank stops after the same one (on several
        ranks at the next metric all-reduce, about every 2 s; one process at once), with
        a checkpoint, the exports and `stop_reason` in `summary.json`. `finish`: the run
        is over, a resume of it has nothing to do (early stopping)."""
        self._steer.request_stop(reason, finish)

    @property
    def stop_requested(self) -> bool:
        """Whether this rank asked for a stop, or every rank agreed to one."""
        return self._steer.requested or self._steer.agreed is not None

    @property
    def lr_multiplier(self) -> float:
        """The factor on the scheduled learning rate (1.0 unless a hook set it); set it
        (0 or more) alike on every rank: it applies from the next step on and is kept in
        every checkpoint."""
        return self._steer.lr_multiplier

    @lr_multiplier.setter
    def lr_multiplier(self, value: float) -> None:
        self._steer.lr_multiplier = value

    def __repr__(self) -> str:
        return (f"RunView(step={self.step}, epoch={self.epoch}, rank={self.rank}, "
                f"world_size={self.world_size})")


class _Base:
    @property
    def key(self) -> str:
        return type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Hook(_Base):
    """Override what you need; every method is a no-op here. Each gets the `RunView`.

    A hook with state to carry across a resume returns it from `state_dict` (plain
    values: it is saved in every checkpoint, under the hook's `key`) and gets it back in
    `load_state_dict` before `on_fit_start`. `close` runs at the end, also after a
    failure."""

    def on_fit_start(self, run: RunView) -> None: ...

    def on_epoch_start(self, run: RunView, epoch: int) -> None: ...

    def on_step_end(self, run: RunView) -> None: ...

    def on_row(self, run: RunView, row: dict[str, Any]) -> None: ...

    def on_fit_end(self, run: RunView, summary: dict[str, Any]) -> None: ...


class TrainerHook(_Base):
    """Internal, not part of the public API: a hook that gets the `Trainer` itself, for
    ddptrain's own tests and benchmarks that inspect the loop's internals. Hooks that
    observe or steer a run are `Hook`s."""

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None: ...

    def on_step_end(self, trainer: Trainer) -> None: ...

    def on_row(self, trainer: Trainer, row: dict[str, Any]) -> None: ...

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...


class Hooks(TrainerHook):
    """Several hooks called in order: the trainer's. It builds the `RunView` from the
    trainer once and gives it to each `Hook` (a `TrainerHook` gets the trainer)."""

    def __init__(self, hooks: list[Hook | TrainerHook]) -> None:
        self.hooks = hooks
        self._run: RunView | None = None

    def _view(self, trainer: Trainer) -> RunView:
        run = self._run
        if run is None:
            run = self._run = RunView._of(trainer)
        # A resume or a rollback puts a new Progress in place: one attribute to follow.
        run._progress = trainer.progress
        return run

    def state_dict(self) -> dict[str, Any]:
        return {h.key: state for h in self.hooks if (state := h.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for h in self.hooks:
            if h.key in state:
                h.load_state_dict(state[h.key])

    def on_fit_start(self, trainer: Trainer) -> None:
        run = self._view(trainer)
        for h in self.hooks:
            if isinstance(h, TrainerHook):
                h.on_fit_start(trainer)
            else:
                h.on_fit_start(run)

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        run = self._view(trainer)
        run._begin_epoch(epoch)
        for h in self.hooks:
            if isinstance(h, TrainerHook):
                h.on_epoch_start(trainer, epoch)
            else:
                h.on_epoch_start(run, epoch)

    def on_step_end(self, trainer: Trainer) -> None:
        run = self._view(trainer)
        for h in self.hooks:
            if isinstance(h, TrainerHook):
                h.on_step_end(trainer)
            else:
                h.on_step_end(run)

    def on_row(self, trainer: Trainer, row: dict[str, Any]) -> None:
        run = self._view(trainer)
        run._row = MappingProxyType(row)
        for h in self.hooks:
            if isinstance(h, TrainerHook):
                h.on_row(trainer, row)
            else:
                h.on_row(run, row)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        run = self._view(trainer)
        for h in self.hooks:
            if isinstance(h, TrainerHook):
                h.on_fit_end(trainer, summary)
            else:
                h.on_fit_end(run, summary)

    def close(self) -> None:
        for h in self.hooks:
            h.close()
