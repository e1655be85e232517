"""A Hugging Face mixture of experts (Mixtral, Qwen3-MoE) under expert parallelism:

    torchrun --nproc_per_node=2 -m ddptrain train --model hf:models/tiny-mixtral \\
        --dataset mymod:tokens --ep 2                       # half the experts a rank

transformers (5.x) holds a layer's experts as one module of batched weights, experts
first, as the built-in GPT's mixture does (`models.moe`): `gate_up_proj` (experts,
2 x inner, width), `down_proj` (experts, width, inner), and a forward taking the tokens,
each token's top-k experts and their weights (the router, beside it, stays replicated).
Such a module is recognised by that structure as the model is built, and told apart by
`expert_weights`, which `parallel.ep` spreads over the ranks (dimension 0, the experts).
Its forward stays transformers' own until then; once spread (`ep_group` set) the
token rows go to the ranks of their experts and back through `models.moe.routed`, the
built-in mixture's dispatch, each rank computing its experts as transformers does.
Layouts this pass does not compute (biases, transposed or interleaved weights, experts
without a gate) are named in `no_expert_parallel`, which `--ep` refuses with.

The balancing loss of such a model is transformers' own, not the training loop's
(`train.routing`, which takes the built-in mixture's and reads `--moe_aux_weight` and
`--moe_aux_scope`): with the model config's `output_router_logits` on and batches holding
`labels`, the model adds `router_aux_loss_coef` times its loss over the router logits of
its forward (this rank's tokens) to the loss it returns, which ddptrain trains on as the
model's own; with it off (transformers' default) none trains. Either way its experts'
token counts are not logged.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from ddptrain.models.moe import routed

WEIGHTS = ("gate_up_proj", "down_proj")
# transformers' `use_experts_implementation` flags, and the value this pass computes
LAYOUT = {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True}


def adopt_experts(model: nn.Module) -> int:
    """Mark each batched-experts module of `model` for `--ep` (see the module's
    docstring), in place; returns how many. A no-op for the other layouts, which get
    `no_expert_parallel` instead."""
    adopted = 0
    for module in model.modules():
        if not _batched(module):
            continue
        odd = [f"{flag}={getattr(module, flag)}" for flag, want in LAYOUT.items()
               if getattr(module, flag, want) != want]
        if odd:
            vars(module)["no_expert_parallel"] = f"{type(module).__name__} ({', '.join(odd)})"
            continue
        # plain attributes of this instance (its class is transformers'); the forward is
        # transformers' own until `parallel.ep` sets the group
        vars(module).update(expert_weights=WEIGHTS, ep_group=None,
                            forward=types.MethodType(_forward, module))
        adopted += 1
    return adopted


def _batched(module: nn.Module) -> bool:
    """Whether `module` holds experts as transformers' batched weights: (E, 2I, H) and
    (E, H, I) beside an activation."""
    gate_up, down = (module._parameters.get(n) for n in WEIGHTS)
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return False
    return gate_up.shape[0] == down.shape[0] and callable(getattr(module, "act_fn", None))


def _forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' forward, or under `--ep` the tokens' rows exchanged with the ranks
    holding their experts (`models.moe.routed`) and summed back per token."""
    if self.ep_group is None:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    experts = self.gate_up_proj.shape[0]  # all of them: a DTensor's global shape
    out, token, _ = routed(hidden_states, top_k_index, top_k_weights, experts,
                           lambda rows, counts, ids: _experts(self, rows, counts), self.ep_group)
    mixed = torch.zeros_like(hidden_states)
    mixed.index_add_(0, token, out.to(mixed.dtype))
    return mixed


def _experts(self: Any, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each of this rank's experts on its contiguous share of `rows` (`counts[e]` rows of
    local expert e), as transformers computes one: gate and up, the gate's activation
    times up, down."""
    gate_up, down = (_local(getattr(self, n)) for n in WEIGHTS)
    gate = getattr(self, "_apply_gate", None) or (lambda x: _gate(self, x))
    return torch.cat([
        F.linear(gate(F.linear(part, gate_up[e])), down[e])
        for e, part in enumerate(rows.split(counts.tolist()))  # one host read
    ])


def _gate(self: Any, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p
