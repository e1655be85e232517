"""`--ema_decay D`: an exponential moving average of the weights.

After every optimizer step, each trainable parameter's average moves toward it:
`ema = D * ema + (1 - D) * weight` (one fused lerp over all of them, on the device, no
host read; a step skipped on the device moves it by 0). The averages are tensors of the
same kind as the weights: whole tensors under ddp and zero, this rank's DTensor shards
under fsdp, so they cost each rank what its parameters do. Buffers (BatchNorm
statistics) are not averaged: the EMA model uses the live ones.

Evaluating or exporting the EMA puts it into the module for a moment (`swapped`), so the
strategy's own evaluation and gathering serve it unchanged; the weights are put back bit
for bit. The averages are saved with every checkpoint (`shadow`: `.pt` gathers them
whole, DCP writes each rank's shards) and loaded on a resume.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ddptrain.parallel.base import local_tensor


class EMA:
    """The moving average of `module`'s trainable floating-point parameters."""

    def __init__(self, module: nn.Module, decay: float) -> None:
        self.decay = decay
        named = [
            (n, p) for n, p in module.named_parameters()
            if p.requires_grad and p.is_floating_point()
        ]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in self.params]

    def _locals(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [local_tensor(p) for p in self.params], [local_tensor(s) for s in self.shadow]

    @torch.no_grad()
    def update(self, skipped: torch.Tensor | None = None) -> None:
        """Move the averages toward the weights (after an optimizer step); not at all
        where the device flag `skipped` is 1.0 (the step was skipped on the device)."""
        params, shadow = self._locals()
        if skipped is None:
            torch._foreach_lerp_(shadow, params, 1.0 - self.decay)
            return
        weight = (1.0 - skipped) * (1.0 - self.decay)
        cast = {s.dtype: weight.to(s.dtype) for s in shadow}
        torch._foreach_lerp_(shadow, params, [cast[s.dtype] for s in shadow])

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside, the module holds the averages; afterwards its own weights again."""
        params, shadow = self._locals()
        with torch.no_grad():
            kept = [p.clone() for p in params]
            torch._foreach_copy_(params, shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, kept)

    def state(self) -> dict[str, torch.Tensor]:
        """The averages by parameter name, as held (DTensor shards under fsdp): what a
        checkpoint saves, and what a DCP load fills in place."""
        return dict(zip(self.names, self.shadow, strict=True))

    @torch.no_grad()
    def load_full(self, state: dict[str, torch.Tensor]) -> list[str]:
        """Take whole averages (a `.pt` checkpoint's); each rank keeps its shard. The
        averages `state` lacks start from the weights as they are now (the resumed ones:
        call it after the weights are loaded); returns their names."""
        missing = []
        for name, shadow, param in zip(self.names, self.shadow, self.params, strict=True):
            full = state.get(name)
            if full is None:
                missing.append(name)
                local_tensor(shadow).copy_(local_tensor(param))
                continue
            if isinstance(shadow, DTensor):
                # Every rank holds the whole tensor: each takes its slice, no communication.
                full = distribute_tensor(
                    full.to(shadow.device), shadow.device_mesh, shadow.placements,
                    src_data_rank=None,
                )
            local_tensor(shadow).copy_(local_tensor(full))
        return missing
