"""What a run's data is: the train and validation sets, and the facts a task and a model
read from them (input shape, target shape and kind, classes, vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import (
    Dataset,
    IterableDataset,
)


@dataclass(frozen=True)
class DataBundle:
    train: Dataset
    val: Dataset
    facts: DataFacts
    collate: Callable[[list[Any]], Any] | None = None  # the user's collate (--collate)
    more_val: dict[str, Dataset] = field(default_factory=dict)  # --val NAME=DATASET

    @property
    def num_classes(self) -> int | None:
        return self.facts.num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.facts.input_shape

    @property
    def is_image(self) -> bool:
        return len(self.input_shape) == 3

    @property
    def iterable(self) -> bool:
        return isinstance(self.train, IterableDataset)


@dataclass(frozen=True)
class DataFacts:
    """What the data says about itself, read from its first sample."""

    input_shape: tuple[int, ...]  # one sample's inputs; () for dict inputs
    target_shape: tuple[int, ...] | None  # one sample's targets; None: no targets
    target_is_float: bool
    num_classes: int | None = None  # classification: labels are 0..num_classes-1
    vocab_size: int | None = None  # token data: ids are 0..vocab_size-1
    dict_batches: bool = False  # samples are dicts (Hugging Face style)
    classes_from: str | None = None  # where num_classes came from (the plan says it)

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "input_shape": self.input_shape, "num_classes": self.num_classes,
            "vocab_size": self.vocab_size, "target_shape": self.target_shape,
        }


def attr_through(dataset: Any, name: str) -> Any:
    """`dataset.name`, or that of the dataset it wraps (through `Subset` and friends)."""
    while dataset is not None:
        if getattr(dataset, name, None) is not None:
            return getattr(dataset, name)
        dataset = getattr(dataset, "dataset", None)
    return None
