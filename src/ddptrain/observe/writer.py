"""`metrics.jsonl` and TensorBoard scalars: rank 0 writes every row the hooks see.

A log that cannot be written (a read-only or full filesystem, a directory in the file's
place) ends the run with one line naming it, not a traceback: at the start a
`ConfigError` (exit 2, the log left as it was); during the run the writer keeps the error
(`failure`) and the trainer stops every rank at its next agreed point, before any further
checkpoint, with `RunLogError` (exit 74, as for a checkpoint that cannot be written).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from ddptrain.errors import EXIT_IO, ConfigError, TrainingStopped
from ddptrain.files import atomic_write_text, open_append, refuse_link
from ddptrain.observe.hooks import Hook, RunView

TENSORBOARD_HANDOVER_S = 20.0  # TensorBoard's own writer flushes every 120 s by default


class MetricsWriter(Hook):
    """Appends one JSON object per line to `metrics.jsonl` (rank 0 only), and mirrors every
    numeric field of a row as the TensorBoard scalar `split/name` at the row's step into
    `tensorboard_dir`, when one is given and the tensorboard package is installed."""

    def __init__(
        self, path: Path, enabled: bool, tensorboard_dir: Path | None = None,
        run_id: str | None = None,
    ) -> None:
        self.path, self.run_id = path, run_id
        self.enabled = enabled
        self.tensorboard_dir = tensorboard_dir
        self._file: TextIO | None = None
        self._tb: Any = None
        self._pending: list[tuple[Any, int]] = []
        self._handed_at = time.monotonic()
        self.failure: str | None = None  # the line of a write that failed mid-run

    def start(self, keep_step: int | None, keep_epoch: int | None) -> None:
        """Open the file. On resume keep only what the checkpoint already covers, so the
        continued log has no gap and no step twice; on a fresh start begin empty."""
        if not self.enabled:
            return
        try:  # TensorBoard first: a refusal leaves metrics.jsonl as it was
            self._tb = self._open_tensorboard(keep_step)
        except OSError as exc:
            raise unwritable(exc, self.tensorboard_dir) from None
        try:
            self._file = self._open_metrics(keep_step, keep_epoch)
        except OSError as exc:
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            raise unwritable(exc, self.path) from None

    def _open_metrics(self, keep_step: int | None, keep_epoch: int | None) -> TextIO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if keep_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
                covered = (
                    row.get("step", 0) <= keep_step
                    if row.get("split") == "train"
                    else row.get("epoch", 0) <= (keep_epoch or 0)
                )
                if covered:
                    kept.append(line)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        return open_append(self.path)

    def _open_tensorboard(self, keep_step: int | None) -> Any:
        if self.tensorboard_dir is None:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the tensorboard package is an optional extra ([viz])
            return None
        # As with metrics.jsonl: a fresh start begins empty (old event files would be drawn
        # as the same run), and a resume hides the events logged after the checkpoint
        # (purge_step), so the curves continue without a doubled stretch.
        refuse_link(self.tensorboard_dir)
        if keep_step is None and self.tensorboard_dir.is_dir():
            for old in self.tensorboard_dir.glob("events.out.tfevents.*"):
                old.unlink(missing_ok=True)
        purge = keep_step + 1 if keep_step is not None else None
        quiet_writer_threads()
        return SummaryWriter(str(self.tensorboard_dir), purge_step=purge)

    def on_row(self, run: RunView, row: dict[str, Any]) -> None:
        self.write(row)

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({**row, "run_id": self.run_id}) + "\n")
            self._file.flush()
        except OSError as exc:
            self._failed(exc, self.path)
            return
        if self._tb is not None:
            self._write_scalars(row)

    def _failed(self, exc: OSError, path: Path | None) -> None:
        """Keep the first failure's line and write nothing more: the trainer stops the run."""
        if self.failure is None:
            self.failure = str(unwritable(exc, path))
        file, tb, self._file, self._tb = self._file, self._tb, None, None
        self._pending.clear()
        for closing in (file, tb):
            try:
                if closing is not None:
                    closing.close()
            except OSError:
                pass  # the same failure again

    def _write_scalars(self, row: dict[str, Any]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        split = row.get("split", "train")
        values = [
            Summary.Value(tag=f"{split}/{name}", simple_value=float(value))
            for name, value in row.items()
            # bool is an int subclass, but a flag is not a curve
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        # One event holding every scalar of the row costs a fifth of one `add_scalar` per
        # field. The events are handed to the writer's thread in batches: waking it for
        # every row steals measurable time from millisecond steps, and it only flushes
        # to disk every `flush_secs` anyway.
        self._pending.append((Summary(value=values), int(row.get("step", 0))))
        if time.monotonic() - self._handed_at >= TENSORBOARD_HANDOVER_S:
            self._hand_over()

    def _hand_over(self) -> None:
        # The writer's thread writes to disk; its error comes back at the next call here.
        try:
            writer = self._tb._get_file_writer()
            for summary, step in self._pending:
                writer.add_summary(summary, step)
        except OSError as exc:
            self._failed(exc, self.tensorboard_dir)
            return
        self._pending.clear()
        self._handed_at = time.monotonic()

    def close(self) -> None:
        """Flush and close; a write that fails here (the run's end) is one line, exit 74."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._failed(exc, self.path)
            self._file = None
        if self._tb is not None:
            self._hand_over()
        if self._tb is not None:
            try:
                self._tb.close()
            except OSError as exc:
                self._failed(exc, self.tensorboard_dir)
            self._tb = None


def unwritable(exc: OSError, path: Path | None) -> ConfigError:
    """The one line for a log that cannot be written."""
    reason = f"{exc.strerror} (errno {exc.errno})" if exc.strerror else str(exc)
    where = path if path is not None else exc.filename
    return ConfigError(
        f"cannot write the run's log {str(where)!r}: {reason}: make the --output_dir "
        "writable or give another one, then resume with --resume_from auto"
    )


class RunLogError(TrainingStopped):
    """The run's log could not be written mid-run; every rank stopped without a further
    checkpoint, so the last one is intact and matches the log."""

    exit_code = EXIT_IO


def quiet_writer_threads() -> None:
    """TensorBoard's writer thread records its write error for the writer's next call (where
    `MetricsWriter` turns it into one line) and then lets it escape, and Python prints the
    thread's traceback on top of that line: the errors of those threads alone go unprinted."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: Any) -> None:
        thread = args.thread
        if (
            type(thread).__name__ == "_AsyncWriterThread"
            and type(thread).__module__.startswith("tensorboard.")
            and getattr(thread, "exception", None) is args.exc_value
        ):
            return
        previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook
