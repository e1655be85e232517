"""Whole weights written by the ranks, one tensor at a time: `model.safetensors` and a
Hugging Face `hf/` directory from any layout without any rank holding the whole model.

Every rank lists what it holds (names, global shapes, dtypes: `Catalog`, one small
all-gather). Each output file has one writer rank (`model.safetensors`: rank 0; the
shards of `hf/`: spread over the ranks). The ranks then walk the tensors in one order: a
sharded tensor (a DTensor: fsdp, tp) is made whole by the ranks that hold it, a stage's
tensor (pp) is taken by the first rank that holds it, and either is sent to the file's
writer when that rank does not hold it. A writer thus holds its own shard and one whole
tensor; it streams each tensor into its file behind a header written last (the checksums
are of the bytes as they go out), and each file's checksum comes from its tensors' without
reading it back.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.checkpoint.integrity import SAFETENSORS_SUMS, crc32_combine, tensor_crcs
from ddptrain.context import DistributedContext
from ddptrain.parallel.lora import ADAPTER, base_name, is_adapter, merge_one

# safetensors' names of torch's dtypes
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
HF_SHARD_BYTES = 5 * 10**9  # transformers' own default largest shard (`max_shard_size`)
# A safetensors file's metadata entry that carries the CRC-32 of all its others (ties,
# the tensors' checksums, format): what a loader acts on is checked like the tensors.
METADATA_SUM = "ddptrain:metadata"


def _metadata_crc(entries: dict[str, str]) -> str:
    text = json.dumps({k: v for k, v in entries.items() if k != METADATA_SUM},
                      sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(text.encode()):08x}"


def with_metadata_sum(metadata: dict[str, str]) -> dict[str, str]:
    """`metadata` and the checksum of its entries, as ddptrain writes a safetensors file."""
    return {**metadata, METADATA_SUM: _metadata_crc(metadata)}


def metadata_damage(metadata: dict[str, str]) -> str | None:
    """What is wrong with the metadata of a safetensors file ddptrain wrote (one carrying
    its tensors' checksums) against the checksum of its entries, or None (also for
    another tool's file). A file without that checksum (written before it) may hold
    nothing but its format and tensor checksums: a tie is never taken unchecked."""
    if SAFETENSORS_SUMS not in metadata and METADATA_SUM not in metadata:
        return None
    stored = metadata.get(METADATA_SUM)
    if stored is None:
        unchecked = sorted(set(metadata) - {"format", SAFETENSORS_SUMS})
        return (None if not unchecked else f"its metadata entry {unchecked[0]!r} has no "
                f"checksum ({METADATA_SUM})")
    if stored != _metadata_crc(metadata):
        return f"its metadata (ties, checksums) does not match its checksum ({METADATA_SUM})"
    return None


@dataclass(frozen=True)
class Item:
    """One tensor of an output file: its name there, the names it is made of (one, or a
    LoRA layer's base weight and adapters) and how (None: the one tensor as it is)."""

    name: str
    sources: tuple[str, ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None


class Catalog:
    """What every rank holds of a module's state (collective to build: one all-gather of
    names, shapes and dtypes), and the whole tensors sent to the ranks that write them."""

    def __init__(self, local: dict[str, torch.Tensor], ctx: DistributedContext) -> None:
        self.local, self.ctx = local, ctx
        mine = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), _is_dtensor(t))
                for n, t in local.items()]
        every: list[Any] = [mine]
        if ctx.distributed:
            every = [None] * ctx.world_size
            dist.all_gather_object(every, mine)
        self.holders: dict[str, list[int]] = {}
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype, bool]] = {}
        for rank, listed in enumerate(every):  # rank 0's order first: the same on every rank
            for name, shape, dtype, dtensor in listed:
                self.holders.setdefault(name, []).append(rank)
                self.meta.setdefault(name, (shape, getattr(torch, dtype), dtensor))

    def nbytes(self, name: str) -> int:
        shape, dtype, _ = self.meta[name]
        return math.prod(shape) * dtype.itemsize

    def whole(self, name: str, writers: set[int]) -> torch.Tensor | None:
        """Collective over the ranks that hold `name` and the `writers`: the whole tensor,
        on the CPU, on each writer (made whole there if it holds a shard, else sent by
        the first rank that holds it); None on every other rank."""
        rank, holders = self.ctx.rank, self.holders[name]
        shape, dtype, dtensor = self.meta[name]
        t = self.local.get(name)
        if t is not None:
            t = t.detach()
            if dtensor:
                t = t.full_tensor()  # type: ignore[attr-defined]  # every holder takes part
        got = t if rank in writers else None
        device = self.ctx.device if self.ctx.backend == "nccl" else torch.device("cpu")
        for writer in sorted(writers - set(holders)):
            if rank == holders[0]:
                assert t is not None
                dist.send(t.to(device).contiguous(), dst=writer)
            elif rank == writer:
                got = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(got, src=holders[0])
        return None if got is None else got.cpu()

    def items(self, items: list[Item], writers: list[set[int]]
              ) -> Iterator[tuple[int, torch.Tensor | None]]:
        """Collective: each of `items` (index, tensor), whole, on the ranks of its entry
        of `writers`; None elsewhere."""
        for i, (item, ranks) in enumerate(zip(items, writers, strict=True)):
            parts = [self.whole(name, ranks) for name in item.sources]
            if self.ctx.rank not in ranks:
                yield i, None
                continue
            wholes = [p for p in parts if p is not None]
            yield i, item.combine(wholes) if item.combine else wholes[0]


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "device_mesh")


