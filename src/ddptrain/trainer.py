"""The training loop: one optimizer step = one gradient reduction, however it is reached.

Path of one optimizer step (`train_epoch` -> `_forward_backward` -> `_optimizer_step`):
micro-batches 1..K-1 of an accumulation window run forward and backward inside the
strategy's `no_backward_sync` (gradients only accumulate locally); micro-batch K runs
outside it and the gradients are reduced once; then (optional) unscale + clip, the
non-finite check, optimizer and scaler step, `zero_grad(set_to_none=True)`, and the
warm-up/cosine schedule advances by one step.

Each micro-batch's loss is the task's *sum*, scaled by world size / the global count of
its window (every rank, every micro-batch), so the reduced gradient is the mean over the
whole optimizer step: N ranks x batch B equal one rank x batch N*B, and K micro-batches of
b one batch of K*b, also when an epoch's last global batch is short. When the count is
only known from the data (tokens; iterable datasets), the window's global count is
all-reduced at the step and the gradients are rescaled by it.

Faults: a non-finite gradient skips the step on every rank; SIGTERM is agreed on at the
next metric all-reduce, a checkpoint is written and the run exits with `Preempted`; a
restarted torchrun worker resumes from the newest checkpoint.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.batches import ModelCall, split, to_device
from ddptrain.checkpoint import (
    export_safetensors_state,
    gather_rng_states,
    load_model_state,
    locate_resume,
    save_checkpoint,
    set_rng_state,
)
from ddptrain.config import TrainingConfig
from ddptrain.data import (
    DataBundle,
    Micro,
    make_train_batches,
    make_val_loader,
)
from ddptrain.distributed import DistributedContext
from ddptrain.errors import Preempted
from ddptrain.files import atomic_write_text
from ddptrain.flops import gpu_fields
from ddptrain.hooks import Console, Curves, Hook, Hooks
from ddptrain.metrics import EpochMeter, MetricSums, MetricsWriter
from ddptrain.models import create_model
from ddptrain.optim import build_optimizer, build_scheduler, peak_lr
from ddptrain.precision import resolve_precision
from ddptrain.profiling import StepProfiler
from ddptrain.state import Progress
from ddptrain.strategy import create_strategy
from ddptrain.tasks import Scorer, Task, head_size, resolve_task
from ddptrain.trackers import tracker_hooks

log = logging.getLogger("ddptrain")

# A SIGTERM is acted on at the next metric all-reduce: every --log_interval steps, and at
# least every this many, so a preempted job stops well inside the launcher's grace period
# (torchrun: 30 s) without adding a collective to every step.
STOP_CHECK_STEPS = 25


class Trainer:
    """Owns the model, optimizer, schedule, loaders and progress of one run on one rank."""

    def __init__(
        self, config: TrainingConfig, ctx: DistributedContext, data: DataBundle,
        module: nn.Module | None = None, task: Task | None = None,
        hooks: Sequence[Hook] = (),
    ) -> None:
        self.config, self.ctx, self.data = config, ctx, data
        device = ctx.device
        self.task = task or resolve_task(config, data.facts)
        torch.manual_seed(config.seed)  # identical initial weights on every rank
        if module is None:
            module = create_model(config, data, head_size(self.task, data.facts), device)
        self.module = module.to(device)
        self.strategy = create_strategy(ctx)
        self.call = ModelCall(self.module)
        self.scorer = Scorer(self.task, device)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self._setup_data()
        self.precision = resolve_precision(config, device)
        self.optimizer = build_optimizer(self.module, config, peak_lr(config, ctx.world_size))
        warmup_steps = config.warmup_epochs * self.steps_per_epoch
        self.scheduler = build_scheduler(self.optimizer, warmup_steps, self.total_steps)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.precision.scaler)
        self.progress = Progress()
        self.steps_done_in_epoch = 0
        self._resumed_meter: dict[str, Any] | None = None
        self._stop_requested = False

        self.writer = MetricsWriter(
            config.run_dir / "metrics.jsonl", enabled=ctx.is_main,
            tensorboard_dir=config.run_dir / "tensorboard" if config.tensorboard else None,
        )
        self.hooks = Hooks([
            self.writer, Console(), StepProfiler(config, ctx, self.steps_per_epoch), Curves(),
            *tracker_hooks(config, ctx), *hooks,
        ])
        torch.manual_seed(config.seed + ctx.rank)  # per-rank randomness (dropout, user aug.)
        self.resumed_from = self._resume()
        self.model = self.strategy.setup_module(self.module)

    def _setup_data(self) -> None:
        cfg, ctx = self.config, self.ctx
        self.val_loader = make_val_loader(self.data.val, cfg, ctx)
        self.train_batches = make_train_batches(self.data.train, cfg, ctx)
        self.steps_per_epoch = self.train_batches.steps_per_epoch
        # An iterable dataset without a length has no planned end: a constant LR.
        self.total_steps = self.steps_per_epoch * cfg.epochs or 2**62
        # Counts known only from the data (tokens, iterable samples): the loss is scaled by
        # a nominal count, and the step rescales by the true global one.
        self.dynamic = self.task.dynamic_count or self.data.iterable
        self.nominal = float(cfg.batch_size * cfg.grad_accum_steps * ctx.world_size)

    # ------------------------------------------------------------------ state
    def state_dict(self, meter: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything a resume needs; RNG states of all ranks are gathered on rank 0.
        `meter` holds the epoch's global metric totals when saving mid-epoch."""
        return {
            "epoch_meter": meter or {},
            **self.progress.to_dict(),
            "model_state_dict": self.strategy.module_state_dict(self.module),
            "optimizer_state_dict": self.optimizer.state_dict(),
            "scheduler_state_dict": self.scheduler.state_dict(),
            "scaler_state_dict": self.scaler.state_dict(),
            "task": self.task.name,
            "world_size": self.ctx.world_size,
            "config": self.config.to_dict(),
            "rng": gather_rng_states(self.ctx),
            "hooks": self.hooks.state_dict(),
        }

    def _resume(self) -> str | None:
        found = locate_resume(self.config.resume_from, self.config.ckpt_dir, self.ctx.device)
        if found is None:
            return None
        path, payload = found
        load_model_state(self.module, payload["model_state_dict"], path)
        self.optimizer.load_state_dict(payload["optimizer_state_dict"])
        self.scheduler.load_state_dict(payload["scheduler_state_dict"])
        self.scaler.load_state_dict(payload["scaler_state_dict"])
        self.progress = Progress.from_payload(payload)
        self.hooks.load_state_dict(payload.get("hooks", {}))
        self._restore_position(payload)
        log.info(
            "resumed from %s: epoch %d done, step %d",
            path, self.progress.epoch, self.progress.step,
        )
        return str(path)

    def _restore_position(self, payload: dict[str, Any]) -> None:
        """Per-rank random state and the epoch's running metrics, where they still mean
        the same; the data position (global samples) means the same on any layout."""
        saved = payload.get("config", {})
        same_layout = payload.get("world_size") == self.ctx.world_size and all(
            saved.get(k) == getattr(self.config, k)
            for k in ("batch_size", "grad_accum_steps", "drop_last", "seed")
        )
        if same_layout:
            set_rng_state(payload["rng"][self.ctx.rank], self.ctx.device)
        meter = payload.get("epoch_meter") or None
        if meter and payload.get("task") == self.task.name:
            self._resumed_meter = meter
        if not self.progress.samples_in_epoch:
            return
        if self.data.iterable:
            log.warning(
                "an IterableDataset cannot start part-way: epoch %d restarts from its beginning",
                self.progress.epoch + 1,
            )
            self.progress.samples_in_epoch = 0
            self._resumed_meter = None
        elif not same_layout:
            log.warning(
                "checkpoint was taken mid-epoch with another world size or batch layout: "
                "epoch %d continues at global sample %d",
                self.progress.epoch + 1, self.progress.samples_in_epoch,
            )

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, Any]:
        cfg, ctx = self.config, self.ctx
        self.writer.start(
            keep_step=self.progress.step if self.resumed_from else None,
            keep_epoch=self.progress.epoch,
        )
        task = self.task
        best: float | None = None
        best_epoch, val, started, samples_seen = 0, {}, time.perf_counter(), 0
        previous = self._catch_sigterm()
        try:
            self.hooks.on_fit_start(self)
            for epoch in range(self.progress.epoch + 1, cfg.epochs + 1):
                t0 = time.perf_counter()
                train = self.train_epoch(epoch)
                samples_seen += train["samples"]
                val = self.evaluate()
                score = val.get(task.best, float("nan"))
                if best is None or _better(score, best, task.mode):
                    best, best_epoch = score, epoch
                self.progress.epoch, self.progress.samples_in_epoch = epoch, 0
                self.hooks.on_row(self, {
                    "split": "val", "epoch": epoch, "step": self.progress.step, **val,
                    **{f"train_{k}": v for k, v in train.items() if k != "samples"},
                    "epoch_time_s": time.perf_counter() - t0,
                })
                last = epoch == cfg.epochs
                if last or (cfg.save_every and epoch % cfg.save_every == 0):
                    self.save()
            elapsed = time.perf_counter() - started
            summary = {
                "epochs": cfg.epochs, "steps": self.progress.step,
                "world_size": ctx.world_size, "task": task.name,
                **{f"val_{k}": v for k, v in val.items() if k != "samples"},
                "best_metric": task.best, f"best_val_{task.best}": best, "best_epoch": best_epoch,
                "train_time_s": elapsed,
                "samples_per_sec": samples_seen / elapsed if elapsed else 0.0,
                "bad_steps": self.progress.bad_steps,
            }
            if ctx.is_main:
                export_safetensors_state(
                    self.strategy.module_state_dict(self.module), cfg.run_dir / "model.safetensors"
                )
                text = json.dumps(summary, indent=2) + "\n"
                atomic_write_text(cfg.run_dir / "summary.json", text)
            self.hooks.on_fit_end(self, summary)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self.hooks.close()
        return summary

    def _catch_sigterm(self) -> Any:
        """Turn SIGTERM into a request to stop at the next agreed point (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def request_stop(signum: int, frame: Any) -> None:
            self._stop_requested = True

        return signal.signal(signal.SIGTERM, request_stop)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        cfg, ctx = self.config, self.ctx
        self.model.train()
        meter = self._new_meter()
        self.steps_done_in_epoch = max(0, self.progress.step - (epoch - 1) * self.steps_per_epoch)
        self.hooks.on_epoch_start(self, epoch)
        inputs: Any = None
        for batch, micro, waited in self.train_batches.epoch(epoch, self.progress.samples_in_epoch):
            meter.wait += waited
            inputs = self._forward_backward(batch, micro, meter.sums)
            if not micro.ends_window:
                continue
            good = self._optimizer_step(meter.sums)
            meter.sums.commit(keep=good)
            self.progress.count_step(good, self.config.max_bad_steps, self.config.ckpt_dir)
            self.progress.samples_in_epoch = micro.position
            self.hooks.on_step_end(self)
            step = self.progress.step
            log_now = step % cfg.log_interval == 0
            save_now = bool(cfg.save_every_steps) and step % cfg.save_every_steps == 0
            if not (log_now or save_now or step % STOP_CHECK_STEPS == 0):
                continue
            # The one all-reduce of metric totals also carries the stop request, so all
            # ranks learn of a SIGTERM at the same step.
            totals, stop = meter.sums.global_totals_and_flag(ctx, self._stop_requested)
            if log_now:
                self._log_interval(epoch, meter, totals, inputs)
            if save_now or stop:
                self._save_mid_epoch(meter, totals, stop)
        totals, stop = meter.sums.global_totals_and_flag(ctx, self._stop_requested)
        if stop:
            self._save_mid_epoch(meter, totals, stop)
        return meter.sums.summarize(totals)

    def _save_mid_epoch(self, meter: EpochMeter, totals: list[float], stop: bool) -> None:
        """Checkpoint with the epoch's running totals; on an agreed stop, end the run."""
        self.save({"totals": totals, "logged": meter.logged})
        if stop:
            raise Preempted(
                f"stopped by SIGTERM at step {self.progress.step} after a checkpoint"
            )

    def _forward_backward(self, batch: Any, micro: Micro, sums: MetricSums) -> Any:
        """Forward and backward of one micro-batch; gradients are reduced only on the
        last micro-batch of a window. Returns the model inputs (for FLOP counting)."""
        inputs, targets = split(to_device(batch, self.ctx.device))
        with self.strategy.no_backward_sync(self.model, skip=not micro.ends_window):
            with self.precision.autocast():
                out = self.call(self.model, inputs)
            score = self.scorer.score(out, targets, inputs)
            scale = 0.0 if micro.pad else self._loss_scale(micro)
            loss = score.loss_sum
            self.scaler.scale(loss if scale == 1.0 else loss * scale).backward()
        if not micro.pad:
            sums.update(score)
        return inputs

    def _loss_scale(self, micro: Micro) -> float:
        # DDP averages gradients over the ranks, hence the factor of world size.
        if self.dynamic:
            return self.ctx.world_size / self.nominal
        return self.ctx.world_size / micro.window_samples

    def _new_meter(self) -> EpochMeter:
        meter = EpochMeter(MetricSums(self.task, self.ctx.device), self.progress.step)
        saved, self._resumed_meter = self._resumed_meter, None
        if saved:  # mid-epoch resume: the epoch's figures continue from the checkpoint
            meter.restore(saved, self.ctx.is_main)
        return meter

    def _log_interval(
        self, epoch: int, meter: EpochMeter, totals: list[float], inputs: Any
    ) -> None:
        row = meter.row(totals, self.progress.step)
        rate = row["samples_per_sec"]
        self.hooks.on_row(self, {
            "split": "train", "epoch": epoch, "step": self.progress.step, **row,
            "lr": self.optimizer.param_groups[0]["lr"], "bad_steps": self.progress.bad_steps,
            **gpu_fields(self.module, inputs, rate, self.ctx, self.precision.dtype),
        })

    def _optimizer_step(self, sums: MetricSums) -> bool:
        """Step unless the gradients are not finite; returns whether it stepped."""
        cfg = self.config
        if self.dynamic:
            self._rescale_to_global_count(sums.window_count())
        check = cfg.max_bad_steps > 0 and not self.precision.scaler  # fp16: the scaler's job
        norm = None
        if cfg.max_grad_norm:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
            norm = self.strategy.clip_grad_norm(self.params, cfg.max_grad_norm)
        if not check:
            good = True
        elif norm is not None:
            good = bool(torch.isfinite(norm))
        else:
            good = self.strategy.grads_finite(self.params)
        if good:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return good

    def _rescale_to_global_count(self, count: torch.Tensor) -> None:
        """Gradients were scaled by a nominal count; make them the mean over the true
        global count of the window (tokens, or samples of an iterable dataset)."""
        if self.ctx.distributed:
            dist.all_reduce(count)
        factor = self.nominal / count.item() if count.item() > 0 else 0.0
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation over every val sample exactly once, summed across ranks.

        Runs the plain module: DDP's forward would broadcast buffers, a collective that
        ranks with unequal shard lengths would call a different number of times. Rank 0's
        BatchNorm statistics are broadcast first, so every rank evaluates the same model
        (the one the checkpoint holds).
        """
        ctx = self.ctx
        if ctx.distributed:
            for buf in self.module.buffers():
                dist.broadcast(buf, src=0)
        self.module.eval()
        sums = MetricSums(self.task, ctx.device)
        for batch in self.val_loader:
            inputs, targets = split(to_device(batch, ctx.device))
            with self.precision.autocast():
                out = self.call(self.module, inputs)
            sums.update(self.scorer.score(out, targets, inputs))
        sums.commit()
        self.module.train()
        return sums.summarize(sums.global_totals(ctx))

    def save(self, meter: dict[str, Any] | None = None) -> None:
        cfg = self.config
        path = save_checkpoint(
            cfg.ckpt_dir, self.progress.step, self.state_dict(meter), self.ctx, cfg.keep_last
        )
        log.info("checkpoint %s", path)


def _better(score: float, best: float, mode: str) -> bool:
    if score != score:  # NaN is never better
        return False
    if best != best:
        return True
    return score > best if mode == "max" else score < best
