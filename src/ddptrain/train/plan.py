"""The run's arithmetic, stated before the first step (and by `--dry_run`).

    ddptrain train --dataset breast_cancer --batch_size 8 --drop_last --dry_run
    torchrun --standalone --nproc_per_node=2 -m ddptrain train --drop_last --batch_size 8 --dry_run

World size, strategy, device, precision; per-rank and global batch; how an epoch's samples
fall on ranks and batches and how many are dropped (and why); optimizer steps per epoch
and in total; peak and effective learning rate; warm-up; checkpoint cadence; the bytes
per rank and the largest model each strategy fits on one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ddptrain.config import TrainingConfig
from ddptrain.data import DataBundle, samples_dropped, steps_per_epoch
from ddptrain.observe.flops import meta_shadow
from ddptrain.observe.startup import Phases
from ddptrain.parallel import StrategyChoice, resolve_strategy
from ddptrain.parallel.lora import adapt, nf4_freed
from ddptrain.parallel.memory import format_bytes, human_bytes, human_count, optimizer_slots
from ddptrain.parallel.parts import freeze
from ddptrain.train.optim import peak_lr
from ddptrain.train.precision import Precision, resolve_precision
from ddptrain.train.tasks import LanguageModel, ModelLoss, Task, resolve_task

if TYPE_CHECKING:
    from ddptrain.train.trainer import Trainer


@dataclass(frozen=True)
class Resolved:
    """What a `Trainer` is built from, each part resolved once before the process group
    starts (`ddptrain.fit`: `api.resolve_run`); the trainer resolves nothing again."""

    config: TrainingConfig
    precision: Precision
    strategy: StrategyChoice
    data: DataBundle
    task: Task
    # The start-up's phases so far (`fit`: from the process's start); by hand: from the
    # trainer's construction.
    startup: Phases | None = None


def resolve(
    config: TrainingConfig, data: DataBundle, world_size: int, device: torch.device,
    task: Task | None = None,
) -> Resolved:
    """The parts of a trainer built by hand (a test, a benchmark), resolved by the
    functions `ddptrain.fit` resolves them with."""
    return Resolved(
        config, resolve_precision(config, device), resolve_strategy(config, world_size, device),
        data, task or resolve_task(config, data.facts),
    )


@dataclass(frozen=True)
class RunPlan:
    world_size: int
    strategy: str
    device: str
    backend: str
    precision: str
    task: str
    parameters: int | None
    batch_size: int  # per rank, per micro-batch
    accum: int
    global_batch: int  # samples per optimizer step, all ranks
    train_samples: int | None  # None: an iterable dataset without a length
    dropped: int
    batches_per_rank: int | None
    steps_per_epoch: int | None
    total_steps: int | None
    base_lr: float
    peak_lr: float
    warmup_steps: float | None
    checkpoints: str
    rank_bytes: dict[str, int] | None = None  # implied by the strategy (fp32 master state)
    device_bytes: int | None = None  # one rank's device memory (CPU: the host's share)
    largest: dict[str, int] | None = None  # parameters ddp, zero and fsdp fit in it
    classes: str | None = None  # "10 (dataset.classes)": how many, and who said so
    data_ranks: int | None = None  # ranks with their own batches, when not every rank (--tp)
    frozen: int | None = None  # parameters --freeze keeps from training (None: no model yet)
    groups: tuple[str, ...] = ()  # the optimizer's parameter groups, one line each
    trained_bytes: int | None = None  # of the trained parameters (LoRA's adapters), on rank 0
    experts: tuple[int, int] | None = None  # a mixture's expert parameters, their bytes on rank 0

    @property
    def samples_per_epoch(self) -> int | None:
        return None if self.train_samples is None else self.train_samples - self.dropped


def make_plan(
    config: TrainingConfig, data: DataBundle, world_size: int, device: str, backend: str,
    precision: str, task: str, parameters: int | None, strategy: StrategyChoice,
    steps: int | None = None, frozen: int | None = None, groups: list[str] | None = None,
    trained_bytes: int | None = None, experts: tuple[int, int] | None = None,
    freed: int = 0,
) -> RunPlan:
    """`steps`: optimizer steps per epoch as the trainer's batches counted them (derived
    from the data when no trainer exists yet: the dry run); `frozen`: the parameters that
    do not train (--freeze's, a LoRA run's base: no gradients, no optimizer state);
    `freed`: the bytes `--lora_quantize`'s 4-bit base saves (`parallel.lora.nf4_freed`)."""
    cfg, b, k = config, config.batch_size, config.grad_accum_steps
    # Ranks that split a model (--tp) share one batch: the data is split over the others.
    w = strategy.layout.data_parallel if strategy.layout else world_size
    try:
        n: int | None = len(data.train)  # type: ignore[arg-type]
    except TypeError:
        n = None
    dropped = samples_dropped(n, w, b, cfg.drop_last) if n else 0
    batches = math.ceil((n - dropped) / (w * b)) if n else None
    spe = steps or (steps_per_epoch(n, w, b, k, cfg.drop_last) if n else None)
    cadence = [f"every {cfg.save_every} epoch(s)" if cfg.save_every else "at the end"]
    if cfg.save_every_steps:
        cadence.append(f"every {cfg.save_every_steps} steps")
    if cfg.keep_last:
        cadence.append(f"keeping the newest {cfg.keep_last}")
    return RunPlan(
        world_size=world_size, strategy=strategy.label, data_ranks=w,
        device=device, backend=backend, precision=precision, task=task,
        parameters=parameters, batch_size=b, accum=k, global_batch=w * b * k,
        train_samples=n, dropped=dropped, batches_per_rank=batches, steps_per_epoch=spe,
        total_steps=spe * cfg.epochs if spe is not None else None, base_lr=cfg.lr,
        peak_lr=peak_lr(cfg, w), warmup_steps=cfg.warmup_epochs * spe if spe else None,
        checkpoints=", ".join(cadence) + f" {_kind(strategy, parameters, cfg)} into {cfg.ckpt_dir}",
        rank_bytes=None if parameters is None else strategy.rank_bytes(
            parameters, optimizer_slots(cfg), None if frozen is None else parameters - frozen,
            freed, experts[0] if experts else 0,
        ),
        device_bytes=strategy.device_bytes, largest=strategy.largest_models(optimizer_slots(cfg)),
        classes=_classes(data, task), frozen=frozen, groups=tuple(groups or ()),
        trained_bytes=trained_bytes, experts=experts,
    )


