"""Global metrics: sums kept on the device, all-reduced only when read.

Each rank adds (loss x samples, correct, samples) into one float64 tensor; reading it
all-reduces that tensor once, so the global loss is the sample-weighted mean over every
rank (not a mean of per-rank means) and the hot loop never waits for the host.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.distributed import DistributedContext


class MetricSums:
    """Running (loss_sum, correct, count) for one split.

    Micro-batches add into a pending window that `commit` folds into the totals once the
    optimizer step is known to be good (a skipped, non-finite step is dropped, so one bad
    batch does not turn every later figure into NaN). Each update is a handful of small
    in-place ops and no host sync; the sample count is a Python int, known on the host.
    """

    def __init__(self, device: torch.device) -> None:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self._loss, self._correct = zero.clone(), zero.clone()  # committed
        self._count = 0
        self._win_loss, self._win_correct = zero.clone(), zero.clone()  # pending
        self._win_count = 0

    def update(
        self, logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor, scale: float
    ) -> None:
        """Add a batch: `loss x scale` is its summed loss (scale = batch size for a mean)."""
        self._win_loss.add_(loss.detach(), alpha=scale)
        self._win_correct.add_((logits.argmax(dim=1) == labels).sum())
        self._win_count += labels.shape[0]

    def commit(self, keep: bool = True) -> None:
        """Fold the pending window into the totals (or drop it), and start a new one."""
        if keep:
            self._loss.add_(self._win_loss)
            self._correct.add_(self._win_correct)
            self._count += self._win_count
        self._win_loss.zero_()
        self._win_correct.zero_()
        self._win_count = 0

    def global_totals(self, ctx: DistributedContext) -> tuple[float, float, float]:
        """(loss_sum, correct, count) summed over every rank so far. A sync point."""
        totals, _ = self.global_totals_and_flag(ctx, False)
        return totals

    def global_totals_and_flag(
        self, ctx: DistributedContext, flag: bool
    ) -> tuple[tuple[float, float, float], bool]:
        """The committed global totals and whether `flag` is set on any rank, in one
        all-reduce."""
        extra = self._loss.new_tensor([float(self._count), float(flag)])
        buf = torch.cat([self._loss.view(1), self._correct.view(1), extra])
        if ctx.distributed:
            dist.all_reduce(buf)
        loss_sum, correct, count, flags = buf.tolist()
        return (loss_sum, correct, count), flags > 0

    def set(self, totals: list[float]) -> None:
        """Start from saved totals (a mid-epoch resume)."""
        self._loss.fill_(totals[0])
        self._correct.fill_(totals[1])
        self._count = int(totals[2])


def summarize(loss_sum: float, correct: float, count: float) -> dict[str, float]:
    """Sample-weighted mean loss and accuracy from summed totals."""
    if count == 0:
        return {"loss": float("nan"), "accuracy": float("nan"), "samples": 0}
    return {"loss": loss_sum / count, "accuracy": correct / count, "samples": int(count)}


TENSORBOARD_HANDOVER_S = 20.0  # TensorBoard's own writer flushes every 120 s by default


class MetricsWriter:
    """Appends one JSON object per line to `metrics.jsonl` (rank 0 only), and mirrors every
    numeric field of a row as the TensorBoard scalar `split/name` at the row's step into
    `tensorboard_dir`, when one is given and the tensorboard package is installed."""

    def __init__(self, path: Path, enabled: bool, tensorboard_dir: Path | None = None) -> None:
        self.path = path
        self.enabled = enabled
        self.tensorboard_dir = tensorboard_dir
        self._file = None
        self._tb: Any = None
        self._pending: list[tuple[Any, int]] = []
        self._handed_at = time.monotonic()

    def start(self, keep_step: int | None, keep_epoch: int | None) -> None:
        """Open the file. On resume keep only what the checkpoint already covers, so the
        continued log has no gap and no step twice; on a fresh start begin empty."""
        if not self.enabled:
            return
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
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")
        self._tb = self._open_tensorboard(keep_step)

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
        if keep_step is None and self.tensorboard_dir.is_dir():
            for old in self.tensorboard_dir.glob("events.out.tfevents.*"):
                old.unlink(missing_ok=True)
        purge = keep_step + 1 if keep_step is not None else None
        return SummaryWriter(str(self.tensorboard_dir), purge_step=purge)

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._write_scalars(row)

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
        writer = self._tb._get_file_writer()
        for summary, step in self._pending:
            writer.add_summary(summary, step)
        self._pending.clear()
        self._handed_at = time.monotonic()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._hand_over()
            self._tb.close()
            self._tb = None
