"""Initial weights for a fresh run (`--init_from PATH`): the weights only, with a fresh
optimizer, schedule and progress.

    ddptrain train --init_from runs/pretrain --lr 0.001 --output_dir runs/finetune

PATH is a `.safetensors` file, a run directory (its `model.safetensors`), a `.pt`
checkpoint or a DCP step directory (their model weights), or a Hugging Face
`save_pretrained` directory (`model.safetensors`, or its shards and their index). The
names and shapes are compared with the model before the process group starts
(`check_fit`: strict, one line naming what does not fit; `--no-init_strict` loads what
fits and logs the rest); the readers are the checkpoint's own, checksums included, so a
damaged `.pt` or step directory is refused. Rank 0 alone reads the weights and every
rank receives them a tensor at a time (`load_initial_weights`): under fsdp each keeps
only its shard, as when it starts from rank 0's seeded template. A resume wins: a run
that resumes never re-initialises.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ddptrain.checkpoint.common import CheckpointError, read_payload
from ddptrain.checkpoint.dcp import (
    META,
    check_metadata,
    check_shards,
    follow_pointer,
    model_state_from_dir,
    read_meta,
)
from ddptrain.checkpoint.export import read_safetensors
from ddptrain.context import DistributedContext
from ddptrain.errors import few
from ddptrain.files import refuse_special, sums_damage
from ddptrain.parallel.lora import base_name, is_adapter

log = logging.getLogger("ddptrain")

WEIGHTS = "model.safetensors"
SHARDED = "model.safetensors.index.json"  # save_pretrained's shards and where each name is
Shapes = dict[str, tuple[int, ...]]
_checked_dirs: set[tuple[str, int]] = set()  # step directories whose files passed their CRCs


@dataclass(frozen=True)
class Fit:
    """How the weights of `--init_from` fit the model, by name."""

    missing: list[str]  # the model's, not in the weights
    unexpected: list[str]  # the weights', not in the model
    mismatched: list[str]  # 'name (weights shape) vs (model shape)'
    loaded: int  # names that load

    @property
    def exact(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def describe(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing: {few(self.missing)}")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected: {few(self.unexpected)}")
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} of another shape (weights vs model): "
                         f"{few(self.mismatched)}")
        return "; ".join(parts)


# ---------------------------------------------------------------------- reading
def _weights_file(path: Path) -> Path:
    """The safetensors file (or shard index) of a run or Hugging Face directory, whose
    files are checked first against the checksums ddptrain exported with them."""
    damage = sums_damage(path)
    if damage is not None:
        raise CheckpointError(f"--init_from {str(path)!r} is damaged: {damage}: export it "
                              "again, or give another directory")
    for name in (WEIGHTS, SHARDED):
        if (path / name).is_file():
            return path / name
    if (path / "config.yaml").is_file():
        hint = ("the run has not finished: give one of its checkpoints, such as "
                f"{str(path / 'checkpoints' / 'latest.pt')!r}")
    elif (path / "pytorch_model.bin").is_file():
        hint = "save it again with save_pretrained(safe_serialization=True)"
    else:
        hint = ("give a .safetensors or .pt file, a run directory, a DCP step directory or "
                "a Hugging Face save_pretrained directory")
    raise CheckpointError(f"--init_from {str(path)!r} holds no {WEIGHTS}: {hint}")


def _is_step_dir(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def _safetensors_files(path: Path) -> list[Path]:
    if path.name != SHARDED:
        return [path]
    try:
        index = json.loads(path.read_text())
        names = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"--init_from: {str(path)!r} is not a safetensors shard index ({exc}): save the "
            "weights again with save_pretrained"
        ) from None
    return [path.parent / name for name in names]


def _safetensors_shapes(path: Path) -> tuple[Shapes, dict[str, str]]:
    """Names and shapes from the files' headers (no tensor read), and the ties that
    ddptrain's export recorded (`tied:ALIAS` -> the name stored)."""
    from safetensors import safe_open

    shapes: Shapes = {}
    ties: dict[str, str] = {}
    for file in _safetensors_files(path):
        refuse_special(file, "--init_from")
        try:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    shapes[key] = tuple(f.get_slice(key).get_shape())
                meta = f.metadata() or {}
        except Exception as exc:
            raise _unreadable(file, exc) from None
        ties.update({k[4:]: v for k, v in meta.items() if k.startswith("tied:")})
    return shapes, ties


def _unreadable(path: Path, exc: BaseException) -> CheckpointError:
    text = str(exc).strip()
    reason = text.splitlines()[0][:160] if text else type(exc).__name__
    return CheckpointError(
        f"--init_from {str(path)!r} cannot be read: {reason}; give a whole safetensors file"
    )


