"""A mixture of experts in place of the built-in GPT's MLP:

    ddptrain train --dataset chars --model gpt --model_args experts=8 top_k=2

Each block's MLP becomes `experts` MLPs and a router, a linear layer scoring every token
for every expert. A token goes to the `top_k` experts with the highest softmax
probability and leaves as their outputs weighted by those probabilities (renormalised
over its k). Routing is dropless: every token reaches all k of its experts, however
unevenly the router spreads them, so nothing depends on a capacity and the output is
that of the dense computation of the chosen experts.

The experts' weights are batched tensors, (experts, in, out) and (experts, out), so that
a sharding over the experts is a split of dimension 0. The tokens are sorted by expert
and each expert multiplies its contiguous rows: all of them in one grouped GEMM
(`torch._grouped_mm`, its group ends a device tensor: no host read) where the widths
meet its 16-byte alignment, else a loop over the experts (the group sizes read on the
host: one read per layer and forward, as torchtitan's loop does).

Under expert parallelism (`--ep`, `ddptrain.parallel.ep`) each rank holds its share of the
experts (the batched weights are DTensor shards of dimension 0): the sorted rows go to
the ranks that hold their experts with one all-to-all, are computed there, and come back
with another, in the order they left; their gradients travel the same way in backward.

Each forward leaves `last` (`Balance`): the router's load-balancing loss over this
forward's tokens (Switch Transformer's: experts x the sum over experts of the fraction of
token slots it got times its mean probability; 1 when perfectly even), the token slots
each expert got, and each expert's router probability summed over the tokens. The
training loop adds the loss, weighted by `--moe_aux_weight`, and logs the counts
(`ddptrain.train.routing`). By default (`--moe_aux_scope global`) it takes the loss of
the global micro-batch, not of this rank's share: the counts are all-reduced over the
data-parallel ranks and each rank's part is the global fractions times its own
probability sums (`global_balance`), so N ranks train as one process does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single
from torch.distributed.tensor import DTensor
from torch.nn import functional as F


class Balance(NamedTuple):
    """What a mixture's forward leaves for its load-balancing loss (`MoE.last`)."""

    loss: torch.Tensor  # the balancing loss of this forward's tokens alone (fp32, 0-d)
    counts: torch.Tensor  # the token slots each expert got (int64, (experts,))
    prob_sums: torch.Tensor  # each expert's router probability summed over the tokens (fp32)


def global_balance(counts: torch.Tensor, prob_sums: torch.Tensor, top_k: int) -> torch.Tensor:
    """This rank's part of the balancing loss of a micro-batch spread over ranks: with
    `counts` the token slots of every rank summed (all-reduced, so T = counts.sum() / k
    tokens in all) and `prob_sums` this rank's own probability sums,

        experts x sum_e (counts_e / (T k)) x prob_sums_e / T

    The ranks' parts sum to the loss of the whole micro-batch in one process (its mean
    probabilities are the ranks' sums over T), and so do their gradients: the fractions
    are not differentiable (a top-k's counts), each rank's sums are its tokens' alone."""
    slots = counts.to(prob_sums.dtype)
    total = slots.sum().clamp_min(1.0)  # T k
    return prob_sums.numel() * top_k * (slots * prob_sums).sum() / (total * total)


