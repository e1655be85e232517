"""Whole-model weights for inference: `model.safetensors` with the model's own parameter
names, tied weights stored once (`ddptrain export`, and the end of every run); for a
Hugging Face model also `hf/`, a `save_pretrained` directory (`export_hf_dir`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from ddptrain.checkpoint.common import CheckpointError, first_line
from ddptrain.checkpoint.integrity import (
    SAFETENSORS_SUMS,
    safetensors_damage,
    safetensors_sums,
    share,
    tensors_damage,
)
from ddptrain.checkpoint.manager import load_checkpoint
from ddptrain.context import DistributedContext
from ddptrain.files import check_output, refuse_special, staged, staged_dir, write_sums
from ddptrain.parallel.lora import ADAPTER, LoraSpec, is_adapter


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
    shared = _remove_duplicate_names(weights)  # {kept name: [aliases of the same tensor]}
    aliases = {alias: name for name, names in shared.items() for alias in names}
    tensors = {k: v.cpu().contiguous() for k, v in weights.items() if k not in aliases}
    metadata = {"format": "pt", **{f"tied:{a}": n for a, n in aliases.items()},
                **safetensors_sums(tensors)}
    with staged(out, overwrite) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return len(tensors)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def export_safetensors(checkpoint: Path, out: Path, overwrite: bool = False) -> int:
    """`ddptrain export`: the whole model of a checkpoint (a `.pt` file or a DCP step
    directory of any world size), for inference; a damaged checkpoint is refused, and an
    existing `out` replaced only with `overwrite`."""
    check_output(out, "output", overwrite)
    return export_safetensors_state(checkpoint_model_state(checkpoint), out, overwrite)


def checkpoint_model_state(
    checkpoint: Path, ctx: DistributedContext | None = None
) -> dict[str, torch.Tensor]:
    """The whole model state of a `.pt` file or a DCP step directory, on the CPU, its
    checksums checked first (a damaged checkpoint is refused). `ctx`: the ranks that
    share the checking of a step directory's files (collective); None: this process."""
    from ddptrain.checkpoint.dcp import follow_pointer

    checkpoint = follow_pointer(checkpoint)
    if checkpoint.is_dir():
        from ddptrain.checkpoint.dcp import check_shards, model_state_from_dir

        meta = load_checkpoint(checkpoint, torch.device("cpu"))  # whole, written by ddptrain
        check_shards(checkpoint, meta, ctx or DistributedContext(0, 0, 1, torch.device("cpu")))
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
    damage = safetensors_damage(state, metadata)
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
            text = (f.metadata() or {}).get(SAFETENSORS_SUMS)
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
        if source is not None:
            for pattern in TOKENIZER_FILES:
                for file in source.glob(pattern):
                    if file.is_file() and not (partial / file.name).exists():
                        shutil.copy2(file, partial / file.name)
        # its weight shards' checksums, checked before `hf:DIR` or `--init_from DIR` uses them
        write_sums(partial, [p.name for p in partial.glob("*.safetensors")])


def export_adapter(state: dict[str, torch.Tensor], out: Path, lora: LoraSpec) -> None:
    """peft's adapter directory from a LoRA module's whole `state` (`parallel.lora`): the
    adapters under peft's names (`base_model.model.NAME.lora_A.weight`) and the config
    that injects them again, `PeftModel.from_pretrained(base_model, out)`."""
    weights = {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v
               for k, v in state.items() if is_adapter(k)}
    with staged_dir(out) as partial:
        export_safetensors_state(weights, partial / "adapter_model.safetensors")
        lora.peft_config().save_pretrained(str(partial))
        write_sums(partial, ["adapter_model.safetensors"])
