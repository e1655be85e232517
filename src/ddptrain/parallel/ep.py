"""`--ep E`: expert parallelism, the experts of each mixture-of-experts layer spread over E
ranks (`ddptrain.models.moe`).

    torchrun --nproc_per_node=2 -m ddptrain train --dataset chars --model gpt \\
        --model_args experts=8 top_k=2 --ep 2                    # 4 experts a rank
    torchrun --nproc_per_node=4 -m ddptrain train --dataset chars --model gpt \\
        --model_args experts=8 top_k=2 --ep 2 --strategy fsdp    # and sharded over 2 more
    torchrun --nproc_per_node=2 -m ddptrain train --dataset mymod:tokens \\
        --model hf:models/tiny-mixtral --ep 2                    # a Mixtral, a Qwen3-MoE

The pass runs on the bare module before the strategy wraps it (`parallel.parallelize`),
and borrows the data-parallel ranks, as torchtitan does: the job's mesh lays them out as
`dp_mod_ep x ep` (`parallel.mesh.ep_mesh`: an expert group is `ep` ranks next to each
other, inside a node where `ep` divides it).
Each layer's batched expert weights become DTensors sharded by expert (dimension 0) on
the `ep` dimension, each rank keeping the rows of its E-th of the experts, and the layer
sends each token's rows to the rank of its expert and back with an all-to-all. So an
expert's gradient arrives on its rank whole, summed over the group's tokens; what is left
is a sum over `dp_mod_ep` and the data-parallel mean, which the strategies do (`ddp`: an
all-reduce once a window; `fsdp`: the experts' own unit, sharded over `dp_mod_ep`).
A Hugging Face mixture's experts module (transformers' batched weights) is marked as
the model is built and spread the same way (`models.hf_moe`); its router stays whole.
Checkpoints are DCP step directories (each rank writes its experts; a step resumes into
any other `--ep` or world size), and exports make each expert tensor whole under its own
name.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError
from ddptrain.parallel.mesh import ep_mesh


def expert_layers(module: nn.Module) -> list[tuple[str, Any]]:
    """The layers of `module` that spread their experts, by name: those naming their
    batched weights, experts first (`models.moe.MoE.expert_weights`; a Hugging Face
    mixture's experts module, marked as it is built: `models.hf_moe`)."""
    return [(n, m) for n, m in module.named_modules() if hasattr(m, "expert_weights")]


def expert_parallel(module: nn.Module, ctx: DistributedContext, ep: int) -> None:
    """Spread `module`'s experts over `ep` ranks, in place (see the module's docstring).
    Under tensor parallelism the tp ranks of a group hold the same experts."""
    # what `models.hf_moe` found but does not compute: named, not spread wrongly
    odd = sorted({str(m.no_expert_parallel) for m in module.modules()
                  if hasattr(m, "no_expert_parallel")})
    if odd:
        raise ConfigError(f"--ep {ep}: the experts of this model ({', '.join(odd)}) are laid "
                          "out in a way expert parallelism does not compute yet; train it "
                          "with --strategy fsdp, or use --model gpt --model_args experts=E "
                          "top_k=K")
    named = expert_layers(module)
    if not named:
        raise ConfigError(f"--ep {ep} needs a mixture of experts: --model gpt --model_args "
                          "experts=E top_k=K, or a Hugging Face one whose experts are "
                          "batched weights (hf:DIR of a Mixtral, a Qwen3-MoE)")
    mesh = ep_mesh(ctx, ep)
    # torch advises, on every rank, to flatten the mesh when a 2-D DTensor is made whole
    # in two collectives: here a gradient norm (a scalar) and an export's gather, both
    # as they must be
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_two_step_gathers)
    for name, layer in named:
        experts = getattr(layer, layer.expert_weights[0]).shape[0]
        if experts % ep:
            raise ConfigError(f"--ep {ep} does not divide the {experts} experts of "
                              f"{name}: choose --ep among the divisors of {experts}")
        for leaf in layer.expert_weights:
            whole = getattr(layer, leaf)
            # every rank built the same seeded weights: each keeps its own rows
            shard = distribute_tensor(whole.detach(), mesh["ep"], [Shard(0)],
                                      src_data_rank=None)
            setattr(layer, leaf, nn.Parameter(shard, requires_grad=whole.requires_grad))
        layer.ep_group = mesh["ep"].get_group()


def _two_step_gathers(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("While redistributing from")


def expert_params(module: nn.Module) -> dict[str, Any]:
    """The experts' batched weights spread by `expert_parallel`, by name."""
    return {f"{name}.{leaf}" if name else leaf: getattr(layer, leaf)
            for name, layer in expert_layers(module) for leaf in layer.expert_weights}
