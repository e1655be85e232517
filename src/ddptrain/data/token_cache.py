"""Token files `ddptrain tokenize` writes beside the data, read memory-mapped by a run.

    ddptrain tokenize --dataset 'text:corpus/*.jsonl.gz' --tokenizer hf:models/llama-tiny
    ddptrain train --model hf:models/llama-tiny --dataset 'text:corpus/*.jsonl.gz' --pack

The documents of `--dataset chat:PATH` or `text:PATH`, tokenized once, are stored in
`ddptrain_tokens/KIND-KEY/` in the folder of the first file: `ids.npy` (every document's
token ids end to end, int32), `labels.npy` (a chat's labels, likewise), `offsets.npy`
(where each document starts, int64), `rows.json` (where each document came from, and the
rows set aside with their reasons) and `ddptrain_checksums.json` (the checksums of them
all). KEY is a digest of what the tokens depend on: the data files' contents (their sizes
and CRC32s, in order), the tokenizer directory's files and, for text, `--text_field`. A
run over the same files with the same tokenizer reads the documents from there instead of
tokenizing them, and gets the same token stream; a change to a file or to the tokenizer
makes another KEY, so stale tokens are never read. A directory whose files do not match
their checksums (truncated, overwritten, half copied) is refused, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddptrain.data.rowfiles import Rows
from ddptrain.errors import ConfigError
from ddptrain.files import SUMS_FILE, file_crc, staged_dir, sums_damage, write_sums

log = logging.getLogger("ddptrain")

CACHE = "ddptrain_tokens"
FORMAT = 1  # the layout of the files here: part of KEY
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")  # a model directory's, not read


def cache_of(kind: str, paths: list[Path], tokenizer_ref: str, text_field: str,
             lookup: bool = False) -> Path | None:
    """The directory the documents of `paths` tokenized by `tokenizer_ref` (`hf:DIR`) are
    stored in (`lookup`: None when no tokens were ever stored beside them, without reading
    the files)."""
    root = paths[0].parent / CACHE
    if lookup and not root.is_dir():
        return None
    tokenizer_dir = Path(tokenizer_ref.removeprefix("hf:"))
    names = sorted(n for n in os.listdir(tokenizer_dir) if (tokenizer_dir / n).is_file()
                   and not n.endswith(_WEIGHTS) and n != SUMS_FILE)
    described = {
        "format": FORMAT, "kind": kind, "text_field": text_field if kind == "text" else None,
        "sources": [[p.name, *file_crc(p)] for p in paths],
        "tokenizer": [[n, *file_crc(tokenizer_dir / n)] for n in names],
    }
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{kind}-{key}"


def write(directory: Path, documents: Sequence[Any], wheres: list[str], rows: Rows) -> None:
    """Store `documents` ((input_ids, labels or None) each), where each came from and the
    rows set aside, in `directory` (replaced whole, never left half written)."""
    lengths = [len(ids) for ids, _ in documents]
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    ids = np.concatenate([d[0].numpy() for d in documents]).astype(np.int32)
    labelled = any(labels is not None for _, labels in documents)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with staged_dir(directory) as tmp:
        np.save(tmp / "ids.npy", ids)
        np.save(tmp / "offsets.npy", offsets)
        if labelled:
            labels = np.concatenate([(d[0] if d[1] is None else d[1]).numpy()
                                     for d in documents]).astype(np.int32)
            np.save(tmp / "labels.npy", labels)
        (tmp / "rows.json").write_text(json.dumps(
            {"documents": wheres, "set_aside": rows.bad}) + "\n")
        write_sums(tmp)


class Stored(Sequence[Any]):
    """Stored documents, each read from the memory-mapped files when asked for."""

    def __init__(self, directory: Path) -> None:
        self.ids = np.load(directory / "ids.npy", mmap_mode="r")
        self.offsets = np.load(directory / "offsets.npy")
        labels = directory / "labels.npy"
        self.labels = np.load(labels, mmap_mode="r") if labels.is_file() else None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1 if i >= 0 else i + len(self) + 1])
        ids = torch.from_numpy(np.array(self.ids[a:b], dtype=np.int64))
        if self.labels is None:
            return ids, None
        return ids, torch.from_numpy(np.array(self.labels[a:b], dtype=np.int64))


def stored(dataset: str, directory: Path | None) -> tuple[Stored, list[str], Rows] | None:
    """The documents stored in `directory`, where each came from and the rows set aside;
    None when nothing is stored there; refused when its files are damaged."""
    if directory is None or not directory.exists():
        return None
    damage = (sums_damage(directory) if (directory / SUMS_FILE).is_file()
              else f"{SUMS_FILE} is missing")
    if damage is None:
        try:
            documents = Stored(directory)
            described = json.loads((directory / "rows.json").read_text())
            wheres, bad = list(described["documents"]), described["set_aside"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            damage = f"it cannot be read ({type(exc).__name__})"
    if damage is not None:
        raise ConfigError(
            f"--dataset {dataset!r}: its token files {str(directory)!r} are damaged: {damage}: "
            "run ddptrain tokenize again, or remove that directory to tokenize as the run "
            "starts"
        )
    log.info("--dataset %s: %s documents (%s tokens) read from %s", dataset,
             f"{len(documents):,}", f"{len(documents.ids):,}", directory)
    return documents, wheres, Rows(dataset, [(str(w), str(r)) for w, r in bad])
