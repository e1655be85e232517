"""Global metrics: sums kept on the device, all-reduced only when read.

Each rank adds (loss x samples, correct, samples) into one float64 tensor; reading it
all-reduces that tensor once, so the global loss is the sample-weighted mean over every
rank (not a mean of per-rank means) and the hot loop never waits for the host.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.distributed import DistributedContext


class MetricSums:
    """Running (loss_sum, correct, count) for one split over some steps."""

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """`loss_sum` is the loss summed over the batch (not its mean)."""
        correct = (logits.argmax(dim=1) == labels).sum()
        n = torch.tensor(labels.numel(), dtype=torch.float64, device=self.sums.device)
        self.sums += torch.stack([loss_sum.detach().double(), correct.double(), n])

    def global_totals(self, ctx: DistributedContext) -> tuple[float, float, float]:
        """(loss_sum, correct, count) summed over every rank so far. A sync point."""
        total = self.sums.clone()
        if ctx.distributed:
            dist.all_reduce(total)
        loss_sum, correct, count = total.tolist()
        return loss_sum, correct, count


def summarize(loss_sum: float, correct: float, count: float) -> dict[str, float]:
    """Sample-weighted mean loss and accuracy from summed totals."""
    if count == 0:
        return {"loss": float("nan"), "accuracy": float("nan"), "samples": 0}
    return {"loss": loss_sum / count, "accuracy": correct / count, "samples": int(count)}


class MetricsWriter:
    """Appends one JSON object per line to `metrics.jsonl` (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled
        self._file = None

    def start(self, keep_step: int | None, keep_epoch: int | None) -> None:
        """Open the file. On resume keep only what the checkpoint already covers, so the
        continued log has no gap and no step twice; on a fresh start begin empty."""
        if not self.enabled:
            return
        kept: list[str] = []
        if keep_step is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
                if row.get("split") == "train" and row.get("step", 0) <= keep_step:
                    kept.append(line)
                elif row.get("split") != "train" and row.get("epoch", 0) <= (keep_epoch or 0):
                    kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
