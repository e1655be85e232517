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

CRC-32 (zlib) runs at several GB/s a core, and a few threads sum one state at once
(`tensor_crcs`): a second or two per 10 GB, on the rank that already reads those bytes.
The zip records of a `.pt` carry no CRC of their own (torch's writer would sum every byte
a second time, more slowly): the payload's checksums are the check.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

_CHUNK = 32 << 20  # bytes summed by one job of `tensor_crcs`
_MAX_THREADS = 8  # CRC-32 is bound by memory bandwidth well before this


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    data = tensor.detach().contiguous().reshape(-1)
    if data.numel() == 0:
        return memoryview(b"")
    return data.view(torch.uint8).numpy().data.cast("B")


def tensor_crcs(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """[bytes, crc32] of each CPU tensor's contents, summed in chunks by a few threads at
    once (zlib lets go of the GIL while it sums): each byte once, in a fraction of the
    time of one thread wherever cores are idle, as they are while rank 0 saves."""
    views = [_bytes_of(t) for t in tensors]
    jobs = [(i, start) for i, v in enumerate(views) for start in range(0, len(v), _CHUNK)]
    threads = min(_MAX_THREADS, len(os.sched_getaffinity(0)), len(jobs))

    def crc(job: tuple[int, int]) -> int:
        i, start = job
        return zlib.crc32(views[i][start:start + _CHUNK])

    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="ddptrain-crc") as pool:
            crcs = list(pool.map(crc, jobs))
    else:
        crcs = [crc(job) for job in jobs]
    sums = [[len(v), 0] for v in views]
    for (i, start), value in zip(jobs, crcs, strict=True):
        size = min(_CHUNK, len(views[i]) - start)
        sums[i][1] = crc32_combine(sums[i][1], value, size) if start else value
    return sums


_POLY = 0xEDB88320  # CRC-32's polynomial, reflected


def _multmodp(a: int, b: int) -> int:
    """a x b modulo CRC-32's polynomial (reflected bit order), as zlib computes it."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from A's CRC, B's CRC and B's length (zlib's
    `crc32_combine`, which Python's zlib does not expose): no byte read again."""
    p, k = 1 << 31, 3  # x^0; a byte is 2^3 bits
    while len2:
        if len2 & 1:
            p = _multmodp(_X2N[k & 31], p)
        len2 >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


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
    found = dict(tensors_in(state))
    sums = dict(zip(found, tensor_crcs(list(found.values())), strict=True))
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
    return tensors_damage(dict(tensors_in(body)), tensors)


def tensors_damage(found: dict[str, torch.Tensor], expected: dict[str, Any]) -> str | None:
    """The first tensor of `expected` ({path: [bytes, crc]}) missing from `found` or not
    matching its checksum, or None."""
    missing = next((path for path in expected if path not in found), None)
    if missing is not None:
        return f"tensor {missing} is missing"
    got = tensor_crcs([found[path] for path in expected])
    for (path, want), crc in zip(expected.items(), got, strict=True):
        if crc != list(want):
            return f"tensor {path} does not match its checksum"
    return None


# The safetensors metadata entry of ddptrain's exports: {tensor name: [bytes, crc32]}.
SAFETENSORS_SUMS = "ddptrain:checksums"


def safetensors_sums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The metadata entry that carries the checksum of each tensor of a safetensors file."""
    sums = dict(zip(tensors, tensor_crcs(list(tensors.values())), strict=True))
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
    return tensors_damage(tensors, expected)


def share(names: Sequence[str], rank: int, world_size: int) -> list[str]:
    """The files one rank checks: every `world_size`-th of the sorted names."""
    return sorted(names)[rank::world_size]
