"""A small GPT-style decoder-only transformer, written with plain `torch.nn`.

The layout follows nanoGPT: token and learned position embeddings, a stack of pre-LayerNorm
`Block`s (causal self-attention, then a 4x GELU MLP, each with a residual connection), a
final LayerNorm and a language-model head whose weight is tied to the token embedding.

Each transformer layer is one `Block` instance so that sharding wrappers can treat every
`Block` as a unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ddptrain.data.pack import document_mask
from ddptrain.models.moe import MoE

DEFAULT_N_LAYER = 2
DEFAULT_N_HEAD = 4


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a `GPT`: vocabulary, context length and transformer size."""

    vocab_size: int
    block_size: int  # longest sequence (context length) the position embedding covers
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    experts: int = 0  # > 0: each block's MLP a mixture of this many experts (`moe.MoE`)
    top_k: int = 2  # ... each token going to this many of them

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.experts and not (self.experts >= 2 and 1 <= self.top_k <= self.experts):
            raise ValueError(f"experts={self.experts} top_k={self.top_k}: a mixture needs at "
                             "least 2 experts and 1 <= top_k <= experts")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and earlier ones.

    q, k and v come from one projection, `qkv`, whose output (and weight rows) is laid out
    head by head: head h's q, then its k, then its v, `head_dim` each. A contiguous share
    of the rows is then whole heads, so tensor parallelism splits it by rows like any
    column-parallel linear (`ddptrain.parallel.tp`) and each rank computes its own heads
    with no collective. The module computes as many heads as its projection's output
    holds: all of them, or a tp rank's share."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        # One projection for q, k and v: a single larger matmul is cheaper than three.
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.register_load_state_dict_pre_hook(self._from_fused_rows)
        # --cp: the ranks that split each sequence (`parallel.cp`); attention over theirs
        self.context_parallel: Any = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: (B, 1, T, T) bool, where each position may attend (causal within each
        packed document: `data.pack.document_mask`); None: causal over the whole window."""
        b, t, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.size(-1) // (3 * self.head_dim)
        # (B, T, heads, 3, head_dim) -> three (B, heads, T, head_dim): the layout
        # scaled_dot_product_attention takes.
        q, k, v = (z.transpose(1, 2) for z in qkv.view(b, t, heads, 3, self.head_dim).unbind(3))
        dropout = self.dropout if self.training else 0.0
        if self.context_parallel is not None:  # the whole sequence's mask is its own
            y = self.context_parallel.attention(q, k, v, dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                               is_causal=mask is None)
        y = y.transpose(1, 2).contiguous().view(b, t, heads * self.head_dim)
        return self.resid_dropout(self.c_proj(y))

    def _from_fused_rows(self, _module: nn.Module, state: dict[str, Any], prefix: str,
                         *_: Any) -> None:
        """Reads a state saved when the projection was `c_attn`, its rows all the q heads,
        then all k, then all v: the same weights, reordered head by head under the new name."""
        for kind in ("weight", "bias"):
            old = state.pop(f"{prefix}c_attn.{kind}", None)
            if old is not None:
                rows = old.unflatten(0, (3, -1, self.head_dim))  # (3, n_head, head_dim, ...)
                state[f"{prefix}qkv.{kind}"] = rows.transpose(0, 1).reshape(old.shape)


class MLP(nn.Module):
    """Position-wise feed-forward layer: widen 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer layer: pre-LayerNorm attention and MLP, each added to the residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp: nn.Module = MLP(config) if not config.experts else MoE(
            config.n_embd, 4 * config.n_embd, config.experts, config.top_k, config.dropout,
            out_std=0.02 / math.sqrt(2 * config.n_layer),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # the mask only when there is one: tp's sequence-parallel plan prepares one input
        x = x + (self.attn(self.ln_1(x)) if mask is None else self.attn(self.ln_1(x), mask))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model mapping token ids (B, T) to next-token logits (B, T, V)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: input and output embeddings share one matrix, which saves
        # vocab_size * n_embd parameters and generally helps small language models.
        self.lm_head.weight = self.wte.weight
        self.context_parallel: Any = None  # --cp: positions of this rank's slice (`parallel.cp`)
        self.apply(self._init_weights)  # the experts' batched weights keep their own
        # GPT-2 scaling: each residual projection is shrunk by 1/sqrt(2 * n_layer) so the
        # residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Distinct trainable parameters (the tied embedding/head matrix counted once)."""
        # named_parameters() already yields a shared tensor once.
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`position_ids` (B, T): packed documents (`--pack`), each counted from 0 and
        attending only within itself; None: one sequence per row."""
        idx = input_ids
        if idx.dim() != 2:
            raise ValueError(f"GPT expects token ids of shape (B, T), got {tuple(idx.shape)}")
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds the model's block_size "
                f"{self.config.block_size}: shorten the input or build a larger model"
            )
        # under --cp the positions are a slice's, and attention builds the whole mask
        split = self.context_parallel
        mask = None if position_ids is None or split is not None else document_mask(position_ids)
        pos = position_ids if position_ids is not None else (
            torch.arange(t, device=idx.device) if split is None else split.positions(t, idx.device))
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        return self.lm_head(self.ln_f(x))


def build_gpt(vocab_size: int, block_size: int, width: int, experts: int = 0,
              top_k: int = 2) -> GPT:
    """A small default GPT: `width`-dimensional embeddings, 2 layers, 4 attention heads;
    `experts` > 0: a mixture of that many experts in each block, `top_k` per token."""
    if width % DEFAULT_N_HEAD:
        raise ValueError(
            f"width {width} must be divisible by the number of attention heads "
            f"({DEFAULT_N_HEAD}): choose a multiple of {DEFAULT_N_HEAD}"
        )
    return GPT(
        GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=DEFAULT_N_LAYER,
            n_head=DEFAULT_N_HEAD,
            n_embd=width,
            experts=experts,
            top_k=top_k,
        )
    )
