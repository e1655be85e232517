"""One training step of a layout on fake ranks: the memory one rank would hold and the
collectives it would call, measured before a single device is allocated (`ddptrain plan`).

    figures = fake_step(config, world_size=64, rank=0, local_ranks=8, build=..., batch=...,
                        seq=..., vocab=...)
    figures["total"], figures["params"]       # peak bytes by kind (a dict)
    figures.collectives                       # {"all_gather": {"calls": 6, "bytes": ...}}
    stages = fake_stages(config, 64, 8, ...)  # --pp: one rank of each stage, in order

The step is the real one of the layout, whichever it is (ddp, zero, fsdp, HSDP, tp, fsdp x
tp, ep, pp): `resolve_strategy` and the job's device mesh, the strategy building the model
(on the meta device where it does), `parallelize`'s passes and the strategy's own (fsdp
shards, tp splits, ddp wraps, pp cuts the stages and keeps this rank's), the run's
optimizer over what they made, its state made as a first step makes it, then the
strategy's forward and backward (a plain one, DDP's reducing backward, a pipeline's
schedule over its micro-batches; under autocast where the config asks for it),
`finish_gradients`, the optimizer's step. It runs in this process as one rank, under
torch's fake process group and `FakeTensorMode`: tensors have shapes and no data,
collectives return at once, torch's `MemTracker` records each tensor's bytes by kind
(parameters, buffers, gradients, activations, temporaries, optimizer state) as a device
would hold them, and `train.collectives` counts each collective called. The peak is that
of forward and backward (the optimizer's step, in place, adds no bytes); the collectives
those of the whole step. A pipeline is measured at its second step: its first infers the
stages' shapes.

Where a rank would learn something from its peers' data, which fake peers do not send,
the answer is worked out here as they would give it (`fake_workarounds`): DDP's check of
the parameters' shapes, its reducer's all-reduce future, a pipeline's stage shapes and
shared tensors, the rows an expert layer exchanges (even routing: the calls are the real
ones, the bytes each rank sends the average of the group's).

What it does not see: the caching allocator's fragmentation, the communication library's
buffers (NCCL's), kernels' workspaces; `ddptrain plan` keeps a margin for them. The
weights are never filled (the model is marked as filled by its builder: no rank-0
template, no broadcast), which changes no byte a rank holds in training.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.layout import Layout
from ddptrain.parallel.base import FILLED_BY_BUILDER, Strategy, init_optimizer_state
from ddptrain.parallel.cp import of as context_of
from ddptrain.parallel.mesh import attach_mesh, build_mesh, ep_mesh, pp_mesh
from ddptrain.parallel.parallelize import parallelize
from ddptrain.parallel.pp import Pipeline
from ddptrain.parallel.resolve import resolve_strategy
from ddptrain.train.collectives import CountCollectives, Traffic, traffic
from ddptrain.train.fake_peers import answered_all_reduce, fake_workarounds, meshes_outside_fake
from ddptrain.train.optim import build_optimizer

# The kinds torch's trackers count (MemTracker's, FSDPMemTracker's), by the names
# `ddptrain plan` prints
KINDS = {"Parameter": "params", "Sharded Param": "params", "Unsharded Param": "params",
         "Buffer": "buffers", "Gradient": "grads", "Sharded Grad": "grads",
         "Unsharded Grad": "grads", "Activation": "activations", "Inputs": "activations",
         "Temp": "temporaries", "All Gather": "communication",
         "Reduce Scatter": "communication", "Optstate": "optimizer", "OptState": "optimizer",
         "Other": "other"}


class StepFigures(dict[str, int]):
    """Peak bytes by kind (`KINDS`' names, with `total`) that one rank holds in a training
    step, `held_params`, `held_grads`, `held_optimizer` (what it holds between steps) and
    `turn_<kind>` (as backward begins), as a dict (what `ddptrain plan` reads), and the
    step's collectives by op (`train.collectives.traffic`); `stage`: the rank's place on
    the pipeline (its stage, or its first of two under interleaved1f1b), None without
    one."""

    def __init__(self, peak: dict[str, int], collectives: Traffic,
                 stage: int | None = None) -> None:
        super().__init__(peak)
        self.collectives = collectives
        self.stage = stage


def _call(model: Any, inputs: torch.Tensor) -> Any:
    return model(inputs)


def forward_backward(strategy: Strategy, model: Any, tokens: torch.Tensor,
                     autocast: Any) -> None:
    """A language model's forward and backward on `tokens` (each position predicts the
    next) through the strategy, as the trainer runs a window's last micro-batch (a
    pipeline's schedule, DDP's reducing backward), then `finish_gradients`: the step
    `ddptrain plan` measures, the same on fake ranks and real ones. A pipeline's last
    stage scores each micro-batch against the first rows of the targets: the same shapes
    as its own rows, which a fake rank cannot read."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    split = context_of(model) if isinstance(model, nn.Module) else None
    if split is not None:  # --cp: this rank's slice of each sequence
        inputs, targets = split.shard(inputs, targets)

    def loss(output: Any, rows: torch.Tensor | None) -> torch.Tensor:
        logits = getattr(output, "logits", output)
        held = targets if rows is None else targets[: logits.size(0)]
        return F.cross_entropy(logits.float().flatten(0, 1), held.flatten())

    strategy.forward_backward(_call, model, inputs, loss, True, autocast)
    strategy.finish_gradients()


