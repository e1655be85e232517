"""Initial weights for a fresh run (`--init_from PATH`): the weights only, with a fresh
optimizer, schedule and progress.

    ddptrain train --init_from runs/pretrain --lr 0.001 --output_dir runs/finetune

PATH is a `.safetensors` file, a run directory (its `model.safetensors`), a `.pt`
checkpoint or a DCP step directory (their model weights), or a Hugging Face
`save_pretrained` directory (`model.safetensors`, or its shards and their index). The
names and shapes are compared with the model before the process group starts, from the
files' headers (`check_fit`: strict, one line naming what does not fit; `--no-init_strict`
loads what fits and logs the rest).

From safetensors and step directories each rank reads only what it will hold
(`load_initial_weights`, through DCP's planner and its Hugging Face reader): its fsdp
shard, its tp slice, its pipeline stages (the whole model under ddp, where each rank holds
it whole), so no rank reads or holds the model whole for the others. The checksums
ddptrain wrote with them are checked on the way: a step directory's entry by entry as
they are read, safetensors by the ranks in shares (a directory's files, a file's
tensors), and a damaged source is refused on every rank with one line. A `.pt` file is
read by rank 0 and sent one tensor at a time. A resume wins: a run that resumes never
re-initialises.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ddptrain.checkpoint.common import CheckpointError, read_payload
from ddptrain.checkpoint.dcp import (
    check_metadata,
    check_shards,
    follow_pointer,
    load_sharded,
    quiet_without_group,
    read_meta,
)
from ddptrain.checkpoint.export import safetensors_share_damage
from ddptrain.checkpoint.kind import resolve_checkpoint
from ddptrain.checkpoint.streamed import metadata_damage
from ddptrain.context import DistributedContext
from ddptrain.errors import few
from ddptrain.files import SUMS_FILE, refuse_special, sums_damage
from ddptrain.models.hf import hf_dir, report_loading, start_values
from ddptrain.parallel.base import copy_whole, named_tensors, tie_groups
from ddptrain.parallel.lora import adapter_start, base_name, is_adapter

log = logging.getLogger("ddptrain")

FLAG = "--init_from"  # the option whose weights the messages speak of
WEIGHTS = "model.safetensors"
SHARDED = "model.safetensors.index.json"  # save_pretrained's shards and where each name is
Shapes = dict[str, tuple[int, ...]]


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
    """The safetensors file (or shard index) of a run or Hugging Face directory."""
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


def _safetensors_files(path: Path, flag: str = FLAG) -> list[Path]:
    if path.name != SHARDED:
        return [path]
    try:
        index = json.loads(path.read_text())
        names = sorted(set(index["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{flag} {str(path)!r} is not a safetensors shard index ({exc}): save the "
            "weights again with save_pretrained"
        ) from None
    return [path.parent / name for name in names]


def _safetensors_shapes(path: Path, flag: str = FLAG) -> tuple[Shapes, dict[str, str]]:
    """Names and shapes from the files' headers (no tensor read), and the ties that
    ddptrain's export recorded (`tied:ALIAS` -> the name stored)."""
    from safetensors import safe_open

    shapes: Shapes = {}
    ties: dict[str, str] = {}
    for file in _safetensors_files(path, flag):
        refuse_special(file, flag)
        try:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    shapes[key] = tuple(f.get_slice(key).get_shape())
                meta = f.metadata() or {}
        except Exception as exc:
            raise _unreadable(file, exc, flag) from None
        damage = metadata_damage(meta)  # the ties are taken only as the export wrote them
        if damage is not None:
            raise CheckpointError(f"{flag} {str(file)!r} is damaged: {damage}: export it "
                                  "again, or give another file")
        ties.update({k[4:]: v for k, v in meta.items() if k.startswith("tied:")})
    return shapes, ties


def _unreadable(path: Path, exc: BaseException, flag: str) -> CheckpointError:
    text = str(exc).strip()
    reason = text.splitlines()[0][:160] if text else type(exc).__name__
    return CheckpointError(
        f"{flag} {str(path)!r} cannot be read: {reason}; give a whole safetensors file"
    )


def source_shapes(path: Path, flag: str = FLAG) -> tuple[Shapes, dict[str, str]]:
    """The names and shapes of the weights at `path`, and the ties it records, from the
    headers (safetensors) or the metadata (a step directory, its `meta.pt` checked); a
    `.pt` file is checked against its checksums first. The bytes of safetensors and step
    directories are checked as the ranks read them (`load_initial_weights`)."""
    cpu = torch.device("cpu")
    path = follow_pointer(path)
    found = resolve_checkpoint(path)
    if found.step_dir:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        read_meta(path, cpu)
        entries = check_metadata(path).state_dict_metadata
        return {
            key.removeprefix("model."): tuple(md.size)
            for key, md in entries.items()
            if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
        }, {}
    if found.directory:
        return _safetensors_shapes(_weights_file(path), flag)
    if path.suffix == ".safetensors":
        return _safetensors_shapes(path, flag)
    payload = read_payload(path, cpu, verify=True)
    state = payload.get("model_state_dict") or {}
    return {k: tuple(v.shape) for k, v in state.items() if torch.is_tensor(v)}, {}


