"""`--strategy zero`: ZeRO stage 1, the optimizer state sharded over the ranks: DDP's
replicas and all-reduce (`parallel.ddp`), with the optimizer this file builds.

Each rank steps the parameters it owns (`ZeroRedundancyOptimizer`, its local optimizer
fused where torch has it, so a non-finite step is skipped on the device) and broadcasts
them, one flat bucket per rank;
its state leaves and enters keyed by parameter names, like every strategy's.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ddptrain.context import DistributedContext
from ddptrain.parallel.base import (
    OptimizerSpec,
    State,
    fused_where_it_can,
    hyperparameters,
    init_optimizer_state,
    named_optimizer_state,
    state_bytes,
    to_cpu,
)


class ZeroOptimizer:
    """The optimizer state sharded: each rank steps the parameters it owns and broadcasts
    them (ZeroRedundancyOptimizer, ZeRO stage 1). DDP holds one under `--strategy zero`
    and hands it the optimizer and its state; the rest of the run is DDP's."""

    def __init__(self, ctx: DistributedContext) -> None:
        self.ctx = ctx

    def build_optimizer(
        self, module: nn.Module, spec: OptimizerSpec, groups: list[dict[str, Any]] | None = None
    ) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kwargs = spec
        groups = groups or [{"params": [p for p in module.parameters() if p.requires_grad]}]
        # each rank's parameters in one flat bucket: one broadcast per rank, not per tensor
        return ZeroRedundancyOptimizer(
            groups, optimizer_class=cls, parameters_as_bucket_view=True,
            **{**fused_where_it_can(cls, groups, kwargs), **kwargs},
        )

    @staticmethod
    def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer.optim  # type: ignore[attr-defined]

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The same class over the same groups, each rank stepping its share: the
        optimizer is built again as a ZeroRedundancyOptimizer (before any step, so no
        state is lost)."""
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [dict(g) for g in optimizer.param_groups]
        return self.build_optimizer(nn.Module(), (cls, defaults), groups)

    def _mine(self, module: nn.Module, optimizer: Any) -> State:
        """This rank's shard of the optimizer state, keyed by parameter name."""
        names = {p: n for n, p in module.named_parameters()}
        groups = [
            {**hyperparameters(g), "params": [names[p] for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        state = {names[p]: dict(s) for p, s in optimizer.optim.state.items()}
        return {"state": state, "param_groups": groups}

    def full_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        from ddptrain.context import gather_to_main

        mine = self._mine(module, optimizer)
        cpu = to_cpu(mine["state"])
        shards = gather_to_main(cpu, self.ctx)
        if shards is None:
            return {}, {}
        merged = {n: s for shard in shards for n, s in shard.items()}
        return module.state_dict(), {"state": merged, "param_groups": mine["param_groups"]}

    def sharded_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        init_optimizer_state(optimizer.optim)  # type: ignore[attr-defined]
        return module.state_dict(), self._mine(module, optimizer)

    def load_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, model: State, optim: State,
        full: bool,
    ) -> None:
        """Each rank takes the state of the parameters it owns; hyperparameters go to the
        exposed groups and to the local optimizer's."""
        optim = named_optimizer_state(optim, module)
        module.load_state_dict(model)
        local = optimizer.optim  # type: ignore[attr-defined]
        names = {p: n for n, p in module.named_parameters()}
        for group in local.param_groups:
            for p in group["params"]:
                saved = optim["state"].get(names[p])
                if saved is not None:
                    local.state[p] = {
                        k: v.to(p.device) if torch.is_tensor(v) and v.dim() else v
                        for k, v in saved.items()
                    }
        for saved_group, *groups in zip(
            optim["param_groups"], optimizer.param_groups, local.param_groups, strict=False
        ):
            for group in groups:
                group.update(hyperparameters(saved_group))

    @staticmethod
    def state_bytes(optimizer: torch.optim.Optimizer) -> int:
        return state_bytes(optimizer.optim.state)  # type: ignore[attr-defined]
