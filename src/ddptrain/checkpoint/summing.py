"""Checksums of a DCP step directory taken in the one pass that writes it, and checked in
the one pass that reads it.

A save writes through `SummingWriter`, DCP's filesystem writer with its streams wrapped:
each file's [bytes, crc32] (`files`, the same sums `integrity.share` splits among the
ranks for a whole-directory check) and each stored item's (`items`: one tensor chunk or
one entry saved as bytes, by `item_key`) are taken from the bytes as they go to disk, so
nothing is read back, and each byte is summed once: a file's CRC folds in the CRC of each
entry written into it (`crc32_combine`), summing only the bytes between entries. A large
write is summed on a helper thread while this one writes it: the time of the longer of
the two, not of both. A resume checks each item's byte range against `items` as DCP
reads it to deserialise it (`CheckedRange`), before the entry is loaded into the model:
each byte is read once, by the rank that needs it, and a damaged range is `Damaged`,
never loaded.
"""

from __future__ import annotations

import io
import os
import zlib
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from ddptrain.checkpoint.integrity import crc32_combine


class Damaged(Exception):
    """Bytes of a checkpoint do not match the checksum written with them."""


def item_key(index: MetadataIndex) -> str:
    """A stored item's name in `items`: its state-dict key and, for a chunk, its offsets."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


_ALONGSIDE = 1 << 20  # a write this large is summed on `_helper` while it is written
_helpers: list[ThreadPoolExecutor] = []


def _helper() -> ThreadPoolExecutor:
    """The process's one summing thread (zlib and the file write both let go of the GIL,
    so a write and its CRC take the time of the longer, not of both)."""
    if not _helpers:
        _helpers.append(ThreadPoolExecutor(1, thread_name_prefix="ddptrain-crc"))
    return _helpers[0]


class _Summed(io.RawIOBase):
    """A writable stream that passes every byte on to `raw` and keeps their CRC-32. While
    an entry's own summed stream writes through it (`inner`), its bytes are counted, not
    summed again: the entry's CRC is folded in when it closes (`fold`)."""

    def __init__(self, raw: Any, on_close: Callable[[_Summed], None] | None = None) -> None:
        super().__init__()
        self.raw, self.size, self.crc = raw, 0, 0
        self.on_close = on_close  # what the owner records once every byte has gone by
        self.inner = False
        self.passed = 0  # bytes an inner stream summed, not yet folded in

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self.inner:
            n = self.raw.write(view)
            n = len(view) if n is None else n
            self.passed += n
        elif len(view) < _ALONGSIDE:
            n = self.raw.write(view)
            n = len(view) if n is None else n
            self.crc = zlib.crc32(view[:n], self.crc)
        else:  # summed on a helper thread while this one writes the same bytes
            summing = _helper().submit(zlib.crc32, view, self.crc)
            try:
                n = self.raw.write(view)
            finally:
                crc = summing.result()
            n = len(view) if n is None else n
            self.crc = crc if n == len(view) else zlib.crc32(view[:n], self.crc)
        self.size += n
        return n

    def fold(self, size: int, crc: int) -> None:
        """An inner stream's `size` bytes went by, with `crc`: the file's CRC goes on
        from it."""
        if size != self.passed:
            raise RuntimeError(f"an entry's stream wrote {size} bytes, its file saw "
                               f"{self.passed}: the checksums would not hold")
        self.crc = crc32_combine(self.crc, crc, size)
        self.inner, self.passed = False, 0

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if self.closed:
            return
        if self.on_close is not None:
            self.on_close(self)
        super().close()  # flushes
        self.raw.close()

    @property
    def sums(self) -> list[int]:
        return [self.size, self.crc]


class _SummingFileSystem(FileSystem):
    """DCP's filesystem, keeping [bytes, crc] of every file written, by name."""

    def __init__(self, files: dict[str, list[int]]) -> None:
        self.files = files

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            summed = _Summed(stream)
            yield summed
        self.files[Path(path).name] = summed.sums

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # `.metadata.tmp` -> `.metadata`
        sums = self.files.pop(Path(path).name, None)
        if sums is not None:
            self.files[Path(new_path).name] = sums


