"""The training loop: one optimizer step = one gradient reduction, however it is reached.

Path of one optimizer step (`train_epoch` -> `forward.forward_backward` ->
`stepping.optimizer_step`):
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

Faults: a non-finite gradient skips the step on every rank (on the device, read by the
host a step later: `stepping`); SIGTERM is agreed on at the
next metric all-reduce, a checkpoint is written and the run exits with `Preempted`; a
restarted torchrun worker resumes from the newest checkpoint. `--oom_backoff`: an
out-of-memory in the first steps runs the window again at a smaller micro-batch
(`train.backoff`; `BackedOff` restarts the epoch's batches at the position reached).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ddptrain.checkpoint import Checkpointer, Progress
from ddptrain.checkpoint.export import export_run
from ddptrain.checkpoint.finished import clear_finished, ended_at, writing_exports
from ddptrain.checkpoint.rng import gather_rng_states, seed_process
from ddptrain.context import DistributedContext, gather_to_main
from ddptrain.data import (
    ModelCall,
    make_train_batches,
    make_val_loader,
    most_val_batches,
    stop_workers,
)
from ddptrain.files import atomic_write_text
from ddptrain.models import build_model, hf_dir, is_hf_model, is_hf_ref
from ddptrain.observe import Console, Curves, Hook, Hooks, MetricsWriter
from ddptrain.observe.flops import gpu_fields, meta_shadow, peak_fields
from ddptrain.observe.hang import POSITION, StallWatch
from ddptrain.observe.profiling import StepProfiler
from ddptrain.observe.startup import Phases
from ddptrain.observe.trackers import tracker_hooks
from ddptrain.observe.writer import RunLogError
from ddptrain.parallel.cp import of as context_of
from ddptrain.parallel.lora import LoraSpec, adapt
from ddptrain.parallel.memory import optimizer_slots
from ddptrain.parallel.mesh import attach_mesh
from ddptrain.parallel.parallelize import compile_pass, parallelize
from ddptrain.train.backoff import BackedOff, Backoff, refuse_unsupported
from ddptrain.train.ema import EMA
from ddptrain.train.evaluate import Evaluator, named_figures
from ddptrain.train.forward import counting, forward_backward
from ddptrain.train.metrics import (
    EpochMeter,
    MetricSums,
    Stragglers,
    Sync,
    improves,
    reduce_snapshots,
)
from ddptrain.train.optim import build_optimizer, build_scheduler
from ddptrain.train.plan import Resolved, RunPlan, format_plan, plan_of
from ddptrain.train.resume import restore, take_best
from ddptrain.train.rollback import SkippedSteps, roll_back
from ddptrain.train.routing import Routing
from ddptrain.train.saves import check_logs, may_save, save_mid_epoch
from ddptrain.train.start import fill_start, initial_weights, mark_per_rank
from ddptrain.train.steer import SpikeRollback, SteeredStop, Steering, steering_hooks
from ddptrain.train.stepping import Verdicts, optimizer_step, skipped_step
from ddptrain.train.stop import StopRequest
from ddptrain.train.summary import run_summary
from ddptrain.train.tasks import Scorer, head_size, ranking

log = logging.getLogger("ddptrain")
# Train rows are all-reduced in batches: one collective about every SYNC_EVERY_S seconds
# of training (and at the end of each epoch), whatever --log_interval is, since on a busy
# machine a collective costs far more than its bytes. Until the step time is known, the
# first batch is due after --log_interval steps, and never later than FIRST_SYNC_STEPS.
# The same collective carries the stop request: a SIGTERM is acted on within about
# SYNC_EVERY_S plus a step, well inside a launcher's grace period (torchrun: 30 s).
SYNC_EVERY_S = 2.0
FIRST_SYNC_STEPS = 25
MAX_SYNC_STEPS = 100_000


class Trainer:
    """Owns the model, optimizer, schedule, loaders and progress of one run on one rank."""

    def __init__(
        self, run: Resolved, ctx: DistributedContext,
        module: nn.Module | Callable[[], nn.Module] | None = None, hooks: Sequence[Hook] = (),
    ) -> None:
        """`run`: the config, precision, strategy, data and task, resolved before the
        process group (`ddptrain.fit`; by hand: `ddptrain.train.plan.resolve`)."""
        device, config = ctx.device, run.config
        self.choice = run.strategy
        ctx = attach_mesh(ctx, self.choice.layout)  # the layout's device mesh, built once
        self.config, self.ctx, self.data = config, ctx, run.data
        self.task, self.precision = run.task, run.precision
        self.precision.apply()
        self.strategy = self.choice.build(ctx, config, self.precision.dtype)
        self.lora: LoraSpec | None = None  # --lora_rank: the adapters (set as it is built)
        self.module = self._build_module(module)
        self.routing = Routing.of(self.module, config.moe_aux_weight, config.moe_aux_scope, ctx)
        refuse_unsupported(config, self.choice.name, run.data.iterable,  # --oom_backoff
                           routed_globally=getattr(self.routing, "spread", False))
        self._setup_data()
        # FLOPs: on a meta-device shadow taken before the module is wrapped or sharded (an
        # FSDP module cannot be copied); only GPU rows report them.
        self.flops_model = meta_shadow(self.module)
        self.parameter_count = sum(p.numel() for p in self.module.parameters())  # before pp
        # The passes in their one order (`parallel.parallelize`), the strategy's last, before
        # the optimizer sees the parameters: a checkpoint loads into them.
        model, self.frozen = parallelize(
            self.module, self.strategy, config, ctx, self.precision.float8
        )
        self.model: Any = model  # maybe compiled below
        split = context_of(self.module)  # --cp: each rank's slice of the sequences
        self.call = ModelCall(self.module, packed=config.pack, split=split)
        self.scorer = Scorer(self.task, device, split)
        started = fill_start(self)  # hf:DIR per rank; --lora_quantize's base
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimization = build_optimizer(config, self.module, self.strategy, ctx.data_world)
        self.optimizer = self.optimization.optimizer
        self.scheduler = build_scheduler(
            config, self.optimizer, self.steps_per_epoch, self.total_steps
        )
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.precision.scaler)
        # What hooks may change (a stop, the LR multiplier); the EMA weights (fsdp: shards).
        self.steer = Steering(self.optimizer, self.scheduler)
        self.ema = EMA(self.module, config.ema_decay) if config.ema_decay else None
        self.verdicts = Verdicts(ctx.device, config.max_bad_steps, config.ckpt_dir)
        self.backoff = Backoff(self)  # --oom_backoff: the first steps' micro-steps
        self.progress = Progress()
        self._sync_every = min(config.log_interval, FIRST_SYNC_STEPS)
        self.stragglers = Stragglers(config.straggler_factor)
        self.steps_done_in_epoch = 0
        self.resumed_meter: dict[str, Any] | None = None
        self.stop = StopRequest(config.preempt_exit_code)
        self.history: dict[str, Any] = {
            "train_time_s": 0.0, "samples": 0, "best": None, "best_epoch": 0, "skipped_steps": 0,
        }
        self.writer = MetricsWriter(
            config.run_dir / "metrics.jsonl", enabled=ctx.is_main,
            tensorboard_dir=config.run_dir / "tensorboard" if config.tensorboard else None,
            run_id=config.run_id,
        )
        self.hooks = Hooks([
            self.writer, Console(), StepProfiler(config, ctx, self.steps_per_epoch),
            *([Curves(sync=config.tracker != "none")] if config.curves else []),
            *tracker_hooks(config, ctx),
            *steering_hooks(config), *hooks,
        ])
        # Per data-parallel rank (dropout, user aug.): tensor-parallel peers draw alike, or
        # dropout on the activations they hold whole would differ between them.
        seed_process(config.seed + ctx.data_rank)
        kind = self.choice.checkpoint_kind_for(
            sum(p.numel() for p in self.module.parameters()), optimizer_slots(config)
        )
        self.checkpoints = Checkpointer(config, ctx, self.strategy, kind)
        self.evaluators = {  # the run's own validation set (""), then --val's
            name: Evaluator(
                self.module, self.call, self.scorer, self.precision, self.strategy, ctx,
                loader, self.memory_format,
                most_val_batches(self.val_sets[name], config.batch_size, ctx),
            ) for name, loader in self.val_loaders.items()
        }
        self.best_key, self.best_mode = ranking(config, self.task)  # --best_metric
        self.skips = SkippedSteps(config, ctx)  # --skip_steps, and the run's rollbacks
        self.resumed_from = restore(self)
        if config.init_from is not None and not started:
            initial_weights(self, config.init_from)
        self.last_inputs: Any = None  # model inputs of the newest micro-batch (FLOPs, fsdp eval)
        if config.compile:
            self.model = compile_pass(self.strategy, self.model)
        self.first_step_s: float | None = None
        self._t_fit = time.perf_counter()
        self.startup = run.startup or Phases(from_process_start=False)
        self.startup.mark("model")

    def _build_module(self, module: nn.Module | Callable[[], nn.Module] | None) -> nn.Module:
        """The user's module (an instance, or a factory of one), or the built-in one for
        the task's head, with identical initial weights on every rank. The strategy
        decides where it is built (fsdp: on the meta device); an instance is only moved."""
        cfg = self.config

        def build(device: torch.device) -> nn.Module:
            built = build_model(
                cfg, self.data, head_size(self.task, self.data.facts), device,
                task=self.task.name, model=module,
            )
            self.lora = adapt(built, cfg)  # --lora_rank: its adapters, the rest frozen
            mark_per_rank(built, cfg, module is None and device.type == "meta")
            return built

        if isinstance(module, nn.Module):
            return build(self.ctx.device)
        return self.strategy.build_module(build)

    @property
    def memory_format(self) -> torch.memory_format | None:
        return torch.channels_last if self.config.channels_last else None

    def _setup_data(self) -> None:
        cfg, ctx = self.config, self.ctx
        collate = self.data.collate
        self.val_sets = {"": self.data.val, **self.data.more_val}
        self.val_loaders = {
            name: make_val_loader(dataset, cfg, ctx, collate)
            for name, dataset in self.val_sets.items()
        }
        self.train_batches = make_train_batches(self.data.train, cfg, ctx, collate)
        self.steps_per_epoch = self.train_batches.steps_per_epoch
        # An iterable dataset without a length has no planned end: a constant LR.
        self.total_steps = self.steps_per_epoch * cfg.epochs or 2**62
        self.dynamic, self.targets_each = counting(self.task, self.data)  # (`train.forward`)
        self.nominal = float(cfg.batch_size * cfg.grad_accum_steps * ctx.data_world)

    # ------------------------------------------------------------------ state
    def meta_state(self, meter: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything a resume needs but the weights and optimizer state; RNG states of
        all ranks are gathered on rank 0. `meter` holds the epoch's global metric totals
        when saving mid-epoch. Collective."""
        return {
            "epoch_meter": meter or {},
            **self.progress.to_dict(),
            "scheduler_state_dict": self.scheduler.state_dict(),
            "scaler_state_dict": self.scaler.state_dict(),
            "task": self.task.name,
            "world_size": self.ctx.world_size,
            "config": self.config.to_dict(),
            "rng": gather_rng_states(self.ctx),
            "data_state": gather_to_main(self.train_batches.state_dict(), self.ctx),
            "hooks": self.hooks.state_dict(),
            "history": dict(self.history),
            "strategy_state": self.strategy.layout_state(),
            "steer": self.steer.state_dict(),
            **({"ema": {"decay": self.ema.decay}} if self.ema is not None else {}),
        }

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, Any]:
        cfg, ctx = self.config, self.ctx
        self.writer.start(
            keep_step=self.progress.step if self.resumed_from else None,
            keep_epoch=self.progress.epoch,
        )
        if ctx.is_main:
            log.info("plan\n%s", format_plan(self.plan(), cfg))
        self._t_fit = time.perf_counter()
        val: dict[str, float] = {}
        POSITION.update(run_dir=str(cfg.run_dir), progress=self.progress)  # (observe.hang)
        self.ended: dict[str, Any] | None = None  # rank 0: the checkpoint exported from
        last = 0 if "stop" in self.history else cfg.epochs  # a hook finished it (early stop)
        if ctx.is_main:  # before the first step: the exports are the final ones no more
            clear_finished(cfg.run_dir)
        try:
            with self.stop, StallWatch(cfg.run_dir, ctx.rank, ctx.world_size, cfg.timeout_s):
                self.hooks.on_fit_start(self)
                while (epoch := self.progress.epoch + 1) <= last:
                    try:
                        val = self._epoch(epoch)
                    except SteeredStop:
                        break
                    except SpikeRollback as spike:  # every rank, at the same row
                        roll_back(self, spike)
                        continue
                    if self.steer.agreed:
                        break
            self.checkpoints.close()
            if self.first_step_s is None:  # it had ended, its exports cut short: its figures
                val = self._validate()
                self.steer.agreed = self.steer.agreed or (self.history.get("stop") or {}).get(
                    "reason")
            summary = run_summary(self, val)
            if cfg.export == "best":
                summary["exported"] = take_best(self) or "last"
            with writing_exports(ctx.rank, cfg.run_dir):  # a full disk: one line, exit 74
                self._export()
                if ctx.is_main:
                    text = json.dumps(summary, indent=2) + "\n"
                    atomic_write_text(cfg.run_dir / "summary.json", text)
                    self.ended = ended_at(cfg.ckpt_dir, cfg.run_id)
            if ctx.is_main and self.steer.agreed:
                log.info("stopped early at step %d: %s; best epoch %d",
                         self.progress.step, self.steer.agreed, summary["best_epoch"])
            self.hooks.on_fit_end(self, summary)
        except BaseException:
            stop_workers(getattr(self.train_batches, "loader", None), *self.val_loaders.values())
            raise
        finally:
            self.hooks.close()
        if self.writer.failure:  # the last rows' flush: every rank finished, the end is whole
            raise RunLogError(self.writer.failure)
        return summary

    def _export(self) -> None:
        """`model.safetensors` and the rest, written by the ranks (`export_run`)."""
        model = self.config.model
        export_run(self.module, self.strategy, self.ctx, self.config.run_dir, lora=self.lora,
                   averaged=self.ema.swapped if self.ema is not None else None,
                   export_ema=self.config.export_ema, hf=is_hf_model(self.module),
                   source=hf_dir(model) if is_hf_ref(model) else None,
                   shard_bytes=int(self.config.export_shard_mb * 10**6))

    def _epoch(self, epoch: int) -> dict[str, float]:
        """Train one epoch, validate, checkpoint when due or when it is the best so far."""
        cfg, t0, history = self.config, time.perf_counter(), self.history
        train = self.train_epoch(epoch)
        val = self._validate()
        history["samples"] += train["samples"]
        history["train_time_s"] += time.perf_counter() - t0
        score = val.get(self.best_key, float("nan"))
        improved = history["best"] is None or improves(score, history["best"], self.best_mode)
        if improved:
            history["best"], history["best_epoch"] = score, epoch
        self.progress.epoch, self.progress.samples_in_epoch = epoch, 0
        self.hooks.on_row(self, {
            "split": "val", "epoch": epoch, "step": self.progress.step, **val,
            **{f"train_{k}": v for k, v in train.items() if k != "samples"},
            "epoch_time_s": time.perf_counter() - t0,
        })
        # A hook's stop, agreed once validation is seen (one small all-reduce an epoch).
        stop = self.steer.agree(self.ctx)
        if stop and self.steer.finish:
            history["stop"] = {"reason": self.steer.agreed, "epoch": epoch}
        due = epoch == cfg.epochs or (cfg.save_every and epoch % cfg.save_every == 0)
        if (due or improved or stop) and may_save(self):
            check_logs(self)
            self.save(best=improved)
        return val

    def train_epoch(self, epoch: int) -> dict[str, float]:
        self.model.train()
        meter = self._new_meter()
        self.steps_done_in_epoch = max(0, self.progress.step - (epoch - 1) * self.steps_per_epoch)
        self.hooks.on_epoch_start(self, epoch)
        sync = Sync(self.progress.step, self._sync_every)
        while True:  # once, unless --oom_backoff runs a window again at a smaller batch
            batches = self.train_batches.epoch(epoch, self.progress.samples_in_epoch)
            try:
                self._steps(epoch, meter, sync, batches)
            except BackedOff:
                continue  # the window again, from its first sample, at the new micro-batch
            finally:
                close = getattr(batches, "close", None)
                if close is not None:  # now: a window run again reads its batches afresh
                    close()
            break
        # A hook's stop agreed here waits for validation: the epoch ends as any other.
        totals, stop, _ = self._sync(sync, meter)
        if stop:
            save_mid_epoch(self, meter, totals, stop)
        return meter.sums.summarize(totals)

    def _steps(self, epoch: int, meter: EpochMeter, sync: Sync, batches: Any) -> None:
        """The epoch's optimizer steps, from the position reached."""
        cfg, backoff = self.config, self.backoff
        for batch, micro, waited in batches:
            meter.wait += waited
            sync.wait += waited
            skipped = self.skips.covers(self.progress.step + 1)  # read, not trained on
            if not skipped:
                self.last_inputs = (
                    backoff.micro_step(self, batch, micro, meter.sums) if backoff.armed
                    else forward_backward(self, batch, micro, meter.sums)
                )
            if not micro.ends_window:
                continue
            if backoff.armed:
                if not skipped:
                    backoff.window_done(self)  # every rank is past its micro-steps
                backoff.stepped()
            verdict = skipped_step(self) if skipped else optimizer_step(self, meter.sums)
            self.verdicts.settle(self.progress)  # the step before's: done on the device
            self.progress.step += 1
            self.verdicts.hold(self.progress.step, verdict, meter.sums)
            self.progress.samples_in_epoch = micro.position
            if self.first_step_s is None:
                self._first_step_done()
            self.hooks.on_step_end(self)
            step = self.progress.step
            if step % cfg.log_interval == 0:
                self.verdicts.settle(self.progress)
                sync.rows.append((meter.sums.snapshot(), self._row_head(epoch, meter)))
            save_now = bool(cfg.save_every_steps) and step % cfg.save_every_steps == 0
            # One process needs no agreement: a stop request is acted on at once.
            requested = self._stopping() or self.steer.requested
            alone_stopping = requested and not self.ctx.distributed
            if save_now or sync.due(step) or alone_stopping:
                totals, stop, flags = self._sync(sync, meter)
                steered = not stop and self.steer.agree(self.ctx, flags)
                if save_now or stop or steered:
                    save_mid_epoch(self, meter, totals, stop, steered)

    def _row_head(self, epoch: int, meter: EpochMeter) -> tuple[dict[str, Any], Any]:
        """What a train row takes from the step it is logged at, and the interval's timing."""
        head = {
            "split": "train", "epoch": epoch, "step": self.progress.step,
            "lr": self.optimizer.param_groups[0]["lr"], "bad_steps": self.progress.bad_steps,
            **peak_fields(self.ctx),
        }
        return head, meter.mark(self.progress.step)

    def _sync(
        self, sync: Sync, meter: EpochMeter
    ) -> tuple[list[float], bool, tuple[bool, bool]]:
        """One all-reduce of the metric totals at every log point since the last sync and
        of those now, with the stop requests and the ranks' step time: writes those train
        rows, sets when the next sync is due; returns (the totals now, whether a signal
        stops the run, the hooks' (stop, finish) flags of all ranks)."""
        self.verdicts.settle(self.progress)  # the newest step counts in the totals
        step, now = self.progress.step, time.perf_counter()
        steps = step - sync.step
        step_s = (now - sync.t) / steps if steps else 0.0
        snapshots = [snap for snap, _ in sync.rows] + [meter.sums.snapshot()]
        totals, (stop, steer, finish), mean_step_s, waits = reduce_snapshots(
            self.ctx, snapshots, (self._stopping(), self.steer.requested, self.steer.finish),
            step_s, own=(sync.wait / steps if steps else 0.0,),
        )
        if steps:
            self.stragglers.update([w for (w,) in waits], mean_step_s, self.ctx)
        slow = self.stragglers.now()
        for (_, (head, mark)), row_totals in zip(sync.rows, totals, strict=False):
            row = {**head, **meter.row(row_totals, mark), **({"stragglers": slow} if slow else {})}
            row.update(gpu_fields(
                self.flops_model, self.last_inputs, row["samples_per_sec"], self.ctx,
                self.precision.dtype,
            ))
            self.hooks.on_row(self, row)
        if steps and mean_step_s > 0:  # the same on every rank: it was all-reduced
            self._sync_every = max(1, min(MAX_SYNC_STEPS, round(SYNC_EVERY_S / mean_step_s)))
        sync.restart(step, self._sync_every)
        return totals[-1], stop, (steer, finish)

    def _first_step_done(self) -> None:
        self.first_step_s = time.perf_counter() - self._t_fit
        self.startup.mark("first step")
        if self.ctx.is_main:
            log.info("%s", self.startup.line())

    def plan(self) -> RunPlan:
        """The run's arithmetic (see `ddptrain.train.plan`)."""
        return plan_of(self)

    def _stopping(self) -> bool:
        """A stop to agree on at the next sync: a signal, or a log that rank 0 cannot write."""
        return self.stop.requested or self.writer.failure is not None

    def _new_meter(self) -> EpochMeter:
        meter = EpochMeter(MetricSums(self.task, self.ctx.device, self.routing),
                           self.progress.step)
        saved, self.resumed_meter = self.resumed_meter, None
        if saved:  # mid-epoch resume: the epoch's figures continue from the checkpoint
            meter.restore(saved, self.ctx.is_main)
        return meter

    def _validate(self) -> dict[str, float]:
        """The epoch's validation figures, the EMA weights' as `ema_*` (collective)."""
        val = self.evaluate()
        if self.ema is not None:
            self.checkpoints.settle()  # the swap writes the weights a save may be copying
            with self.ema.swapped():
                val.update({f"ema_{k}": v for k, v in self.evaluate().items() if k != "samples"})
        return val

    def evaluate(self) -> dict[str, float]:
        """The task's figures over every validation sample exactly once (collective): the
        run's own set's as they are, each `--val` set's as NAME/METRIC."""
        figures: dict[str, float] = {}
        for name, evaluator in self.evaluators.items():
            figures.update(named_figures(name, evaluator.run(self.last_inputs)))
        return figures

    def save(self, meter: dict[str, Any] | None = None, best: bool = False) -> None:
        """Checkpoint the run where it stands (collective)."""
        path = self.checkpoints.save(
            self.progress.step, self.meta_state(meter), self.module, self.optimizer, best,
            self.ema.state() if self.ema is not None else None,
        )
        log.info(
            "checkpoint %s%s%s", path, " (best so far)" if best else "",
            " (being written in the background)" if self.checkpoints.background else "",
        )
