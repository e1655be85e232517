"""The collectives of one training step, counted by op: how many calls, how many bytes a
rank hands to them. Two witnesses that must agree:

    with CountCollectives() as counted:      # a fake rank's step (`train.probe`)
        ...
    traffic(counted.calls)                   # {"all_gather": {"calls": 4, "bytes": ...}}

    since = recorder_mark()                  # a real rank's step (torchrun, gloo)
    ...
    traffic(recorded_calls(since))

On fake ranks the collectives never leave the process: a `TorchDispatchMode` inside
`FakeTensorMode` sees each one as the dispatcher runs it (the c10d ops the
`torch.distributed` functions and DDP's reducer call, the functional ones DTensor calls),
with the shapes of its tensors. On real ranks torch's flight recorder keeps each
collective the process group ran (`TORCH_FR_BUFFER_SIZE` set before the group starts),
which is read back after the step (the same dump `observe.hang` reads).

The two name the same collective differently, and gloo runs some as others: its
reduce-scatter is an all-reduce of the whole input, which the recorder names so, called
from torch's `reduce_scatter_*` functions (its Python frames say so). Both are brought to
one name per collective (`OPS`). A call's bytes are its input tensors' (an all-gather's
shard, a reduce-scatter's whole input, an all-reduce's tensor, a send's or a receive's
buffer). The recorder keeps no point-to-point op on gloo (a pipeline's sends and
receives): the real run counts those with the same dispatch mode as the fake one.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# One name for each collective, from the dispatcher's op names (c10d's, the functional
# ones') and the flight recorder's (after the backend's `gloo:`)
OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "allgather_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "all_gather": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all", "all_to_all": "all_to_all", "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv", "recv": "recv",
    "barrier": "barrier", "reduce_": "reduce", "reduce": "reduce",
    "gather_": "gather", "gather": "gather", "scatter_": "scatter", "scatter": "scatter",
}
P2P = ("send", "recv")
NAMESPACES = ("c10d", "_c10d_functional")
# the c10d ops whose input is their second argument (the first is the output)
_OUTPUT_FIRST = {"_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_",
                 "allgather_coalesced_", "_reduce_scatter_base_", "reduce_scatter_",
                 "reduce_scatter_tensor_coalesced_", "alltoall_base_", "alltoall_",
                 "gather_", "scatter_"}
# One collective call: its name (`OPS`) and the bytes of its input
Call = tuple[str, int]
# By name: {"calls": n, "bytes": b}
Traffic = dict[str, dict[str, int]]


class CountCollectives(TorchDispatchMode):
    """Each collective the dispatcher runs while the mode is on, as a `Call`, in order.
    Entered inside `FakeTensorMode` it sees the ops before fake mode answers them (fake
    mode runs the functional ones' meta kernels: no c10d op under them is counted twice).
    `p2p_only`: sends and receives alone (a real rank's, which the recorder misses)."""

    def __init__(self, p2p_only: bool = False) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.p2p_only = p2p_only

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in NAMESPACES:
            base = func._schema.name.split("::")[-1]
            name = OPS.get(base)
            if name is not None and (not self.p2p_only or name in P2P):
                given = args[1] if base in _OUTPUT_FIRST and len(args) > 1 else args[0]
                self.calls.append((name, _bytes(given)))
        return func(*args, **kwargs)


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def traffic(calls: Iterable[Call]) -> Traffic:
    """Calls summed by name: {"all_gather": {"calls": 4, "bytes": 1024}, ...}."""
    out: Traffic = {}
    for name, nbytes in calls:
        row = out.setdefault(name, {"calls": 0, "bytes": 0})
        row["calls"] += 1
        row["bytes"] += nbytes
    return dict(sorted(out.items()))


def _recorder() -> dict[str, Any]:
    dump = torch._C._distributed_c10d._dump_fr_trace  # type: ignore[attr-defined]
    return pickle.loads(dump())  # torch's own bytes, from this process


def recorder_mark() -> int:
    """The flight recorder's last record id (-1: none yet): the calls after it are the
    next step's."""
    entries = _recorder().get("entries", [])
    return max((int(e["record_id"]) for e in entries), default=-1)


def recorded_calls(since: int) -> list[Call]:
    """The collectives the flight recorder kept after record `since`, as `Call`s."""
    entries = [e for e in _recorder().get("entries", []) if int(e["record_id"]) > since]
    return [_recorded(e) for e in sorted(entries, key=lambda e: int(e["record_id"]))]


_ITEMSIZE = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4,
             "Byte": 1, "Char": 1, "Bool": 1, "Short": 2}


def _recorded(entry: dict[str, Any]) -> Call:
    base = str(entry.get("profiling_name", "")).split(":")[-1]
    name = OPS.get(base, base)
    frames = [str(f.get("name", "")) for f in entry.get("frames") or []]
    if name == "all_reduce" and any(f.startswith("reduce_scatter") for f in frames):
        name = "reduce_scatter"  # gloo's: an all-reduce of the whole input
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    nbytes = 0
    for shape, dtype in zip(sizes, dtypes, strict=False):
        numel = 1
        for n in shape:
            numel *= int(n)
        nbytes += numel * _ITEMSIZE.get(str(dtype), 4)
    return name, nbytes