class MoE(nn.Module):
    """`experts` GELU MLPs (width -> hidden -> width) behind a top-k router."""

    expert_weights = ("w_in", "b_in", "w_out", "b_out")  # batched, experts first (`--ep`)

    def __init__(self, width: int, hidden: int, experts: int, top_k: int, dropout: float = 0.0,
                 out_std: float = 0.02) -> None:
        super().__init__()
        if experts < 2 or not 1 <= top_k <= experts:
            raise ValueError(f"a mixture needs at least 2 experts and 1 <= top_k <= experts, "
                             f"got experts={experts} top_k={top_k}")
        self.top_k = top_k
        self.router = nn.Linear(width, experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(experts, width, hidden))
        self.b_in = nn.Parameter(torch.zeros(experts, hidden))
        self.w_out = nn.Parameter(torch.empty(experts, hidden, width))
        self.b_out = nn.Parameter(torch.zeros(experts, width))
        self.dropout = nn.Dropout(dropout)
        self.out_std = out_std
        self.reset_parameters()
        # the newest forward's figures for the load-balancing loss
        self.last: Balance | None = None
        self.ep_group: Any = None  # the ranks the experts are spread over (`--ep`)
        self.tp_group: Any = None  # the ranks splitting each expert's hidden width (`--tp`)

    def reset_parameters(self) -> None:
        """GPT-2's initialisation, the output projections shrunk with depth (`out_std`)."""
        nn.init.normal_(self.router.weight, std=0.02)
        nn.init.normal_(self.w_in, std=0.02)
        nn.init.normal_(self.w_out, std=self.out_std)
        nn.init.zeros_(self.b_in)
        nn.init.zeros_(self.b_out)

    @property
    def experts(self) -> int:
        return self.router.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        probs = F.softmax(self.router(flat).float(), dim=-1)  # (tokens, experts)
        weight, chosen = probs.topk(self.top_k, dim=-1)  # (tokens, k)
        weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)
        out, token, counts = routed(flat, chosen, weight, self.experts, self._experts,
                                    self.ep_group)
        mixed = torch.zeros_like(x)  # its own tensor, not a view (FSDP wraps the layer)
        mixed.view(-1, x.size(-1)).index_add_(0, token, out)
        share = counts.float() / chosen.numel()
        self.last = Balance(self.experts * (share * probs.mean(0)).sum(), counts, probs.sum(0))
        return self.dropout(mixed)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each (local) expert's MLP on its contiguous share of `rows`: `counts[e]` rows of
        expert e, `ids` each row's expert (device tensors). Under `--tp` each rank holds a
        slice of every expert's hidden width: the products are summed over the tp ranks."""
        w_in, b_in, w_out = (_local(p) for p in (self.w_in, self.b_in, self.w_out))
        if self.tp_group is not None:
            rows = _SumGradients.apply(rows, self.tp_group)
        if rows.is_meta:
            # FLOPs are counted on the meta device (observe.flops), where the grouped GEMM
            # has no rule for float32 and the counts no values: every row through one
            # expert's shapes costs what the grouped GEMM does
            out = F.gelu(rows @ w_in[0] + _per_row(b_in, ids)) @ w_out[0]
        elif _aligned(w_in):
            ends = counts.cumsum(0).to(torch.int32)
            dtype = (torch.get_autocast_dtype(rows.device.type)
                     if torch.is_autocast_enabled(rows.device.type) else rows.dtype)
            # as the loop's matmuls under autocast: the products in its dtype, the biases
            # added in theirs
            hidden = F.gelu(torch._grouped_mm(rows.to(dtype), w_in.to(dtype), offs=ends)
                            + _per_row(b_in, ids))
            out = torch._grouped_mm(hidden.to(dtype), w_out.to(dtype), offs=ends)
        else:
            out = torch.cat([
                F.gelu(part @ w_in[e] + b_in[e]) @ w_out[e]
                for e, part in enumerate(rows.split(counts.tolist()))  # one host read
            ])
        if self.tp_group is not None:
            out = _SumOutputs.apply(out, self.tp_group)
        return out + _per_row(_local(self.b_out), ids)


