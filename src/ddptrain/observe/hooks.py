"""Step hooks: what observes training, and what steers it.

The trainer calls every hook, on every rank, at the same points: `on_fit_start`,
`on_epoch_start`, `on_step_end` (after each optimizer step), `on_row` (each train or
validation metrics row, with its global figures: the same on every rank), `on_fit_end`
(with the summary) and `close` (always, also after a failure). The metrics file,
TensorBoard, the console, the progress bar, the profiler and early stopping are hooks; so
is anything a user passes to `ddptrain.fit(hooks=[...])`.

A hook steers the run through `trainer.steer` (`ddptrain.train.steer.Steering`): ask it
to stop after this step (`request_stop`: every rank agrees, a checkpoint is written, the
run ends with 0) or read and set the learning-rate multiplier (`lr_multiplier`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddptrain.train import Trainer


class Hook:
    """Override what you need; every method is a no-op here.

    A hook with state to carry across a resume returns it from `state_dict` (plain
    values: it is saved in every checkpoint, under the hook's `key`) and gets it back in
    `load_state_dict` before `on_fit_start`."""

    @property
    def key(self) -> str:
        return type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def on_fit_start(self, trainer: Trainer) -> None: ...

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None: ...

    def on_step_end(self, trainer: Trainer) -> None: ...

    def on_row(self, trainer: Trainer, row: dict[str, Any]) -> None: ...

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Hooks(Hook):
    """Several hooks called in order."""

    def __init__(self, hooks: list[Hook]) -> None:
        self.hooks = hooks

    def state_dict(self) -> dict[str, Any]:
        return {h.key: state for h in self.hooks if (state := h.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for h in self.hooks:
            if h.key in state:
                h.load_state_dict(state[h.key])

    def on_fit_start(self, trainer: Trainer) -> None:
        for h in self.hooks:
            h.on_fit_start(trainer)

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        for h in self.hooks:
            h.on_epoch_start(trainer, epoch)

    def on_step_end(self, trainer: Trainer) -> None:
        for h in self.hooks:
            h.on_step_end(trainer)

    def on_row(self, trainer: Trainer, row: dict[str, Any]) -> None:
        for h in self.hooks:
            h.on_row(trainer, row)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        for h in self.hooks:
            h.on_fit_end(trainer, summary)

    def close(self) -> None:
        for h in self.hooks:
            h.close()
