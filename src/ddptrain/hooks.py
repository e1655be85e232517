"""Step hooks: everything that observes training without steering it.

The trainer calls every hook at the same points: `on_fit_start`, `on_epoch_start`,
`on_step_end` (after each optimizer step), `on_row` (each train or validation metrics
row), `on_fit_end` (with the summary) and `close` (always, also after a failure). The
metrics file, TensorBoard, the console, the progress bar and the profiler are hooks; so
is anything a user passes to `ddptrain.fit(hooks=[...])`.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddptrain.trainer import Trainer

log = logging.getLogger("ddptrain")

# Fields of a row that are bookkeeping, not a figure of the task.
_NOT_METRICS = {
    "split", "epoch", "step", "samples", "lr", "samples_per_sec", "step_time_s",
    "data_wait_frac", "peak_rss_mb", "bad_steps", "epoch_time_s", "tokens", "peak_cuda_mb",
    "tflops_per_sec", "mfu", "run_id", "first_step_s",
}


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


def metric_text(row: dict[str, Any], prefix: str = "") -> str:
    """'loss 0.1234 accuracy 0.9500' from the task's figures in a row."""
    names = [
        k for k in row
        if k.startswith(prefix) and k[len(prefix):] not in _NOT_METRICS
        and (prefix or not k.startswith("train_"))
    ]
    return " ".join(f"{k[len(prefix):]} {row[k]:.4f}" for k in names)


class Console(Hook):
    """Rank 0's log lines, and a progress bar when stderr is a terminal."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        self._close_bar()
        if not (trainer.ctx.is_main and sys.stderr.isatty()):
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=trainer.steps_per_epoch, initial=trainer.steps_done_in_epoch,
            desc=f"epoch {epoch}/{trainer.config.epochs}", unit="step", leave=False,
            dynamic_ncols=True,
        )

    def on_step_end(self, trainer: Trainer) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_row(self, trainer: Trainer, row: dict[str, Any]) -> None:
        if row["split"] == "val":
            self._close_bar()
            log.info(
                "epoch %d/%d  train %s | val %s | %.1fs", row["epoch"], trainer.config.epochs,
                metric_text(row, "train_"), metric_text(row), row.get("epoch_time_s", 0.0),
            )
            return
        text = (
            f"epoch {row['epoch']} step {row['step']}/{trainer.total_steps} "
            f"{metric_text(row)} lr {row['lr']:.5f} {row['samples_per_sec']:,.0f} samples/s"
        )
        if self.bar is not None:
            self.bar.set_postfix_str(metric_text(row))
            self.bar.write(text)
        else:
            log.info(text)

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self._close_bar()


class Curves(Hook):
    """Leaves `curves.png` in the run directory at the end (rank 0), when matplotlib is
    installed.

    A child process draws it (`ddptrain.plot.draw_in_background`) while this one
    exports, tears down the process group and lets the other ranks go; the job waits for
    it before it releases its run directory, so the file is there when the job ends. With
    `sync` (a tracker uploads the file at its `on_fit_end`) it is waited for at once."""

    def __init__(self, sync: bool = False) -> None:
        self.sync = sync

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if not trainer.ctx.is_main:
            return
        from ddptrain.plot import draw_in_background, matplotlib_available, wait_for_drawings

        if not matplotlib_available():
            log.info("matplotlib is not installed: no curves.png (pip install 'ddptrain[viz]')")
            return
        run_dir = trainer.config.run_dir
        draw_in_background(run_dir, run_dir / "curves.png")
        if self.sync:
            wait_for_drawings()