class SafetensorsStream:
    """A safetensors file written one tensor at a time: the header's room is kept first
    (its checksums at their widest), the tensors follow, the header goes in last."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str]) -> None:
        self.path, self.metadata = path, dict(metadata)
        self.header: dict[str, Any] = {}
        offset = 0
        for name, shape, dtype in entries:
            size = math.prod(shape) * dtype.itemsize
            self.header[name] = {"dtype": DTYPES[dtype], "shape": list(shape),
                                 "data_offsets": [offset, offset + size]}
            offset += size
        self.sums: dict[str, list[int]] = {name: [0, 0] for name, _, _ in entries}
        widest = {name: [info["data_offsets"][1], 2**32 - 1]
                  for name, info in self.header.items()}
        room = len(self._header_bytes(widest))
        self.room = room + (-room) % 8  # the data starts 8-byte aligned, as safetensors has it
        self.data_len = offset
        self.written: set[str] = set()
        self.file = path.open("wb")
        self.file.write(b"\0" * (8 + self.room))

    def _header_bytes(self, sums: dict[str, list[int]]) -> bytes:
        metadata = with_metadata_sum(
            {**self.metadata, SAFETENSORS_SUMS: json.dumps(sums, separators=(",", ":"))})
        return json.dumps({"__metadata__": metadata, **self.header},
                          separators=(",", ":")).encode()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """`name`'s bytes at their place in the file, in any order."""
        info = self.header[name]
        if (DTYPES[tensor.dtype], list(tensor.shape)) != (info["dtype"], info["shape"]):
            raise ValueError(f"{name}: {tensor.dtype} {list(tensor.shape)} is not what the "
                             f"header says, {info['dtype']} {info['shape']}")
        tensor = tensor.contiguous()
        self.sums[name] = tensor_crcs([tensor])[0]
        if self.sums[name][0]:
            self.file.seek(8 + self.room + info["data_offsets"][0])
            data: Any = tensor.view(-1).view(torch.uint8).numpy()  # the bytes, not copied
            self.file.write(data)
        self.written.add(name)

    def close(self) -> list[int]:
        """Write the header; [bytes, crc32] of the whole file (`files.file_crc`'s), from
        the header's and the tensors' own (no byte read back)."""
        missing = [name for name in self.header if name not in self.written]
        if missing:
            self.file.close()
            raise ValueError(f"{self.path.name}: {len(missing)} tensor(s) never written, "
                             f"{missing[0]} first")
        text = self._header_bytes(self.sums)
        head = struct.pack("<Q", self.room) + text + b" " * (self.room - len(text))
        self.file.seek(0)
        self.file.write(head)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        crc = zlib.crc32(head)
        for size, part in self.sums.values():  # in the order of the file's offsets
            crc = crc32_combine(crc, part, size) if size else crc
        return [len(head) + self.data_len, crc]