class _SummingTransforms(_StorageWriterTransforms):
    """DCP's per-item write streams, each one's [bytes, crc] kept by `item_key`. No
    transform is added: the files and `.metadata` are DCP's own, readable by any DCP."""

    def __init__(self, items: dict[str, list[int]]) -> None:
        super().__init__(None)
        self.items = items

    def transform_save_stream(
        self, write_item: WriteItem, raw_stream: io.IOBase
    ) -> tuple[IO[bytes], list[str]]:
        inner, descriptors = super().transform_save_stream(write_item, raw_stream)
        items, key = self.items, item_key(write_item.index)
        outer = raw_stream if isinstance(raw_stream, _Summed) else None
        if outer is not None:  # the file's CRC takes this entry's, not its bytes again
            outer.inner = True

        def record(summed: _Summed) -> None:
            items[key] = summed.sums
            if outer is not None:
                outer.fold(summed.size, summed.crc)

        return _Summed(inner, record), descriptors  # type: ignore[return-value]


class SummingWriter(FileSystemWriter):
    """DCP's filesystem writer that keeps the checksums of what this rank wrote: `files`
    ({file name: [bytes, crc]}) and `items` ({`item_key`: [bytes, crc]})."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.files: dict[str, list[int]] = {}
        self.items: dict[str, list[int]] = {}
        self.fs = _SummingFileSystem(self.files)
        self.transforms = _SummingTransforms(self.items)


class CheckedRange(io.RawIOBase):
    """The `length` bytes at `offset` of a DCP file (`base`, named `name`), for DCP to
    deserialise an entry from, checked against `want` ([bytes, crc]) in the same read.

    torch.load reads a zip record at random, small headers back and forth, and a tensor's
    data in one large read straight into its storage: the CRC is taken in file order from
    those large reads as they land (the bytes are in cache), the small gaps between them
    read again (`finish`, which DCP's planner calls before the entry is loaded into the
    model: `SafeLoadPlanner`). So each byte comes from storage once and is copied once."""

    LARGE = 1 << 16

    def __init__(self, base: Any, name: str, offset: int, length: int, want: list[int]) -> None:
        super().__init__()
        self.base, self.name, self.offset, self.length, self.want = base, name, offset, length, want
        self.pos = 0
        self.crc, self.summed = 0, 0  # the CRC of the range's bytes [0, summed)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = max(0, min(self.length, start + offset))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self.length - self.pos)
        if n <= 0:
            return 0
        self.base.seek(self.offset + self.pos)
        got = self.base.readinto(view[:n]) or 0
        if got >= self.LARGE and self.pos >= self.summed:
            self._sum_to(self.pos)
            if self.summed == self.pos:
                self.crc = zlib.crc32(view[:got], self.crc)
                self.summed += got
        self.pos += got
        return got

    def read(self, size: int | None = -1) -> bytes:
        n = self.length - self.pos if size is None or size < 0 else size
        buffer = bytearray(max(0, min(n, self.length - self.pos)))
        got = self.readinto(buffer)
        return bytes(buffer[:got])

    def _sum_to(self, end: int) -> None:
        """Take the CRC on to `end` by reading the bytes not yet summed again."""
        self.base.seek(self.offset + self.summed)
        while self.summed < end:
            chunk = self.base.read(min(end - self.summed, 1 << 20))
            if not chunk:
                return
            self.crc = zlib.crc32(chunk, self.crc)
            self.summed += len(chunk)

    def finish(self) -> None:
        """`Damaged` unless the whole range matches `want`."""
        self._sum_to(self.length)
        if self.summed != self.want[0]:
            raise Damaged(f"{self.name} ends {self.want[0] - self.summed} bytes short of an "
                          "entry (truncated)")
        if self.crc != self.want[1]:
            raise Damaged(f"{self.name}: the entry at byte {self.offset} does not match its "
                          "checksum")
