"""The weights a run starts from, after the strategy has wrapped or sharded the module:
a Hugging Face directory read per rank (`--model hf:DIR` built on the meta device), the
4-bit base of `--lora_quantize`, and `--init_from`.

    trainer: build -> setup_module -> fill_start -> optimizer ... -> restore -> initial_weights
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from ddptrain.checkpoint.init import fill_pretrained, holds_safetensors, load_initial_weights
from ddptrain.config import TrainingConfig
from ddptrain.models import hf_dir, is_hf_ref
from ddptrain.models.hf import renames_weights
from ddptrain.parallel.base import FILLED_BY_BUILDER
from ddptrain.parallel.lora import quantize_base

if TYPE_CHECKING:
    from ddptrain.train.trainer import Trainer

log = logging.getLogger("ddptrain")


def mark_per_rank(built: nn.Module, config: TrainingConfig, on_meta: bool) -> None:
    """`--model hf:DIR` built on the meta device from safetensors whose names are the
    model's: no whole copy anywhere, each rank reads its part after `setup_module`."""
    if (on_meta and is_hf_ref(config.model) and holds_safetensors(hf_dir(config.model))
            and not renames_weights(built)):
        setattr(built, FILLED_BY_BUILDER, True)


def fill_start(trainer: Trainer) -> bool:
    """Collective where it reads. Fill what the strategy allocated empty (a marked model),
    then `--lora_quantize`'s base: quantized from the weights the run starts with
    (`--init_from`'s, loaded first, even on a resume: a checkpoint holds the base
    dequantized, and each start makes the same 4-bit base again). Returns whether the
    base was quantized (`--init_from` then is loaded already)."""
    config, module = trainer.config, trainer.module
    if getattr(module, FILLED_BY_BUILDER, False):
        fill_pretrained(
            module, trainer.flops_model, config.model, trainer.ctx, config.seed,
            trainer.strategy.ties(module), read=not (config.init_from and config.init_strict),
        )
    if config.lora_quantize == "off" or trainer.lora is None:
        return False
    if config.init_from is not None:
        _load(trainer, config.init_from)
    freed = quantize_base(module, trainer.lora)
    log.info("--lora_quantize %s: the adapted layers' frozen weights in 4 bits (%.1f MB "
             "freed on this rank)", config.lora_quantize, freed / 2**20)
    return True


def initial_weights(trainer: Trainer, source: str) -> None:
    """`--init_from`: the weights a fresh run starts from; a resumed run keeps its own."""
    if trainer.resumed_from is not None:
        log.info("--init_from %s is ignored: the run resumes from %s (a run that goes on "
                 "never re-initialises)", source, trainer.resumed_from)
        return
    _load(trainer, source)
    if trainer.ema is not None:  # the average starts from the weights the run starts from
        trainer.ema = type(trainer.ema)(trainer.module, trainer.ema.decay)


def _load(trainer: Trainer, source: str) -> None:
    load_initial_weights(trainer.module, Path(source), trainer.ctx,
                         trainer.config.init_strict, trainer.strategy.ties(trainer.module))
