"""How the model is spread over the ranks: one small interface, one class per way.

The trainer never asks which strategy runs. It calls `setup_module` and
`build_optimizer` once, wraps the micro-steps that must not reduce gradients in
`no_backward_sync`, uses `clip_grad_norm` / `grads_finite` on the optimizer step, and
moves state in and out through `full_state` / `sharded_state` / `load_state`.

| strategy | parameters | gradients | optimizer state | what |
| --- | --- | --- | --- | --- |
| `Strategy` (world size 1) | full | full | full | the bare module |
| `ddp` | full | full, all-reduced | full | `DistributedDataParallel` |
| `zero` | full | full, all-reduced | 1/N | `ZeroRedundancyOptimizer`: ZeRO-1 |
| `fsdp` | 1/N | 1/N, reduce-scattered | 1/N | `fully_shard`: ZeRO-3 (or ZeRO-2) |

State leaves a strategy in one form whatever the strategy: the user module's own
parameter names, and the optimizer state keyed by those names (torch's
`get_optimizer_state_dict` layout). So a checkpoint written under one strategy and world
size loads under another.

    ddptrain train --strategy fsdp ...   # under torchrun, 2+ processes
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from ddptrain.config import TrainingConfig
from ddptrain.distributed import DistributedContext
from ddptrain.errors import ConfigError
from ddptrain.optim import build_optimizer, optimizer_spec
from ddptrain.precision import NO_CONTEXT, Precision

log = logging.getLogger("ddptrain")

State = dict[str, Any]
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Strategy:
    """World size 1: the bare module; every method is the plain single-process one."""

    name = "single process"
    even_forwards = False  # must every rank run the same number of forward passes?
    _full_load = StateDictOptions()  # a whole state loads as it is into a whole module

    def __init__(self, ctx: DistributedContext, config: TrainingConfig, precision: Precision):
        self.ctx, self.config, self.precision = ctx, config, precision
        self._found_inf = torch.zeros(1, device=ctx.device)
        self._one = torch.ones(1, device=ctx.device)

    # ------------------------------------------------------------------ setup
    def setup_module(self, module: nn.Module) -> nn.Module:
        """The model the training step calls (a wrapper of `module`, or itself)."""
        return module

    def build_optimizer(self, module: nn.Module, lr: float) -> torch.optim.Optimizer:
        return build_optimizer(module, self.config, lr)

    # ------------------------------------------------------------------ step
    def no_backward_sync(self, model: nn.Module, skip: bool) -> AbstractContextManager[Any]:
        """Inside, backward only accumulates gradients locally (when `skip`)."""
        return NO_CONTEXT

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping."""
        return nn.utils.clip_grad_norm_(params, max_norm)

    def grads_finite(self, params: list[nn.Parameter]) -> bool:
        """Whether every gradient is finite, with the same verdict on every rank.

        GradScaler's fused check (with a scale of 1, which leaves the values as they
        are) costs a few µs where a norm costs tens. Under DDP every rank holds the same
        all-reduced gradients, so the local verdict is already the global one."""
        grads = [_local(p.grad) for p in params if p.grad is not None]
        self._found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, self._one)
        return not self._found_inf.item()

    # ------------------------------------------------------------------ state
    def full_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        """Collective. The whole model and optimizer state, on rank 0 (maybe empty elsewhere)."""
        return module.state_dict(), get_optimizer_state_dict(module, optimizer)

    def model_state(self, module: nn.Module) -> State:
        """Collective. The whole model state with the user module's names, on rank 0."""
        return module.state_dict()

    def sharded_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        """What this rank writes into (and loads from) a DCP checkpoint. Tensors every
        rank holds alike are written once; DCP reshards on load."""
        return get_state_dict(module, optimizer)

    def load_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, model: State, optim: State,
        full: bool,
    ) -> None:
        """Load a state from `full_state` (every rank holds all of it) or `sharded_state`."""
        optim = named_optimizer_state(optim, module)
        if not full:
            set_state_dict(module, optimizer, model_state_dict=model, optim_state_dict=optim)
            return
        set_model_state_dict(module, model, options=self._full_load)
        set_optimizer_state_dict(module, optimizer, optim, options=self._full_load)

    def rank_bytes(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of parameters, gradients (as they are once materialised) and optimizer
        state this rank holds."""
        params = sum(_nbytes(p) for p in module.parameters())
        grads = sum(_nbytes(p) for p in module.parameters() if p.requires_grad)
        return {"params": params, "grads": grads, "optimizer": _state_bytes(optimizer.state)}


class DDP(Strategy):
    """DistributedDataParallel: a full replica per rank, gradients all-reduced in backward."""

    name = "ddp"

    def setup_module(self, module: nn.Module) -> nn.Module:
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # Gradients written straight into the all-reduce buckets save a copy per step.
        return DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True)

    def no_backward_sync(self, model: nn.Module, skip: bool) -> AbstractContextManager[Any]:
        return model.no_sync() if skip else NO_CONTEXT  # type: ignore[operator]


class Zero(DDP):
    """DDP with the optimizer state sharded: each rank steps the parameters it owns and
    broadcasts them (ZeroRedundancyOptimizer, ZeRO stage 1)."""

    name = "zero"

    def build_optimizer(self, module: nn.Module, lr: float) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kwargs = optimizer_spec(self.config, lr)
        params = [p for p in module.parameters() if p.requires_grad]
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)

    def _mine(self, module: nn.Module, optimizer: Any) -> State:
        """This rank's shard of the optimizer state, keyed by parameter name."""
        names = {p: n for n, p in module.named_parameters()}
        groups = [
            {**_hyper(g), "params": [names[p] for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        state = {names[p]: dict(s) for p, s in optimizer.optim.state.items()}
        return {"state": state, "param_groups": groups}

    def full_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        from ddptrain.checkpoint import gather_to_main

        mine = self._mine(module, optimizer)
        cpu = {n: {k: _cpu(v) for k, v in s.items()} for n, s in mine["state"].items()}
        shards = gather_to_main(cpu, self.ctx)
        if shards is None:
            return {}, {}
        merged = {n: s for shard in shards for n, s in shard.items()}
        return module.state_dict(), {"state": merged, "param_groups": mine["param_groups"]}

    def sharded_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        _init_optimizer_state(optimizer.optim)  # type: ignore[attr-defined]
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
                group.update(_hyper(saved_group))

    def rank_bytes(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        figures = super().rank_bytes(module, optimizer)
        figures["optimizer"] = _state_bytes(optimizer.optim.state)  # type: ignore[attr-defined]
        return figures


class FSDP(Strategy):
    """FSDP2: `fully_shard` on each block and on the root. Parameters, gradients and
    optimizer state are sharded; a block's parameters are all-gathered for its forward
    and backward and freed after (`--no-reshard_after_forward` keeps them from forward
    to backward: ZeRO-2 memory, one all-gather fewer)."""

    name = "fsdp"
    even_forwards = True  # every forward all-gathers: ranks must call it alike
    _full_load = StateDictOptions(full_state_dict=True)  # each rank keeps its shard of it

    def setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {"reshard_after_forward": self.config.reshard_after_forward}
        if self.precision.dtype is not None:
            # Compute in the low precision, reduce gradients and keep the master weights
            # in fp32; autocast stays on for the ops it keeps in fp32 (losses, norms).
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.precision.dtype, reduce_dtype=torch.float32
            )
        if self.config.fsdp_cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        blocks = fsdp_blocks(module, self.config.fsdp_wrap)
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(module, **kwargs)
        log.debug("fsdp: %d blocks sharded, plus the root", len(blocks))
        self._root = module
        return module

    def no_backward_sync(self, model: nn.Module, skip: bool) -> AbstractContextManager[Any]:
        self._root.set_requires_gradient_sync(not skip)  # type: ignore[operator]
        return NO_CONTEXT

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        # Each rank holds a shard of every gradient: the norm of the sharded gradients
        # is a DTensor whose full value is the global norm.
        grads = [p.grad for p in params if p.grad is not None]
        norm = nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def grads_finite(self, params: list[nn.Parameter]) -> bool:
        finite = torch.tensor([float(super().grads_finite(params))], device=self.ctx.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # one rank's inf is everyone's
        return bool(finite.item())

    def full_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        return self.model_state(module), get_optimizer_state_dict(module, optimizer, options=_FULL)

    def model_state(self, module: nn.Module) -> State:
        state = get_model_state_dict(module, options=_FULL)
        # Gathering copies each name's tensor apart; tied parameters (a language model's
        # embedding and output head) are one tensor again, so export stores them once.
        first: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            kept = first.setdefault(id(p), name)
            if kept != name and kept in state and name in state:
                state[name] = state[kept]
        return state

    def sharded_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        # Buffers (BatchNorm statistics) are not sharded and FSDP does not keep them in
        # step: each rank's drift apart in training. DCP writes one copy of a replicated
        # tensor, so make it rank 0's, the copy evaluation and export use.
        for buf in module.buffers():
            dist.broadcast(buf, src=0)
        return super().sharded_state(module, optimizer)


STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDP, "zero": Zero, "fsdp": FSDP}


def create_strategy(
    ctx: DistributedContext, config: TrainingConfig, precision: Precision
) -> Strategy:
    if not ctx.distributed:
        return Strategy(ctx, config, precision)
    if config.fsdp_cpu_offload and ctx.device.type != "cuda":
        raise ConfigError(
            "--fsdp_cpu_offload is invalid on CPU: the parameters already live there; "
            "drop the flag"
        )
    return STRATEGIES[config.strategy](ctx, config, precision)


def fsdp_blocks(module: nn.Module, wrap: str | None) -> list[nn.Module]:
    """The modules FSDP shards one by one (each is all-gathered as a unit).

    `--fsdp_wrap A,B`: every submodule whose class is named A or B. Otherwise the repeated
    blocks: starting at the root, a module whose children of one class (not a container
    such as `nn.Sequential`) hold at least half of its parameters gives those children (a
    GPT's blocks, an MLP's layers, a ResNet's residual blocks); else the search goes on
    into its biggest child."""
    if wrap:
        names = {n.strip() for n in wrap.split(",") if n.strip()}
        found = [m for m in module.modules() if type(m).__name__ in names and m is not module]
        if not found:
            present = sorted({type(m).__name__ for m in module.modules()})
            raise ConfigError(
                f"--fsdp_wrap {wrap!r} matches no module of this model: choose among "
                f"{', '.join(present[:12])}"
            )
        return found
    node = module
    while True:
        total = _count(node)
        children = [c for c in node.children() if _count(c)]
        if not children or not total:
            return []
        by_class: dict[type, list[nn.Module]] = {}
        for child in children:
            if not isinstance(child, _CONTAINERS):  # a Sequential is a list, not a block
                by_class.setdefault(type(child), []).append(child)
        if by_class:
            group = max(by_class.values(), key=lambda g: sum(_count(c) for c in g))
            if len(group) >= 2 and 2 * sum(_count(c) for c in group) >= total:
                return group
        biggest = max(children, key=_count)
        if 2 * _count(biggest) < total:
            return []
        node = biggest


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def named_optimizer_state(optim: State, module: nn.Module) -> State:
    """An optimizer state keyed by parameter names. A torch `Optimizer.state_dict()`
    (integer ids, the order the optimizer was built in: the trainable parameters) is
    converted; one keyed by names is returned as it is."""
    groups = optim.get("param_groups", [])
    if not groups or all(isinstance(p, str) for g in groups for p in g["params"]):
        return optim
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    return {
        "state": {names[i]: s for i, s in optim.get("state", {}).items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
    }


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Materialise a lazily created optimizer state (Adam's moments appear at the first
    step) with a step of zero gradients at a learning rate of 0, so a checkpoint has
    tensors of the right shape to load into."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """An optimizer param group's settings, without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _cpu(v: Any) -> Any:
    return v.detach().cpu() if torch.is_tensor(v) else v


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _state_bytes(state: Any) -> int:
    return sum(
        _nbytes(v) for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    )


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
