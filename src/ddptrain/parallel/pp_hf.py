"""Pipeline stages of a Hugging Face decoder-only language model (`--model hf:DIR --pp P`).

    torchrun --nproc_per_node=2 -m ddptrain train --model hf:models/tiny-llama --pp 2 ...

Llama-style models (Llama, Qwen2, Mistral: a base model of `embed_tokens`, `layers`,
`norm` and `rotary_emb`, and an `lm_head`) are cut as the built-in GPT is: the units are
the embedding, each decoder layer, and the final norm with the head, spread evenly over
the stages. Every stage holds the rotary embedding (buffers only) and computes the
positions and the causal mask of its sequence as the base model's own forward does
(`create_causal_mask`: none under SDPA, whose causal flag does it), so a stage's layers
see what they see in the whole model. A tied head is the first and last stages' shared
tensor (`pp`).

Models whose layers do not all attend causally over the whole sequence (sliding-window
layers) are refused: give `--pp_split`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddptrain.errors import ConfigError
from ddptrain.parallel.cp import of as context_of

_BASE_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def is_hf_decoder(module: nn.Module) -> bool:
    """Whether `module` is a transformers decoder-only model this split handles."""
    base = getattr(module, "base_model", None)
    if base is None or not hasattr(module, "lm_head"):
        return False
    if not all(hasattr(base, part) for part in _BASE_PARTS):
        return False
    return _full_attention(getattr(module, "config", None))


def _full_attention(config: Any) -> bool:
    kinds = getattr(config, "layer_types", None) or ["full_attention"]
    return set(kinds) == {"full_attention"}


def check_hf_stages(config: Any, stages: int, what: str) -> None:
    """Before the process group, from the model's config alone: a model this split cannot
    cut, or more stages than it has units, is one line."""
    layers = getattr(config, "num_hidden_layers", None)
    if getattr(config, "model_type", None) == "gpt2" or not isinstance(layers, int) or (
        not _full_attention(config)
    ):
        raise ConfigError(
            f"--pp: ddptrain splits the built-in GPT and Llama-style Hugging Face models, and "
            f"{what} is a {getattr(config, 'model_type', 'model')!r} model: give --pp_split "
            "package.module:fn, fn(model, stage, stages) returning the stage's module"
        )
    units = layers + 2
    if units < stages:
        raise ConfigError(
            f"{what} has {layers} layers, {units} units with its embedding and head, and "
            f"--pp asks for {stages} stages: use at most {units} stages"
        )


class HFDecoderStage(nn.Module):
    """One stage of a Llama-style model: its share of the units, the model's own modules."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        base: Any = model.base_model
        layers = list(base.layers)
        units = len(layers) + 2
        lo, hi = stage * units // stages, (stage + 1) * units // stages
        self.first, self.last = lo == 0, hi == units
        self.blocks = nn.ModuleList(layers[max(lo - 1, 0):min(hi - 1, len(layers))])
        self.rotary_emb = base.rotary_emb
        self.base_config = base.config
        if self.first:
            self.embed_tokens = base.embed_tokens
        if self.last:
            self.norm, self.lm_head = base.norm, model.lm_head
        self.split = context_of(model)  # --cp: the slice's positions are its rank's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        h = self.embed_tokens(x) if self.first else x
        t = h.size(1)
        positions = (torch.arange(t, device=h.device) if self.split is None
                     else self.split.positions(t, h.device)).unsqueeze(0)
        mask = create_causal_mask(config=self.base_config, inputs_embeds=h,
                                  attention_mask=None, cache=None, position_ids=positions)
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.blocks:
            out = layer(h, attention_mask=mask, position_ids=positions,
                        position_embeddings=rotary)
            h = out[0] if isinstance(out, tuple) else out
        if self.last:
            h = self.lm_head(self.norm(h))  # type: ignore[operator]
        return h
