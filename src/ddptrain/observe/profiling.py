"""`--enable_profiling`: a torch.profiler trace of a few optimizer steps, on rank 0.

The profiler follows a wait/warm-up/active schedule that only advances when `step()` is
called, so it is stepped once per optimizer step; when the active steps end, the trace is
written to `<output_dir>/profile/` (open it in TensorBoard or Perfetto).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.profiler as tp

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.files import refuse_link
from ddptrain.observe.hooks import Hook, RunView

log = logging.getLogger("ddptrain")


def profile_schedule(steps_available: int) -> tuple[int, int, int]:
    """(wait, warmup, active) fitted into the steps one epoch has."""
    wait = 1 if steps_available >= 3 else 0
    warmup = 1 if steps_available >= 2 else 0
    active = max(1, min(3, steps_available - wait - warmup))
    return wait, warmup, active


class StepProfiler(Hook):
    """No-op unless profiling is on and this is rank 0."""

    def __init__(self, config: TrainingConfig, ctx: DistributedContext, steps_per_epoch: int):
        self._prof: Any = None
        self._left = 0
        if not (config.enable_profiling and ctx.is_main):
            return
        wait, warmup, active = profile_schedule(steps_per_epoch)
        self.trace_dir = refuse_link(config.run_dir / "profile")
        activities = [tp.ProfilerActivity.CPU]
        if ctx.device.type == "cuda":
            activities.append(tp.ProfilerActivity.CUDA)
        self._prof = tp.profile(
            activities=activities,
            schedule=tp.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=tp.tensorboard_trace_handler(str(self.trace_dir)),
            record_shapes=True,
        )
        self._left = wait + warmup + active
        self._prof.__enter__()
        log.info("profiling %d steps into %s", active, self.trace_dir)

    def on_step_end(self, run: RunView) -> None:
        if self._prof is None:
            return
        self._prof.step()
        self._left -= 1
        if self._left <= 0:
            self.close()

    def close(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
