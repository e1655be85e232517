"""`--cp N`: context parallelism, each sequence split over N ranks (Ulysses).

    torchrun --nproc_per_node=2 -m ddptrain train --dataset chars --model gpt --cp 2
    torchrun --nproc_per_node=4 -m ddptrain train --dataset chars --model gpt --cp 2 \\
        --strategy fsdp                                   # and sharded over 2 more
    torchrun --nproc_per_node=2 -m ddptrain train --model hf:models/tiny-llama \\
        --dataset mymod:tokens --cp 2                     # a Llama-style model

The cp ranks of a job see the same batch, as tensor-parallel peers do, and each keeps one
contiguous slice of every sequence (`ContextParallel.shard`): its tokens, their global
positions (a packed document's own), their targets. Everything but attention is a
function of a token alone and runs on the slice. Attention is where positions meet: an
all-to-all turns the ranks' sequence slices of q, k and v into head slices of the whole
sequence, each rank attends with its share of the heads over every position (causal, or
within each packed document), and a second all-to-all turns the output back into
sequence slices (`ContextParallel.attention`; DeepSpeed-Ulysses). So activations per
rank are about 1/N, attention is exact, and the traffic is four all-to-alls of a layer's
q, k, v and output per layer, independent of the ranks' number.

The pass (`parallelize.PASSES`, after tp: a rank's heads are its tp share, which cp then
divides) hands the built-in GPT's attention modules the object, or registers it with
transformers' attention interface for a Hugging Face model (`ddptrain_cp`; rotary
positions come from the `position_ids` each slice carries). Each cp rank's loss is the
sum over its own tokens; the gradients are averaged over the data-parallel x cp ranks
(DDP over them, FSDP over `dp_shard x cp`: `parallel.mesh.fsdp_mesh`), so the loss is
scaled by that number (`DistributedContext.grad_world`) and the step is the mean over
every token of the global batch, as on one process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.nn import functional as F

from ddptrain.context import DistributedContext
from ddptrain.data.pack import IGNORE, document_mask
from ddptrain.errors import ConfigError

HF_NAME = "ddptrain_cp"  # the attention implementation registered with transformers


class ContextParallel:
    """This rank's place among the ranks that split each sequence, and the batch in
    flight's whole positions (what attention over the whole sequence needs)."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.shift = False  # the targets are a Hugging Face batch's labels: shift them here
        self._positions: torch.Tensor | None = None  # packed documents' (B, T); None: causal
        self._mask: torch.Tensor | None = None
        # a model whose attention should come here (a whole Hugging Face one): checked
        # that it did, once a batch has run, rather than trained on slices apart
        self.verify, self._calls, self._shards = False, 0, 0

    def shard(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """This rank's slice of a batch every cp rank holds whole: (B, T) token ids and
        their targets. A dict of inputs (`position_ids` in it when documents are packed)
        then carries the slice's global `position_ids`; of a tensor, the model counts
        them (`positions`). A 2-D `attention_mask` is dropped: the rows are causal (or
        packed), padding at their end and out of the loss."""
        ids = inputs["input_ids"] if isinstance(inputs, dict) else inputs
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ConfigError("--cp splits sequences of token ids (B, T): this data gives "
                              f"{type(ids).__name__}; run it without --cp")
        b, t = ids.shape
        if t % self.size:
            raise ConfigError(f"--cp {self.size} does not divide the sequence length {t}: "
                              "each rank takes an equal slice; choose --block_size (or "
                              "the data's length) a multiple of --cp")
        if self.verify and self._shards and not self._calls:
            raise ConfigError(f"--cp {self.size}: this model's attention does not go through "
                              "transformers' attention interface, so its ranks would attend "
                              "within their own slices; run it without --cp")
        self._shards += 1
        given = inputs.get("position_ids") if isinstance(inputs, dict) else None
        self._positions, self._mask = given, None
        n = t // self.size
        cut = slice(self.rank * n, (self.rank + 1) * n)
        if targets is not None and self.shift:  # position t predicts label t + 1
            pad = torch.full_like(targets[:, :1], IGNORE)
            targets = torch.cat([targets[:, 1:], pad], dim=1)
        targets = None if targets is None else targets[:, cut]
        if not isinstance(inputs, dict):  # the model counts positions (`positions`)
            return ids[:, cut], targets
        out = {k: v for k, v in inputs.items() if k not in ("labels", "attention_mask")}
        out["input_ids"] = ids[:, cut]
        out["position_ids"] = (given[:, cut] if given is not None
                               else self.positions(n, ids.device).expand(b, n))
        return out, targets

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """The global positions of this rank's slice of `t` tokens of each row."""
        return torch.arange(self.rank * t, (self.rank + 1) * t, device=device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  dropout: float = 0.0, scale: float | None = None) -> torch.Tensor:
        """Attention over the whole sequence of this rank's slices (B, H, T/N, D): the
        same shape back, each head having seen every position it may attend to."""
        if q.size(1) % self.size:
            raise ConfigError(f"--cp {self.size} does not divide the {q.size(1)} attention "
                              "heads a rank computes (heads / --tp): choose --cp among "
                              "their divisors")
        self._calls += 1
        q, k, v = (self._to_heads(z) for z in (q, k, v))
        mask = self._whole_mask()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                           is_causal=mask is None, scale=scale)
        return self._to_sequence(y)

    def _whole_mask(self) -> torch.Tensor | None:
        if self._positions is not None and self._mask is None:  # once a batch
            self._mask = document_mask(self._positions)
        return self._mask

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T/N, D), a sequence slice -> (B, H/N, T, D), a head slice."""
        b, h, n, d = x.shape
        parts = x.reshape(b, self.size, h // self.size, n, d).transpose(0, 1).contiguous()
        got = all_to_all_single_autograd(parts.reshape(-1), None, None, self.group)
        # [source rank = sequence slice][b][my heads][n][d]
        got = got.reshape(self.size, b, h // self.size, n, d)
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // self.size, self.size * n, d)

    def _to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """(B, H/N, T, D), a head slice -> (B, H, T/N, D), a sequence slice."""
        b, h, t, d = y.shape
        n = t // self.size
        parts = y.reshape(b, h, self.size, n, d).permute(2, 0, 1, 3, 4).contiguous()
        got = all_to_all_single_autograd(parts.reshape(-1), None, None, self.group)
        # [source rank = head slice][b][its heads][my n][d]
        got = got.reshape(self.size, b, h, n, d)
        return got.transpose(0, 1).reshape(b, self.size * h, n, d)


def context_parallel(module: nn.Module, ctx: DistributedContext, cp: int) -> None:
    """Give `module`'s attention the cp ranks (in place): the built-in GPT's modules, or a
    Hugging Face model's attention interface. Anything else is refused in one line."""
    from ddptrain.parallel.mesh import cp_mesh

    mesh = cp_mesh(ctx)
    assert mesh is not None, "context parallelism runs on the job's mesh"
    split = ContextParallel(mesh.get_group(), mesh.get_local_rank(), cp)
    takers = [m for m in module.modules() if hasattr(m, "context_parallel")]
    config = getattr(module, "config", None)
    if not takers and hasattr(config, "_attn_implementation"):
        from transformers import AttentionInterface

        AttentionInterface.register(HF_NAME, _hf_attention)
        module.set_attn_implementation(HF_NAME)  # type: ignore[operator]
        takers = [m for m in module.modules() if type(m).__name__.endswith("Attention")]
        split.verify = ctx.mesh["pp"].size() == 1  # (a pipeline stage may hold none)
    if not takers:
        raise ConfigError(f"--cp {cp} splits the sequences of the built-in GPT (--model gpt) "
                          "or of a Hugging Face language model (hf:DIR); this model is "
                          f"{type(module).__name__}: run it without --cp")
    heads = getattr(config, "n_head", None) or getattr(config, "num_attention_heads", None)
    tp = ctx.mesh["tp"].size() if "tp" in (ctx.mesh.mesh_dim_names or ()) else 1
    if heads is not None and (heads % tp or (heads // tp) % cp):
        raise ConfigError(f"--cp {cp} does not divide the {heads // max(tp, 1)} attention "
                          f"heads of a rank ({heads} heads / --tp {tp}): choose --cp among "
                          "their divisors")
    for m in takers:
        setattr(m, "context_parallel", split)  # noqa: B010 (a module attribute, not a field)


def of(module: nn.Module) -> ContextParallel | None:
    """The cp ranks `module`'s attention was given (`context_parallel`), if any."""
    found = (getattr(m, "context_parallel", None) for m in module.modules())
    return next((f for f in found if isinstance(f, ContextParallel)), None)


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                  scaling: float | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the cp ranks: q (B, H, T/N, D), k and v
    with the model's key-value heads (repeated to H, as its sdpa does), the output
    (B, T/N, H, D). The mask transformers would build is not: the whole sequence's is
    the object's."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = (z.repeat_interleave(groups, dim=1) for z in (key, value))
    split: ContextParallel = getattr(module, "context_parallel")  # noqa: B009
    y = split.attention(query, key, value, dropout, scaling)
    return y.transpose(1, 2).contiguous(), None
