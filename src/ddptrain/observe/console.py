"""Rank 0's console: a log line per row, a progress bar on a terminal, and `curves.png` at
the end (drawn by a child process, see `ddptrain.observe.plot`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ddptrain.observe.fields import metric_text
from ddptrain.observe.hooks import Hook, RunView

log = logging.getLogger("ddptrain")


class Console(Hook):
    """Rank 0's log lines, and a progress bar when stderr is a terminal."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_epoch_start(self, run: RunView, epoch: int) -> None:
        self._close_bar()
        if not (run.is_main and sys.stderr.isatty()):
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=run.steps_per_epoch, initial=run.step_in_epoch,
            desc=f"epoch {epoch}/{run.config.epochs}", unit="step", leave=False,
            dynamic_ncols=True,
        )

    def on_step_end(self, run: RunView) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_row(self, run: RunView, row: dict[str, Any]) -> None:
        if row["split"] == "val":
            self._close_bar()
            log.info(
                "epoch %d/%d  train %s | val %s | %.1fs", row["epoch"], run.config.epochs,
                metric_text(row, "train_"), metric_text(row), row.get("epoch_time_s", 0.0),
            )
            return
        total = run.total_steps  # None: the data has no length
        text = (
            f"epoch {row['epoch']} step {row['step']}{f'/{total}' if total else ''} "
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

    A child process draws it (`ddptrain.plot.draw_in_background`) while this one tears
    down the process group, lets the other ranks go and prints its done line; the job
    waits for it before it releases its run directory, so the file is there when the job
    ends. With
    `sync` (a tracker uploads the file at its `on_fit_end`) it is waited for at once."""

    def __init__(self, sync: bool = False) -> None:
        self.sync = sync

    def on_fit_end(self, run: RunView, summary: dict[str, Any]) -> None:
        if not run.is_main:
            return
        from ddptrain.observe.plot import (
            draw_in_background,
            matplotlib_available,
            wait_for_drawings,
        )

        if not matplotlib_available():
            log.info("matplotlib is not installed: no curves.png (pip install 'ddptrain[viz]')")
            return
        run_dir = run.config.run_dir
        draw_in_background(run_dir, run_dir / "curves.png")
        log.info("curves %s (drawing)", run_dir / "curves.png")
        if self.sync:
            wait_for_drawings()
