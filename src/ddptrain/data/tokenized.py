"""`--dataset chat:PATH` and `--dataset text:PATH`: files of raw text or chats, tokenized
with the model's own tokenizer as the run starts.

    ddptrain train --model hf:models/llama-tiny --dataset chat:data/chats.jsonl --pack
    ddptrain train --model hf:models/llama-tiny --dataset 'text:corpus/shard-*.jsonl.gz' \\
        --text_field text --pack --block_size 1024

PATH is a file or a glob of `.jsonl`, `.jsonl.gz` or `.parquet` files (`data.rowfiles`).
`chat:` rows are chats or prompt/completion pairs (`data.chat`), trained on the replies
alone. `text:` rows hold a document in `--text_field`; each is tokenized without the
tokenizer's special tokens and ends with its end-of-sequence token, so that a model learns
where documents end and none runs into the next unmarked. The tokenizer is `--tokenizer
hf:DIR`, by default `--model hf:DIR`'s (`data.tokenizer`).

Every rank reads and tokenizes all the files itself, up front, in the same order, so the
documents and the seeded train/val split (`--val_fraction` of the documents) are the same
on every rank with nothing exchanged. With `--pack` the documents are packed as any
documents are (`data.pack`), the chats' labels kept. Without it, a chat is one sample of
`--block_size` tokens, padded on the right (labels -100 and `attention_mask` 0 on the
padding), and text is one stream (documents end to end) cut into windows of
`--block_size` + 1 tokens, each an input and its next tokens.

A chat longer than `--block_size` is left out, not cut: a reply cut from its prompt, or a
prompt without its reply, teaches what the chat did not say. Such chats, and the rows
that could not be used, are each named once (file and line) in a warning line; a dataset
left with nothing is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddptrain.config import TrainingConfig
from ddptrain.data import token_cache
from ddptrain.data.bundle import DataBundle, DataFacts
from ddptrain.data.chat import BadRow, encode_row
from ddptrain.data.pack import IGNORE, pack_bundle
from ddptrain.data.rowfiles import NAMED, Rows, files_of
from ddptrain.data.text import TokenWindows
from ddptrain.data.tokenizer import load_tokenizer, tokenizer_ref, vocabulary
from ddptrain.errors import ConfigError, few

log = logging.getLogger("ddptrain")

KINDS = ("chat", "text")
_BATCH = 1024  # texts handed to the tokenizer at once


def is_tokenized(dataset: str) -> bool:
    """Whether `--dataset` names files this module tokenizes (`chat:PATH`, `text:PATH`)."""
    kind, sep, path = dataset.partition(":")
    return bool(sep and path) and kind in KINDS


Document = tuple[torch.Tensor, torch.Tensor | None]  # input_ids, and labels when not them


class Documents(Dataset):
    """Token documents as `--pack` takes them: dicts of `input_ids` (and `labels`)."""

    def __init__(self, documents: Sequence[Document], vocab_size: int) -> None:
        self.documents, self.vocab_size = documents, vocab_size

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.documents[i]
        return {"input_ids": ids} if labels is None else {"input_ids": ids, "labels": labels}


class PaddedChats(Dataset):
    """Chats one a sample, padded on the right to `block_size`; nothing trains on padding."""

    def __init__(self, documents: Sequence[Document], block_size: int, pad_id: int,
                 vocab_size: int) -> None:
        self.documents, self.block_size, self.pad_id = documents, block_size, pad_id
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.documents[i]
        labels = ids if labels is None else labels
        pad = self.block_size - len(ids)
        mask = torch.cat([torch.ones(len(ids), dtype=torch.long),
                          torch.zeros(pad, dtype=torch.long)])
        return {
            "input_ids": torch.cat([ids, torch.full((pad,), self.pad_id, dtype=torch.long)]),
            "labels": torch.cat([labels, torch.full((pad,), IGNORE, dtype=torch.long)]),
            "attention_mask": mask,
        }


def load_tokenized(config: TrainingConfig, split: Callable[[int], tuple[np.ndarray, np.ndarray]]
                   ) -> DataBundle:
    """The bundle of `--dataset chat:PATH` or `text:PATH` (see the module's text); `split`:
    the seeded (train, val) indices of so many documents. Documents `ddptrain tokenize`
    stored for these files and this tokenizer are read from there (`data.token_cache`)."""
    kind, _, spec = config.dataset.partition(":")
    ref = tokenizer_ref(config.tokenizer, config.model, config.dataset)
    paths = files_of(spec, config.dataset)
    tokenizer = load_tokenizer(ref)
    stored = token_cache.stored(config.dataset, token_cache.cache_of(
        kind, paths, ref, config.text_field, lookup=True))
    read = stored or tokenize_files(config.dataset, paths, tokenizer, config.text_field)
    documents: Sequence[Document] = read[0]
    wheres, rows = read[1], read[2]
    rows.report(len(documents), "chats" if kind == "chat" else "documents")
    if kind == "chat":
        documents = fitting(documents, wheres, config.block_size, config.dataset)
    train_idx, val_idx = split(len(documents))
    train, val = Picked(documents, train_idx), Picked(documents, val_idx)
    vocab, block = vocabulary(tokenizer), config.block_size
    if config.pack:
        return pack_bundle(Documents(train, vocab), Documents(val, vocab), block,
                           config.dataset)
    if kind == "chat":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
            tokenizer.eos_token_id
        facts = DataFacts((block,), (block,), False, None, vocab, True)
        return DataBundle(PaddedChats(train, block, pad, vocab),
                          PaddedChats(val, block, pad, vocab), facts)
    facts = DataFacts((block,), (block,), False, None, vocab)
    return DataBundle(_windows(train, block, config.dataset, "training"),
                      _windows(val, block, config.dataset, "validation"), facts)


class Picked(Sequence[Document]):
    """Some of a sequence's documents, in the order given (read when asked for)."""

    def __init__(self, documents: Sequence[Document], picked: Any) -> None:
        self.documents, self.picked = documents, [int(i) for i in picked]

    def __len__(self) -> int:
        return len(self.picked)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.documents[self.picked[i]]


def tokenize_files(dataset: str, paths: list[Path], tokenizer: Any, text_field: str
                   ) -> tuple[list[Document], list[str], Rows]:
    """The documents of `paths` (`dataset`: chat:PATH or text:PATH), where each came from,
    and the rows set aside."""
    rows = Rows(dataset)
    if dataset.startswith("chat:"):
        return (*chats(tokenizer, rows, paths), rows)
    return (*texts(tokenizer, rows, paths, text_field), rows)


def fitting(documents: Sequence[Document], wheres: list[str], block_size: int, dataset: str
            ) -> Sequence[Document]:
    """The chats of `block_size` tokens or fewer; the others named in a warning line."""
    keep = [i for i, (ids, _) in enumerate(documents) if len(ids) <= block_size]
    long = [f"{wheres[i]} ({len(documents[i][0])} tokens)" for i in range(len(documents))
            if len(documents[i][0]) > block_size]
    if long:
        log.warning("--dataset %s: %d chat(s) longer than --block_size %d left out (raise "
                    "--block_size to train on them): %s", dataset, len(long),
                    block_size, few(long, NAMED))
        if not keep:
            raise ConfigError(
                f"--dataset {dataset!r}: every usable chat is longer than --block_size "
                f"{block_size} ({few(long, NAMED)}): raise --block_size"
            )
    return documents if len(keep) == len(documents) else Picked(documents, keep)


def chats(tokenizer: Any, rows: Rows, paths: list[Path]) -> tuple[list[Document], list[str]]:
    """The usable chats of `paths` as (input_ids, labels), and where each came from; rows
    that cannot be used are set aside in `rows`."""
    documents: list[Document] = []
    wheres: list[str] = []
    for where, row in rows.read(paths):
        if "messages" in row and tokenizer.chat_template is None:
            raise ConfigError(
                f"--dataset {rows.dataset!r} holds chats ({where}) and the tokenizer has no "
                "chat template: give --tokenizer hf:DIR of one that has (its "
                "chat_template.jinja or tokenizer_config.json's chat_template)"
            )
        try:
            ids, labels = encode_row(tokenizer, row)
        except BadRow as reason:
            rows.reject(where, str(reason))
            continue
        if not bool((labels[1:] != IGNORE).any()):
            rows.reject(where, "no reply token to train on")
        else:
            documents.append((ids, labels))
            wheres.append(where)
    return documents, wheres


def texts(tokenizer: Any, rows: Rows, paths: list[Path], text_field: str
          ) -> tuple[list[Document], list[str]]:
    """The documents in `text_field` of `paths`' rows, each ending with the end-of-sequence
    token, and where each came from; rows without such text are set aside in `rows`."""
    found: list[str] = []
    wheres: list[str] = []
    for where, row in rows.read(paths):
        text = row.get(text_field) if isinstance(row, Mapping) else None
        if text_field not in row:
            rows.reject(where, f"no {text_field!r} field (--text_field)")
        elif not isinstance(text, str):
            rows.reject(where, f"{text_field!r} is a {type(text).__name__}, not text")
        elif not text:
            rows.reject(where, f"an empty {text_field!r}")
        else:
            found.append(text)
            wheres.append(where)
    eos = torch.tensor([tokenizer.eos_token_id], dtype=torch.long)
    documents: list[Document] = []
    for start in range(0, len(found), _BATCH):
        encoded = tokenizer(found[start:start + _BATCH], add_special_tokens=False)
        documents += [(torch.cat([torch.tensor(ids, dtype=torch.long), eos]), None)
                      for ids in encoded["input_ids"]]
    return documents, wheres


def token_stream(documents: Sequence[Document]) -> torch.Tensor:
    """The documents' ids end to end."""
    return torch.cat([ids for ids, _ in documents]) if len(documents) else torch.zeros(0).long()


def _windows(documents: Sequence[Document], block_size: int, dataset: str, part: str
             ) -> TokenWindows:
    """The documents' stream cut into windows of `block_size` + 1 tokens (the tail shorter
    than one dropped), each an input and its next tokens."""
    stream = token_stream(documents)
    n = len(stream) // (block_size + 1)
    if not n:
        raise ConfigError(
            f"--dataset {dataset!r}: its {part} documents hold {len(stream)} tokens, fewer "
            f"than one window of --block_size {block_size} + 1: lower --block_size, give "
            "more text or use --pack"
        )
    windows = stream[:n * (block_size + 1)].view(n, block_size + 1)
    return TokenWindows(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())


def tokenize_to_files(dataset: str, tokenizer: str | None, model: str | None,
                      text_field: str) -> Path:
    """`ddptrain tokenize`: the documents of `dataset` (chat:PATH or text:PATH) tokenized
    and stored beside its files (`data.token_cache`); returns where."""
    if not is_tokenized(dataset):
        raise ConfigError(f"--dataset {dataset!r} is not files to tokenize: give chat:PATH or "
                          "text:PATH (a file or glob of .jsonl, .jsonl.gz or .parquet files)")
    if not tokenizer and not (model or "").startswith("hf:"):
        raise ConfigError("which tokenizer? give --tokenizer hf:DIR, or --model hf:DIR whose "
                          "directory holds one")
    kind, _, spec = dataset.partition(":")
    ref = tokenizer_ref(tokenizer, model or "", dataset)
    paths = files_of(spec, dataset)
    documents, wheres, rows = tokenize_files(dataset, paths, load_tokenizer(ref), text_field)
    rows.report(len(documents), "chats" if kind == "chat" else "documents")
    directory = token_cache.cache_of(kind, paths, ref, text_field)
    assert directory is not None  # (only a lookup finds none)
    token_cache.write(directory, documents, wheres, rows)
    log.info("--dataset %s: %s documents (%s tokens) stored in %s", dataset,
             f"{len(documents):,}", f"{sum(len(d[0]) for d in documents):,}", directory)
    return directory
