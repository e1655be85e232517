"""Data: where samples come from and how an epoch's samples fall on ranks and batches.

| module | owns |
| --- | --- |
| `sources` | built-in sets, `.npz` / `.npy` files, user factories; the seeded train/val split |
| `bundle` | `DataBundle` (train, val, a collate) and the `DataFacts` a task and a model read |
| `hf` | Hugging Face `datasets` (map-style and iterable) taken as they are |
| `mix` | `--mix`: several datasets drawn by weight, position by position, as one; `--val`'s sets |
| `tokenized` | `chat:PATH` / `text:PATH`: raw text and chats through the model's tokenizer |
| `chat`, `rowfiles` | a chat's replies as labels; files' rows, and the rows set aside |
| `tokenizer` | `--tokenizer hf:DIR` (default `--model hf:DIR`'s), read from the directory alone |
| `pack` | `--pack`: token documents end to end in windows, each positioned and masked alone |
| `arrays`, `text` | in-memory and memory-mapped arrays sliced a batch at a time; the chars corpus |
| `epoch` | the epoch plan: global micro-batches split evenly over ranks, positions |
| `train_batches`, `iterable`, `validation` | this rank's batches: map-style, iterable, evaluation |
| `loader` | the DataLoader every path uses |
| `batch` | any batch: device moves, `(inputs, targets)` or dicts, calling a model, its output |
"""

from __future__ import annotations

from ddptrain.data.arrays import ArrayDataset, MemmapDataset, TensorBatches
from ddptrain.data.batch import (
    ModelCall,
    Output,
    mark_batch_dynamic,
    num_samples,
    parse_output,
    split,
    to_device,
)
from ddptrain.data.bundle import DataBundle, DataFacts
from ddptrain.data.epoch import Micro, plan_epoch, samples_dropped, steps_per_epoch
from ddptrain.data.iterable import IterableBatches
from ddptrain.data.loader import stop_workers
from ddptrain.data.mix import Mixture, mix_counts
from ddptrain.data.sources import bundle_datasets, load_data, split_indices, with_collate
from ddptrain.data.train_batches import Batches, TrainBatches, make_train_batches
from ddptrain.data.validation import make_val_loader, most_val_batches

__all__ = [
    "ArrayDataset",
    "Batches",
    "DataBundle",
    "DataFacts",
    "IterableBatches",
    "MemmapDataset",
    "Micro",
    "Mixture",
    "ModelCall",
    "Output",
    "TensorBatches",
    "TrainBatches",
    "bundle_datasets",
    "load_data",
    "make_train_batches",
    "make_val_loader",
    "mark_batch_dynamic",
    "mix_counts",
    "most_val_batches",
    "num_samples",
    "parse_output",
    "plan_epoch",
    "samples_dropped",
    "split",
    "split_indices",
    "steps_per_epoch",
    "stop_workers",
    "to_device",
    "with_collate",
]
