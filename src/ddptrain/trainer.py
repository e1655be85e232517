"""The training loop: one optimizer step = one gradient all-reduce, however it is reached.

Path of one optimizer step with `--grad_accum_steps K`:
micro-batches 1..K-1 run forward and backward inside `DDP.no_sync()` (gradients only
accumulate locally), micro-batch K runs outside it and DDP all-reduces the summed
gradients once; then (optional) unscale + clip, optimizer and scaler step,
`zero_grad(set_to_none=True)`, and the warm-up/cosine schedule advances by one step.

Each micro-batch's loss is weighted by its share of the samples in its window, so K
micro-batches of b equal one batch of K*b, and an epoch's last, shorter window is
stepped with the right weights instead of being dropped.

Faults: a non-finite gradient skips the step on every rank (the all-reduced gradient is
the same everywhere, so every rank reaches the same verdict without another collective);
SIGTERM is agreed on at the next metric all-reduce, a checkpoint is written and the run
exits with `Preempted`; a restarted torchrun worker resumes from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ddptrain.checkpoint import (
    export_safetensors_state,
    find_resumable,
    gather_rng_states,
    load_checkpoint,
    load_model_state,
    save_checkpoint,
    set_rng_state,
)
from ddptrain.config import ConfigError, TrainingConfig
from ddptrain.data import (
    DataBundle,
    batch_sizes,
    make_train_loader,
    make_val_loader,
    steps_per_epoch,
)
from ddptrain.distributed import DistributedContext
from ddptrain.errors import Diverged, Preempted
from ddptrain.flops import gpu_fields
from ddptrain.metrics import MetricSums, MetricsWriter, summarize
from ddptrain.models import create_model, wrap_ddp
from ddptrain.profiling import StepProfiler

log = logging.getLogger("ddptrain")

# A SIGTERM is acted on at the next metric all-reduce: every --log_interval steps, and at
# least every this many, so a preempted job stops well inside the launcher's grace period
# (torchrun: 30 s) without adding a collective to every step.
STOP_CHECK_STEPS = 25


@dataclass
class Progress:
    """Where training stands; enough to continue from exactly here."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken in total (skipped non-finite ones included)
    batches_in_epoch: int = 0  # micro-batches done in epoch `epoch + 1`
    bad_steps: int = 0  # steps skipped for non-finite gradients, in total
    bad_streak: int = 0  # ... in a row, up to now


@dataclass
class EpochMeter:
    """Running train metrics of the current epoch, as of the last log point."""

    sums: MetricSums
    logged: tuple[float, float, float] = (0.0, 0.0, 0.0)  # global totals at the last log
    t_last: float = 0.0
    wait: float = 0.0  # seconds blocked on the loader since the last log
    step_last: int = 0


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype | None  # autocast dtype; None: full precision
    scaler: bool  # a GradScaler only earns its cost for float16


def resolve_precision(config: TrainingConfig, device: torch.device) -> Precision:
    if not config.use_amp:
        return Precision(None, False)
    if device.type == "cuda":
        dtype = torch.bfloat16 if config.amp_dtype == "bfloat16" else torch.float16
        return Precision(dtype, dtype == torch.float16)
    if config.amp_dtype == "bfloat16":
        return Precision(torch.bfloat16, False)
    if config.amp_dtype == "float16":
        raise ConfigError(
            "--amp_dtype 'float16' is invalid on CPU: float16 autocast is a GPU feature; "
            "use --amp_dtype bfloat16 or --no-use_amp"
        )
    return Precision(None, False)  # auto on CPU: fp32, as mixed precision rarely pays there


