"""User code for tests/test_hsdp_hosts.py: SGD that first writes down where this rank's
parameters live, as the strategy left them, to prove a layout from inside the run.

    --optimizer meshplug:recording_sgd --optimizer_args record=DIR

Each rank writes DIR/rank<R>.json: its rank, its host (the network interfaces of the
namespace it runs in, loopback aside: two network-namespace hosts differ there) and, for
each dimension of the mesh its parameters are sharded over (a DTensor's device mesh), the
global ranks of its group in that dimension.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def where(model: nn.Module) -> dict[str, Any]:
    """This rank, its host, and its group's ranks in each mesh dimension of the model's
    parameters (empty when they are plain tensors)."""
    groups: dict[str, list[int]] = {}
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            for name in mesh.mesh_dim_names or ():
                groups[name] = sorted(dist.get_process_group_ranks(mesh.get_group(name)))
            break
    return {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "host": sorted(name for _, name in socket.if_nameindex() if name != "lo"),
        "groups": groups,
    }


def recording_sgd(config: Any, model: nn.Module, record: str) -> torch.optim.Optimizer:
    """SGD with the run's --lr, --momentum and --weight_decay, after recording `where`."""
    found = where(model)
    Path(record).mkdir(parents=True, exist_ok=True)
    Path(record, f"rank{found['rank']}.json").write_text(json.dumps(found))
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                           weight_decay=config.weight_decay)
