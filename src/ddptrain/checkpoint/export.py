"""Whole-model weights for inference: `model.safetensors` with the model's own parameter
names, tied weights stored once (`ddptrain export`, and the end of every run); for a
Hugging Face model also `hf/`, a `save_pretrained` directory (`export_hf_dir`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.checkpoint.common import CheckpointError, first_line, link_or_copy
from ddptrain.checkpoint.integrity import (
    SAFETENSORS_SUMS,
    safetensors_damage,
    safetensors_sums,
    share,
    tensors_damage,
)
from ddptrain.checkpoint.kind import CheckpointKind, resolve_checkpoint
from ddptrain.checkpoint.manager import load_checkpoint
from ddptrain.checkpoint.streamed import (
    HF_SHARD_BYTES,
    Catalog,
    Item,
    SafetensorsStream,
    Target,
    hf_shards,
    metadata_damage,
    plain_items,
    shard_names,
    with_metadata_sum,
    write_files,
)
from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError, few
from ddptrain.files import (
    SUMS_FILE,
    atomic_write_text,
    check_output,
    file_crc,
    open_regular,
    refuse_special,
    staged,
    staged_dir,
    summed_names,
    temp_name,
    write_sums,
)
from ddptrain.models.hf import renames_weights
from ddptrain.parallel.lora import ADAPTER, LoraSpec, is_adapter, merged

log = logging.getLogger("ddptrain")


def export_safetensors_state(state: dict[str, torch.Tensor], out: Path,
                             overwrite: bool = True) -> int:
    """Write model weights to a safetensors file atomically; returns the tensor count.

    Tied weights (one tensor under two names, like a language model's embedding and
    output head) are stored once, under the name safetensors' own helper keeps; load the
    file with `safetensors.torch.load_model(model, path)`, which restores the tie, or with
    `model.load_state_dict(load_file(path), strict=False)`.
    """
    from safetensors.torch import _remove_duplicate_names, save_file

    # A tensor that is a view into a bigger buffer (FSDP's gathered state) is copied out:
    # safetensors stores whole storages only.
    owned: dict[int, torch.Tensor] = {}  # one copy per tensor: tied names stay tied
    weights = {k: owned.setdefault(id(v), _own_storage(v.detach())) for k, v in state.items()}
    # a tie kept under its first name in the state's order, as the run's own export keeps it
    firsts = {v.untyped_storage().data_ptr(): k for k, v in reversed(weights.items())}
    shared = _remove_duplicate_names(  # {kept name: [aliases of the same tensor]}
        weights, preferred_names=list(firsts.values()))
    aliases = {alias: name for name, names in shared.items() for alias in names}
    tensors = {k: v.cpu().contiguous() for k, v in weights.items() if k not in aliases}
    metadata = with_metadata_sum({"format": "pt", **{f"tied:{a}": n for a, n in aliases.items()},
                                  **safetensors_sums(tensors)})
    with staged(out, overwrite) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return len(tensors)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def export_safetensors(checkpoint: Path, out: Path, overwrite: bool = False) -> int:
    """`ddptrain export`: the whole model of a checkpoint (a `.pt` file or a DCP step
    directory of any world size), for inference; a damaged checkpoint is refused, and an
    existing `out` replaced only with `overwrite`. A LoRA run's checkpoint (its stored
    config has `lora_rank`) is merged as the run's own end merges it (`stored_lora`,
    `parallel.lora.merged`): the file is the run's `model.safetensors`, plain names."""
    from ddptrain.checkpoint.dcp import follow_pointer, model_chunks_from_dir

    check_output(out, "output", overwrite)
    checkpoint = follow_pointer(checkpoint)
    found = resolve_checkpoint(checkpoint)
    if found.kind is CheckpointKind.FILE or _stored_config(checkpoint).get("lora_rank"):
        # a LoRA step directory read whole: its merge needs each layer's three tensors
        state, config = _state_and_config(checkpoint)
        lora = stored_lora(state, config)
        return export_safetensors_state(merged(state, lora) if lora is not None else state,
                                        out, overwrite)
    # A step directory: read and written a few tensors at a time, never the whole model.
    _check_step_dir(checkpoint)
    entries, chunks = model_chunks_from_dir(checkpoint)
    with staged(out, overwrite) as tmp:
        stream = SafetensorsStream(tmp, entries, {"format": "pt"})
        try:
            for chunk in chunks:
                for name, tensor in chunk.items():
                    stream.write(name, tensor)
        except BaseException:
            stream.file.close()  # the read's own error, not the file's missing tensors
            raise
        stream.close()
    return len(entries)


