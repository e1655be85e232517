"""`--pack`: token documents of any length packed into `--block_size` windows, documents
kept apart, no compute spent on padding.

    ddptrain train --dataset mymod:documents --pack --block_size 256 --model gpt

A dataset for `--pack` yields documents: a 1-D sequence of token ids (a tensor, an array,
a list) or a dict with `input_ids` (a Hugging Face dataset's rows), map-style. The
documents, in the dataset's order, are laid end to end and cut into windows of
`--block_size` tokens (the last one padded); a window is a dict in the Hugging Face
convention: `input_ids`, `labels` (the same ids, or the document's own `labels` where it
gives them, -100 on the tokens nothing is trained to predict, such as a chat's prompt; the
lm task predicts label t + 1 from position t) and `position_ids`, which count from 0 at
the start of each document's piece in the window. The label of each piece's first token
is -100, so no token is predicted across a boundary, and `document_mask` turns the
positions into the block-diagonal causal mask that keeps each piece's attention inside
it: the built-in GPT builds it from `position_ids`, a Hugging Face model gets it as its
4-D `attention_mask` (`ModelCall`).
A document that fits a window is then scored exactly as if it ran alone; a longer one is
cut, each piece a document of its own. Windows are samples like any other: how they fall
on ranks, every window once, a mid-epoch resume are the epoch plan's. The run logs how
much of the windows is trained against padding each document to a window.

A stream of documents (an `IterableDataset`) is packed as it comes (`PackedStream`), and
its windows are sharded over rank x worker as any stream's; its position is the windows
it has given, so a stream that reads the same documents again for an epoch resumes
mid-epoch exactly, DataLoader workers included.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from ddptrain.data.bundle import DataBundle, DataFacts, attr_through
from ddptrain.data.loader import WorkerSafeError
from ddptrain.errors import ConfigError

log = logging.getLogger("ddptrain")

IGNORE = -100  # the label of a token nothing predicts


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: position i may attend to j when j <= i and both lie in one
    document piece (a piece starts where `position_ids` is 0)."""
    piece = torch.cumsum(position_ids == 0, dim=1)
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ((piece[:, :, None] == piece[:, None, :]) & causal)[:, None]


def _tokens(document: Any, where: str) -> torch.Tensor:
    ids = document.get("input_ids") if isinstance(document, Mapping) else document
    try:
        tensor = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError):
        tensor = None
    if tensor is None or tensor.ndim != 1 or tensor.is_floating_point() or tensor.is_complex():
        what = (f"a {type(document).__name__}" if tensor is None
                else f"{tuple(tensor.shape)} {tensor.dtype}")
        raise ConfigError(
            f"--pack packs token documents, and {where} gives {what}: give documents as "
            "1-D sequences of token ids, or dicts with input_ids"
        )
    return tensor.long()


def _labels(document: Any, tokens: torch.Tensor, where: str) -> torch.Tensor:
    """A document's own `labels` (a dict's, as long as its `input_ids`), else its ids."""
    given = document.get("labels") if isinstance(document, Mapping) else None
    if given is None:
        return tokens
    labels = torch.as_tensor(given)
    if labels.shape != tokens.shape or labels.is_floating_point():
        raise ConfigError(
            f"--pack: {where} gives labels of {tuple(labels.shape)} {labels.dtype} for "
            f"{len(tokens)} input_ids: give one integer label a token (-100: not trained)"
        )
    return labels.long()


def check_ids(tokens: torch.Tensor, vocab_size: int | None, which: str) -> None:
    """Refuse a token id outside 0..vocab_size-1 (`vocab_size` None: a negative one), naming
    `which` (the document) holds it: one min and one max of ids already read."""
    if not len(tokens):
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0:
        raise WorkerSafeError(
            f"--pack: {which} holds token id {low}, and token ids count from 0"
            + (f" (a vocabulary of {vocab_size}: 0..{vocab_size - 1})" if vocab_size else "")
            + ": give the tokenizer's ids as they are (no -100 or other marker in input_ids)"
        )
    if vocab_size is not None and high >= vocab_size:
        raise WorkerSafeError(
            f"--pack: {which} holds token id {high}, outside the dataset's vocabulary of "
            f"{vocab_size} (its vocab_size: ids 0..{vocab_size - 1}): tokenize with that "
            "vocabulary, or give the dataset the vocab_size of its tokenizer"
        )


