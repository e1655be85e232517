"""The hand-written DDP loop: the physical reference, and the seed's flawed variant.

`hand_written_epoch` is the seed's `train_one_epoch` shape with accumulation done right:
micro-batches that do not end a window run under `DDP.no_sync()`, so one optimizer step
costs one gradient all-reduce; the epoch's last, short window still steps.
`no_sync=False, keep_last_window=False` reproduces the seed's own loop: every backward
all-reduces, and a short last window is dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from bench.common import track


def hand_written_epoch(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    criterion: nn.Module,
    grad_accum_steps: int = 1,
    no_sync: bool = True,
    keep_last_window: bool = True,
    on_step: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One epoch; returns the on-device (loss sum, correct, count) like ddptrain tracks."""
    model.train()
    k = grad_accum_steps
    n_batches = len(loader)
    sums = torch.zeros(3, dtype=torch.float64)
    for i, (x, y) in enumerate(loader):
        ends_window = (i + 1) % k == 0 or (keep_last_window and i + 1 == n_batches)
        sync = ends_window or not no_sync or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            logits = model(x)
            loss = criterion(logits, y)
            (loss / k).backward()
        track(sums, logits, y, loss)
        if ends_window:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            if on_step is not None:
                on_step()
    return sums
