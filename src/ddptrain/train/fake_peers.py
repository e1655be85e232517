"""What a fake rank cannot answer, answered as its peers would (`train.probe.fake_step`).

A rank under torch's fake process group and `FakeTensorMode` has no peers and no data:
a collective returns at once with nothing in it, a tensor has a shape and no values.
Where the step asks a peer something (DDP's shape check, a pipeline's vote and stage
shapes, the tensors several stages hold) or reads a value (`--ep`'s token counts, a
device mesh's coordinates), the answer is worked out here as every real rank would get
it; each workaround says what it answers and how.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.config import TrainingConfig
from ddptrain.layout import Layout


@contextlib.contextmanager
def meshes_outside_fake() -> Iterator[None]:
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


def answered_all_reduce(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's bucket all-reduce on a fake rank: the same collective, its future answered
    here with the bucket (a fake group's future holds no value, which DDP's own hook
    hands back to its reducer)."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


@contextlib.contextmanager
def fake_workarounds(config: TrainingConfig, build: Callable[[torch.device], nn.Module],
                     batch: int, seq: int, fake: Any, autocast: Any) -> Iterator[None]:
    """What a fake rank cannot answer, answered as the other ranks would (see each);
    `autocast`: the step's autocast context (a pipeline's stages run under it)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_ddp_without_shape_check())
        stack.enter_context(_swaps_past_the_memo(fake))
        if config.pp > 1:
            stack.enter_context(_pipeline_without_peers(config, build, batch, seq, autocast))
        if config.ep > 1:
            stack.enter_context(_balanced_experts())
        yield


@contextlib.contextmanager
def _swaps_past_the_memo(fake: Any) -> Iterator[None]:
    """A fake parameter is moved off the meta device by swapping it with its new tensor
    (`nn.Module.to_empty`: tp's whole tensors), which torch refuses for a tensor that fake
    mode's converter remembers (a weak reference): it is forgotten first."""
    real = torch.utils.swap_tensors
    memo = fake.fake_tensor_converter.meta_converter.tensor_memo

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        for key in [k for k, v in list(memo.items()) if v is t1 or v is t2]:
            del memo[key]
        real(t1, t2)

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = real


@contextlib.contextmanager
def _ddp_without_shape_check() -> Iterator[None]:
    """DDP compares its parameters' shapes with every rank's by their values, which no
    fake tensor has: every rank builds the same model, so the check is left out."""
    import torch.nn.parallel.distributed as ddp

    real = ddp._verify_param_shape_across_processes
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes = real


@contextlib.contextmanager
def _pipeline_without_peers(config: TrainingConfig,
                            build: Callable[[torch.device], nn.Module],
                            batch: int, seq: int, autocast: Any) -> Iterator[None]:
    """A pipeline rank learns from its peers what the stages hold and pass: which tensors
    several stages hold (`_shared_parameters`: an object all-gather), the stages' shapes
    (torch's vote and metadata sends before the first step). A fake peer sends nothing:
    the answers are worked out here from the whole model, split as every rank splits it,
    each stage run on fake tensors of a micro-batch's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import (
        _derive_grad_metas,
        _StageBackwardMeta,
        _StageForwardMeta,
        extract_tensor_metas,
    )

    from ddptrain.parallel import pp
    from ddptrain.parallel.mesh import pipeline_microbatches

    stages = config.pp * (2 if config.pp_schedule == "interleaved1f1b" else 1)
    micro = batch // pipeline_microbatches(config)
    holders: dict[str, set[int]] = {}
    inputs: dict[int, Any] = {}
    whole_shapes: dict[str, tuple[int, ...]] = {}
    apart = FakeTensorMode(allow_non_fake_inputs=True)
    with apart, _swaps_past_the_memo(apart), torch.device("cpu"):
        whole = build(torch.device("cpu"))
        first = {id(p): n for n, p in whole.named_parameters()}
        whole_shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}
        split = pp.stage_split(whole, config)
        x: Any = torch.randint(0, 2, (micro, seq))
        for s in range(stages):
            view = split(whole, s, stages)
            for p in view.parameters():
                holders.setdefault(first[id(p)], set()).add(s % config.pp)
            inputs[s] = extract_tensor_metas((x,))
            with autocast():
                x = view(x)
    data_world = Layout.of(config, dist.get_world_size()).data_parallel

    def shared(module: nn.Module, group: Any, canonical: dict[str, str]
               ) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, int]]:
        mine = {canonical.get(n, n): (tuple(p.to_local().shape if hasattr(p, "to_local")
                                            else p.shape), p.dtype)
                for n, p in module.named_parameters()}
        names = sorted(n for n, r in holders.items() if len(r) > 1)
        shapes = {n: mine.get(n) or (_shard_shape(whole_shapes[n], data_world),
                                     torch.float32) for n in names}
        return shapes, {n: min(holders[n]) for n in names}

    def vote(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _Dynamic()  # each stage infers its shapes, as every real rank votes

    def recv_meta(self: Any, src_stage: int) -> Any:
        if src_stage < self.stage_index:
            return _StageForwardMeta(forward_metas=inputs[self.stage_index])
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))

    patched = {"_warmup_forward_vote": vote, "_warmup_backward_result": vote,
               "_recv_meta": recv_meta, "_send_meta": lambda self, meta, dst: None}
    real = {k: getattr(PipelineStage, k) for k in patched}
    real_shared = pp._shared_parameters
    for k, fn in patched.items():
        setattr(PipelineStage, k, fn)
    pp._shared_parameters = shared
    try:
        yield
    finally:
        for k, fn in real.items():
            setattr(PipelineStage, k, fn)
        pp._shared_parameters = real_shared


class _Dynamic:
    """torch's vote on how the stages learn their shapes, as a tensor it reads with
    `item()`: 0, inferred at the first step (no stage was given its shapes)."""

    def item(self) -> int:
        return 0


def _shard_shape(shape: tuple[int, ...], ranks: int) -> tuple[int, ...]:
    """The first rank's shard of a tensor FSDP splits by rows over `ranks`."""
    if ranks == 1 or not shape:
        return shape
    return (-(-shape[0] // ranks), *shape[1:])


@contextlib.contextmanager
def _balanced_experts() -> Iterator[None]:
    """--ep: each rank reads how many rows it sends each expert and gets from each rank
    (`models.moe.exchange`: one host read), which a fake rank's routing has no values
    for. A fake rank's router spreads its rows evenly: as many to each rank, and from
    each rank as many to each of its experts."""
    from torch._subclasses.fake_tensor import FakeTensor

    from ddptrain.models import moe

    real = moe.exchange
    real_tolist = FakeTensor.tolist

    def exchange(rows: torch.Tensor, counts: torch.Tensor, compute: Any,
                 group: Any) -> torch.Tensor:
        ranks = dist.get_world_size(group)
        local = counts.numel() // ranks
        n = rows.size(0)
        send = _even(n, ranks)
        got = [c for q in range(ranks) for c in _even(send[q], local)]
        values = [*send, *got]

        def tolist(t: FakeTensor) -> Any:
            return list(values) if t.numel() == len(values) else real_tolist(t)

        FakeTensor.tolist = tolist  # type: ignore[method-assign,assignment]
        try:
            return real(rows, counts, compute, group)
        finally:
            FakeTensor.tolist = real_tolist  # type: ignore[method-assign]

    moe.exchange = exchange
    try:
        yield
    finally:
        moe.exchange = real


def _even(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]