def nothing_to_predict(where: str, block_size: int) -> ConfigError:
    """The refusal of documents whose windows leave no token to predict (no loss counted:
    a run on them would train nothing and log a loss of nan)."""
    return WorkerSafeError(
        f"--pack: {where} leaves no token to predict in windows of {block_size}: each "
        "piece of its documents a window holds is one token, and a piece's first token "
        "has nothing before it: give documents of 2 tokens or more, or a larger --block_size"
    )


class Packed(Dataset):
    """`documents` laid end to end and cut into windows of `block_size` tokens (see the
    module's text). Each document is read once as the windows are planned: its length,
    and its ids against the vocabulary (`check_ids`). A set whose windows leave no token
    to predict (no loss to count) is refused."""

    def __init__(self, documents: Dataset, block_size: int, where: str,
                 vocab_size: int | None = None) -> None:
        self.documents, self.block_size, self.vocab_size = documents, block_size, vocab_size
        count = len(documents)  # type: ignore[arg-type]
        lengths = []
        masked: dict[int, np.ndarray] = {}  # the documents with labels of their own
        for i in range(count):  # each document read once: its length, its ids' range
            document = documents[i]
            tokens = _tokens(document, where)
            check_ids(tokens, vocab_size, f"document {i} of {where}")
            labels = _labels(document, tokens, f"document {i} of {where}")
            if labels is not tokens:
                masked[i] = (labels != IGNORE).numpy()
            lengths.append(len(tokens))
        self.starts = [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
        self.documents_count = count
        self.tokens = self.starts[-1]
        if not self.tokens:
            raise ConfigError(f"--pack: {where} holds no tokens")
        # Every token is trained but the first of each piece a window holds (nothing
        # before it predicts it): a document cut by windows loses one more per cut.
        # Padding each document to windows of its own would cut it ceil(n / block) times.
        starts = np.asarray(self.starts, dtype=np.int64)
        held = starts[1:] > starts[:-1]  # the documents with tokens: [a, b) in the stream
        a, b = starts[:-1][held], starts[1:][held]
        self.trained = self.tokens - int(((b - 1) // block_size - a // block_size + 1).sum())
        alone = -(-(b - a) // block_size)
        self.trained_alone = int((b - a - alone).sum())
        self.padded = int(alone.sum()) * block_size
        for i, trains in masked.items():
            if not len(trains):
                continue  # labels of their own: only those trained count
            a0, n = self.starts[i], len(trains)
            cuts, cuts_alone = _cuts(a0, n, block_size), np.arange(0, n, block_size)
            self.trained -= (n - len(cuts)) - int(trains.sum() - trains[cuts].sum())
            self.trained_alone -= (n - len(cuts_alone)) - int(
                trains.sum() - trains[cuts_alone].sum())
        if not self.trained:
            raise nothing_to_predict(where, block_size)

    def __len__(self) -> int:
        return -(-self.tokens // self.block_size)

    def __getitem__(self, w: int) -> dict[str, torch.Tensor]:
        lo = w * self.block_size
        hi = min(lo + self.block_size, self.tokens)
        ids, labels, positions = [], [], []
        d = bisect.bisect_right(self.starts, lo) - 1
        while d < self.documents_count and self.starts[d] < hi:
            a, b = max(lo, self.starts[d]), min(hi, self.starts[d + 1])
            if b > a:
                document = self.documents[d]
                doc = _tokens(document, "the dataset")
                piece = slice(a - self.starts[d], b - self.starts[d])
                ids.append(doc[piece])
                labels.append(_labels(document, doc, "the dataset")[piece])
                positions.append(torch.arange(b - a))
            d += 1
        return _window(ids, positions, self.block_size, labels)

    @property
    def efficiency(self) -> float:
        """Trained tokens over window positions."""
        return self.trained / (len(self) * self.block_size)


def _cuts(start: int, length: int, block_size: int) -> np.ndarray:
    """The offsets in a document at `start` of the stream where its pieces begin: its
    first token and each token a window starts at."""
    first = -(-start // block_size) * block_size - start
    return np.unique(np.concatenate([[0], np.arange(first, length, block_size)])).astype(
        np.int64)


def _window(ids: list[torch.Tensor], positions: list[torch.Tensor], block_size: int,
            labels: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A window's dict from its pieces (padded to `block_size` with a piece of its own
    that nothing is trained on); `labels`: the pieces' own (default: their ids)."""
    pad = block_size - sum(len(x) for x in ids)
    pieces = ids if labels is None else labels
    if pad:
        ids, positions = [*ids, torch.zeros(pad, dtype=torch.long)], [*positions,
                                                                     torch.arange(pad)]
    input_ids, position_ids = torch.cat(ids), torch.cat(positions)
    targets = torch.cat([*pieces, torch.full((pad,), IGNORE, dtype=torch.long)])
    targets[position_ids == 0] = IGNORE
    return {"input_ids": input_ids, "labels": targets, "position_ids": position_ids}


class PackedStream(IterableDataset):
    """A stream of documents packed into windows as `Packed` packs a dataset, window by
    window as the documents come. Its position is the windows it has given this epoch
    (`state_dict`): a resume reads the documents again from the epoch's start and skips
    as many windows, so a stream that gives the same documents each time it is read (and
    is told its epoch, `set_epoch`) resumes mid-epoch exactly."""

    def __init__(self, documents: IterableDataset, block_size: int, where: str,
                 vocab_size: int | None = None) -> None:
        self.documents, self.block_size, self.where = documents, block_size, where
        self.vocab_size = vocab_size
        self.given, self._skip = 0, 0

    def __iter__(self) -> Any:
        skip, self._skip = self._skip, 0
        self.given = 0
        ids: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        fill = trained = 0
        for n, document in enumerate(self.documents):
            which = f"document {n} of {self.where} (a stream)"
            tokens = _tokens(document, self.where)
            check_ids(tokens, self.vocab_size, which)
            targets = _labels(document, tokens, which)
            while len(tokens):
                piece = tokens[:self.block_size - fill]
                ids.append(piece)
                labels.append(targets[:len(piece)])
                trained += int((labels[-1][1:] != IGNORE).sum())
                positions.append(torch.arange(len(piece)))
                fill += len(piece)
                tokens, targets = tokens[len(piece):], targets[len(piece):]
                if fill == self.block_size:
                    yield from self._give(
                        _window(ids, positions, self.block_size, labels), skip)
                    ids, labels, positions, fill = [], [], [], 0
        if fill:
            yield from self._give(_window(ids, positions, self.block_size, labels), skip)
        if self.given and not trained:  # a whole pass, and no loss counted
            raise nothing_to_predict(self.where, self.block_size)

    def _give(self, window: dict[str, torch.Tensor], skip: int) -> Any:
        self.given += 1
        if self.given > skip:
            yield window

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self.given}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._skip = self.given = int(state["windows"])

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.documents, "set_epoch"):
            self.documents.set_epoch(epoch)


def pack_bundle(train: Dataset, val: Dataset, block_size: int, name: str) -> DataBundle:
    """A dataset's documents (`train`, `val`) packed into windows, alike."""
    vocab = attr_through(train, "vocab_size")
    if isinstance(train, IterableDataset):  # windows as the documents come
        facts = DataFacts((block_size,), (block_size,), False, None, vocab, True)
        log.info("--pack: the stream's documents in windows of %d", block_size)
        def windows(documents: Dataset) -> Dataset:
            return (PackedStream(documents, block_size, f"--dataset {name!r}", vocab)
                    if isinstance(documents, IterableDataset)
                    else Packed(documents, block_size, f"--dataset {name!r}", vocab))

        return DataBundle(windows(train), windows(val), facts)
    packed = Packed(train, block_size, f"--dataset {name!r}", vocab)
    log.info(
        "--pack: %s documents (%s tokens) in %s windows of %d: %.1f%% of window positions "
        "trained (padding each document to windows of %d: %.1f%%)",
        f"{packed.documents_count:,}", f"{packed.tokens:,}", f"{len(packed):,}", block_size,
        100 * packed.efficiency, block_size,
        100 * packed.trained_alone / max(packed.padded, 1),
    )
    facts = DataFacts((block_size,), (block_size,), False, None, vocab, True)
    return DataBundle(
        packed, Packed(val, block_size, f"--dataset {name!r} (validation)", vocab), facts
    )
