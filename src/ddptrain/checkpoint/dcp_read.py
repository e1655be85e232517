"""Reading a DCP step directory without trusting it: its `.metadata` and its entries.

A `.metadata` is a pickle, so it is unpickled only from what such a file is made of
(`load_metadata`; anything else is `ForeignMetadata`, never run). `SafeReader` reads a
directory with DCP, checking `.metadata` and each entry's bytes against the checksums its
save took (`summing`) as it reads them, once; `SafeLoadPlanner` loads the entries saved
as bytes weights-only, each after its check. `check_metadata` is the one-line refusal of
a directory whose `.metadata` is foreign or unreadable. `checkpoint.dcp` uses them to
resume and to read a directory whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import zlib
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ddptrain.checkpoint.common import CheckpointError
from ddptrain.checkpoint.summing import CheckedRange, Damaged, item_key

# What a `.metadata` is made of, beyond plain containers and scalars: DCP's metadata
# classes, the storage index of the filesystem writer, tensor sizes, dtypes and layouts,
# and the path a save was written to.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class ForeignMetadata(Exception):
    """A `.metadata` names something DCP metadata is not made of."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _METADATA_MODULE:
            import torch.distributed.checkpoint.metadata as md

            found = getattr(md, name, None)
            if isinstance(found, type) and found.__module__ == module:
                return found
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise ForeignMetadata(f"{module}.{name}")


def load_metadata(data: bytes) -> Metadata:
    """A `.metadata`'s bytes as DCP's `Metadata`, built only from what such a file is made
    of: `ForeignMetadata` for anything else (it could run code)."""
    metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise ForeignMetadata(type(metadata).__name__)
    return metadata


class SafeReader(FileSystemReader):
    """DCP's filesystem reader, reading `.metadata` with `load_metadata`. Given the sums
    a save took (`summing`: `files`, `items`), it checks `.metadata` and each entry's
    byte range as it reads them, once: `Damaged` when one does not match."""

    def __init__(self, path: str, sums: dict[str, Any] | None = None) -> None:
        super().__init__(path)
        sums = sums or {}
        self.files: dict[str, list[int]] = sums.get("files") or {}
        self.items: dict[str, list[int]] = sums.get("items") or {}
        self._want: dict[tuple[str, int], list[int]] = {}
        self.pending: CheckedRange | None = None  # the entry being read, not yet checked

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        want = self.files.get(path.name)
        if want is not None and [len(data), zlib.crc32(data)] != list(want):
            raise Damaged(f"{path.name} does not match its checksum")
        metadata = load_metadata(data)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if self.items:
            self._want = {
                (info.relative_path, info.offset): self.items[item_key(index)]
                for index, info in (metadata.storage_data or {}).items()
                if item_key(index) in self.items
            }

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, each file's entries in the order they lie in it: one sequential
        pass per file (DCP reads them in plan order, which seeks back and forth)."""
        def where(item: ReadItem) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        ordered = dataclasses.replace(plan, items=sorted(plan.items, key=where))
        try:
            return super().read_data(ordered, planner)
        except Exception:  # damaged bytes that fail to deserialise before their check
            with contextlib.suppress(OSError):
                self.finish_pending()  # `Damaged`, the failure DCP then gives every rank
            raise

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self.finish_pending()
        # torch.load reads an entry's zip record back and forth: ask for all of it at
        # once, so that those reads find it in the page cache (one read from the disk)
        with contextlib.suppress(AttributeError, OSError, io.UnsupportedOperation):
            os.posix_fadvise(file.fileno(), sinfo.offset, sinfo.length, os.POSIX_FADV_WILLNEED)
        want = self._want.get((sinfo.relative_path, sinfo.offset))
        if want is None:
            return super()._slice_file(file, sinfo)
        self.pending = CheckedRange(file, sinfo.relative_path, sinfo.offset, sinfo.length, want)
        return self.pending  # type: ignore[return-value]

    def finish_pending(self) -> None:
        """Check the entry just read (`Damaged`); before it is loaded into the model.
        After a failed read DCP has closed its file: it is opened again for the check."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if not pending.base.closed:
            pending.finish()
            return
        with open(Path(self.path) / pending.name, "rb") as again:
            pending.base = again
            pending.finish()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading the entries saved as bytes weights-only; with a
    `reader`, each entry is checked (`SafeReader.finish_pending`) before it is loaded."""

    def __init__(self, reader: SafeReader | None = None) -> None:
        super().__init__()
        self.reader = reader

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if self.reader is not None:
            self.reader.finish_pending()
        return super().resolve_tensor(read_item)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if self.reader is not None:
            self.reader.finish_pending()
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(
                self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded
            )
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def refused(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {str(path)!r} cannot be read: its .metadata holds pickled code "
        f"({what}), which is refused; give a directory written by ddptrain, or "
        "--resume_from auto (which skips unusable ones)"
    )


def check_metadata(path: Path) -> Metadata:
    """A step directory's `.metadata`, read with `load_metadata`; refused with one line
    when it names anything else or cannot be read."""
    try:
        return SafeReader(str(path)).read_metadata()
    except ForeignMetadata as exc:
        raise refused(path, str(exc)) from None
    except Exception as exc:
        text = str(exc).strip()
        reason = text.splitlines()[0][:160] if text else type(exc).__name__
        raise CheckpointError(
            f"{str(path)!r} is not a whole DCP step directory (its .metadata cannot be "
            f"read: {reason}): give a step_XXXXXXXXX directory of a finished save, or "
            "--resume_from auto"
        ) from None
