"""Data and models as users have them, for tests/test_userdata.py, named as
`--dataset userdata_plug:NAME` / `--model userdata_plug:NAME` / `--collate
userdata_plug:NAME`: Hugging Face `datasets` (map-style, iterable, a `DatasetDict`, one
set to split), variable-length sequences with a padding collate, and an image-folder
style set that names its classes.

Every sample carries its id (column `idx`, or feature 0 of `x`), so a model can write
down what it trains on:
  USERDATA_RECORD=DIR  training forwards append their batch's ids to DIR/rank<R>.txt
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset


def _record(ids: torch.Tensor) -> None:
    where = os.environ.get("USERDATA_RECORD")
    if where:
        rank = os.environ.get("RANK", "0")
        with (Path(where) / f"rank{rank}.txt").open("a") as f:
            f.write(" ".join(str(int(v)) for v in ids.tolist()) + "\n")


# ---------------------------------------------------------------- Hugging Face datasets
def _rows(n: int, seed: int, offset: int = 0) -> dict[str, list[Any]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    label = ((x[:, 0] + x[:, 1]) > 0).long()
    return {
        "idx": list(range(offset, offset + n)),
        "x": x.tolist(),
        "label": label.tolist(),
        "text": [f"sample {i}" for i in range(offset, offset + n)],  # dropped: not numbers
    }


def _hf(n: int, seed: int, offset: int = 0, torch_format: bool = False) -> Any:
    from datasets import ClassLabel, Dataset, Features, List, Value

    features = Features({
        "idx": Value("int64"), "x": List(Value("float32")),
        "label": ClassLabel(names=["neg", "pos", "unused"]),  # 3 classes, 2 of them seen
        "text": Value("string"),
    })
    ds = Dataset.from_dict(_rows(n, seed, offset), features=features)
    return ds.with_format("torch") if torch_format else ds


def hf_dict(config: Any, n: int = 160, torch_format: bool = False) -> Any:
    """A `DatasetDict` with `train` and `validation`, as `load_dataset` returns one."""
    from datasets import DatasetDict

    return DatasetDict({
        "train": _hf(n, 0, torch_format=torch_format),
        "validation": _hf(n // 4, 1, offset=n, torch_format=torch_format),
    })


def hf_one(config: Any, n: int = 200) -> Any:
    """One map-style `datasets.Dataset`, which ddptrain splits by --val_fraction."""
    return _hf(n, 2, torch_format=True)


def hf_stream(config: Any, n: int = 160, shards: int = 4) -> tuple[Any, Any]:
    """`datasets.IterableDataset`s from sharded sources (shuffled by epoch)."""
    train = _hf(n, 0).to_iterable_dataset(num_shards=shards).shuffle(seed=3, buffer_size=16)
    val = _hf(n // 4, 1, offset=n).to_iterable_dataset(num_shards=shards)
    return train, val


class Linear(nn.Module):
    """A linear classifier of `x` that writes down the ids it trains on."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        self.net = nn.Linear(4, outputs)

    def forward(self, x: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        if self.training and idx is not None:
            _record(idx)
        return self.net(x)


def linear(config: Any, outputs: int) -> nn.Module:
    return Linear(outputs)


class _Config:
    num_labels = 3


class HFStyle(Linear):
    """A model with a Hugging Face style `config.num_labels`."""

    def __init__(self) -> None:
        super().__init__(_Config.num_labels)
        self.config = _Config()


# ---------------------------------------------------------------- variable-length sequences
class Sequences(Dataset):
    """Token sequences of 3 to 12 tokens, labelled by whether token 5 occurs."""

    num_classes = 2

    def __init__(self, n: int, seed: int, offset: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            length = int(torch.randint(3, 13, (1,), generator=g))
            ids = torch.randint(1, 10, (length,), generator=g)
            self.items.append({
                "input_ids": ids, "idx": torch.tensor(offset + i),
                "labels": torch.tensor(int((ids == 5).any())),
            })

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def sequences(config: Any, n: int = 160) -> tuple[Sequences, Sequences]:
    return Sequences(n, 0), Sequences(n // 4, 1, offset=n)


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad `input_ids` with 0 to the batch's longest, with the attention mask."""
    ids = pad_sequence([s["input_ids"] for s in samples], batch_first=True)
    mask = pad_sequence([torch.ones_like(s["input_ids"]) for s in samples], batch_first=True)
    return {
        "input_ids": ids, "attention_mask": mask,
        "idx": torch.stack([s["idx"] for s in samples]),
        "labels": torch.stack([s["labels"] for s in samples]),
    }


class BagOfTokens(nn.Module):
    """Mean of the embeddings of the unpadded tokens, then a linear head."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, outputs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                idx: torch.Tensor | None = None) -> torch.Tensor:
        if self.training and idx is not None:
            _record(idx)
        m = attention_mask.unsqueeze(-1).float()
        return self.head((self.embed(input_ids) * m).sum(1) / m.sum(1))


def bag_of_tokens(config: Any, outputs: int) -> nn.Module:
    return BagOfTokens(outputs)


# ---------------------------------------------------------------- an image-folder style set
class Folder(Dataset):
    """Like torchvision's `ImageFolder`: `classes` lists the class names, and no sample
    of the last class is in the training split."""

    classes: ClassVar[list[str]] = ["cat", "dog", "fox", "owl"]

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 1, 8, 8, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


def folder(config: Any) -> tuple[Folder, Folder]:
    return Folder(64, 0), Folder(16, 1)