def as_trained(model: nn.Module, config: TrainingConfig) -> tuple[nn.Module, int | None, int]:
    """`model` as the run trains it, on a meta-device copy (a model of any size, the given
    one left as it is): `--lora_rank`'s adapters added, the rest and `--freeze`'s
    parameters frozen, as the trainer makes it (`adapt`, `parallel.parallelize`); with the
    parameters that do not train and the bytes `--lora_quantize`'s 4-bit base saves, for
    a plan made before any trainer (the dry run's): gradients and optimizer state of the
    trained parameters alone."""
    shadow = meta_shadow(model)
    if shadow is None:  # cannot be copied: counted as it is, all of it trained
        return model, None, 0
    spec = adapt(shadow, config)
    freeze(shadow, config.freeze)
    frozen = sum(p.numel() for p in shadow.parameters() if not p.requires_grad)
    return shadow, frozen, nf4_freed(shadow, spec, config)


def _classes(data: DataBundle, task: str) -> str | None:
    facts = data.facts
    if facts.num_classes is None or facts.target_is_float or facts.classes_from is None:
        return None
    if task == LanguageModel.name:  # --num_classes sizes an lm's vocabulary
        return f"vocabulary of {facts.num_classes:,} tokens (from {facts.classes_from})"
    return f"{facts.num_classes} classes (from {facts.classes_from})"


def _task(name: str) -> str:
    if name == ModelLoss.name:
        return "the model's own loss (the batches hold no 'labels')"
    return name


def _kind(strategy: StrategyChoice, parameters: int | None, cfg: TrainingConfig) -> str:
    if parameters is None:
        return strategy.checkpoint_kind
    return strategy.checkpoint_kind_for(parameters, optimizer_slots(cfg))


