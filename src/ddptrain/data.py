"""Datasets and the per-rank loaders that shard them.

Built-in datasets ship with scikit-learn (no download): `breast_cancer` (30 features, 2
classes, seed 004's classifier), `digits` (1x8x8 images, 10 classes) and `synthetic`
(3x32x32 images for throughput work). Users bring `path/to/data.npz` (arrays `x`, `y`) or
`package.module:fn` returning `(train_dataset, val_dataset)`.

The train/validation split depends on `--seed` alone, never on the world size, so a run
on 1 rank and on N ranks see the same samples.
"""

from __future__ import annotations

import importlib
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ddptrain.config import ConfigError, TrainingConfig
from ddptrain.distributed import DistributedContext


class ArrayDataset(Dataset):
    """Samples held in memory as tensors.

    `__getitems__` lets the DataLoader fetch a whole batch with one indexing operation
    instead of collating `batch_size` single samples: for small models this is most of
    the data-loading cost of a hand-written loop.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, scale: float | None = None) -> None:
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
        self.x, self.y, self.scale = x, y, scale

    def __len__(self) -> int:
        return len(self.y)

    def _convert(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().mul_(self.scale) if self.scale is not None else x

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._convert(self.x[i]), self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch(torch.as_tensor(indices, dtype=torch.long))

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._convert(self.x[idx]), self.y[idx]


class ArrayLoader:
    """Batches of an `ArrayDataset`, sliced in-process in the sampler's order.

    What a DataLoader with `num_workers=0` does, without its per-batch machinery (fetcher,
    collate, pin-memory checks): for millisecond steps that machinery is most of the time
    spent waiting for data.
    """

    def __init__(
        self, dataset: ArrayDataset, sampler: torch.utils.data.Sampler[int], batch_size: int,
        drop_last: bool,
    ) -> None:
        self.dataset, self.sampler = dataset, sampler
        self.batch_size, self.drop_last = batch_size, drop_last

    def __len__(self) -> int:
        full, rest = divmod(len(self.sampler), self.batch_size)  # type: ignore[arg-type]
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.as_tensor(list(self.sampler), dtype=torch.long)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            yield self.dataset.batch(order[start : start + self.batch_size])


def _batched(batch: Any) -> Any:
    """Collate for `ArrayDataset`: its `__getitems__` already returns a batch."""
    return batch


@dataclass(frozen=True)
class DataBundle:
    train: Dataset
    val: Dataset
    num_classes: int
    input_shape: tuple[int, ...]  # one sample, e.g. (30,) or (1, 8, 8)

    @property
    def is_image(self) -> bool:
        return len(self.input_shape) == 3


# ---------------------------------------------------------------------- built-in data
def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A train/val split fixed by the seed alone (never by rank or world size)."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise ConfigError(
            f"--val_fraction {val_fraction} leaves no training samples out of {n}: lower it"
        )
    return perm[n_val:], perm[:n_val]


def _bundle(
    x: np.ndarray, y: np.ndarray, config: TrainingConfig, standardize: bool = False
) -> DataBundle:
    y = y.astype(np.int64)
    num_classes = _check_labels(y, config.num_classes, source=config.dataset)
    train_idx, val_idx = split_indices(len(y), config.val_fraction, config.seed)
    x = x.astype(np.float32)
    if standardize:  # statistics of the training split only: no leak from validation
        mean = x[train_idx].mean(axis=0)
        std = x[train_idx].std(axis=0) + 1e-6
        x = (x - mean) / std
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)
    train = ArrayDataset(xt[train_idx], yt[train_idx])
    val = ArrayDataset(xt[val_idx], yt[val_idx])
    return DataBundle(train, val, num_classes, tuple(x.shape[1:]))


def _check_labels(y: np.ndarray, num_classes: int | None, source: str) -> int:
    if y.ndim != 1:
        raise ConfigError(f"--dataset {source!r}: labels y must be 1-D, got shape {y.shape}")
    if len(y) == 0:
        raise ConfigError(f"--dataset {source!r} holds no samples")
    lo, hi = int(y.min()), int(y.max())
    if num_classes is None:
        num_classes = max(hi + 1, 2)
    if lo < 0 or hi >= num_classes:
        raise ConfigError(
            f"--dataset {source!r} has labels in {lo}..{hi} but --num_classes is {num_classes}: "
            f"labels must be in 0..{num_classes - 1}; raise --num_classes or fix the labels"
        )
    return num_classes


def _breast_cancer(config: TrainingConfig) -> DataBundle:
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    return _bundle(data.data, data.target, config, standardize=True)


def _digits(config: TrainingConfig) -> DataBundle:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.images[:, None, :, :] / 16.0 - 0.5) / 0.5  # 0..16 pixel values to [-1, 1]
    return _bundle(x, data.target, config)


def _synthetic(config: TrainingConfig) -> DataBundle:
    """Images with a learnable class signal: a per-class template under uniform noise.

    Stored as uint8 (150 MB for 50,000 3x32x32 samples instead of 600 MB of float32) and
    converted per batch.
    """
    n = config.synthetic_size
    classes = config.num_classes or 10
    channels = config.in_channels or 3
    side = config.image_size or 32
    rng = np.random.default_rng(config.seed)
    templates = rng.integers(0, 256, size=(classes, channels, side, side), dtype=np.uint8)
    y = rng.integers(0, classes, size=n).astype(np.int64)
    x = rng.integers(0, 256, size=(n, channels, side, side), dtype=np.uint8)
    for start in range(0, n, 4096):  # blend in chunks to bound the float temporaries
        sl = slice(start, start + 4096)
        x[sl] = (0.5 * x[sl] + 0.5 * templates[y[sl]]).astype(np.uint8)
    train_idx, val_idx = split_indices(n, config.val_fraction, config.seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    scale = 1.0 / 255.0
    train = ArrayDataset(xt[train_idx], yt[train_idx], scale=scale)
    val = ArrayDataset(xt[val_idx], yt[val_idx], scale=scale)
    return DataBundle(train, val, classes, (channels, side, side))


def _npz(config: TrainingConfig) -> DataBundle:
    path = Path(config.dataset)
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [k for k in ("x", "y") if k not in archive.files]
            if missing:
                raise ConfigError(
                    f"--dataset {str(path)!r} lacks array(s) {', '.join(missing)}: "
                    f"it has {archive.files}; save it with np.savez(path, x=..., y=...)"
                )
            x, y = archive["x"], archive["y"]
    except ConfigError:
        raise
    except Exception as exc:  # zipfile/pickle/format errors all mean the same to a user
        raise ConfigError(
            f"--dataset {str(path)!r} is not a readable .npz file ({type(exc).__name__}): "
            "save it with np.savez(path, x=..., y=...)"
        ) from None
    if not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(f"--dataset {str(path)!r}: y must hold integer class labels")
    if not (np.issubdtype(x.dtype, np.number) and x.ndim in (2, 3, 4)):
        raise ConfigError(
            f"--dataset {str(path)!r}: x must be numeric with shape (N, F), (N, H, W) or "
            f"(N, C, H, W); got {x.dtype} {x.shape}"
        )
    if len(x) != len(y):
        raise ConfigError(f"--dataset {str(path)!r}: x has {len(x)} samples but y has {len(y)}")
    if x.ndim == 3:
        x = x[:, None]
    return _bundle(x, y, config)


def _user_datasets(config: TrainingConfig) -> DataBundle:
    train, val = load_ref(config.dataset, "dataset")(config)
    sample_x = train[0][0]
    num_classes = config.num_classes or getattr(train, "num_classes", None)
    if num_classes is None:
        raise ConfigError(
            f"--dataset {config.dataset!r} does not say how many classes it has: "
            "pass --num_classes, or give the dataset a num_classes attribute"
        )
    return DataBundle(train, val, int(num_classes), tuple(torch.as_tensor(sample_x).shape))


def load_ref(ref: str, what: str) -> Any:
    """Import `package.module:name`, reporting a failure as one line."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"--{what} {ref!r}: cannot import {module_name!r} ({exc}): "
            "check the module is on PYTHONPATH"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"--{what} {ref!r}: {module_name!r} has no {attr!r}") from None


