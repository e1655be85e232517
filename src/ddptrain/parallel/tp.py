"""`--tp T`: tensor parallelism, each layer split over T ranks that see the same batch,
composed with FSDP over the data-parallel ranks (FSDP x TP, 2-D; HSDP x TP, 3-D).

    torchrun --nproc_per_node=2 -m ddptrain train --dataset chars --tp 2           # TP alone
    torchrun --nproc_per_node=4 -m ddptrain train --dataset chars --tp 2 --strategy fsdp

The built-in GPT's plan: in every block the MLP is split Megatron-style (the widening
projection by columns, the narrowing one by rows: one all-reduce); attention is split by
heads, each rank computing `n_head / T` of them. Its fused q/k/v projection is laid out
head by head (`models.gpt.CausalSelfAttention`), so its row shard is whole heads: it is
split like the widening projection, and the output projection by rows (one all-reduce).
Per layer that is one all-reduce forward and one backward, Megatron's count: no
activation is gathered. Embeddings, norms and the tied head stay whole on every tp rank
(plain tensors, identical there), sharded by FSDP over the data-parallel ranks.
`--sequence_parallel` splits the norms too, by sequence (`parallelize_gpt`).

Any other model takes a plan of its own: `--tp_plan package.module:fn`, where
`fn(model, tp_mesh)` parallelizes the model in place (`parallelize_module`).

The split parameters are DTensors, and under FSDP every parameter is: the checkpoint's
state is the whole model's under its own names (`get_state_dict` gathers or reshards), and
the gradient norm is the true global one, whichever mesh (or none) each parameter lives on.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ddptrain.config_sections import ParallelSection
from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError
from ddptrain.parallel.lora import tp_plan_with_adapters
from ddptrain.parallel.mesh import tp_mesh
from ddptrain.parallel.tp_hf import hf_tp_plan
from ddptrain.plugins import load_ref

log = logging.getLogger("ddptrain")
TPPlan = Callable[[nn.Module, DeviceMesh], Any]


def tensor_parallel(module: nn.Module, config: ParallelSection, ctx: DistributedContext) -> None:
    """The tensor-parallel pass (`parallel.parallelize`): `module` (on the meta device, or
    whole) split in place over the mesh's tp dimension by its plan
    (`tensor_parallel_plan`); the strategy (`parallel.fsdp`) then shards it over the
    data-parallel ranks, or leaves it as it is where tp takes every rank."""
    mesh = tp_mesh(ctx)
    assert mesh is not None, "tensor parallelism runs on a mesh with a tp dimension"
    plan = tensor_parallel_plan(module, config)
    if config.sequence_parallel and plan is not parallelize_gpt:
        raise ConfigError(
            f"--sequence_parallel is the built-in GPT's, and this model is a "
            f"{type(module).__name__}: drop the flag"
        )
    if plan is parallelize_gpt:
        # under --ep each expert stays whole on its ep rank, the same on every tp rank
        plan = functools.partial(parallelize_gpt, sequence_parallel=config.sequence_parallel,
                                 experts_by_tp=config.ep == 1)
    plan(module, mesh)


def tensor_parallel_plan(module: nn.Module, config: ParallelSection) -> TPPlan:
    """`--tp_plan` when given, the built-in GPT's plan for the built-in GPT, a Hugging
    Face model's (`tp_hf`) for GPT-2 and Llama-style models; any other model without a
    plan is a ConfigError."""
    if config.tp_plan:
        fn = load_ref(config.tp_plan, "tp_plan")
        if not callable(fn):
            raise ConfigError(
                f"--tp_plan {config.tp_plan!r} is not a function: give fn(model, tp_mesh)"
            )
        return fn
    if _gpt_layout(module):
        return parallelize_gpt
    if (hf := hf_tp_plan(module, config.tp)) is not None:
        return hf
    raise ConfigError(
        f"--tp {config.tp}: ddptrain has tensor-parallel plans for the built-in GPT and "
        f"Hugging Face GPT-2 and Llama-style models, and this model is a "
        f"{type(module).__name__}: give --tp_plan package.module:fn, "
        "fn(model, tp_mesh) calling parallelize_module"
    )


def parallelize_gpt(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False,
                    experts_by_tp: bool = True) -> None:
    """The built-in GPT's plan (see the module's docstring). `sequence_parallel`: the norms
    and the residual stream between them are split by sequence over the tp ranks, each
    holding T / tp tokens; attention and the MLP all-gather their input's tokens and
    reduce-scatter their output (the traffic of the all-reduce they replace), and the
    tied head gathers them back. `experts_by_tp`: a mixture's experts split by hidden
    width (`split_experts`); else left whole (`--ep` spreads them)."""
    tp = mesh.size()
    heads = int(model.config.n_head)  # type: ignore[union-attr, arg-type]
    block_size = int(model.config.block_size)  # type: ignore[union-attr, arg-type]
    # A model handed over: `fit` checks the data's own sequence length before the group.
    check_gpt_split(tp, heads, block_size if sequence_parallel else None)
    tokens = Shard(1)  # (B, T, C): the sequence dimension
    gather = PrepareModuleInput(input_layouts=(tokens,), desired_input_layouts=(Replicate(),),
                                use_local_output=True)
    for block in model.blocks:  # type: ignore[union-attr]
        out = tokens if sequence_parallel else Replicate()
        plan: dict[str, ParallelStyle] = {
            "attn.qkv": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=out),
        }
        if hasattr(block.mlp, "expert_weights"):
            if experts_by_tp:
                split_experts(block.mlp, mesh)
        else:
            plan.update({"mlp.c_fc": ColwiseParallel(),
                         "mlp.c_proj": RowwiseParallel(output_layouts=out)})
        if sequence_parallel:
            norm = SequenceParallel(use_local_output=True)
            plan.update({"ln_1": norm, "attn": gather, "ln_2": norm, "mlp": gather})
        parallelize_module(block, mesh, tp_plan_with_adapters(block, plan))
    if sequence_parallel:
        split = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(tokens,),
                                   use_local_output=True)
        parallelize_module(model, mesh, {
            "blocks.0": split, "ln_f": SequenceParallel(use_local_output=True),
            "lm_head": gather,
        })
        model.register_forward_pre_hook(_EvenTokens(tp))


def split_experts(layer: nn.Module, mesh: DeviceMesh) -> None:
    """A mixture's experts split Megatron-style over the tp ranks (`models.moe.MoE`): each
    rank holds a slice of every expert's hidden width (the widening weights and biases by
    columns, the narrowing weights by rows) and the layer sums the partial products over
    the ranks, one all-reduce forward and one backward; the router and the output biases
    stay whole on every rank."""
    hidden = layer.get_parameter("w_in").size(2)
    if hidden % mesh.size():
        raise ConfigError(f"--tp {mesh.size()} does not divide the experts' hidden width "
                          f"{hidden}: choose --tp among its divisors")
    for leaf, dim in (("w_in", 2), ("b_in", 1), ("w_out", 1)):
        whole = getattr(layer, leaf)
        shard = distribute_tensor(whole.detach(), mesh, [Shard(dim)], src_data_rank=None)
        setattr(layer, leaf, nn.Parameter(shard, requires_grad=whole.requires_grad))
    setattr(layer, "tp_group", mesh.get_group())  # noqa: B010 (an attribute, not a module)


class _EvenTokens:
    """Refuses a batch whose sequence the tp ranks cannot split evenly."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        tokens = args[0].size(1) if args and isinstance(args[0], torch.Tensor) else 0
        if tokens % self.tp:
            raise ConfigError(
                f"--sequence_parallel splits each sequence over --tp {self.tp} ranks and a "
                f"batch has {tokens} tokens: feed sequences whose length tp divides, or drop "
                "the flag"
            )


