"""The training loop: one optimizer step = one gradient all-reduce, however it is reached.

Path of one optimizer step with `--grad_accum_steps K`:
micro-batches 1..K-1 run forward and backward inside `DDP.no_sync()` (gradients only
accumulate locally), micro-batch K runs outside it and DDP all-reduces the summed
gradients once; then (optional) unscale + clip, optimizer and scaler step,
`zero_grad(set_to_none=True)`, and the warm-up/cosine schedule advances by one step.

Each micro-batch's loss is weighted by its share of the samples in its window, so K
micro-batches of b equal one batch of K*b, and an epoch's last, shorter window is
stepped with the right weights instead of being dropped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import sys
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
from ddptrain.flops import gpu_fields
from ddptrain.metrics import MetricSums, MetricsWriter, summarize
from ddptrain.models import create_model, wrap_ddp
from ddptrain.profiling import StepProfiler

log = logging.getLogger("ddptrain")


@dataclass
class Progress:
    """Where training stands; enough to continue from exactly here."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken in total
    batches_in_epoch: int = 0  # micro-batches done in epoch `epoch + 1`


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
        self.train_loader, self.sampler = make_train_loader(data.train, config, ctx)
        self.val_loader = make_val_loader(data.val, config, ctx)

        k = config.grad_accum_steps
        sizes = batch_sizes(self.sampler.num_samples, config.batch_size, config.drop_last)
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

        torch.manual_seed(config.seed + ctx.rank)  # per-rank randomness (dropout, user aug.)
        self.resumed_from = self._resume()
        self.model = wrap_ddp(self.module, ctx)
        self.writer = MetricsWriter(
            config.run_dir / "metrics.jsonl", enabled=ctx.is_main,
            tensorboard_dir=config.run_dir / "tensorboard" if config.tensorboard else None,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs; RNG states of all ranks are gathered on rank 0."""
        return {
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
            payload["epoch"], payload["step"], payload.get("batches_in_epoch", 0)
        )
        saved = payload.get("config", {})
        same_layout = payload.get("world_size") == self.ctx.world_size and all(
            saved.get(k) == getattr(self.config, k)
            for k in ("batch_size", "grad_accum_steps", "drop_last", "seed")
        )
        if same_layout and payload.get("rng"):
            set_rng_state(payload["rng"][self.ctx.rank], self.ctx.device)
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
        try:
            for epoch in range(self.progress.epoch + 1, cfg.epochs + 1):
                t0 = time.perf_counter()
                train = self.train_epoch(epoch, profiler)
                samples_seen += train["samples"]
                val = self.evaluate()
                best = max(best, val["accuracy"])
                self.progress = Progress(epoch, self.progress.step, 0)
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
            profiler.close()
            self.writer.close()
        elapsed = time.perf_counter() - started
        summary = {
            "epochs": cfg.epochs, "steps": self.progress.step, "world_size": ctx.world_size,
            "val_loss": val.get("loss"), "val_accuracy": val.get("accuracy"),
            "best_val_accuracy": best, "train_time_s": elapsed,
            "samples_per_sec": samples_seen / elapsed if elapsed else 0.0,
        }
        if ctx.is_main:
            export_safetensors_state(self.module.state_dict(), cfg.run_dir / "model.safetensors")
        return summary

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
        self.sampler.set_start(start * cfg.batch_size)
        self.model.train()
        sums = MetricSums(ctx.device)
        autocast = self._autocast()
        bar = self._progress_bar(epoch, start)
        last_totals = (0.0, 0.0, 0.0)
        t_last, wait = time.perf_counter(), 0.0
        steps_at_last = self.progress.step
        for i, (x, y, waited) in enumerate(self._batches(start), start=start):
            wait += waited
            final = self.ends_window[i]
            sync = final or not ctx.distributed
            with contextlib.nullcontext() if sync else self.model.no_sync():  # type: ignore[operator]
                with autocast:
                    logits = self.model(x)
                    loss = self.criterion(logits, y)
                self.scaler.scale(loss * self.loss_weights[i]).backward()
            sums.update(logits, y, loss.detach() * y.shape[0])
            if not final:
                continue
            self._optimizer_step()
            self.progress.step += 1
            self.progress.batches_in_epoch = i + 1
            profiler.step()
            if bar is not None:
                bar.update(1)
            if self.progress.step % cfg.log_interval == 0:
                totals = sums.global_totals(ctx)
                now = time.perf_counter()
                interval = [a - b for a, b in zip(totals, last_totals, strict=True)]
                steps = self.progress.step - steps_at_last
                row = {
                    "split": "train", "epoch": epoch, "step": self.progress.step,
                    **summarize(*interval),
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "samples_per_sec": interval[2] / (now - t_last),
                    "step_time_s": (now - t_last) / steps,
                    "data_wait_frac": wait / (now - t_last),
                    "peak_rss_mb": peak_rss_mb(),
                    **gpu_fields(
                        self.module, x, interval[2] / (now - t_last), ctx, self.precision.dtype
                    ),
                }
                self.writer.write(row)
                self._log_train(row, bar)
                last_totals, t_last, wait, steps_at_last = totals, now, 0.0, self.progress.step
        if bar is not None:
            bar.close()
        return summarize(*sums.global_totals(ctx))

    def _optimizer_step(self) -> None:
        if self.config.max_grad_norm:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not scaled ones
            nn.utils.clip_grad_norm_(self.module.parameters(), self.config.max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

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
            sums.update(logits, y, loss_sum)
        self.module.train()
        return summarize(*sums.global_totals(ctx))

    def save(self) -> None:
        cfg = self.config
        path = save_checkpoint(
            cfg.ckpt_dir, self.progress.step, self.state_dict(), self.ctx, cfg.keep_last
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