def export_checkpoint_adapter(checkpoint: Path, out: Path, overwrite: bool = False) -> int:
    """`ddptrain export CHECKPOINT OUTDIR --adapter_only`: a LoRA run's checkpoint's peft
    adapter directory (`export_adapter`, the run's own `adapter/`); returns the adapter
    tensor count. A checkpoint without adapters, or an existing `out` without
    `overwrite`, is refused with one line."""
    from ddptrain.checkpoint.dcp import follow_pointer

    check_output(out, "output", overwrite, directory=True)  # peft's adapter directory
    checkpoint = follow_pointer(checkpoint)
    state, config = _state_and_config(checkpoint)
    lora = stored_lora(state, config)
    if lora is None:
        raise ConfigError(f"{str(checkpoint)!r} holds no LoRA adapters (its run had no "
                          "--lora_rank): export the whole model, without --adapter_only")
    export_adapter(state, out, lora)
    return sum(1 for k in state if is_adapter(k))


def _stored_config(checkpoint: Path) -> dict[str, Any]:
    """The config a checkpoint was written under (a step directory's progress file only;
    a `.pt` file is read whole)."""
    return dict(load_checkpoint(checkpoint, torch.device("cpu")).get("config") or {})


def _state_and_config(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint's whole model state (checksums checked) and its stored config; a
    `.pt` file read once."""
    if resolve_checkpoint(checkpoint).kind is CheckpointKind.DCP:
        return checkpoint_model_state(checkpoint), _stored_config(checkpoint)
    payload = load_checkpoint(checkpoint, torch.device("cpu"), verify=True)
    return dict(payload["model_state_dict"]), dict(payload.get("config") or {})


# transformers' models whose linears are Conv1D (weight stored (in, out)): GPT-2's family
_CONV1D_MODELS = ("gpt2", "openai-gpt", "imagegpt", "decision_transformer")


def stored_lora(state: dict[str, torch.Tensor], config: dict[str, Any]) -> LoraSpec | None:
    """The adapters of a LoRA run's checkpoint (`state`: its module as it trained) from
    its stored `config`, without building the model (`parallel.lora.lora_spec`'s spec for
    the merge and peft's config): the wrapped layers are those with adapters; a layer
    stores its weight (in, out) (transformers' Conv1D) where its base weight has B @ A's
    shape transposed; a square one follows the other wrapped layers (a model's blocks are
    of one kind), and where all are square, the model's `config.json` says (GPT-2's
    family). None for a checkpoint without adapters."""
    rank = config.get("lora_rank")
    if not rank or not any(is_adapter(k) for k in state):
        return None
    suffix = f".lora_A.{ADAPTER}.weight"
    layers = [k.removesuffix(suffix) for k in state if k.endswith(suffix)]
    kinds: dict[str, bool] = {}  # a non-square layer: is it stored (in, out)?
    for layer in layers:
        ins = state[layer + suffix].shape[1]
        outs = state[f"{layer}.lora_B.{ADAPTER}.weight"].shape[0]
        if ins != outs:
            kinds[layer] = tuple(state[f"{layer}.base_layer.weight"].shape) == (ins, outs)
    model = str(config.get("model") or "")
    base = model[len("hf:"):] if model.startswith("hf:") else None
    square = any(kinds.values()) if kinds else _conv1d_model(base)
    return LoraSpec(
        names=tuple(layers), rank=int(rank), alpha=float(config.get("lora_alpha") or 2.0 * rank),
        dropout=float(config.get("lora_dropout") or 0.0),
        flipped=frozenset(n for n in layers if kinds.get(n, square)), base=base,
    )


def _conv1d_model(directory: str | None) -> bool:
    """Whether the Hugging Face model in `directory` is of GPT-2's family (Conv1D)."""
    if directory is None:
        return False
    try:
        kind = json.loads((Path(directory) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return kind in _CONV1D_MODELS


def _check_step_dir(checkpoint: Path, ctx: DistributedContext | None = None) -> None:
    """A step directory's checksums (its progress file whole, written by ddptrain; its
    shards' split over the ranks of `ctx`, collective; None: this process)."""
    from ddptrain.checkpoint.dcp import check_shards

    meta = load_checkpoint(checkpoint, torch.device("cpu"))
    check_shards(checkpoint, meta, ctx or DistributedContext(0, 0, 1, torch.device("cpu")))


def checkpoint_model_state(
    checkpoint: Path, ctx: DistributedContext | None = None
) -> dict[str, torch.Tensor]:
    """The whole model state of a `.pt` file or a DCP step directory, on the CPU, its
    checksums checked first (a damaged checkpoint is refused). `ctx`: the ranks that
    share the checking of a step directory's files (collective); None: this process."""
    from ddptrain.checkpoint.dcp import follow_pointer

    checkpoint = follow_pointer(checkpoint)
    if resolve_checkpoint(checkpoint).kind is CheckpointKind.DCP:
        from ddptrain.checkpoint.dcp import model_state_from_dir

        _check_step_dir(checkpoint, ctx)
        return model_state_from_dir(checkpoint)
    payload = load_checkpoint(checkpoint, torch.device("cpu"), verify=True)
    return dict(payload["model_state_dict"])


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file, checked against the checksums
    ddptrain's export writes into it; a damaged file, or one that is not a safetensors
    file, is refused with one line."""
    from safetensors import SafetensorError, safe_open

    refuse_special(path, "weights file")
    try:
        with safe_open(str(path), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
            metadata = f.metadata() or {}
    except FileNotFoundError:
        raise CheckpointError(f"weights file {str(path)!r} does not exist") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else "unreadable"
        raise CheckpointError(
            f"weights file {str(path)!r} is damaged or not a safetensors file ({reason}): "
            "export it again with `ddptrain export`, or give a checkpoint"
        ) from None
    damage = metadata_damage(metadata) or safetensors_damage(state, metadata)
    if damage is not None:
        raise CheckpointError(
            f"weights file {str(path)!r} is damaged: {damage}: export it again with "
            "`ddptrain export`, or give a checkpoint"
        )
    return state, metadata


def safetensors_share_damage(path: Path, rank: int, ranks: int) -> str | None:
    """What is wrong with a safetensors file against the tensor checksums ddptrain's
    export wrote into it, checking only this rank's share of its tensors (every
    ranks-th name from the rank-th), or None (also for another tool's file)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            damage = metadata_damage(metadata)
            if damage is not None:
                return f"{path.name}: {damage}"
            text = metadata.get(SAFETENSORS_SUMS)
            if text is None:
                return None
            expected = json.loads(text)
            if not isinstance(expected, dict) or set(expected) != set(f.keys()):
                return f"{path.name}: its tensors are not those its checksums list"
            mine = share(list(expected), rank, ranks)
            found = {k: f.get_tensor(k) for k in mine}
    except Exception as exc:  # safetensors' own errors, a vanished file, a bad header
        return f"{path.name} cannot be read ({first_line(exc)})"
    damage = tensors_damage(found, {k: expected[k] for k in mine})
    return None if damage is None else f"{path.name}: {damage}"


def read_safetensors_state(path: Path) -> dict[str, torch.Tensor]:
    """The weights of a file `export_safetensors_state` wrote, tied names restored."""
    state, metadata = read_safetensors(path)
    for key, value in metadata.items():
        alias = key.removeprefix("tied:")
        if alias != key and value in state:
            state[alias] = state[value]
    return state


# Files of a Hugging Face directory that describe its tokenizer (or processor): copied
# into the run's `hf/` so that it loads as the directory it came from did.
TOKENIZER_FILES = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
    "*.model", "chat_template.*", "preprocessor_config.json", "processor_config.json",
)


def export_hf_dir(
    module: nn.Module, state: dict[str, torch.Tensor], out: Path, source: Path | None = None
) -> None:
    """Write a Hugging Face model as a `save_pretrained` directory (its config and
    `state` as safetensors; the tokenizer files of `source` copied when it has them), so
    that `AutoModel*.from_pretrained(out)` loads it as it is. Written beside `out` and
    renamed into place: a crash leaves the old directory or the new one. `state` is the
    whole model on the CPU (gathered under fsdp), `module` this rank's (maybe sharded)
    model, whose config and tie rules are used."""
    with staged_dir(out) as partial:
        module.save_pretrained(  # type: ignore[operator]
            partial, state_dict=state, safe_serialization=True, is_main_process=True
        )
        _copy_tokenizer(source, partial)
        # every file's checksum (weights, index, configs, tokenizer), checked before
        # `hf:DIR` or `--init_from DIR` uses them; a file added later is damage too
        write_sums(partial)


def _copy_tokenizer(source: Path | None, directory: Path) -> None:
    """The tokenizer files of the directory a model came from, copied into its export:
    regular files only, read without following a link (a link, to a secret or anywhere,
    and a device or FIFO are left out, with one warning)."""
    if source is None:
        return
    skipped = []
    for file in sorted({f for pattern in TOKENIZER_FILES for f in source.glob(pattern)}):
        target = directory / file.name
        mode = os.lstat(file).st_mode
        if os.path.lexists(target) or stat.S_ISDIR(mode):
            continue
        fd = _open_regular(file) if stat.S_ISREG(mode) else None
        if fd is None:
            skipped.append(file.name)
            continue
        with os.fdopen(fd, "rb") as f, open(target, "xb") as out:
            shutil.copyfileobj(f, out)
        shutil.copystat(file, target, follow_symlinks=False)
    if skipped:
        log.warning("hf/: %d file(s) of %s left out, being links or not regular files "
                    "(%s): copy the files themselves there to export them",
                    len(skipped), source, few(skipped))


def _open_regular(path: Path) -> int | None:
    """`files.open_regular`, None for anything else (a link put there since it was
    looked at)."""
    try:
        return open_regular(path)
    except OSError:
        return None


def export_adapter(state: dict[str, torch.Tensor], out: Path, lora: LoraSpec) -> None:
    """peft's adapter directory from a LoRA module's whole `state` (`parallel.lora`): the
    adapters under peft's names (`base_model.model.NAME.lora_A.weight`) and the config
    that injects them again, `PeftModel.from_pretrained(base_model, out)`."""
    weights = {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v
               for k, v in state.items() if is_adapter(k)}
    with staged_dir(out) as partial:
        export_safetensors_state(weights, partial / "adapter_model.safetensors")
        lora.peft_config().save_pretrained(str(partial))
        write_sums(partial)


@dataclass(frozen=True)
class HfExport:
    """A Hugging Face model's `save_pretrained` directory to write beside the weights file:
    the model (its config, its class), where, the directory it came from (its tokenizer
    files are copied), its largest weight file."""

    module: nn.Module
    out: Path
    source: Path | None = None
    shard_bytes: int = HF_SHARD_BYTES


def export_streamed(catalog: Catalog, ties: list[list[str]], out: Path,
                    lora: LoraSpec | None = None, hf: HfExport | None = None) -> None:
    """Collective: `out` (`model.safetensors`) written by rank 0 one whole tensor at a
    time from what the ranks hold (`checkpoint.streamed`): the module's plain state, tied
    tensors once (their aliases in the metadata, as `export_safetensors_state` has them),
    LoRA layers merged. With `hf`, also its `save_pretrained` directory (`export_hf_dir`'s
    layout), in the same walk over the tensors: weight file i by rank i mod the world
    size; rank 0 adds the config, the index of several files, the tokenizer files and the
    files' checksums (each writer's, summed as it wrote)."""
    ctx = catalog.ctx
    items, aliases = plain_items(catalog, ties, lora)  # hf/ leaves an alias out: the model reties
    metadata = {"format": "pt", **{f"tied:{a}": n for a, n in aliases.items()}}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(staged(out)) if ctx.is_main else out
        targets = [Target(tmp, 0, items, metadata)]
        directory: Path | None = None
        if hf is not None:
            where = [stack.enter_context(staged_dir(hf.out)) if ctx.is_main else None]
            if ctx.distributed:
                dist.broadcast_object_list(where, src=0)  # once rank 0 made it
            directory = where[0]
            assert directory is not None
            shards = hf_shards(catalog, items, hf.shard_bytes)
            targets += [Target(directory / name, i % ctx.world_size, shard, {"format": "pt"})
                        for i, (name, shard) in enumerate(
                            zip(shard_names(len(shards)), shards, strict=True))]
        sums = write_files(catalog, targets)
        if hf is None:
            return
        mine = {path.name: v for path, v in sums.items() if path.parent == directory}
        every: list[Any] = [mine]
        if ctx.distributed:
            every = [None] * ctx.world_size
            dist.all_gather_object(every, mine)  # every file closed before rank 0 goes on
        if ctx.is_main and directory is not None:
            _hf_files(hf, directory, targets[1:], catalog,
                      {k: v for part in every for k, v in part.items()})


def _hf_files(hf: HfExport, directory: Path, files: list[Target], catalog: Catalog,
              sums: dict[str, list[int]]) -> None:
    """What rank 0 adds to an `hf/` whose weight files the ranks wrote."""
    module: Any = hf.module
    module.config.architectures = [type(module).__name__]
    module.config.save_pretrained(directory)
    generation = getattr(module, "generation_config", None)
    if generation is not None and module.can_generate():
        generation.save_pretrained(directory)
    if len(files) > 1:
        weight_map = {item.name: f.path.name for f in files for item in f.items}
        total = sum(catalog.nbytes(item.sources[0]) for f in files for item in f.items)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_text(directory / "model.safetensors.index.json",
                          json.dumps(index, indent=2) + "\n")
    _copy_tokenizer(hf.source, directory)
    # the other files' (config, index, tokenizer: small) read here; the weights' as written
    sums.update({n: file_crc(directory / n) for n in summed_names(directory) if n not in sums})
    atomic_write_text(directory / SUMS_FILE, json.dumps(sums, indent=1, sort_keys=True) + "\n")


def export_adapter_streamed(catalog: Catalog, out: Path, lora: LoraSpec) -> None:
    """Collective: peft's adapter directory (`export_adapter`) on rank 0, the adapters
    (small) sent whole to it."""
    items = [Item(name, (name,)) for name in catalog.meta if is_adapter(name)]
    adapters = {items[i].name: t for i, t in catalog.items(items, [{0}] * len(items))
                if t is not None}
    if catalog.ctx.is_main:
        export_adapter(adapters, out, lora)


def export_run(module: nn.Module, strategy: Any, ctx: DistributedContext, run_dir: Path, *,
               lora: LoraSpec | None, averaged: Callable[[], Any] | None, export_ema: bool,
               hf: bool, source: Path | None, shard_bytes: int = HF_SHARD_BYTES) -> None:
    """Collective: a run's exports from what each rank holds, no rank holding the whole
    model: `model.safetensors` (with an EMA `averaged` also `model_ema.safetensors`; with
    `export_ema` the averages are `model.safetensors` and the raw weights
    `model_raw.safetensors`), LoRA's `adapter/` (the weights merged), and for a Hugging
    Face model `hf/` (files of at most `shard_bytes`)."""
    plan: list[tuple[list[str], Callable[[], Any] | None]] = [(["model.safetensors"], None)]
    if averaged is not None:  # --export_ema: model.safetensors a second name of the averages
        plan = [(["model_raw.safetensors" if export_ema else "model.safetensors"], None),
                (["model_ema.safetensors", *(["model.safetensors"] if export_ema else [])],
                 averaged)]
    for names, swap in plan:
        with swap() if swap is not None else contextlib.nullcontext():
            catalog = Catalog(strategy.export_state(module), ctx)
            ties = strategy.ties(module)
            if swap is None and lora is not None:
                export_adapter_streamed(catalog, run_dir / "adapter", lora)
            streamed = gathered = False
            if hf and "model.safetensors" in names:
                # transformers renames some models' weights as it saves them (mixtures of
                # experts): those through its own save_pretrained, gathered on rank 0
                gathered = renames_weights(module)
                streamed = not gathered
            export_streamed(catalog, ties, run_dir / names[0], lora, HfExport(
                module, run_dir / "hf", source, shard_bytes) if streamed else None)
            if ctx.is_main and len(names) > 1:
                tmp = temp_name(run_dir / names[1])
                link_or_copy(run_dir / names[0], tmp)
                os.replace(tmp, run_dir / names[1])
            if gathered:
                state = strategy.model_state(module)
                if ctx.is_main:
                    whole = merged(state, lora) if lora is not None else state
                    export_hf_dir(module, whole, run_dir / "hf", source)