# An expert computation: `rows` sorted by expert, `counts[e]` rows of (local) expert e,
# `ids` each row's expert (device tensors) -> each row's output, in the same order.
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def routed(flat: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor, experts: int,
           compute: Experts, group: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dropless dispatch of a mixture: the rows of `flat` (tokens, width), each to its
    k experts `chosen` (tokens, k), computed by `compute` (by the ranks of `group` holding
    their experts under `--ep`: `exchange`) and weighted by `weight` (tokens, k). Returns
    the weighted output rows, the token each belongs to (to sum them with `index_add_`)
    and the token slots each of the `experts` got."""
    top_k = chosen.size(-1)
    slots = chosen.reshape(-1)  # token i's k slots at i*k .. i*k+k-1
    # (bincount would read its largest value on the host)
    counts = slots.new_zeros(experts).scatter_add_(0, slots, torch.ones_like(slots))
    order = slots.argsort(stable=True)  # the slots grouped by expert, in token order
    token = order // top_k
    rows = flat[token]
    out = (compute(rows, counts, slots[order]) if group is None
           else exchange(rows, counts, compute, group)) * weight.reshape(-1)[order, None]
    return out, token, counts


def exchange(rows: torch.Tensor, counts: torch.Tensor, compute: Experts,
             group: Any) -> torch.Tensor:
    """`rows` (sorted by expert, `counts` for each of all the experts) computed by the
    ranks of `group` holding their experts (`compute`, over this rank's consecutive
    share), back in the order they left."""
    ranks = dist.get_world_size(group)
    local = counts.numel() // ranks
    got = torch.empty_like(counts)  # [source rank][my expert]: rows it sends it
    dist.all_to_all_single(got, counts, group=group)
    sizes = torch.cat([counts.view(ranks, local).sum(1), got]).tolist()  # one host read
    send, got_n = sizes[:ranks], sizes[ranks:]
    recv = [sum(got_n[q * local : (q + 1) * local]) for q in range(ranks)]
    inbound = all_to_all_single(rows, recv, send, group)  # differentiable
    blocks = inbound.split(got_n)  # by source rank, then by expert: regrouped by expert
    by_expert = [q * local + j for j in range(local) for q in range(ranks)]
    mine = torch.tensor([sum(got_n[j::local]) for j in range(local)], device=rows.device)
    out = compute(torch.cat([blocks[i] for i in by_expert]), mine,
                  torch.arange(local, device=rows.device).repeat_interleave(
                      mine, output_size=inbound.size(0)))
    parts = dict(zip(by_expert, out.split([got_n[i] for i in by_expert]), strict=True))
    back = torch.cat([parts[i] for i in range(ranks * local)])
    return all_to_all_single(back, send, recv, group)


def expert_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The experts' parameters of `module`'s mixtures: this module's batched weights, and
    a Hugging Face model's (`...experts...`: Mixtral, Qwen3-MoE), each once."""
    found: dict[int, torch.Tensor] = {}
    for name, p in module.named_parameters():
        leaf = name.rpartition(".")[2]
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        if (isinstance(owner, MoE) and leaf in owner.expert_weights) or ".experts." in f".{name}":
            found.setdefault(id(p), p)
    return list(found.values())


class _SumGradients(torch.autograd.Function):
    """The tp ranks' common input: as it is forward, its gradients (each rank's from its
    slice of the experts) summed over them backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOutputs(torch.autograd.Function):
    """The tp ranks' partial products summed forward; each rank's gradient (the same on
    all) passed back as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _aligned(w_in: torch.Tensor) -> bool:
    """Whether the grouped GEMM takes these widths: each row of every operand a multiple
    of 16 bytes (in the narrowest dtype it may compute in)."""
    return all(n * 2 % 16 == 0 for n in (w_in.size(1), w_in.size(2)))


def _per_row(bias: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each row's expert's bias, `bias[ids]`, as a product with the rows' one-hot experts:
    its gradient is then a matrix product too, summed in a fixed order (indexing's
    backward accumulates in an order threads and atomics choose: not bit for bit)."""
    experts = torch.arange(bias.size(0), device=ids.device)
    kind = ids.device.type  # "meta" has no autocast (FLOPs are counted there)
    off = (torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind)
           else contextlib.nullcontext())
    with off:  # the bias in its own precision
        return (ids[:, None] == experts).to(bias.dtype) @ bias  # (one_hot reads the top id)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p
