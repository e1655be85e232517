"""`--ep E`: expert parallelism, the experts of each mixture-of-experts layer spread over E
ranks (`ddptrain.models.moe`).

    torchrun --nproc_per_node=2 -m ddptrain train --dataset chars --model gpt \\
        --model_args experts=8 top_k=2 --ep 2          # 4 experts a rank

The pass runs on the bare module before DDP wraps it, and borrows the data-parallel ranks
(for now all of them, under ddp): each layer's batched expert weights become DTensors
sharded by expert (dimension 0) on a 1-D `ep` mesh, each rank keeping the rows of its
E-th of the experts, and the layer sends each token's rows to the rank of its expert
and back with an all-to-all. DDP leaves those weights alone: every rank's tokens reach
the expert's own rank, so its gradient arrives there whole, summed over the ranks, and is
divided by their number as DDP averages the others. Checkpoints are DCP step directories
(each rank writes its experts; a step resumes into any other `--ep` or world size), and
exports make each expert tensor whole under its own name.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError


def expert_parallel(module: nn.Module, ctx: DistributedContext, ep: int) -> list[str]:
    """Spread `module`'s experts over `ep` ranks, in place (see the module's docstring);
    returns the names of the experts' parameters, which DDP is to leave alone."""
    if ep != ctx.data_world:
        raise ConfigError(f"--ep {ep} spreads the experts over all the data-parallel ranks "
                          f"for now, and there are {ctx.data_world}: launch {ep} ranks")
    # a layer that spreads its experts names its batched weights (`models.moe.MoE`)
    layers = [(n, m) for n, m in module.named_modules() if hasattr(m, "expert_weights")]
    if not layers:
        raise ConfigError(f"--ep {ep} needs a mixture of experts: --model gpt --model_args "
                          "experts=E top_k=K")
    mesh = init_device_mesh(ctx.device.type, (ep,), mesh_dim_names=("ep",))
    names = []
    for name, layer in layers:
        if layer.experts % ep:
            raise ConfigError(f"--ep {ep} does not divide the {layer.experts} experts of "
                              f"{name}: choose --ep among the divisors of {layer.experts}")
        for leaf in layer.expert_weights:
            whole = getattr(layer, leaf)
            # every rank built the same seeded weights: each keeps its own rows
            shard = distribute_tensor(whole.detach(), mesh, [Shard(0)], src_data_rank=None)
            param = nn.Parameter(shard, requires_grad=whole.requires_grad)
            param.register_hook(lambda grad: grad / ep)  # summed over the ranks: averaged
            setattr(layer, leaf, param)
            names.append(f"{name}.{leaf}")
        layer.ep_group = mesh.get_group()
    return names