def _n(value: int | float | None) -> str:
    if value is None:
        return "unknown (the dataset has no length)"
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def format_plan(plan: RunPlan, config: TrainingConfig) -> str:
    """The plan as lines a person reads top to bottom."""
    w, b, k = plan.data_ranks or plan.world_size, plan.batch_size, plan.accum
    if plan.dropped:
        why = f" (--drop_last: the last {plan.dropped} do not fill a global batch of {w * b})"
    elif config.drop_last:
        why = " (--drop_last, but the epoch divides evenly)"
    else:
        why = " (the last global batch is shorter and split as evenly as it goes)"
    scaling = f" = {plan.base_lr:g} x {w * k} (--scale_lr)" if config.scale_lr else ""
    per_rank = None if plan.train_samples is None else plan.samples_per_epoch
    lines = [
        f"world size      {plan.world_size} ({plan.strategy}), {plan.device}, "
        f"backend {plan.backend}, {plan.precision}",
        f"task            {_task(plan.task)}"
        + (f", {plan.classes}" if plan.classes is not None else "")
        + (f", {plan.parameters:,} parameters" if plan.parameters is not None else ""),
        f"batch           {b} per rank x {k} accumulation step(s) x {w} "
        f"{'data-parallel ' if w != plan.world_size else ''}rank(s) = "
        f"{plan.global_batch} samples per optimizer step",
        f"training data   {_n(plan.train_samples)} samples; per epoch {_n(per_rank)} trained, "
        f"{plan.dropped} dropped{why}",
        f"per epoch       {_n(plan.batches_per_rank)} batches per rank, "
        f"{_n(None if plan.batches_per_rank is None else plan.batches_per_rank * w)} in all, "
        f"{_n(plan.steps_per_epoch)} optimizer steps",
        f"in total        {config.epochs} epochs, {_n(plan.total_steps)} optimizer steps",
        f"learning rate   peak {plan.peak_lr:g}{scaling}; warm-up "
        f"{_n(plan.warmup_steps)} steps, then cosine to 0",
        f"checkpoints     {plan.checkpoints}",
    ]
    if plan.frozen is not None and plan.parameters is not None:
        base = (", the adapted layers' weights in 4-bit nf4" if config.lora_quantize != "off"
                else "")
        why = (f" (LoRA adapters of rank {config.lora_rank} train, the model is frozen{base})"
               if config.lora_rank else " (--freeze)" if plan.frozen else "")
        held = ("" if plan.trained_bytes is None or plan.world_size == 1
                else f" ({human_bytes(plan.trained_bytes)} of them on rank 0)")
        lines.append(f"trained         {plan.parameters - plan.frozen:,} parameters{held}, "
                     f"{plan.frozen:,} frozen{why}")
    if plan.experts is not None and plan.parameters:
        in_experts, on_rank0 = plan.experts
        lines.append(f"experts         {in_experts:,} parameters in the experts "
                     f"({100 * in_experts / plan.parameters:.0f}% of the model; "
                     f"{human_bytes(on_rank0)} of them on rank 0)")
    if plan.groups:
        lines.append(f"optimizer       {_optimizer_name(config)}, {len(plan.groups)} "
                     "parameter group(s):")
        lines.extend(f"  group {i}       {line}" for i, line in enumerate(plan.groups))
    if plan.rank_bytes is not None:
        lines.insert(2, f"memory          {format_bytes(plan.rank_bytes)} ({plan.strategy})")
    if plan.largest is not None and plan.device_bytes is not None:
        fits = ", ".join(
            f"{name} ~{human_count(n)}" + (" params" if i == 0 else "")
            for i, (name, n) in enumerate(plan.largest.items())
        )
        lines.insert(3, f"largest model   per device of {human_bytes(plan.device_bytes)}: {fits} "
                        f"({_optimizer_name(config)}, fp32; activations not counted)")
    return "\n".join(lines)


def _optimizer_name(config: TrainingConfig) -> str:
    if config.optimizer not in ("sgd", "adamw"):
        return config.optimizer
    if config.optimizer == "adamw":
        return "AdamW"
    return "SGD with momentum" if config.momentum else "SGD"


def plan_of(trainer: Trainer) -> RunPlan:
    """A built trainer's run plan (`Trainer.plan`)."""
    from ddptrain.models.moe import expert_parameters
    from ddptrain.parallel.base import nbytes

    module = trainer.module
    experts = expert_parameters(module)
    return make_plan(
        trainer.config, trainer.data, trainer.ctx.world_size, str(trainer.ctx.device),
        trainer.ctx.backend or "none", trainer.precision.describe(), trainer.task.name,
        trainer.parameter_count, trainer.choice, trainer.steps_per_epoch,
        frozen=trainer.frozen, groups=trainer.optimization.lines,
        freed=nf4_freed(module, trainer.lora, trainer.config),
        trained_bytes=sum(nbytes(p) for p in module.parameters() if p.requires_grad),
        experts=(sum(p.numel() for p in experts), sum(nbytes(p) for p in experts))
        if experts else None,
    )
