"""How the model is spread over the ranks: one small interface, one class per way.

The trainer never asks which strategy runs. It calls `setup_module` once, wraps the
micro-steps that must not reduce gradients in `no_backward_sync`, and uses
`clip_grad_norm` / `grads_finite` / `module_state_dict` on the optimizer step and at a
checkpoint. `SingleDevice` is world size 1 (no wrapper, no collectives); `DDP` replicates
the model and all-reduces gradients once per optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddptrain.distributed import DistributedContext


class Strategy:
    """World size 1: the bare module; every method is the plain single-process one."""

    name = "single process"

    def __init__(self, ctx: DistributedContext) -> None:
        self.ctx = ctx
        self._found_inf = torch.zeros(1, device=ctx.device)
        self._one = torch.ones(1, device=ctx.device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The model the training step calls (a wrapper of `module`, or itself)."""
        return module

    @contextlib.contextmanager
    def no_backward_sync(self, model: nn.Module, skip: bool) -> Iterator[None]:
        """Inside, backward only accumulates gradients locally (when `skip`)."""
        yield

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping."""
        return nn.utils.clip_grad_norm_(params, max_norm)

    def grads_finite(self, params: list[nn.Parameter]) -> bool:
        """Whether every gradient is finite, with the same verdict on every rank.

        GradScaler's fused check (with a scale of 1, which leaves the values as they
        are) costs a few µs where a norm costs tens. Under DDP every rank holds the same
        all-reduced gradients, so the local verdict is already the global one."""
        grads = [p.grad for p in params if p.grad is not None]
        self._found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, self._one)
        return not self._found_inf.item()

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full model state with the user module's own names (no wrapper prefix)."""
        return module.state_dict()


class DDP(Strategy):
    """DistributedDataParallel: a full replica per rank, gradients all-reduced in backward."""

    name = "ddp"

    def setup_module(self, module: nn.Module) -> nn.Module:
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # Gradients written straight into the all-reduce buckets save a copy per step.
        return DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True)

    @contextlib.contextmanager
    def no_backward_sync(self, model: nn.Module, skip: bool) -> Iterator[None]:
        if not skip:
            yield
            return
        with model.no_sync():  # type: ignore[operator]
            yield


def create_strategy(ctx: DistributedContext) -> Strategy:
    return DDP(ctx) if ctx.distributed else Strategy(ctx)