def source_shapes(path: Path) -> tuple[Shapes, dict[str, str]]:
    """The names and shapes of the weights at `path`, and the ties it records. A `.pt`
    file and a step directory are checked against their checksums first (a damaged one
    is refused); safetensors are read from their headers."""
    cpu = torch.device("cpu")
    path = follow_pointer(path)
    if _is_step_dir(path):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = read_meta(path, cpu)
        key = (str(path.resolve()), (path / META).stat().st_mtime_ns)
        if key not in _checked_dirs:  # checked before the process group, not again after
            check_shards(path, meta, DistributedContext(0, 0, 1, cpu))
            _checked_dirs.add(key)
        entries = check_metadata(path).state_dict_metadata
        return {
            key.removeprefix("model."): tuple(md.size)
            for key, md in entries.items()
            if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
        }, {}
    if path.is_dir():
        return _safetensors_shapes(_weights_file(path))
    if path.suffix == ".safetensors":
        return _safetensors_shapes(path)
    payload = read_payload(path, cpu, verify=True)
    state = payload.get("model_state_dict") or {}
    return {k: tuple(v.shape) for k, v in state.items() if torch.is_tensor(v)}, {}


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole model state at `path`, on the CPU (a `.pt` is memory-mapped)."""
    path = follow_pointer(path)
    if _is_step_dir(path):
        return model_state_from_dir(path)
    if path.is_dir():
        path = _weights_file(path)
    if path.suffix == ".safetensors" or path.name == SHARDED:
        state: dict[str, torch.Tensor] = {}
        for file in _safetensors_files(path):
            state.update(read_safetensors(file)[0])  # checked against its checksums
        return state
    return dict(read_payload(path, torch.device("cpu"), verify=True)["model_state_dict"])


# ---------------------------------------------------------------------- fitting
def tied_names(model: nn.Module) -> list[list[str]]:
    """Names that are one parameter (a language model's embedding and output head)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _complete(names: dict[str, str], ties: dict[str, str], groups: list[list[str]]) -> None:
    """Give the names a file stores once (tied weights) every name they have: `names`
    maps each name to the stored one it reads."""
    for alias, stored in ties.items():
        if stored in names:
            names.setdefault(alias, names[stored])
    for group in groups:
        present = next((n for n in group if n in names), None)
        if present is not None:
            for name in group:
                names.setdefault(name, names[present])


def _unwrapped(names: dict[str, str], own: Iterable[str]) -> None:
    """A LoRA run's (`--lora_rank`) wrapped layers read the plain layer's names
    (`q.base_layer.weight` <- `q.weight`); its adapters are not read (they start fresh)."""
    for name in own:
        if base_name(name) != name and base_name(name) in names:
            names.setdefault(name, names[base_name(name)])


def check_fit(model: nn.Module, path: Path, strict: bool) -> Fit:
    """How the weights at `path` fit `model` (which may be on the meta device, or
    sharded); strict: refused with one line naming what does not fit."""
    shapes, ties = source_shapes(path)
    reads = {k: k for k in shapes}
    _complete(reads, ties, tied_names(model))
    own = {k: tuple(v.shape) for k, v in model.state_dict().items() if not is_adapter(k)}
    _unwrapped(reads, own)
    fit = Fit(
        missing=sorted(set(own) - set(reads)),
        unexpected=sorted(set(shapes) - {reads[k] for k in own if k in reads}),
        mismatched=[
            f"{k} {shapes[reads[k]]} vs {own[k]}"
            for k in sorted(set(own) & set(reads)) if shapes[reads[k]] != own[k]
        ],
        loaded=sum(1 for k in own if k in reads and shapes[reads[k]] == own[k]),
    )
    if strict and not fit.exact:
        raise CheckpointError(
            f"--init_from {str(path)!r} does not fit this model: {fit.describe()}; give "
            "weights of the same --model (and --width, data), or --no-init_strict to load "
            "what fits"
        )
    return fit


def load_initial_weights(
    module: nn.Module, path: Path, ctx: DistributedContext, strict: bool
) -> Fit:
    """Collective: fill `module` (whole, wrapped in place or sharded) with the weights at
    `path`. Rank 0 reads them; each rank receives them one tensor at a time and keeps what
    it holds (its shard under fsdp). What does not fit was refused or is logged."""
    fit = check_fit(module, path, strict)
    if not fit.exact:
        log.warning("--init_from %s: %d tensors load, the rest keep their initial values "
                    "(%s)", path, fit.loaded, fit.describe())
    state: dict[str, Any] = {}
    if ctx.is_main:
        weights = read_weights(path)
        reads = {k: k for k in weights}
        _complete(reads, {}, tied_names(module))
        own = module.state_dict()
        _unwrapped(reads, own)
        state = {
            k: weights[reads[k]] for k in own
            if k in reads and tuple(weights[reads[k]].shape) == tuple(own[k].shape)
        }
    if not ctx.distributed:
        with torch.no_grad():
            module.load_state_dict(state, strict=False)
    else:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(module, state, options=options)
    log.info("initial weights from %s (%d tensors)", path, fit.loaded)
    return fit
