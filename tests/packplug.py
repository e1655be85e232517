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