def load_data(config: TrainingConfig) -> DataBundle:
    builders = {"breast_cancer": _breast_cancer, "digits": _digits, "synthetic": _synthetic}
    if config.dataset in builders:
        return builders[config.dataset](config)
    if config.dataset.endswith(".npz"):
        return _npz(config)
    return _user_datasets(config)


# ---------------------------------------------------------------------- sharding
class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, for an exact mid-epoch resume.

    The order of an epoch is a function of (seed, epoch) only; `set_start(k)` skips the
    first k indices of this rank's shard for the current epoch (none are replayed, none
    lost) and is cleared by the next `set_epoch`.
    """

    def __init__(self, dataset: Dataset, ctx: DistributedContext, seed: int, drop_last: bool):
        super().__init__(
            dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed,
            drop_last=drop_last,
        )
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def set_start(self, start: int) -> None:
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start {start} outside this rank's {self.num_samples} samples")
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


class ShardSampler(torch.utils.data.Sampler[int]):
    """Evaluation shard: rank r takes samples r, r+N, ... with no padding.

    DistributedSampler pads the last round with repeated samples, which would count them
    twice in validation metrics; shards here may differ in length by one instead.
    """

    def __init__(self, n: int, ctx: DistributedContext) -> None:
        self.indices = range(ctx.rank, n, ctx.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; python and numpy follow it
    # so that augmentations in user datasets differ across workers and ranks.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _loader(
    dataset: Dataset,
    sampler: torch.utils.data.Sampler[int],
    config: TrainingConfig,
    ctx: DistributedContext,
    drop_last: bool,
) -> DataLoader | ArrayLoader:
    if isinstance(dataset, ArrayDataset) and config.num_workers == 0:
        return ArrayLoader(dataset, sampler, config.batch_size, drop_last)
    generator = torch.Generator()
    generator.manual_seed(config.seed + ctx.rank)
    workers = config.num_workers
    return DataLoader(
        dataset,
        batch_size=config.batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=_batched if isinstance(dataset, ArrayDataset) else None,
        pin_memory=ctx.device.type == "cuda",  # page-locked memory only helps a GPU copy
        drop_last=drop_last,
        persistent_workers=workers > 0,
        worker_init_fn=_seed_worker if workers > 0 else None,
        generator=generator,
    )


def make_train_loader(
    dataset: Dataset, config: TrainingConfig, ctx: DistributedContext
) -> tuple[DataLoader | ArrayLoader, ResumableDistributedSampler]:
    sampler = ResumableDistributedSampler(dataset, ctx, config.seed, config.drop_last)
    if sampler.num_samples < config.batch_size:
        raise ConfigError(
            f"--batch_size {config.batch_size} is larger than a rank's share of the training "
            f"data ({sampler.num_samples} samples with {ctx.world_size} ranks): "
            "lower --batch_size or use fewer ranks"
        )
    return _loader(dataset, sampler, config, ctx, config.drop_last), sampler


def make_val_loader(
    dataset: Dataset, config: TrainingConfig, ctx: DistributedContext
) -> DataLoader | ArrayLoader:
    return _loader(dataset, ShardSampler(len(dataset), ctx), config, ctx, drop_last=False)


def batch_sizes(num_samples: int, batch_size: int, drop_last: bool) -> list[int]:
    """Sizes of the batches a loader yields over `num_samples` (the last may be short)."""
    full, rest = divmod(num_samples, batch_size)
    return [batch_size] * full + ([rest] if rest and not drop_last else [])


def steps_per_epoch(num_batches: int, grad_accum_steps: int) -> int:
    """Optimizer steps in an epoch: a short last accumulation window still steps."""
    return math.ceil(num_batches / grad_accum_steps)
