"""Rows of `.jsonl`, `.jsonl.gz` and `.parquet` files, and the rows that could not be used.

A path or a glob (`data/shard-*.jsonl.gz`) names the files, read in sorted order so
that every rank and every run reads the same rows in the same order. A row is named by
its file and line (`data/a.jsonl:17`; a `.parquet` file's row number counted from 1). A
row that cannot be used (not UTF-8, not JSON, without the field a dataset needs, an
empty file) is set aside in `Rows.bad` with its reason; `Rows.report` names them all in
one warning line, and refuses a dataset left with nothing.
"""

from __future__ import annotations

import glob
import gzip
import json
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddptrain.errors import ConfigError, few

log = logging.getLogger("ddptrain")

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
NAMED = 10  # the rows a warning names before it counts the rest


def files_of(spec: str, dataset: str) -> list[Path]:
    """The files a path or a glob names, sorted; refused when none is a data file."""
    matched = sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else [spec]
    paths = [Path(m) for m in matched if Path(m).is_file()]
    if not paths:
        raise ConfigError(f"--dataset {dataset!r}: no file matches {spec!r}: give a path or "
                          f"a glob of {', '.join(SUFFIXES)} files")
    unlike = [str(p) for p in paths if not str(p).endswith(SUFFIXES)]
    if unlike:
        raise ConfigError(f"--dataset {dataset!r}: {few(unlike)} is not a "
                          f"{' / '.join(SUFFIXES)} file: give files of those kinds")
    return paths


@dataclass
class Rows:
    """The rows read so far and the ones set aside, each with where it came from."""

    dataset: str
    bad: list[tuple[str, str]] = field(default_factory=list)  # (file:line, reason)

    def reject(self, where: str, reason: str) -> None:
        self.bad.append((where, reason))

    def read(self, paths: list[Path]) -> Iterator[tuple[str, dict[str, Any]]]:
        """Each file's rows that are JSON objects, as `(file:line, row)`."""
        for path in paths:
            count = 0
            for where, row in _rows(path, self):
                count += 1
                if isinstance(row, dict):
                    yield where, row
                else:
                    self.reject(where, f"a JSON {type(row).__name__}, not an object")
            if not count:
                self.reject(str(path), "an empty file")

    def report(self, kept: int, what: str) -> None:
        """One warning line naming the rows set aside; a refusal when none is `kept`."""
        named = [f"{where} ({reason})" for where, reason in self.bad]
        if not kept:
            raise ConfigError(
                f"--dataset {self.dataset!r} holds no usable {what}"
                + (f": {len(named)} set aside: {few(named, NAMED)}" if named else "")
            )
        if named:
            log.warning("--dataset %s: %d row(s) set aside: %s", self.dataset, len(named),
                        few(named, NAMED))


def _rows(path: Path, rows: Rows) -> Iterator[tuple[str, Any]]:
    if str(path).endswith(".parquet"):
        yield from _parquet_rows(path, rows)
        return
    opener: Any = gzip.open if str(path).endswith(".gz") else open
    line = 0
    try:
        with opener(path, "rb") as lines:
            for line, raw in enumerate(lines, start=1):
                where = f"{path}:{line}"
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    rows.reject(where, "not UTF-8")
                    continue
                if not text.strip():
                    continue  # a blank line (often the last) holds no row
                try:
                    yield where, json.loads(text)
                except json.JSONDecodeError:
                    rows.reject(where, "not JSON")
    except (OSError, EOFError, zlib.error) as exc:  # a damaged or cut .gz
        rows.reject(f"{path}:{line + 1}", f"unreadable: {type(exc).__name__}")


def _parquet_rows(path: Path, rows: Rows) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise ConfigError(f"--dataset {rows.dataset!r}: reading {str(path)!r} needs pyarrow: "
                          "pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow's errors for a file that is not parquet vary
        rows.reject(str(path), f"not a readable parquet file: {type(exc).__name__}")
        return
    for n, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}:{n}", row
