"""Checkpoints: one interface (`Checkpointer`: save, wait, locate, load) over two backends,
a `.pt` file rank 0 writes (`pt`) and a DCP step directory every rank writes its shard into
(`dcp`); where a resume starts (`manager`), the schema and its version (`schema`), RNG
states (`rng`) and the safetensors export (`export`)."""

from __future__ import annotations

from ddptrain.checkpoint.common import CheckpointError, CheckpointWriteError
from ddptrain.checkpoint.dcp import list_step_dirs
from ddptrain.checkpoint.export import (
    checkpoint_model_state,
    export_safetensors,
    export_safetensors_state,
    read_safetensors_state,
)
from ddptrain.checkpoint.manager import (
    Checkpointer,
    find_resumable,
    load_checkpoint,
    load_named,
    locate_resume,
)
from ddptrain.checkpoint.pt import BEST, LATEST, list_checkpoints, save_checkpoint
from ddptrain.checkpoint.schema import FORMAT_VERSION, Progress

__all__ = [
    "BEST",
    "FORMAT_VERSION",
    "LATEST",
    "CheckpointError",
    "CheckpointWriteError",
    "Checkpointer",
    "Progress",
    "checkpoint_model_state",
    "export_safetensors",
    "export_safetensors_state",
    "find_resumable",
    "list_checkpoints",
    "list_step_dirs",
    "load_checkpoint",
    "load_named",
    "locate_resume",
    "read_safetensors_state",
    "save_checkpoint",
]