# ---------------------------------------------------------------------- fitting
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


def _fit(
    model: nn.Module, path: Path, flag: str = FLAG, groups: list[list[str]] | None = None
) -> tuple[Fit, dict[str, str]]:
    """How the weights at `path` fit `model`, and the names that load: {the model's name:
    the name stored in the weights}. `groups`: the names that are one tensor in the whole
    model (a pipeline stage holds its own copy: the strategy knows them), by default
    those of `model`."""
    shapes, ties = source_shapes(path, flag)
    reads = {k: k for k in shapes}
    _complete(reads, ties, tie_groups(model) if groups is None else groups)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items() if not is_adapter(k)}
    _unwrapped(reads, own)
    loads = {k: reads[k] for k in own if k in reads and shapes[reads[k]] == own[k]}
    fit = Fit(
        missing=sorted(set(own) - set(reads)),
        unexpected=sorted(set(shapes) - {reads[k] for k in own if k in reads}),
        mismatched=[
            f"{k} {shapes[reads[k]]} vs {own[k]}"
            for k in sorted(set(own) & set(reads)) if shapes[reads[k]] != own[k]
        ],
        loaded=len(loads),
    )
    return fit, loads


def check_fit(model: nn.Module, path: Path, strict: bool) -> Fit:
    """How the weights at `path` fit `model` (which may be on the meta device, or
    sharded); strict: refused with one line naming what does not fit."""
    fit, _ = _fit(model, path)
    _refuse_unfit(fit, path, strict)
    return fit


def _whole_fit(fit: Fit, loads: dict[str, str], ctx: DistributedContext) -> Fit:
    """Collective: the fit of the model all ranks hold together (a name of the weights is
    unexpected only when no rank reads it), the same on every rank."""
    every: list[Any] = [None] * ctx.world_size
    mine = (fit.missing, fit.mismatched, sorted(set(loads.values())), fit.unexpected)
    dist.all_gather_object(every, mine)
    read = {name for part in every for name in part[2]}
    return Fit(
        missing=sorted({n for part in every for n in part[0]}),
        unexpected=sorted({n for part in every for n in part[3]} - read),
        mismatched=sorted({n for part in every for n in part[1]}),
        loaded=len(read),
    )


def _refuse_unfit(fit: Fit, path: Path, strict: bool) -> None:
    if strict and not fit.exact:
        raise CheckpointError(
            f"--init_from {str(path)!r} does not fit this model: {fit.describe()}; give "
            "weights of the same --model (and --width, data), or --no-init_strict to load "
            "what fits"
        )


def load_initial_weights(
    module: nn.Module, path: Path, ctx: DistributedContext, strict: bool,
    ties: list[list[str]] | None = None,
) -> Fit:
    """Collective: fill `module` (whole, wrapped in place or sharded) with the weights at
    `path`. From safetensors and step directories each rank reads only what it holds (its
    fsdp shard, its tp slice, its pipeline stages; the whole model under ddp), and the
    ranks share the checking of the bytes; a `.pt` file is read by rank 0 and sent one
    tensor at a time. What does not fit was refused or is logged. `ties`: see `_fit`."""
    fit, loads = _fit(module, path, groups=ties)
    if ctx.distributed:  # a pipeline stage holds part of the model: judged as a whole
        fit = _whole_fit(fit, loads, ctx)
    _refuse_unfit(fit, path, strict)
    if not fit.exact:
        log.warning("--init_from %s: %d tensors load, the rest keep their initial values "
                    "(%s)", path, fit.loaded, fit.describe())
    source = follow_pointer(path)
    if resolve_checkpoint(source).directory or source.suffix == ".safetensors":
        _read_own_parts(module, source, loads, ctx)
    else:
        _receive_from_rank0(module, source, loads, ctx)
    log.info("initial weights from %s (%d tensors)", path, fit.loaded)
    return fit


def holds_safetensors(directory: Path) -> bool:
    """Whether a Hugging Face directory keeps its weights in safetensors (one file, or
    shards and their index), which each rank can read its part of."""
    return any((directory / name).is_file() for name in (WEIGHTS, SHARDED))