def one_step(strategy: Strategy, model: Any, optimizer: torch.optim.Optimizer,
             tokens: torch.Tensor, autocast: Any) -> None:
    forward_backward(strategy, model, tokens, autocast)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def warm_up(strategy: Strategy, model: Any, tokens: torch.Tensor, autocast: Any,
            module: nn.Module) -> None:
    """A pipeline's first step infers its stages' shapes, sending them from stage to
    stage, and runs each stage once more for it: the step measured is the second, as
    every later one. (No other layout needs one.)"""
    if isinstance(strategy, Pipeline):
        forward_backward(strategy, model, tokens, autocast)
        for p in module.parameters():
            p.grad = None


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


def pipeline_ranks(config: TrainingConfig, world_size: int) -> list[int]:
    """One rank of each pipeline stage (pp is the mesh's outermost dimension: stage s
    starts at rank s x world / pp); [0] without pipelining."""
    pp = config.pp
    return [s * (world_size // pp) for s in range(pp)]


def fake_stages(
    config: TrainingConfig, world_size: int, local_ranks: int,
    build: Callable[[torch.device], nn.Module], batch: int, seq: int, vocab: int,
) -> list[StepFigures]:
    """`fake_step` of the first rank of each pipeline stage, stage by stage (one without
    pipelining): a pipeline's ranks hold different stages, and the job needs the most
    any of them holds."""
    return [fake_step(config, world_size, r, local_ranks, build, batch, seq, vocab)
            for r in pipeline_ranks(config, world_size)]


def fake_step(
    config: TrainingConfig, world_size: int, rank: int, local_ranks: int,
    build: Callable[[torch.device], nn.Module], batch: int, seq: int, vocab: int,
) -> StepFigures:
    """Peak bytes by kind (`KINDS`) that `rank` of a job of `world_size` ranks holds in a
    training step of `config`'s layout, `batch` sequences of `seq` tokens a micro-step,
    and the collectives it calls in that step; measured on fake ranks (see the module's
    docstring). Under --pp `rank` holds its stage alone (`fake_stages`: every stage).
    Needs no process group of this process's own (it starts and ends a fake one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if config.batch_size != batch:  # a pipeline cuts the config's batch into micro-batches
        config = dataclasses.replace(config, batch_size=batch)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        ctx = DistributedContext(rank, rank % local_ranks, world_size, torch.device("cpu"),
                                 backend="fake")
        choice = resolve_strategy(config, world_size, "cpu", local_ranks)
        ctx = attach_mesh(ctx, choice.layout)
        if ctx.mesh is None and config.strategy == "fsdp" and world_size > 1:
            # fsdp over every rank: its mesh made here, outside fake mode
            layout = choice.layout or Layout(dp_shard=world_size)
            ctx = dataclasses.replace(ctx, mesh=build_mesh(layout, "cpu"))
        if config.ep > 1 and ctx.mesh is not None:
            ep_mesh(ctx, config.ep)  # made once, here, outside fake mode (as the mesh)
        dtype = amp_dtype(config)
        autocast = autocast_of(config)
        counter = CountCollectives()
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with (meshes_outside_fake(), fake_workarounds(config, build, batch, seq, fake, autocast),
              fake):
            strategy = choice.build(ctx, config, dtype)
            module = strategy.build_module(_filled_by_builder(build))
            model, _ = parallelize(module, strategy, config, ctx)
            if isinstance(model, DistributedDataParallel):
                # (a lambda: DDP checks a hook's annotations, which are strings here)
                model.register_comm_hook(
                    None, lambda state, bucket: answered_all_reduce(state, bucket))
            optimizer = build_optimizer(config, module, strategy, ctx.data_world).optimizer
            local = strategy.local_optimizer(optimizer)
            init_optimizer_state(local)
            tokens = torch.randint(0, vocab, (batch, seq + 1))
            warm_up(strategy, model, tokens, autocast, module)
            tracker = _tracker(module, local)
            with counter:
                with tracker:
                    # The optimizer's state is held (made as a first step makes it); its
                    # step, in place, adds no bytes, and a fused step over fake DTensor
                    # shards is counted as if each state were whole: forward and backward
                    # are measured, the step's collectives (zero's broadcasts) counted
                    forward_backward(strategy, model, tokens, autocast)
                    held = by_kind(tracker.get_tracker_snapshot("current"))
                turn = _backward_begins(tracker)
                peak = tracker.get_tracker_snapshot("peak")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        pipeline = pp_mesh(ctx)
        stage = pipeline.get_local_rank() if pipeline is not None else None
    finally:
        dist.destroy_process_group()
    # what the rank holds between steps (the state `ddptrain doctor` counts): after
    # backward, the gradients made, the activations gone
    state = {f"held_{k}": held[k] for k in ("params", "grads", "optimizer")}
    turning = {f"turn_{k}": v for k, v in turn.items()}
    return StepFigures({**by_kind(peak), **state, **turning}, traffic(counter.calls), stage)


def _backward_begins(tracker: Any) -> dict[str, int]:
    """What the rank holds as backward begins (the largest module's snapshot then: every
    saved activation and the loss alive), by kind: a moment whose bytes grow by the same
    amount with each block, which the peak, the largest of several moments, may not."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState
    from torch.distributed._tools.mem_tracker import _ModState

    moments = [snap for stats in tracker.memory_tracking.values()
               for state in (_ModState.PRE_BW, _FSDPModState.BEF_PRE_BW)
               for snap in stats.snapshots.get(state, [])]
    if not moments:
        return dict.fromkeys([*set(KINDS.values()), "total"], 0)
    return max((by_kind(m) for m in moments), key=lambda figures: figures["total"])


def _tracker(module: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torch's tracker for the module: FSDP's own, which counts a DTensor's local shard and
    sees through FSDP's hooks, for a module fully_shard made; MemTracker for the rest (a
    pipeline's stages called once a micro-batch: `_MicroBatches`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return FSDPMemTracker(module, optimizer)
    tracker = _micro_batch_tracker()()
    tracker.track_external(module, optimizer)
    return tracker


def _micro_batch_tracker() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class MicroBatches(MemTracker):
        """MemTracker, which takes a root module's second forward for a second step and
        refuses it: a pipeline stage's forward runs once a micro-batch, each measured
        anew (the tensors held, which make the peak, are counted as before)."""

        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                del self.memory_tracking[module]
                super()._pre_fw_hook(module, inputs)

    return MicroBatches


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


