"""`--strategy ddp`: DistributedDataParallel, a full replica per rank, gradients
all-reduced in buckets during backward.

The bucket layout, and why a resume keeps it. A freshly built DDP reduces its first
backward in its first layout (every gradient in one bucket, in parameter order); after
that backward it rebuilds its buckets in the order the gradients became ready (rank 0's
order, on every rank) and keeps them. On 3 ranks or more gloo's ring all-reduce sums each
element in an order set by its offset in the bucket, so the same gradients in another
layout come out different in the last bit; on 2, a + b is the same either way. A resumed
run would reduce its first step in the first layout where the uninterrupted run used the
rebuilt one. So the order the gradients became ready in is recorded (once, in the first
backward that reduces them) and saved with every checkpoint (`layout_state`), and a resume
builds DDP again with the rebuilt layout from its very first step (`resume_module`); the
rebuild after that step then makes the same layout again. Nothing of this runs per step.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ddptrain.parallel.base import (
    NO_CONTEXT,
    OptimizerSpec,
    State,
    Strategy,
    by_layout,
    clip_by_layout,
    local_tensor,
)
from ddptrain.parallel.ep import expert_params
from ddptrain.parallel.mesh import ep_mesh
from ddptrain.parallel.zero import ZeroOptimizer

READY_ORDER = "grad_ready_order"  # the key in `layout_state`: parameter names


class DDP(Strategy):
    """DistributedDataParallel: a full replica per rank, gradients all-reduced in backward;
    under `--strategy zero` the optimizer state sharded too (`parallel.zero`)."""

    name = "ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.zero = ZeroOptimizer(self.ctx) if self.config.strategy == "zero" else None
        self.name = "zero" if self.zero else "ddp"
        self._ready: ReadyOrder | None = None
        # --ep: each rank's experts differ (their flags too), and every forward exchanges
        # tokens with every rank, so all ranks run as many
        self.experts_apart = self.config.ep > 1
        self.flags_differ = self.even_forwards = self.experts_apart
        self._experts: list[nn.Parameter] = []  # --ep: this rank's experts, DDP's to ignore
        self._replicas: Any = None  # --ep: the group holding the same experts, if several

    def _spread_experts(self, module: nn.Module) -> None:
        """`--ep`: each rank keeps its experts (spread by the `parallel.ep` pass). An
        expert's gradient arrives summed over its group's tokens: divided by every
        data-parallel (x cp) rank here, as DDP averages the rest, and summed over the groups in
        `finish_gradients`."""
        mesh = ep_mesh(self.ctx, self.config.ep)
        experts = expert_params(module)
        world = self.ctx.grad_world
        for p in experts.values():
            p.register_hook(lambda grad: grad / world)
        self._experts = list(experts.values())
        if mesh.size(0) > 1:
            self._replicas = mesh.get_group("dp_mod_ep")
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(experts))

    def finish_gradients(self) -> None:
        if self._replicas is None:
            return
        grads = [local_tensor(p.grad) for p in self._experts if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for them all
        dist.all_reduce(flat, group=self._replicas)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.experts_apart:
            self._spread_experts(module)
        model = self._wrap(module)
        # With --find_unused_parameters DDP never rebuilds its buckets: nothing to keep
        # (nor with --ep, whose experts are not in them).
        if not (self.config.find_unused_parameters or self.experts_apart):
            self._ready = ReadyOrder(model, module)
        return model

    # ------------------------------------------------------------------ optimizer
    def build_optimizer(
        self, module: nn.Module, spec: OptimizerSpec, groups: list[dict[str, Any]] | None = None
    ) -> torch.optim.Optimizer:
        if self.zero:
            return self.zero.build_optimizer(module, spec, groups)
        return super().build_optimizer(module, spec, groups)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.zero.adopt_optimizer(optimizer) if self.zero else optimizer

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.zero.local_optimizer(optimizer) if self.zero else optimizer

    def full_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        if self.zero:
            return self.zero.full_state(module, optimizer)
        return super().full_state(module, optimizer)

    def sharded_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        if self.zero:
            return self.zero.sharded_state(module, optimizer)
        return super().sharded_state(module, optimizer)

    def load_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, model: State, optim: State,
        full: bool,
    ) -> None:
        if self.zero:
            return self.zero.load_state(module, optimizer, model, optim, full)
        return super().load_state(module, optimizer, model, optim, full)

    def rank_bytes(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        figures = super().rank_bytes(module, optimizer)
        if self.zero:
            figures["optimizer"] = self.zero.state_bytes(optimizer)
        return figures

    # ------------------------------------------------------------------ state
    def model_state(self, module: nn.Module) -> State:
        state = super().model_state(module)
        if not self.experts_apart:
            return state
        # Collective: each expert tensor whole (every rank takes part in the gather)
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        if not self.experts_apart:
            return super().clip_grad_norm(params, max_norm)
        # the experts' DTensor gradients, the replicated rest
        return clip_by_layout(by_layout(params), max_norm, self.ctx.device)

    def _wrap(
        self, module: nn.Module, order: list[str] | None = None,
        caps: tuple[int, int] | None = None, sync: bool = True,
    ) -> DistributedDataParallel:
        """DDP over `module`; `sync`: broadcast rank 0's weights and buffers first (a
        fresh start), not where every rank holds the same ones already (a resume)."""
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        with first_buckets(module, order, caps):
            # Gradients written straight into the all-reduce buckets save a copy per step.
            return DistributedDataParallel(
                module, device_ids=device_ids, gradient_as_bucket_view=True,
                find_unused_parameters=self.config.find_unused_parameters,
                static_graph=self.config.static_graph, init_sync=sync,
            )

    def no_backward_sync(self, model: nn.Module, skip: bool) -> AbstractContextManager[Any]:
        return model.no_sync() if skip else NO_CONTEXT  # type: ignore[operator]

    def layout_state(self) -> State:
        names = self._ready.names if self._ready else []
        return {READY_ORDER: list(names)} if names else {}

    def resume_module(self, model: nn.Module, module: nn.Module, saved: State) -> nn.Module:
        """DDP built again, its first layout the one the checkpointed run had rebuilt
        (when the checkpoint knows it and the parameters are the same)."""
        order = ([] if self.config.find_unused_parameters or self.experts_apart
                 else saved.get(READY_ORDER) or [])
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        if not isinstance(model, DistributedDataParallel) or sorted(order) != sorted(trainable):
            return model
        config = getattr(model, "_bucket_config", None)
        first = getattr(config, "first_bucket_bytes_cap", dist._DEFAULT_FIRST_BUCKET_BYTES)
        caps = (int(first), int(model.bucket_bytes_cap))
        if self._ready is not None:
            self._ready.close()
        self._ready = ReadyOrder.known(order)
        # The replaced wrapper's reducer removes its hooks once the trainer lets go of it.
        # The checkpoint loaded the same weights on every rank: no second broadcast.
        return self._wrap(module, order, caps, sync=False)


class ReadyOrder:
    """The trainable parameters' names in the order their gradients become ready in the
    first backward that reduces them (DDP's rebuild goes by rank 0's, and rank 0 writes
    the checkpoint's meta); recorded by a hook on each parameter, all removed at the end
    of that backward."""

    def __init__(self, model: DistributedDataParallel, module: nn.Module) -> None:
        self.names: list[str] = []
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._count, ddp = len(params), weakref.ref(model)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(ddp, n)) for n, p in params
        ]

    @classmethod
    def known(cls, names: list[str]) -> ReadyOrder:
        ready = cls.__new__(cls)
        ready.names, ready._count, ready._handles = list(names), len(names), []
        return ready

    def _hook(self, ddp: weakref.ref[DistributedDataParallel], name: str) -> Any:
        def ready(_: torch.Tensor) -> None:
            model = ddp()
            # Backwards inside no_sync() reduce nothing; DDP records only the others.
            if model is None or not model.require_backward_grad_sync:
                return
            if len(self.names) < self._count:
                self.names.append(name)
                if len(self.names) == self._count:
                    # A hook may not remove itself while it runs: at the backward's end.
                    Variable._execution_engine.queue_callback(self.close)

        return ready

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@contextlib.contextmanager
def first_buckets(
    module: nn.Module, order: list[str] | None, caps: tuple[int, int] | None
) -> Iterator[None]:
    """While DDP is built: its first bucket layout made as its rebuild makes it from
    `order` (names, in the order the gradients became ready) with `caps` (the first
    bucket's and the others' byte limits), instead of one bucket in parameter order."""
    assign = getattr(dist, "_compute_bucket_assignment_by_size", None)
    if not order or caps is None or assign is None:
        yield
        return
    named = dict(module.named_parameters())
    ready = [named[n] for n in order]

    def layout(
        params: list[torch.Tensor], limits: list[int], expect_sparse: list[bool] | None = None,
        *rest: Any, **kwargs: Any,
    ) -> tuple[list[list[int]], list[int]]:
        index = {id(p): i for i, p in enumerate(params)}
        indices = [index[id(p)] for p in ready]
        sparse = [expect_sparse[i] for i in indices] if expect_sparse else []
        buckets, per_bucket = assign([params[i] for i in indices], list(caps), sparse, indices)
        # DDP reverses the list it is given (its own follows the parameter order).
        return buckets[::-1], per_bucket[::-1]

    dist._compute_bucket_assignment_by_size = layout  # type: ignore[assignment]
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = assign


def reducer_advice(exc: BaseException) -> str | None:
    """DDP's reducer on a model whose steps leave parameters out of the loss, as what to
    pass; None for any other error. (The peer rank may fail the same way, or lose this one.)"""
    text = str(exc)
    if not isinstance(exc, RuntimeError):
        return None
    if "not compatible with static_graph" in text:
        return (
            "the model used other parameters on this step than on the first, and "
            "--static_graph says it never does: use --find_unused_parameters instead"
        )
    if "mark a variable ready only once" in text:
        return (
            "a parameter got its gradient twice in one backward pass (a module reused, or "
            "reentrant activation checkpointing): add --static_graph if the model uses the "
            "same parameters on every step"
        )
    if "finished reduction in the prior iteration" not in text and (
        "not used in producing loss" not in text
    ):
        return None
    if "find_unused_parameters=True` is enabled" in text:
        return (
            "DDP could not follow the loss back to every output the model returned, though "
            "--find_unused_parameters is on: compute the loss from all of the model's "
            "outputs, or return only those the loss uses"
        )
    # names with TORCH_DISTRIBUTED_DEBUG=INFO, else indices
    names = re.search(r"Parameters which did not receive grad for rank \d+: ([^\n]+)", text)
    indices = re.search(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)",
                        text)
    which = (
        f" ({names.group(1).strip()[:120]})" if names
        else f" (parameter indices {indices.group(1).strip()})" if indices else ""
    )
    return (
        f"the model left parameters{which} out of the loss on a step, and DDP waits for "
        "their gradients: add --find_unused_parameters (or --static_graph if the same "
        "parameters go unused on every step)"
    )
