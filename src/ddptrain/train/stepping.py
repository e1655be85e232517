"""The optimizer step, and whether it was taken, without the host waiting for the device.

A step whose gradients are not finite on some rank is skipped on every rank. The check is
made on the device: a flag (1.0: skip) from the clipped global norm, or from a fused check
of every gradient (all-reduced where ranks hold different shards). torch's fused
optimizers (the built-in SGD and AdamW are built fused, zero's local one too) take the
flag as `found_inf` and skip on the device, undoing their step count, and the EMA's move
is weighted by it; no value comes back to the host for the step to go on.

The host learns the verdict a step later (`Verdicts`): after the next step's forward and
backward are queued, from a copy taken as the flag was made (pinned memory and an event
on a GPU, so the read waits for nothing still running). Only then is the step's window of
metric sums folded into the epoch's totals (a skipped one dropped) and counted in
`Progress` (`--max_bad_steps` in a row end the run), so the figures are exact. Whatever
reads those (a log row, a metric sync, a checkpoint, the epoch's end) settles the verdict
first. An optimizer that cannot take the flag (a user's own, SGD over DTensor shards) is
stepped or not by a host read of it at once, as before.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ddptrain.checkpoint.schema import Progress
from ddptrain.parallel.base import local_tensor, zero_state
from ddptrain.train.metrics import MetricSums

if TYPE_CHECKING:
    from ddptrain.train.trainer import Trainer


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` skips its own step given a device flag (torch's fused ones)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def optimizer_step(trainer: Trainer, sums: MetricSums) -> torch.Tensor | bool:
    """Clip, check and step; the step's verdict: a device flag (1.0: the step was
    skipped) or, where the optimizer cannot skip on the device, whether it stepped."""
    cfg, strategy, optimizer = trainer.config, trainer.strategy, trainer.optimizer
    # A GPU run's background save may still be copying the weights off the device: the
    # step would change them under the copy. Usually done by now (a forward and a
    # backward ago); a no-op without one in flight.
    trainer.checkpoints.settle()
    local = strategy.local_optimizer(optimizer)  # the one that takes the flag
    strategy.finish_gradients()
    check = cfg.max_bad_steps > 0 and not trainer.precision.scaler  # fp16: the scaler's job
    flag = None
    if trainer.dynamic:
        # Where ranks' flags must be combined and no clipped norm gives it, this rank's
        # flag rides with the window's count: one all-reduce for both. A rescale by a
        # finite factor leaves finite gradients finite, so the flag may come first.
        own = (
            strategy.nonfinite_flag(trainer.params).clone()
            if check and not cfg.max_grad_norm and strategy.flags_differ else None
        )
        flag = rescale_to_global_count(trainer, sums.window_count(), own)
    norm = None
    if cfg.max_grad_norm:
        trainer.scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
        norm = strategy.clip_grad_norm(trainer.params, cfg.max_grad_norm)
    verdict: torch.Tensor | bool = True
    if check:
        if norm is not None:
            bad = (~torch.isfinite(norm)).float()
        else:
            bad = flag if flag is not None else strategy.nonfinite_flags(trainer.params)
        bad = bad.reshape(())  # 0-d, as the optimizers' step counts it is subtracted from
        verdict = bad if skips_on_device(local) else not bool(bad.item())
    if skips_on_device(local) and not local.state:
        # A fused SGD's first step skipped, by the flag or by GradScaler's own found_inf
        # (fp16), leaves its momentum as uninitialised memory: the zeros that step starts
        # from
        zero_state(local)
    if isinstance(verdict, torch.Tensor):
        local.found_inf = verdict  # type: ignore[attr-defined]
        try:
            trainer.scaler.step(optimizer)
        finally:
            del local.found_inf  # type: ignore[attr-defined]
    elif verdict:
        trainer.scaler.step(optimizer)
        trainer.scaler.update()
    if trainer.ema is not None and verdict is not False:
        trainer.ema.update(verdict if isinstance(verdict, torch.Tensor) else None)
    optimizer.zero_grad(set_to_none=True)
    _next_rates(trainer)
    return verdict


def _next_rates(trainer: Trainer) -> None:
    """The schedule's next step, and a hook's LR multiplier on the rates just scheduled."""
    trainer.scheduler.step()
    trainer.steer.apply()


def skipped_step(trainer: Trainer) -> bool:
    """A step whose batches were read and not trained on (`--skip_steps`, a rolled-back
    spike's): no update; the schedule moves on as at any step."""
    trainer.history["skipped_steps"] = trainer.history.get("skipped_steps", 0) + 1
    with warnings.catch_warnings():  # a run's first step skipped: no optimizer step yet
        warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before")
        _next_rates(trainer)
    return True


def rescale_to_global_count(
    trainer: Trainer, count: torch.Tensor, own_flag: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Gradients were scaled by a nominal count; make them the mean over the true
    global count of the window (tokens, or samples of an iterable dataset). With
    `own_flag` (this rank's non-finite flag), the flag of every rank comes back, summed
    in the same all-reduce (above 0: some rank's gradients are not finite)."""
    ctx = trainer.ctx
    flag = own_flag
    if ctx.distributed:
        if not ctx.counts_data:  # a tensor-parallel peer's batch is counted once
            count = torch.zeros_like(count)
        if own_flag is None:
            dist.all_reduce(count)
        else:
            both = torch.cat([count.reshape(1), own_flag.reshape(1).to(count.dtype)])
            dist.all_reduce(both)
            count, flag = both[:1], (both[1] > 0).to(own_flag.dtype)
    # On the device: reading the count would make the host wait for the backward.
    factor = torch.where(count > 0, trainer.nominal / count, 0.0)
    # Each rank's own part: sharded gradients may live on several meshes (--tp).
    grads = [local_tensor(p.grad) for p in trainer.params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor.squeeze())
    return flag


class Verdicts:
    """The verdict of the newest optimizer step, held until the host reads it (`settle`):
    its window of metric sums waits with it."""

    def __init__(self, device: torch.device, max_bad_steps: int, ckpt_dir: Path) -> None:
        self.max_bad_steps, self.ckpt_dir = max_bad_steps, ckpt_dir
        on_gpu = device.type == "cuda"
        # two pinned slots: the next step's copy never overwrites one not yet read
        self._slots = [torch.zeros(()).pin_memory() for _ in range(2)] if on_gpu else []
        self._turn = 0
        self._held: tuple[int, torch.Tensor | bool, MetricSums, object] | None = None

    def hold(self, step: int, verdict: torch.Tensor | bool, sums: MetricSums) -> None:
        """Step `step` was taken or skipped as `verdict` says: set its window aside and
        start a copy of a device flag to the host."""
        sums.hold()
        event = None
        if isinstance(verdict, torch.Tensor) and self._slots:
            slot = self._slots[self._turn]
            self._turn ^= 1
            slot.copy_(verdict, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            verdict = slot
        self._held = (step, verdict, sums, event)

    def settle(self, progress: Progress) -> None:
        """Read the held verdict (if any), fold its window or drop it, count the step."""
        if self._held is None:
            return
        step, verdict, sums, event = self._held
        self._held = None
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
        good = verdict if isinstance(verdict, bool) else not bool(verdict)
        sums.fold(keep=good)
        progress.judge(good, step, self.max_bad_steps, self.ckpt_dir)
