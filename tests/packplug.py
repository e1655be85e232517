"""Token documents of many lengths for `--pack` (tests/test_pack.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

VOCAB = 20


class Documents(Dataset):
    vocab_size = VOCAB

    def __init__(self, lengths: list[int], seed: int, as_dicts: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.docs = [torch.randint(0, VOCAB, (int(n),), generator=g) for n in lengths]
        self.as_dicts = as_dicts

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> Any:
        return {"input_ids": self.docs[i].tolist()} if self.as_dicts else self.docs[i]


def documents(config: Any, n: int = 60, as_dicts: bool = False) -> tuple[Documents, Documents]:
    """n documents of 2 to 29 tokens: 48 to train on, 12 to validate."""
    lengths = np.random.default_rng(0).integers(2, 30, size=n).tolist()
    return Documents(lengths[:48], 1, as_dicts), Documents(lengths[48:], 2, as_dicts)


def floats(config: Any) -> tuple[Any, Any]:
    docs = [torch.rand(5) for _ in range(4)]
    return docs, docs


class DocumentStream(torch.utils.data.IterableDataset):
    """`documents` as a stream: the same documents, in an order fixed by the epoch."""

    vocab_size = VOCAB

    def __init__(self, docs: Documents) -> None:
        self.docs, self.epoch = docs, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        order = torch.randperm(len(self.docs), generator=torch.Generator().manual_seed(
            self.epoch))
        for i in order.tolist():
            yield self.docs[i]


def stream(config: Any) -> tuple[DocumentStream, Documents]:
    train, val = documents(config)
    return DocumentStream(train), val


def killable_gpt(config: Any, vocab_size: int, block_size: int = 32) -> torch.nn.Module:
    """The built-in GPT (`--width`) with guardplug's kill switch at a training forward."""
    from guardplug import _KillSwitch

    from ddptrain.models.gpt import build_gpt

    model = build_gpt(vocab_size, block_size, config.width)
    kill = _KillSwitch()
    model.register_forward_pre_hook(lambda m, args: kill.tick() if m.training else None)
    return model


def bad_ids(config: Any, token: int = VOCAB, stream: bool = False) -> tuple[Any, Any]:
    """`documents` with one token id set to `token` (outside 0..VOCAB-1 by default) in
    the fourth training document; `stream`: the training documents as a stream."""
    train, val = documents(config)
    train.docs[3][1] = token
    return (DocumentStream(train) if stream else train), val


def single_tokens(config: Any) -> tuple[Documents, Documents]:
    """Documents of one token each: nothing in them to predict."""
    return Documents([1] * 40, 1), Documents([1] * 8, 2)
