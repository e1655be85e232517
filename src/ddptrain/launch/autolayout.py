"""`--layout auto` and `--batch_size auto`: the layout and micro-batch `ddptrain plan`
ranks first, chosen at launch for this job's world and its device's memory.

    torchrun --nproc_per_node 8 -m ddptrain train --dataset corpus.npz --model gpt \\
        --layout auto --batch_size auto --global_batch_size 256

`--layout auto` chooses the strategy (ddp, zero, fsdp, HSDP), `--tp`, `--pp`, `--ep`,
activation checkpointing and the micro-batch; `--batch_size auto` alone keeps the layout
the flags name and chooses its micro-batch. `--batch_size auto` also arms `--oom_backoff`
(an out-of-memory in the first steps halves the micro-batch) where the layout chosen
allows it (`train.backoff`). Either keeps the global batch: `--global_batch_size`,
else the flags' micro-batch x accumulation x data-parallel ranks. Every rank plans the
same way from the same figures (the device's total memory, not what is free now) and so
chooses the same. The choice is one line on rank 0 and is what config.yaml records; a
resume of the run keeps it (read back from config.yaml) while it divides the world.

Only language models are planned (`--model gpt` or `hf:DIR` on token data): the step
measured is a language model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any

import torch

from ddptrain.config import TrainingConfig
from ddptrain.config_checks import AUTO_BATCH
from ddptrain.errors import ConfigError
from ddptrain.layout import Layout

log = logging.getLogger("ddptrain")

AUTO = AUTO_BATCH  # `--batch_size auto`, as the config holds it
# What the choice sets, and what config.yaml gives back to a resume
CHOSEN = ("strategy", "dp_replicate", "tp", "pp", "ep", "cp", "activation_checkpointing",
          "batch_size", "grad_accum_steps")
# A CPU rank's rough figures for the ranking (FLOP/s; GB/s over loopback and a network;
# seconds a collective call costs beyond its bytes, gloo's and the Python around it)
CPU_CARD = (5e10, 2.0, 1.0)
CPU_LATENCY_S = 1e-3


def wanted(config: TrainingConfig) -> bool:
    return config.layout == "auto" or config.batch_size == AUTO


def choose(config: TrainingConfig, vocab_size: int | None, world: int, local_world: int,
           device: torch.device, own_model: bool, iterable: bool = False) -> TrainingConfig:
    """`config` with the planned layout and micro-batch (the module's docstring);
    `iterable`: the training set is an iterable dataset (no backoff)."""
    _refuse_what_cannot_be_planned(config, vocab_size, own_model)
    kept = _kept(config, world)
    if kept is not None:
        return kept
    from ddptrain.launch.planner import lm_model, plan
    from ddptrain.models.factory import GPT_ARGS
    from ddptrain.observe.flops import count_flops

    batch = _global_batch(config, world)
    name = "gpt" if config.model == "auto" else config.model
    model_args = config.model_args if name != "gpt" else {
        k: v for k, v in config.model_args.items() if k in GPT_ARGS}
    assert vocab_size is not None  # refused above
    model = lm_model(name, model_args, vocab_size, config.block_size, config.width,
                     count_flops)
    nodes, per_node = (world // local_world, local_world) if world % local_world == 0 \
        else (1, world)
    card = _card(config, device, local_world)
    args = argparse.Namespace(
        nodes=nodes, gpus_per_node=per_node, block_size=config.block_size,
        optimizer=config.optimizer, margin=0.1, mfu=0.4, use_amp=config.use_amp,
        amp_dtype=config.amp_dtype, latency_s=2e-5 if device.type == "cuda" else CPU_LATENCY_S)
    fits, over = plan(args, model, world, batch, card)
    if config.layout != "auto":  # the flags' layout: only its micro-batch is chosen
        fits = [p for p in fits if _same_layout(p.candidate, config)]
    if not fits:
        from ddptrain.launch.planner import nothing_fits

        what = "layout" if config.layout == "auto" else "micro-batch of this layout"
        raise ConfigError(f"--{'layout' if config.layout == 'auto' else 'batch_size'} auto: "
                          f"no {what} fits: " + nothing_fits(over, card[0], 0.1))
    best = fits[0].candidate
    chosen = dataclasses.replace(
        config, strategy=best.strategy, dp_replicate=best.dp_replicate, tp=best.tp,
        pp=best.pp, ep=best.ep, cp=best.cp,
        activation_checkpointing=best.recompute,  # type: ignore[arg-type]
        batch_size=best.micro, grad_accum_steps=best.accum,
    )
    if config.batch_size == AUTO and not config.oom_backoff:
        chosen = dataclasses.replace(chosen, oom_backoff=_can_back_off(
            chosen, world, local_world, device, iterable, bool(model.experts)))
    left = sorted({p.name for p in over} - {p.name for p in fits})
    log.info("%s auto: %s, micro-batch %d x accumulation %d (a rank's peak %.3g GiB of "
             "%.3g GiB; predicted %.3g ms a step, the fastest of %d that fit%s)",
             "layout" if config.layout == "auto" else "batch_size", fits[0].name, best.micro,
             best.accum, fits[0].memory["total"] / 2**30, card[0], fits[0].step_s * 1e3,
             len(fits), f"; over the memory: {', '.join(left)}" if left else "")
    return chosen


def _can_back_off(config: TrainingConfig, world: int, local_world: int,
                  device: torch.device, iterable: bool, experts: bool) -> bool:
    """Whether `--oom_backoff` can run with the layout chosen (`train.backoff`)."""
    from ddptrain.parallel import resolve_strategy
    from ddptrain.train.backoff import unsupported

    name = resolve_strategy(config, world, device, local_world).name
    routed = experts and config.moe_aux_scope == "global" and world > 1
    return unsupported(config, name, iterable, routed_globally=routed) is None


def _refuse_what_cannot_be_planned(config: TrainingConfig, vocab_size: int | None,
                                   own_model: bool) -> None:
    flag = "--layout auto" if config.layout == "auto" else "--batch_size auto"
    name = config.model
    if own_model or not (name in ("auto", "gpt") or name.startswith("hf:")) or not vocab_size:
        raise ConfigError(f"{flag} plans a language model (--model gpt or hf:DIR on token "
                          "data): name the layout and --batch_size for this one")


def _global_batch(config: TrainingConfig, world: int) -> int:
    if config.global_batch_size is not None:
        return config.global_batch_size
    return config.batch_size * config.grad_accum_steps * Layout.of(config, world).data_parallel


def _same_layout(c: Any, config: TrainingConfig) -> bool:
    return (c.strategy, c.dp_replicate, c.tp, c.pp, c.ep, c.cp, c.recompute) == (
        config.strategy, config.dp_replicate, config.tp, config.pp, config.ep, config.cp,
        config.activation_checkpointing)


def _card(config: TrainingConfig, device: torch.device, local_world: int
          ) -> tuple[float, float, float, float]:
    """(GiB a rank may hold, FLOP/s, GB/s inside a node, GB/s between nodes)."""
    from ddptrain.launch.planner import GPUS

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory / 2**30
        known = next((figures for card, figures in GPUS.items() if card in name), None)
        _, peak, intra, inter = known or (0.0, 989e12, 100.0, 25.0)
    else:
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory = pages / 2**30 / max(1, local_world)
        peak, intra, inter = CPU_CARD
    return (config.device_memory or memory, peak, intra, inter)


def _kept(config: TrainingConfig, world: int) -> TrainingConfig | None:
    """A resumed run's choice, from its config.yaml, while it still divides `world`."""
    from ddptrain.config_cli import load_yaml

    if config.resume_from is None or config.output_dir is None:
        return None
    path = config.run_dir / "config.yaml"
    if not path.is_file() or path.is_symlink():
        return None
    try:
        saved = load_yaml(str(path))
    except ConfigError:
        return None
    if saved.get("layout") != config.layout or saved.get("batch_size") in (None, AUTO):
        return None
    kept = dataclasses.replace(config, **{k: saved[k] for k in CHOSEN if k in saved})
    layout = Layout.of(kept, world)
    if world % (kept.tp * kept.dp_replicate * kept.pp * kept.cp) or (
        _global_batch(config, world) != kept.batch_size * kept.grad_accum_steps
        * layout.data_parallel):
        return None  # another world: planned again
    log.info("%s auto: kept from the run's config.yaml (%s)",
             "layout" if config.layout == "auto" else "batch_size",
             " ".join(f"--{k} {getattr(kept, k)}" for k in CHOSEN))
    return kept


__all__ = ["AUTO", "choose", "wanted"]
