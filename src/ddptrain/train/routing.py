"""A mixture of experts seen from the training loop (`ddptrain.models.moe`): the routers'
load-balancing loss added to the loss a micro-batch trains on, and the token slots each
expert got counted like a metric, so the train rows show the load balance of their
interval (the row's loss is the task's alone):

    {"expert_tokens": [[212, 190, 251, 115], [180, 202, 233, 153]],  # per layer, per expert
     "expert_tokens_min": 115, "expert_tokens_max": 251, "router_aux": 1.04, ...}

A layer's counts sum to its tokens times top_k. The counts ride in the metric sums (one
small add a micro-batch, on the device) and are all-reduced with them at the rows' sync:
no read of the host per step. Validation trains nothing: its loss is the task's alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddptrain.models.moe import MoE
from ddptrain.train.tasks import Score

AUX = "router_aux"


class Routing:
    """The mixture-of-experts layers of a model and the weight of their balancing loss."""

    def __init__(self, layers: list[MoE], weight: float) -> None:
        self.layers, self.weight = layers, weight
        self.shape = [layer.experts for layer in layers]
        self.names = (AUX, *(f"experts.{i}.{e}" for i, n in enumerate(self.shape)
                             for e in range(n)))

    @classmethod
    def of(cls, module: nn.Module, weight: float) -> Routing | None:
        """The routing of `module`'s MoE layers, or None when it has none."""
        layers = [m for m in module.modules() if isinstance(m, MoE)]
        return cls(layers, weight) if layers else None

    def add(self, score: Score) -> torch.Tensor:
        """The loss a scored training micro-batch (its forward just ran) trains on: the
        task's plus the routers' balancing loss, weighted and counted as the task's is (a
        sum over its count); the routers' figures go into its metric sums."""
        lasts = [layer.last for layer in self.layers if layer.last is not None]
        assert len(lasts) == len(self.layers), "a MoE layer did not run"
        aux = torch.stack([balance for balance, _ in lasts]).sum()
        count = score.count
        mean = aux.detach() / len(lasts)  # a layer's: 1 when its experts are evenly used
        parts = torch.cat([(mean * count).double().reshape(1),
                           *(tokens.double() for _, tokens in lasts)])
        score.metrics.update(zip(self.names, parts.unbind(), strict=True))
        return score.loss_sum + self.weight * aux * count

    def fields(self, totals: dict[str, float], count: float) -> dict[str, Any]:
        """The row's load balance from its interval's totals."""
        per_layer, at = [], 1
        for experts in self.shape:
            per_layer.append([int(totals[n]) for n in self.names[at : at + experts]])
            at += experts
        flat = [c for layer in per_layer for c in layer]
        return {"expert_tokens": per_layer, "expert_tokens_min": min(flat),
                "expert_tokens_max": max(flat), AUX: totals[AUX] / count}