def warmup_cosine(warmup_steps: float, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warm-up to 1, then cosine decay to 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        span = max(1.0, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_optimizer(model: nn.Module, config: TrainingConfig, lr: float) -> torch.optim.Optimizer:
    if config.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(
        model.parameters(), lr=lr, momentum=config.momentum, weight_decay=config.weight_decay
    )


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


class Trainer:
    """Owns the model, optimizer, schedule, loaders and progress of one run on one rank."""

    def __init__(self, config: TrainingConfig, ctx: DistributedContext, data: DataBundle):
        self.config, self.ctx, self.data = config, ctx, data
        device = ctx.device
        torch.manual_seed(config.seed)  # identical initial weights on every rank
        self.module = create_model(config, data, device)
        self.params = list(self.module.parameters())  # walking the modules costs µs a step
        self._found_inf = torch.zeros(1, device=device)
        self._one = torch.ones(1, device=device)
        self.train_loader, self.sampler = make_train_loader(data.train, config, ctx)
        self.val_loader = make_val_loader(data.val, config, ctx)

        k = config.grad_accum_steps
        sizes = batch_sizes(self.sampler.num_samples, config.batch_size, config.drop_last)
        self.batch_sizes = sizes
        # Per micro-batch of an epoch: its loss weight and whether it ends a window.
        # Identical on every rank (DistributedSampler gives equal shard sizes).
        self.loss_weights: list[float] = []
        self.ends_window: list[bool] = []
        for start in range(0, len(sizes), k):
            window = sizes[start : start + k]
            self.loss_weights += [n / sum(window) for n in window]
            self.ends_window += [False] * (len(window) - 1) + [True]
        self.steps_per_epoch = steps_per_epoch(len(sizes), k)
        self.total_steps = self.steps_per_epoch * config.epochs

        lr = config.lr * (ctx.world_size * k if config.scale_lr else 1)
        self.optimizer = build_optimizer(self.module, config, lr)
        warmup_steps = config.warmup_epochs * self.steps_per_epoch
        self.scheduler = LambdaLR(self.optimizer, warmup_cosine(warmup_steps, self.total_steps))
        self.precision = resolve_precision(config, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.precision.scaler)
        self.criterion = nn.CrossEntropyLoss()
        self.progress = Progress()
        self._resumed_meter: dict[str, list[float]] | None = None
        self._stop_requested = False

        torch.manual_seed(config.seed + ctx.rank)  # per-rank randomness (dropout, user aug.)
        self.resumed_from = self._resume()
        self.model = wrap_ddp(self.module, ctx)
        self.writer = MetricsWriter(
            config.run_dir / "metrics.jsonl", enabled=ctx.is_main,
            tensorboard_dir=config.run_dir / "tensorboard" if config.tensorboard else None,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self, meter: dict[str, list[float]] | None = None) -> dict[str, Any]:
        """Everything a resume needs; RNG states of all ranks are gathered on rank 0.
        `meter` holds the epoch's global metric totals when saving mid-epoch."""
        return {
            "epoch_meter": meter or {},
            **asdict(self.progress),
            "model_state_dict": self.module.state_dict(),
            "optimizer_state_dict": self.optimizer.state_dict(),
            "scheduler_state_dict": self.scheduler.state_dict(),
            "scaler_state_dict": self.scaler.state_dict(),
            "sampler": {"seed": self.config.seed, "epoch": self.progress.epoch + 1},
            "world_size": self.ctx.world_size,
            "config": self.config.to_dict(),
            "rng": gather_rng_states(self.ctx),
        }

    def _resume(self) -> str | None:
        source = self.config.resume_from
        if source is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            # torchrun restarted this worker group after a failure: pick up where it was.
            log.warning("restarted by torchrun: resuming from the newest checkpoint")
            source = "auto"
        if source is None:
            return None
        if source == "auto":
            found = find_resumable(self.config.ckpt_dir, self.ctx.device)
            if found is None:
                log.info("no checkpoint in %s: starting fresh", self.config.ckpt_dir)
                return None
            path, payload = found
        else:
            path = Path(source)
            payload = load_checkpoint(path, self.ctx.device)
        load_model_state(self.module, payload["model_state_dict"], path)
        self.optimizer.load_state_dict(payload["optimizer_state_dict"])
        self.scheduler.load_state_dict(payload["scheduler_state_dict"])
        self.scaler.load_state_dict(payload["scaler_state_dict"])
        self.progress = Progress(
            payload["epoch"], payload["step"], payload["batches_in_epoch"],
            payload["bad_steps"], payload["bad_streak"],
        )
        saved = payload.get("config", {})
        same_layout = payload.get("world_size") == self.ctx.world_size and all(
            saved.get(k) == getattr(self.config, k)
            for k in ("batch_size", "grad_accum_steps", "drop_last", "seed")
        )
        if same_layout:
            set_rng_state(payload["rng"][self.ctx.rank], self.ctx.device)
            self._resumed_meter = payload["epoch_meter"] or None
        elif self.progress.batches_in_epoch:
            # The position inside the epoch means nothing under another data layout.
            log.warning(
                "checkpoint was taken mid-epoch with another world size or batch layout: "
                "restarting epoch %d from its beginning",
                self.progress.epoch + 1,
            )
            self.progress.batches_in_epoch = 0
        log.info(
            "resumed from %s: epoch %d done, step %d",
            path, self.progress.epoch, self.progress.step,
        )
        return str(path)

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, Any]:
        cfg, ctx = self.config, self.ctx
        self.writer.start(
            keep_step=self.progress.step if self.resumed_from else None,
            keep_epoch=self.progress.epoch,
        )
        profiler = StepProfiler(cfg, ctx, self.steps_per_epoch)
        best, val, started = 0.0, {}, time.perf_counter()
        samples_seen = 0
        previous = self._catch_sigterm()
        try:
            for epoch in range(self.progress.epoch + 1, cfg.epochs + 1):
                t0 = time.perf_counter()
                train = self.train_epoch(epoch, profiler)
                samples_seen += train["samples"]
                val = self.evaluate()
                best = max(best, val["accuracy"])
                self.progress.epoch, self.progress.batches_in_epoch = epoch, 0
                self.writer.write({
                    "split": "val", "epoch": epoch, "step": self.progress.step, **val,
                    "train_loss": train["loss"], "train_accuracy": train["accuracy"],
                    "epoch_time_s": time.perf_counter() - t0,
                })
                log.info(
                    "epoch %d/%d  train loss %.4f acc %.4f | val loss %.4f acc %.4f | %.1fs",
                    epoch, cfg.epochs, train["loss"], train["accuracy"],
                    val["loss"], val["accuracy"], time.perf_counter() - t0,
                )
                last = epoch == cfg.epochs
                if last or (cfg.save_every and epoch % cfg.save_every == 0):
                    self.save()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            profiler.close()
            self.writer.close()
        elapsed = time.perf_counter() - started
        summary = {
            "epochs": cfg.epochs, "steps": self.progress.step, "world_size": ctx.world_size,
            "val_loss": val.get("loss"), "val_accuracy": val.get("accuracy"),
            "best_val_accuracy": best, "train_time_s": elapsed,
            "samples_per_sec": samples_seen / elapsed if elapsed else 0.0,
            "bad_steps": self.progress.bad_steps,
        }
        if ctx.is_main:
            export_safetensors_state(self.module.state_dict(), cfg.run_dir / "model.safetensors")
        return summary

    def _catch_sigterm(self) -> Any:
        """Turn SIGTERM into a request to stop at the next agreed point (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def request_stop(signum: int, frame: Any) -> None:
            self._stop_requested = True

        return signal.signal(signal.SIGTERM, request_stop)

    def _batches(self, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, float]]:
        """Yield device batches and the seconds spent waiting for each."""
        device = self.ctx.device
        it = iter(self.train_loader)
        while True:
            t0 = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                return
            wait = time.perf_counter() - t0
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True), wait

    def train_epoch(self, epoch: int, profiler: StepProfiler) -> dict[str, float]:
        cfg, ctx = self.config, self.ctx
        self.sampler.set_epoch(epoch)
        start = self.progress.batches_in_epoch
        self.sampler.set_start(sum(self.batch_sizes[:start]))  # no replay, no skip
        self.model.train()
        meter = self._new_meter()
        autocast = self._autocast()
        bar = self._progress_bar(epoch, start)
        for i, (x, y, waited) in enumerate(self._batches(start), start=start):
            meter.wait += waited
            final = self.ends_window[i]
            sync = final or not ctx.distributed
            with contextlib.nullcontext() if sync else self.model.no_sync():  # type: ignore[operator]
                with autocast:
                    logits = self.model(x)
                    loss = self.criterion(logits, y)
                weight = self.loss_weights[i]
                self.scaler.scale(loss if weight == 1.0 else loss * weight).backward()
            meter.sums.update(logits, y, loss, y.shape[0])
            if not final:
                continue
            good = self._optimizer_step()
            meter.sums.commit(keep=good)
            self._count_step(good)
            self.progress.batches_in_epoch = i + 1
            profiler.step()
            if bar is not None:
                bar.update(1)
            step = self.progress.step
            log_now = step % cfg.log_interval == 0
            save_now = bool(cfg.save_every_steps) and step % cfg.save_every_steps == 0
            if not (log_now or save_now or step % STOP_CHECK_STEPS == 0):
                continue
            # The one all-reduce of metric totals also carries the stop request, so all
            # ranks learn of a SIGTERM at the same step.
            totals, stop = meter.sums.global_totals_and_flag(ctx, self._stop_requested)
            if log_now:
                self._log_interval(epoch, meter, totals, x, bar)
            if save_now or stop:
                self.save({"totals": list(totals), "logged": list(meter.logged)})
            if stop:
                raise Preempted(f"stopped by SIGTERM at step {step} after a checkpoint")
        if bar is not None:
            bar.close()
        totals, stop = meter.sums.global_totals_and_flag(ctx, self._stop_requested)
        if stop:
            self.save({"totals": list(totals), "logged": list(meter.logged)})
            raise Preempted(f"stopped by SIGTERM at step {self.progress.step} after a checkpoint")
        return summarize(*totals)

    def _new_meter(self) -> EpochMeter:
        meter = EpochMeter(MetricSums(self.ctx.device), t_last=time.perf_counter())
        meter.step_last = self.progress.step
        saved, self._resumed_meter = self._resumed_meter, None
        if saved:  # mid-epoch resume: the epoch's figures continue from the checkpoint
            meter.logged = tuple(saved["logged"])  # type: ignore[assignment]
            if self.ctx.is_main:  # global totals, so they are added in once
                meter.sums.set(saved["totals"])
        return meter

    def _log_interval(
        self, epoch: int, meter: EpochMeter, totals: tuple[float, float, float],
        x: torch.Tensor, bar: Any,
    ) -> None:
        now = time.perf_counter()
        interval = [a - b for a, b in zip(totals, meter.logged, strict=True)]
        elapsed = now - meter.t_last
        steps = max(1, self.progress.step - meter.step_last)
        row = {
            "split": "train", "epoch": epoch, "step": self.progress.step,
            **summarize(*interval),
            "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_sec": interval[2] / elapsed,
            "step_time_s": elapsed / steps,
            "data_wait_frac": meter.wait / elapsed,
            "peak_rss_mb": peak_rss_mb(),
            "bad_steps": self.progress.bad_steps,
            **gpu_fields(self.module, x, interval[2] / elapsed, self.ctx, self.precision.dtype),
        }
        self.writer.write(row)
        self._log_train(row, bar)
        meter.logged, meter.t_last, meter.wait = totals, now, 0.0
        meter.step_last = self.progress.step

    def _optimizer_step(self) -> bool:
        """Step unless the gradients are not finite; returns whether it stepped."""
        cfg = self.config
        check = cfg.max_bad_steps > 0 and not self.precision.scaler  # fp16: the scaler's job
        norm = None
        if cfg.max_grad_norm:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
            norm = nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
        # After the all-reduce every rank holds the same gradients, so this host read
        # gives the same verdict everywhere: a NaN on any rank reaches all of them.
        if not check:
            good = True
        elif norm is not None:
            good = bool(torch.isfinite(norm))
        else:
            good = self._grads_finite()
        if good:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return good

    def _grads_finite(self) -> bool:
        """Whether every gradient is finite: GradScaler's fused check (with a scale of
        1, which leaves the values as they are), a few µs where a norm costs tens."""
        grads = [p.grad for p in self.params if p.grad is not None]
        self._found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, self._one)
        return not self._found_inf.item()

    def _count_step(self, good: bool) -> None:
        p = self.progress
        p.step += 1
        if good:
            p.bad_streak = 0
            return
        p.bad_steps += 1
        p.bad_streak += 1
        log.warning(
            "step %d: non-finite gradients on at least one rank; step skipped on all "
            "(%d in a row)", p.step, p.bad_streak,
        )
        if p.bad_streak >= self.config.max_bad_steps:
            raise Diverged(
                f"{p.bad_streak} optimizer steps in a row had non-finite gradients (last at "
                f"step {p.step}); the newest checkpoint in {self.config.ckpt_dir} is the last "
                "good state: lower --lr, set --max_grad_norm, or check the data for NaN/inf"
            )

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.precision.dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=dtype)

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
        sums = MetricSums(ctx.device)
        autocast = self._autocast()
        for x, y in self.val_loader:
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            with autocast:
                logits = self.module(x)
            loss_sum = nn.functional.cross_entropy(logits.float(), y, reduction="sum")
            sums.update(logits, y, loss_sum, 1.0)
        sums.commit()
        self.module.train()
        return summarize(*sums.global_totals(ctx))

    def save(self, meter: dict[str, list[float]] | None = None) -> None:
        cfg = self.config
        path = save_checkpoint(
            cfg.ckpt_dir, self.progress.step, self.state_dict(meter), self.ctx, cfg.keep_last
        )
        log.info("checkpoint %s", path)

    # ------------------------------------------------------------------ output
    def _progress_bar(self, epoch: int, start: int) -> Any:
        if not (self.ctx.is_main and sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        done = start // self.config.grad_accum_steps
        return tqdm(
            total=self.steps_per_epoch, initial=done, desc=f"epoch {epoch}/{self.config.epochs}",
            unit="step", leave=False, dynamic_ncols=True,
        )

    def _log_train(self, row: dict[str, Any], bar: Any) -> None:
        text = (
            f"epoch {row['epoch']} step {row['step']}/{self.total_steps} "
            f"loss {row['loss']:.4f} acc {row['accuracy']:.4f} lr {row['lr']:.5f} "
            f"{row['samples_per_sec']:,.0f} samples/s"
        )
        if bar is not None:
            bar.set_postfix(loss=f"{row['loss']:.4f}", acc=f"{row['accuracy']:.3f}")
            bar.write(text)
        else:
            log.info(text)
