"""One training step of a layout on fake ranks: the memory one rank would hold, measured
before a single device is allocated (`ddptrain plan`).

    peak = fake_step(config, world_size=64, rank=0, local_ranks=8, build=..., batch=..., seq=...)

The step is the real one of the layout: `resolve_strategy` and the job's device mesh,
the strategy building the model on the meta device, `parallelize`'s passes and the
strategy's own (fsdp shards, tp splits, ddp wraps), the run's optimizer over what they
made, its state made as a first step makes it, then one forward (under autocast where
the config asks for it), the loss and backward (the step itself updates in place). It
runs in this process under torch's fake process group and `FakeTensorMode`: tensors have
shapes and no data, collectives return at once, and torch's `MemTracker` records each
tensor's bytes by kind (parameters, buffers, gradients, activations, temporaries,
optimizer state) as a device would hold them; the peak is the step's.

What it does not see: the caching allocator's fragmentation, the communication library's
buffers (NCCL's), kernels' workspaces; `ddptrain plan` keeps a margin for them. The
weights are never filled (the model is marked as filled by its builder: no rank-0
template, no broadcast), which changes no byte a rank holds in training.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError
from ddptrain.layout import Layout
from ddptrain.parallel.base import FILLED_BY_BUILDER, init_optimizer_state
from ddptrain.parallel.mesh import attach_mesh, build_mesh
from ddptrain.parallel.parallelize import parallelize
from ddptrain.parallel.resolve import resolve_strategy
from ddptrain.train.optim import build_optimizer

# The kinds torch's trackers count (MemTracker's, FSDPMemTracker's), by the names
# `ddptrain plan` prints
KINDS = {"Parameter": "params", "Sharded Param": "params", "Unsharded Param": "params",
         "Buffer": "buffers", "Gradient": "grads", "Sharded Grad": "grads",
         "Unsharded Grad": "grads", "Activation": "activations", "Inputs": "activations",
         "Temp": "temporaries", "All Gather": "communication",
         "Reduce Scatter": "communication", "Optstate": "optimizer", "OptState": "optimizer",
         "Other": "other"}


def lm_step(model: Any, tokens: torch.Tensor, autocast: Any) -> torch.Tensor:
    """A language model's training loss on `tokens` (each position predicts the next):
    the step `ddptrain plan` measures, the same on fake ranks and real ones."""
    with autocast():
        out = model(tokens[:, :-1])
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def one_step(model: Any, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
             autocast: Any) -> None:
    lm_step(model, tokens, autocast).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def amp_dtype(config: TrainingConfig) -> torch.dtype | None:
    """The autocast dtype of the GPU run planned: `auto` is bfloat16, as on a card that
    computes it natively (`train.precision`)."""
    if not config.use_amp:
        return None
    return torch.float16 if config.amp_dtype == "float16" else torch.bfloat16


def autocast_of(config: TrainingConfig) -> Callable[[], Any]:
    dtype = amp_dtype(config)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast("cpu", dtype=dtype)


def fake_step(
    config: TrainingConfig, world_size: int, rank: int, local_ranks: int,
    build: Callable[[torch.device], nn.Module], batch: int, seq: int, vocab: int,
) -> dict[str, int]:
    """Peak bytes by kind (`KINDS`) that `rank` of a job of `world_size` ranks holds in a
    training step of `config`'s layout, `batch` sequences of `seq` tokens a micro-step;
    measured on fake ranks (see the module's docstring). Needs no process group of this
    process's own (it starts and ends a fake one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    layout = Layout.of(config, world_size)
    if config.strategy in ("ddp", "zero") and world_size > 1 and layout.plain:
        # DDP checks the parameters' shapes across ranks with their data, which a fake
        # tensor has none of: a ddp rank holds one process's step (its gradients are views
        # of DDP's buckets, no more bytes); zero keeps 1/N of the optimizer state
        if layout.ep > 1:
            raise ConfigError(f"--ep under {config.strategy} is not measured on fake ranks: "
                              "plan it under --strategy fsdp")
        one = fake_step(dataclasses.replace(config, strategy="ddp"), 1, 0, 1, build, batch,
                        seq, vocab)
        if config.strategy == "zero":
            kept = -(-one["optimizer"] // world_size)
            one = {**one, "optimizer": kept, "total": one["total"] - one["optimizer"] + kept}
        return one
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        ctx = DistributedContext(rank, rank % local_ranks, world_size, torch.device("cpu"),
                                 backend="fake")
        choice = resolve_strategy(config, world_size, "cpu", local_ranks)
        ctx = attach_mesh(ctx, choice.layout)
        if ctx.mesh is None:  # fsdp over every rank: its mesh made here, outside fake mode
            layout = choice.layout or Layout(dp_shard=world_size)
            ctx = dataclasses.replace(ctx, mesh=build_mesh(layout, "cpu"))
        dtype = amp_dtype(config)
        with _meshes_outside_fake(), FakeTensorMode(allow_non_fake_inputs=True):
            strategy = choice.build(ctx, config, dtype)
            module = strategy.build_module(_filled_by_builder(build))
            model, _ = parallelize(module, strategy, config, ctx)
            optimizer = build_optimizer(config, module, strategy, ctx.data_world).optimizer
            local = strategy.local_optimizer(optimizer)
            init_optimizer_state(local)
            tokens = torch.randint(0, vocab, (batch, seq + 1))
            tracker = _tracker(module, local)
            with tracker:
                # The optimizer's state is held (made as a first step makes it); its step,
                # in place, adds no bytes, and a fused step over fake DTensor shards is
                # counted as if each state were whole: forward and backward are measured
                lm_step(model, tokens, autocast_of(config)).backward()
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    return by_kind(peak)


def _tracker(module: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torch's tracker for the module: FSDP's own, which counts a DTensor's local shard and
    sees through FSDP's hooks, for a module fully_shard made; MemTracker for the rest."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return FSDPMemTracker(module, optimizer)
    tracker = MemTracker()
    tracker.track_external(module, optimizer)
    return tracker


def by_kind(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """One device's figures of a MemTracker snapshot, by `KINDS`' names, with `total`."""
    figures = next(iter(snapshot.values()), {})
    out = dict.fromkeys(KINDS.values(), 0)
    total = 0
    for kind, nbytes in figures.items():
        name = KINDS.get(getattr(kind, "value", str(kind)))
        if name is not None:
            out[name] += int(nbytes)
        else:
            total = max(total, int(nbytes))  # MemTracker's own total
    out["total"] = total or sum(out.values())
    return out


def _filled_by_builder(build: Callable[[torch.device], nn.Module]
                       ) -> Callable[[torch.device], nn.Module]:
    """The builder, its model marked as filled by the builder: allocated, never filled."""

    def marked(device: torch.device) -> nn.Module:
        with torch.device(device):
            module = build(device)
        setattr(module, FILLED_BY_BUILDER, True)
        return module

    return marked


@contextlib.contextmanager
def _meshes_outside_fake() -> Iterator[None]:
    """A device mesh made inside `FakeTensorMode` (FSDP x TP joins two: torch's
    `DeviceMesh._concatenate`) finds this rank's coordinates with `nonzero` on its rank
    table, which a fake tensor cannot answer: meshes are made with fake mode set aside."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    real = DeviceMesh.__init__

    def init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            real(self, *args, **kwargs)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = real  # type: ignore[method-assign]