def check_gpt_split(tp: int, n_head: int, tokens: int | None = None) -> None:
    """Refuse a tensor-parallel degree that does not divide the GPT's heads (each rank
    computes `n_head / tp` of them), or under `--sequence_parallel` the `tokens` of a
    sequence. Called before the process group too (`fit`)."""
    if n_head % tp:
        raise ConfigError(
            f"--tp {tp} does not divide the GPT's {n_head} attention heads: choose a tp "
            "that does"
        )
    if tokens is not None and tokens % tp:
        raise ConfigError(
            f"--sequence_parallel splits the GPT's {tokens} tokens over --tp {tp} ranks: "
            "choose a --block_size that tp divides, or drop the flag"
        )


def _gpt_layout(module: nn.Module) -> bool:
    """Whether `module` is laid out as the built-in GPT (`ddptrain.models.gpt`): blocks of
    a head-by-head fused-qkv attention (which computes the heads its projection holds),
    and an MLP."""
    blocks = getattr(module, "blocks", None)
    return hasattr(getattr(module, "config", None), "n_head") and bool(blocks) and all(
        hasattr(b, "mlp") and all(hasattr(getattr(b, "attn", None), n) for n in ("qkv", "head_dim"))
        for b in blocks  # type: ignore[union-attr]
    )