@dataclass
class Target:
    """One output file: its items in order, the rank that writes it, its metadata."""

    path: Path
    writer: int
    items: list[Item]
    metadata: dict[str, str]


def write_files(catalog: Catalog, targets: list[Target]) -> dict[Path, list[int]]:
    """Collective: every target written by its writer in one walk over the tensors (a
    tensor several files hold is made whole once); {path: [bytes, crc32]} of the files
    this rank wrote. An item is one object in every target that holds it."""
    rank = catalog.ctx.rank
    order: dict[int, Item] = {}
    holding: dict[int, list[Target]] = {}
    for target in targets:
        for item in target.items:
            order.setdefault(id(item), item)
            holding.setdefault(id(item), []).append(target)
    items = list(order.values())
    left = {id(t): len(t.items) for t in targets}
    streams: dict[int, SafetensorsStream] = {}
    sums: dict[Path, list[int]] = {}
    try:
        for target in targets:
            if target.writer == rank:
                entries = [(i.name, *_shape_of(catalog, i)) for i in target.items]
                streams[id(target)] = SafetensorsStream(target.path, entries, target.metadata)
                if not target.items:
                    sums[target.path] = streams.pop(id(target)).close()
        writers = [{t.writer for t in holding[id(item)]} for item in items]
        for i, tensor in catalog.items(items, writers):
            for target in holding[id(items[i])]:
                if target.writer != rank:
                    continue
                assert tensor is not None
                streams[id(target)].write(items[i].name, tensor)
                left[id(target)] -= 1
                if not left[id(target)]:  # its last: the file is whole
                    sums[target.path] = streams.pop(id(target)).close()
    finally:
        for stream in streams.values():
            stream.file.close()
    return sums


def _shape_of(catalog: Catalog, item: Item) -> tuple[tuple[int, ...], torch.dtype]:
    shape, dtype, _ = catalog.meta[item.sources[0]]  # a merged LoRA weight keeps its base's
    return shape, dtype


def plain_items(catalog: Catalog, ties: list[list[str]],
                lora: Any = None) -> tuple[list[Item], dict[str, str]]:
    """The items of the module's plain state: a tied tensor once (under its first name;
    {alias: kept name} returned), a LoRA layer's weight merged with its adapters and the
    adapters left out (`parallel.lora.merged`'s rule, tensor by tensor)."""
    aliases = {alias: group[0] for group in ties for alias in group[1:]
               if group[0] in catalog.meta}
    items: list[Item] = []
    for name in catalog.meta:
        if name in aliases or is_adapter(name):
            continue
        layer = name.removesuffix(".base_layer.weight")
        a = f"{layer}.lora_A.{ADAPTER}.weight"
        if lora is not None and layer != name and a in catalog.meta:
            b = f"{layer}.lora_B.{ADAPTER}.weight"
            items.append(Item(f"{layer}.weight", (name, a, b), _merging(layer, lora)))
        else:
            items.append(Item(base_name(name), (name,)))
    renamed = {i.sources[0]: i.name for i in items}
    return items, {base_name(a): renamed.get(k, k) for a, k in aliases.items()}


def _merging(layer: str, lora: Any) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    def merge(parts: list[torch.Tensor]) -> torch.Tensor:
        weight, a, b = parts
        return merge_one(weight, a, b, layer, lora)

    return merge


def hf_shards(catalog: Catalog, items: list[Item], limit: int = HF_SHARD_BYTES
              ) -> list[list[Item]]:
    """`items` cut into files of at most `limit` bytes (a bigger tensor alone in one)."""
    shards: list[list[Item]] = [[]]
    size = 0
    for item in items:
        n = catalog.nbytes(item.sources[0])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


def shard_names(count: int) -> list[str]:
    """transformers' names for a model's weight files."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]

