"""A mixture of experts seen from the training loop (`ddptrain.models.moe`): the routers'
load-balancing loss added to the loss a micro-batch trains on, and the token slots each
expert got counted like a metric, so the train rows show the load balance of their
interval (the row's loss is the task's alone):

    {"expert_tokens": [[212, 190, 251, 115], [180, 202, 233, 153]],  # per layer, per expert
     "expert_tokens_min": 115, "expert_tokens_max": 251, "router_aux": 1.04, ...}

A layer's counts sum to its tokens times top_k. The counts ride in the metric sums (one
small add a micro-batch, on the device) and are all-reduced with them at the rows' sync:
no read of the host per step. Validation trains nothing: its loss is the task's alone.

The loss is that of the global micro-batch (`--moe_aux_scope global`, the default): per
layer, experts x the sum over experts of the fraction of the token slots of every
data-parallel rank it got times its mean router probability over all their tokens, times
the micro-batch's global count, as one process given the whole global micro-batch would
add. Each micro-step makes one small all-reduce over the data-parallel ranks (the expert
parallel ranks and FSDP shards among them; tensor-parallel peers, which hold the same
tokens, and other pipeline stages not): every layer's token slots and the task's count.
Each rank then trains on its part, the global fractions times its own tokens' probability
sums (`models.moe.global_balance`): the parts sum to the one-process loss, and their
gradients, averaged by the strategy as the task's are, to its gradient. Under gradient
accumulation the equality is per micro-batch: N ranks of batch B equal one process of
batch N x B with the same accumulation, not one process of a batch K times larger (the
loss is not a sum over tokens). `--moe_aux_scope local` takes each rank's own tokens
instead, no collective: ranks then balance their shares, which differs from one process
by as much as the shares' loads differ. With `--moe_aux_weight 0` nothing is all-reduced
and `router_aux` logs the ranks' own balance.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.context import DistributedContext
from ddptrain.models.moe import MoE, global_balance
from ddptrain.parallel.mesh import data_group
from ddptrain.train.tasks import Score

AUX = "router_aux"
SCOPES = ("global", "local")


class Routing:
    """The mixture-of-experts layers of a model and the weight of their balancing loss;
    `spread`: the loss is the global micro-batch's, its counts all-reduced over `group`
    (None: every rank)."""

    def __init__(self, layers: list[MoE], weight: float, spread: bool = False,
                 group: Any = None) -> None:
        self.layers, self.weight = layers, weight
        self.spread, self.group = spread, group
        self.shape = [layer.experts for layer in layers]
        self.names = (AUX, *(f"experts.{i}.{e}" for i, n in enumerate(self.shape)
                             for e in range(n)))

    @classmethod
    def of(cls, module: nn.Module, weight: float, scope: str = "global",
           ctx: DistributedContext | None = None) -> Routing | None:
        """The routing of `module`'s MoE layers, or None when it has none. `scope`
        (`--moe_aux_scope`): global, the loss of the global micro-batch over `ctx`'s
        data-parallel and cp ranks; local, each rank's own tokens'. Collective under an n-D
        layout (the data-parallel group is made once, on every rank)."""
        if scope not in SCOPES:
            raise ValueError(f"moe_aux_scope {scope!r}: use one of {', '.join(SCOPES)}")
        layers = [m for m in module.modules() if isinstance(m, MoE)]
        if not layers:
            return None
        spread = (scope == "global" and weight > 0 and ctx is not None and ctx.distributed
                  and ctx.grad_world > 1)
        return cls(layers, weight, spread, data_group(ctx) if spread and ctx else None)

    def add(self, score: Score, pad: bool = False) -> torch.Tensor:
        """The loss a scored training micro-batch (its forward just ran) trains on: the
        task's plus the routers' balancing loss, weighted and counted as the task's is (a
        sum over its count); the routers' figures go into its metric sums. `pad`: this
        rank's micro-batch is a stand-in (its loss weighs 0) whose tokens the global
        loss leaves out. Collective under the global scope (every data-parallel rank)."""
        lasts = [layer.last for layer in self.layers if layer.last is not None]
        assert len(lasts) == len(self.layers), "a MoE layer did not run"
        count = score.count
        if self.spread:  # this rank's part, and the global micro-batch's count
            aux, count = self._global(lasts, count, pad)
        else:
            aux = torch.stack([last.loss for last in lasts]).sum()
        # a layer's: 1 when its experts are evenly used (the global loss: the ranks' parts
        # of it, summed at the rows' sync)
        mean = aux.detach() / len(lasts)
        parts = torch.cat([(mean * count).double().reshape(1),
                           *(last.counts.double() for last in lasts)])
        score.metrics.update(zip(self.names, parts.unbind(), strict=True))
        return score.loss_sum + self.weight * aux * count

    def _global(self, lasts: list[Any], count: Any,
                pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the layers' global balancing loss, and the micro-batch's
        global count: one all-reduce of every layer's token slots and the count."""
        device = lasts[0].counts.device
        local = torch.cat([*(last.counts.reshape(-1) for last in lasts),
                           torch.as_tensor(count, device=device).reshape(1)]).to(torch.int64)
        if pad:
            local = torch.zeros_like(local)
        total = self._all_reduce(local)
        slots = total[:-1].split([last.counts.numel() for last in lasts])
        aux = torch.stack([
            global_balance(c, last.prob_sums, layer.top_k)
            for c, last, layer in zip(slots, lasts, self.layers, strict=True)
        ]).sum()
        return aux, total[-1]

    def _all_reduce(self, buf: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(buf, group=self.group)
        return buf

    def fields(self, totals: dict[str, float], count: float) -> dict[str, Any]:
        """The row's load balance from its interval's totals."""
        per_layer, at = [], 1
        for experts in self.shape:
            per_layer.append([int(totals[n]) for n in self.names[at : at + experts]])
            at += experts
        flat = [c for layer in per_layer for c in layer]
        return {"expert_tokens": per_layer, "expert_tokens_min": min(flat),
                "expert_tokens_max": max(flat), AUX: totals[AUX] / count}