def fill_pretrained(
    module: nn.Module, skeleton: nn.Module | None, name: str, ctx: DistributedContext, seed: int,
    ties: list[list[str]], read: bool = True,
) -> None:
    """Collective: `module`, the model of `--model hf:DIR` built on the meta device and
    allocated as this rank holds it (its fsdp shards, tp slices, pipeline stages), filled:
    the directory's tensors each rank reads itself from the safetensors files (`read`: a
    strict `--init_from` reads every tensor anyway, and nothing is read twice), and what
    the files do not hold from its start values (a head the task adds, LoRA's adapters,
    buffers computed as the modules are built), made on the host from `skeleton`, the
    model's structure on meta; `ties` as the strategy knows them (`_fit`). Shapes that do
    not fit are one line."""
    directory, flag = hf_dir(name), f"--model {name}:"
    fit, loads = _fit(module, directory, flag, ties)
    whole = _whole_fit(fit, loads, ctx) if ctx.distributed else fit
    if whole.mismatched:
        raise CheckpointError(
            f"{flag} {len(whole.mismatched)} tensor(s) of the directory have another shape "
            f"than the model's (directory vs model): {few(whole.mismatched)}; check "
            "--model_args against the directory's config.json"
        )
    if read:
        _read_own_parts(module, directory, loads, ctx, flag)
        report_loading(name, type(module).__name__, whole.missing, whole.unexpected)
    held = named_tensors(module)
    computed = [f"{owner}.{b}" if owner else b for owner, m in module.named_modules()
                for b in m._non_persistent_buffers_set]
    fresh = [*fit.missing, *computed]
    if fresh and skeleton is None:
        raise CheckpointError(f"{flag} the model cannot be copied to the meta device, so "
                              f"{few(fresh)} cannot start: build it with --strategy ddp")
    values = start_values(skeleton, fresh, seed) if skeleton is not None else {}
    values.update({key: adapter_start(key, t.shape, t.dtype, seed)
                   for key, t in held.items() if is_adapter(key)})
    with torch.no_grad():
        for key, value in values.items():
            copy_whole(held[key], value)


def _read_own_parts(
    module: nn.Module, source: Path, loads: dict[str, str], ctx: DistributedContext,
    flag: str = FLAG,
) -> None:
    """Each rank reads from `source` the slices of the tensors it holds, into them (DCP
    plans the slices: DTensor shards, plain tensors whole)."""
    own = module.state_dict()
    into: dict[str, torch.Tensor] = {}  # by the name stored: one read per stored tensor
    twins: list[tuple[torch.Tensor, str]] = []  # tied names this rank holds apart
    for name, stored in loads.items():
        if stored in into:
            twins.append((own[name], stored))
        else:
            into[stored] = own[name]
    found = resolve_checkpoint(source)
    if found.step_dir:
        meta = read_meta(source, torch.device("cpu"))
        if not meta.get("items"):  # written before per-entry checksums: its files first
            check_shards(source, meta, ctx)
        load_sharded(source, {"model": into}, meta)  # each entry checked as it is read
    else:
        files = _safetensors_files(_weights_file(source) if found.directory else source, flag)
        damage = _shared_damage(source, files, ctx)
        if damage is not None:
            raise CheckpointError(f"{flag} {str(source)!r} is damaged: {damage}: export "
                                  "it again, or give another directory")
        with quiet_without_group():
            dcp.load(into, storage_reader=SafetensorsReader(files))
    with torch.no_grad():
        for tensor, stored in twins:
            tensor.copy_(into[stored])


def _shared_damage(source: Path, files: list[Path], ctx: DistributedContext) -> str | None:
    """Collective: what is wrong with the safetensors `files` against the checksums
    ddptrain wrote with them (a directory's file sums, or a file's tensor sums), each
    rank checking its share; the same answer on every rank."""
    rank, world = ctx.rank, ctx.world_size
    directory = source if resolve_checkpoint(source).directory else None
    if directory is not None and (directory / SUMS_FILE).is_file():
        damage = sums_damage(directory, share=(rank, world))
    else:
        damage = next((d for f in files if (d := safetensors_share_damage(f, rank, world))),
                      None)
    if not ctx.distributed:
        return damage
    found: list[str | None] = [None] * world
    dist.all_gather_object(found, damage)
    return next((d for d in found if d is not None), None)


def _receive_from_rank0(
    module: nn.Module, source: Path, loads: dict[str, str], ctx: DistributedContext
) -> None:
    """A `.pt` file: rank 0 maps it, every rank receives the weights one tensor at a
    time and keeps what it holds."""
    state: dict[str, Any] = {}
    if ctx.is_main:
        weights = read_payload(source, torch.device("cpu"), verify=True)["model_state_dict"]
        state = {k: weights[stored] for k, stored in loads.items()}
    if not ctx.distributed:
        with torch.no_grad():
            module.load_state_dict(state, strict=False)
    else:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(module, state, options=options)


class SafetensorsReader(HuggingFaceStorageReader):
    """DCP's reader of Hugging Face safetensors (each rank reads the slices it plans,
    from the memory-mapped files), limited to `files`: a directory may hold others."""

    def __init__(self, files: list[Path]) -> None:
        super().__init__(str(files[0].parent))
        self.only = {str(f.resolve()) for f in files}

    def read_metadata(self) -> Metadata:
        metadata = super().read_metadata()
        kept = {index: info for index, info in (metadata.storage_data or {}).items()
                if str(Path(info.relative_path).resolve()) in self.only}
        names = {index.fqn for index in kept}
        metadata.storage_data = kept
        metadata.state_dict_metadata = {
            k: v for k, v in metadata.state_dict_metadata.items() if k in names
        }
        return metadata
