"""The checkpoint kind of a run, decided in one place before any process group starts.

A run checkpoints as one `.pt` file (`step_N.pt`: rank 0 writes the whole state while the
others wait) or as a DCP step directory (`step_N/`: every rank writes its shard). The
config names the kind (`--checkpoint_format file | dcp`) or leaves it to ddptrain
(`auto`); `checkpoint_kind` says what `auto` means for a config on a world size, and,
once the model is built, for its size:

    checkpoint_kind(config)                           # from the flags alone
    checkpoint_kind(config, world_size, parameters, optimizer_slots(config))

What kind a path already on disk is, is read by `ddptrain.checkpoint.kind`.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from ddptrain.layout import Layout

if TYPE_CHECKING:
    from ddptrain.config import TrainingConfig

# Above this much model + optimizer state, `--checkpoint_format auto` has every ddp rank
# write a part (DCP) instead of rank 0 writing the whole state while the others wait.
DCP_ABOVE_BYTES = 2 << 30


class CheckpointKind(str, enum.Enum):
    """`file`: one `.pt` file; `dcp`: a torch.distributed.checkpoint step directory. A
    `str`, so that the kind compares with, and is written to YAML and JSON as, its name."""

    FILE = "file"
    DCP = "dcp"

    def __str__(self) -> str:
        return self.value


def checkpoint_kind(
    config: TrainingConfig, world_size: int | None = None, parameters: int | None = None,
    slots: int = 0,
) -> CheckpointKind:
    """The kind a run of `config` on `world_size` ranks checkpoints as; a named
    `--checkpoint_format` is kept. Under `auto`, ranks that each hold a share (zero, fsdp,
    tensor- or pipeline-parallel ranks, experts spread by `--ep`) write DCP; ddp ranks hold
    the whole state, so rank 0 writes one file, until the state of a model of `parameters`
    (fp32, and `slots` optimizer tensors for each) passes `DCP_ABOVE_BYTES` on 2+ ranks:
    then every rank writes a part of it in parallel (replicated tensors are written once)."""
    if config.checkpoint_format != "auto":
        return CheckpointKind(config.checkpoint_format)
    whole = config.strategy == "ddp" and Layout.of(config, world_size).plain and config.ep == 1
    if not whole:
        return CheckpointKind.DCP
    several = world_size is not None and world_size > 1
    if several and parameters is not None and 4 * parameters * (1 + slots) > DCP_ABOVE_BYTES:
        return CheckpointKind.DCP
    return CheckpointKind.FILE
