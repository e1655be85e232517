"""Checksums: every checkpoint carries them, every resume checks them before it trusts a byte.

A `.pt` file holds a CRC-32 of every tensor it stores (`checksums`: the tensor's path in
the payload -> [bytes, crc]) and one of everything else in it (`checksums["<fields>"]`:
progress, schedule, RNG states, config, versions, as text with each tensor a mark); a DCP
step directory's `meta.pt` holds the same of itself, and one per shard file (`shards`:
file name -> [bytes, crc]), computed by the ranks that wrote them, each over its share
of the files. On resume the checkpoint a rank is about to load is checked the
same way: a `.pt` by the rank that locates it, a step directory by every rank over its
share of the files. A damaged or truncated checkpoint is then skipped like a torn one
(`--resume_from auto` goes back to the previous whole checkpoint) or refused (a path
given by hand), never loaded.

CRC-32 (zlib) runs at several GB/s on one core: a few seconds per 10 GB, on the rank
that already reads those bytes.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def tensor_crc(tensor: torch.Tensor) -> list[int]:
    """[bytes, crc32] of a CPU tensor's contents."""
    data = tensor.detach().contiguous().reshape(-1)
    if data.numel() == 0:
        return [0, 0]
    raw = data.view(torch.uint8).numpy()
    return [int(raw.nbytes), zlib.crc32(raw.data)]


def tensors_in(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in nested dicts, lists and tuples, with its path ('a.b.0')."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from tensors_in(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tensors_in(value, f"{prefix}.{i}" if prefix else str(i))


FIELDS = "<fields>"  # the checksum of everything in a payload that is not a tensor


def fields_text(obj: Any) -> str:
    """Everything in nested dicts, lists and tuples but the tensors' contents, as text
    that reads back the same from the file (a tensor is a mark: its CRC is its own)."""
    if isinstance(obj, torch.Tensor):
        return "T"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{k!r}:{fields_text(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        inner = ",".join(fields_text(v) for v in obj)
        return f"[{inner}]" if isinstance(obj, list) else f"({inner})"
    return repr(obj)


def checksums(state: Any) -> dict[str, list[int]]:
    """[bytes, crc32] of every tensor in `state` (CPU tensors), by path, and of all the
    rest (`FIELDS`)."""
    sums = {path: tensor_crc(tensor) for path, tensor in tensors_in(state)}
    text = fields_text(state).encode()
    return {**sums, FIELDS: [len(text), zlib.crc32(text)]}


def payload_damage(payload: dict[str, Any]) -> str | None:
    """What is wrong with a loaded payload, or None when every tensor and all the rest
    match the checksums written with it (a file written before checksums: None)."""
    expected = payload.get("checksums")
    if not expected:
        return None
    body = {k: v for k, v in payload.items() if k != "checksums"}
    fields = expected.get(FIELDS)
    if fields is not None:
        text = fields_text(body).encode()
        if [len(text), zlib.crc32(text)] != list(fields):
            return ("a field other than the tensors (progress, schedule, RNG state or "
                    "config) does not match its checksum")
    tensors = {k: v for k, v in expected.items() if k != FIELDS}
    return _tensors_damage(dict(tensors_in(body)), tensors)


def _tensors_damage(found: dict[str, torch.Tensor], expected: dict[str, Any]) -> str | None:
    """The first tensor of `expected` ({path: [bytes, crc]}) missing from `found` or not
    matching its checksum, or None."""
    for path, want in expected.items():
        tensor = found.get(path)
        if tensor is None:
            return f"tensor {path} is missing"
        if tensor_crc(tensor) != list(want):
            return f"tensor {path} does not match its checksum"
    return None


# The safetensors metadata entry of ddptrain's exports: {tensor name: [bytes, crc32]}.
SAFETENSORS_SUMS = "ddptrain:checksums"


def safetensors_sums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The metadata entry that carries the checksum of each tensor of a safetensors file."""
    sums = {name: tensor_crc(tensor) for name, tensor in tensors.items()}
    return {SAFETENSORS_SUMS: json.dumps(sums, separators=(",", ":"))}


def safetensors_damage(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str | None:
    """What is wrong with a safetensors file's tensors against the checksums in its
    metadata, or None (a file without them, another tool's: None)."""
    text = metadata.get(SAFETENSORS_SUMS)
    if text is None:
        return None
    try:
        expected = json.loads(text)
    except json.JSONDecodeError:
        return "its checksums cannot be read"
    if not isinstance(expected, dict) or set(expected) != set(tensors):
        return "its tensors are not those its checksums list"
    return _tensors_damage(tensors, expected)


def share(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The files one rank checks: every `world_size`-th of the sorted names."""
    return sorted(names)[rank::world_size]
