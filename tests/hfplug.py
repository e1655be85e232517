"""Hugging Face `transformers` models built from a config (no download), with the dict
batches they take: `--dataset hfplug:NAME --model hfplug:NAME`."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset


class Dicts(Dataset):
    def __init__(self, items: list[dict[str, torch.Tensor]], **attrs: Any) -> None:
        self.items = items
        for k, v in attrs.items():
            setattr(self, k, v)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def _split(items: list[dict[str, torch.Tensor]], **attrs: Any) -> tuple[Dicts, Dicts]:
    cut = len(items) * 4 // 5
    return Dicts(items[:cut], **attrs), Dicts(items[cut:], **attrs)


def sentiment(config: Any, n: int = 120, length: int = 10) -> tuple[Dicts, Dicts]:
    """Token sequences labelled by whether token 7 occurs in them."""
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(n):
        ids = torch.randint(1, 30, (length,), generator=g)
        items.append({
            "input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long),
            "labels": torch.tensor(int((ids == 7).any())),
        })
    return _split(items, num_classes=2)


def bert_classifier(config: Any, num_classes: int) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(
        vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=num_classes,
    ))


def counting(config: Any, n: int = 96, length: int = 16) -> tuple[Dicts, Dicts]:
    """Sequences that count upwards modulo the vocabulary: labels are the inputs (HF)."""
    g = torch.Generator().manual_seed(1)
    items = []
    for _ in range(n):
        start = int(torch.randint(0, 20, (1,), generator=g))
        ids = (torch.arange(length) + start) % 20
        items.append({"input_ids": ids, "labels": ids.clone()})
    return _split(items, vocab_size=20)


def counting_windows(config: Any) -> tuple[Dataset, Dataset]:
    """`counting` as token windows: the inputs one tensor, the targets the next tokens
    (what `--pp` passes from stage to stage)."""
    from torch.utils.data import TensorDataset

    class Windows(TensorDataset):
        vocab_size = 20

    splits = []
    for part in counting(config, length=17):
        ids = torch.stack([item["input_ids"] for item in part.items])
        splits.append(Windows(ids[:, :-1], ids[:, 1:]))
    return splits[0], splits[1]


def gpt2(config: Any, vocab_size: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=2,
    ))
