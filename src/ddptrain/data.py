"""Datasets, and how each epoch's samples are laid out over ranks and micro-batches.

Built in (no download): `breast_cancer` (30 features, 2 classes, seed 004's classifier),
`digits` (1x8x8 images, 10 classes), `diabetes` (10 features, a float target: regression),
`synthetic` (3x32x32 images for throughput work) and `chars` (a character-level corpus for
`--model gpt`, see `ddptrain.text`). Users bring `path/to/data.npz` (arrays `x`, `y`),
`path/to/x.npy` with `y.npy` beside it (memory-mapped, never loaded whole), or
`package.module:fn` returning `(train, val)`, or one dataset that `--val_fraction` splits;
a map-style `Dataset` or an `IterableDataset`.

The layout of an epoch (map-style data) is a function of (seed, epoch) and the global
micro-batch alone: the epoch's order is a seeded permutation, cut into consecutive global
micro-batches of `world_size x batch_size` samples, and each one is split across the ranks
as evenly as it goes: no sample is repeated to pad a shard, and the last global batch of
an epoch may give a rank fewer samples, or none. So N ranks x batch B see exactly the
samples of 1 rank x batch N*B, and a position in the epoch is a count of global samples.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Subset,
    TensorDataset,
    get_worker_info,
)

from ddptrain.batches import first_tensor, num_samples, split
from ddptrain.config import TrainingConfig, npy_targets
from ddptrain.distributed import DistributedContext
from ddptrain.errors import ConfigError
from ddptrain.plugins import call_factory
from ddptrain.tasks import DataFacts

log = logging.getLogger("ddptrain")


class ArrayDataset(Dataset):
    """Samples held in memory (or memory-mapped) arrays.

    `batch(idx)` fetches a whole batch with one indexing operation instead of collating
    `batch_size` single samples: for small models this is most of the data-loading cost of
    a hand-written loop. `__getitems__` lets a DataLoader take the same path.
    """

    def __init__(self, x: Any, y: Any, scale: float | None = None) -> None:
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)}")
        self.x, self.y, self.scale = x, y, scale

    def __len__(self) -> int:
        return len(self.y)

    def _convert(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().mul_(self.scale) if self.scale is not None else x

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batch(torch.tensor([i]))
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch(torch.as_tensor(indices, dtype=torch.long))

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._convert(self.x[idx]), self.y[idx]


class TensorBatches(ArrayDataset):
    """A user's `TensorDataset` (or a `Subset` of one), sliced a batch at a time like an
    `ArrayDataset` instead of collating samples one by one."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], rows: torch.Tensor | None) -> None:
        super().__init__(tensors[0], tensors[-1])
        self.tensors, self.rows = tensors, rows

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.tensors[0])

    def __getitem__(self, i: int) -> Any:
        return tuple(t[0] for t in self.batch(torch.tensor([i])))

    def batch(self, idx: torch.Tensor) -> Any:  # type: ignore[override]
        if self.rows is not None:
            idx = self.rows[idx]
        return tuple(t[idx] for t in self.tensors)


def as_sliceable(dataset: Dataset) -> Dataset:
    """The same samples, sliceable in-process when the dataset is a `TensorDataset` or a
    `Subset` of one; any other dataset as it is."""
    rows = None
    base = dataset
    if isinstance(base, Subset) and isinstance(base.dataset, TensorDataset):
        rows, base = torch.as_tensor(list(base.indices), dtype=torch.long), base.dataset
    if type(base) is TensorDataset or (
        isinstance(base, TensorDataset) and type(base).__getitem__ is TensorDataset.__getitem__
    ):
        return TensorBatches(base.tensors, rows)
    return dataset


class MemmapDataset(ArrayDataset):
    """Rows of memory-mapped `.npy` arrays: a batch reads only its own rows from disk."""

    def __init__(self, x: np.ndarray, y: np.ndarray, rows: np.ndarray) -> None:
        super().__init__(rows, rows)
        self.mx, self.my = x, y

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.x[idx.numpy()]
        order = np.argsort(rows)  # sorted reads are sequential on disk
        x, y = np.empty((len(rows), *self.mx.shape[1:]), self.mx.dtype), self.my[rows]
        x[order] = self.mx[rows[order]]
        return torch.from_numpy(_as_float(x)), torch.from_numpy(_targets(y))


def _as_float(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32, copy=False)


def _targets(y: np.ndarray) -> np.ndarray:
    return y.astype(np.int64) if np.issubdtype(y.dtype, np.integer) else y.astype(np.float32)


def _batched(batch: Any) -> Any:
    """Collate for datasets whose `__getitems__` already returns a batch."""
    return batch


@dataclass(frozen=True)
class DataBundle:
    train: Dataset
    val: Dataset
    facts: DataFacts

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


def val_fraction(config: TrainingConfig) -> float:
    return 0.2 if config.val_fraction is None else config.val_fraction


def _standardize(a: np.ndarray, train_idx: np.ndarray) -> np.ndarray:
    """Statistics of the training split only: no leak from validation."""
    return (a - a[train_idx].mean(axis=0)) / (a[train_idx].std(axis=0) + 1e-6)


def _bundle(
    x: np.ndarray, y: np.ndarray, config: TrainingConfig, standardize: bool = False
) -> DataBundle:
    _check_targets(y, config.dataset)
    train_idx, val_idx = split_indices(len(y), val_fraction(config), config.seed)
    x = x.astype(np.float32)
    y = _targets(y)
    if standardize:
        x = _standardize(x, train_idx).astype(np.float32)
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)
    train = ArrayDataset(xt[train_idx], yt[train_idx])
    val = ArrayDataset(xt[val_idx], yt[val_idx])
    return DataBundle(train, val, _array_facts(x.shape[1:], y, config))


def _array_facts(input_shape: tuple[int, ...], y: np.ndarray, config: TrainingConfig) -> DataFacts:
    is_float = not np.issubdtype(y.dtype, np.integer)
    num_classes = None
    if not is_float and y.ndim == 1:
        num_classes = _num_classes(int(y.min()), int(y.max()), config)
    return DataFacts(tuple(input_shape), tuple(y.shape[1:]), is_float, num_classes)


def _check_targets(y: np.ndarray, source: str) -> None:
    if len(y) == 0:
        raise ConfigError(f"--dataset {source!r} holds no samples")
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise ConfigError(f"--dataset {source!r}: y must be numeric, got {y.dtype}")


def _num_classes(lo: int, hi: int, config: TrainingConfig) -> int:
    num_classes = config.num_classes or max(hi + 1, 2)
    if lo < 0 or hi >= num_classes:
        raise ConfigError(
            f"--dataset {config.dataset!r} has labels in {lo}..{hi} but --num_classes is "
            f"{num_classes}: labels must be in 0..{num_classes - 1}; raise --num_classes or "
            "fix the labels"
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


def _diabetes(config: TrainingConfig) -> DataBundle:
    """442 patients, 10 features, disease progression after a year (a float). The target
    is standardized with the training split's statistics, so MSE is in units of its
    variance (and r2 = 1 - MSE on the training split's scale)."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    train_idx, _ = split_indices(len(data.target), val_fraction(config), config.seed)
    y = _standardize(data.target.astype(np.float64), train_idx).astype(np.float32)
    return _bundle(data.data, y, config, standardize=True)


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
    train_idx, val_idx = split_indices(n, val_fraction(config), config.seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    scale = 1.0 / 255.0
    train = ArrayDataset(xt[train_idx], yt[train_idx], scale=scale)
    val = ArrayDataset(xt[val_idx], yt[val_idx], scale=scale)
    return DataBundle(train, val, DataFacts((channels, side, side), (), False, classes))


def _chars(config: TrainingConfig) -> DataBundle:
    from ddptrain.text import char_lm_datasets

    train, val, vocab, _ = char_lm_datasets(config.block_size, val_fraction(config), config.seed)
    train, val = ArrayDataset(train.x, train.y), ArrayDataset(val.x, val.y)
    facts = DataFacts((config.block_size,), (config.block_size,), False, vocab_size=vocab)
    return DataBundle(train, val, facts)


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
    _check_arrays(x, y, str(path))
    if x.ndim == 3:
        x = x[:, None]
    return _bundle(x, y, config)


def _check_arrays(x: np.ndarray, y: np.ndarray, source: str) -> None:
    if not (np.issubdtype(x.dtype, np.number) and x.ndim in (2, 3, 4)):
        raise ConfigError(
            f"--dataset {source!r}: x must be numeric with shape (N, F), (N, H, W) or "
            f"(N, C, H, W); got {x.dtype} {x.shape}"
        )
    if len(x) != len(y):
        raise ConfigError(f"--dataset {source!r}: x has {len(x)} samples but y has {len(y)}")
    _check_targets(y, source)


def _npy(config: TrainingConfig) -> DataBundle:
    """`x.npy` + `y.npy`, memory-mapped: batches read their rows from the page cache, so
    a file larger than memory trains."""
    xpath = Path(config.dataset)
    try:
        x = np.load(xpath, mmap_mode="r", allow_pickle=False)
        y = np.load(npy_targets(xpath), mmap_mode="r", allow_pickle=False)
    except Exception as exc:
        raise ConfigError(
            f"--dataset {str(xpath)!r} is not a readable .npy pair ({type(exc).__name__}): "
            "save them with np.save('x.npy', x) and np.save('y.npy', y)"
        ) from None
    _check_arrays(x, y, str(xpath))
    if x.ndim == 3:
        raise ConfigError(f"--dataset {str(xpath)!r}: save (N, H, W) images as (N, 1, H, W)")
    train_idx, val_idx = split_indices(len(y), val_fraction(config), config.seed)
    y_mem = np.asarray(y)  # targets are small next to inputs: read them once
    facts = _array_facts(x.shape[1:], y_mem, config)
    return DataBundle(
        MemmapDataset(x, y_mem, train_idx), MemmapDataset(x, y_mem, val_idx), facts
    )


def _user_datasets(config: TrainingConfig) -> DataBundle:
    made = call_factory(config.dataset, "dataset", config, config.dataset_args, {})
    return bundle_datasets(made, config)


def bundle_datasets(made: Any, config: TrainingConfig) -> DataBundle:
    """A user's `(train, val)` pair, or one dataset that `--val_fraction` splits."""
    if isinstance(made, (tuple, list)) and len(made) == 2:
        if config.val_fraction is not None:
            raise ConfigError(
                f"--val_fraction {config.val_fraction} cannot apply: --dataset "
                f"{config.dataset!r} returns its own validation set; drop the flag, or "
                "return one dataset for ddptrain to split"
            )
        train, val = made
    elif isinstance(made, Dataset):
        if isinstance(made, IterableDataset):
            raise ConfigError(
                f"--dataset {config.dataset!r} returned one IterableDataset, which cannot be "
                "split: return (train, val)"
            )
        train_idx, val_idx = split_indices(len(made), val_fraction(config), config.seed)  # type: ignore[arg-type]
        train, val = Subset(made, train_idx.tolist()), Subset(made, val_idx.tolist())
    else:
        raise ConfigError(
            f"--dataset {config.dataset!r} gave {type(made).__name__}: give "
            "(train_dataset, val_dataset) or one map-style Dataset"
        )
    return DataBundle(train, val, _probe(train, config))


def _attr(dataset: Any, name: str) -> Any:
    while dataset is not None:
        if getattr(dataset, name, None) is not None:
            return getattr(dataset, name)
        dataset = getattr(dataset, "dataset", None)  # through Subset and friends
    return None


def _probe(train: Dataset, config: TrainingConfig) -> DataFacts:
    """Read the facts a task and a model need from the first training sample."""
    try:
        sample = next(iter(train)) if isinstance(train, IterableDataset) else train[0]
    except (IndexError, StopIteration):
        raise ConfigError(f"--dataset {config.dataset!r} holds no training samples") from None
    dict_batches = isinstance(sample, dict)
    inputs, target = split(sample)
    x = first_tensor(inputs) if not isinstance(inputs, (np.ndarray, int, float)) else inputs
    input_shape = () if dict_batches or x is None else tuple(torch.as_tensor(x).shape)
    num_classes = config.num_classes or _attr(train, "num_classes")
    if target is None:
        return DataFacts(input_shape, None, False, num_classes, _attr(train, "vocab_size"), True)
    t = torch.as_tensor(target)
    return DataFacts(
        input_shape, tuple(t.shape), t.is_floating_point(),
        int(num_classes) if num_classes is not None else None,
        _attr(train, "vocab_size"), dict_batches,
    )


def load_data(config: TrainingConfig) -> DataBundle:
    builders = {
        "breast_cancer": _breast_cancer, "digits": _digits, "diabetes": _diabetes,
        "synthetic": _synthetic, "chars": _chars,
    }
    if config.dataset in builders:
        return builders[config.dataset](config)
    if config.dataset.endswith(".npz"):
        return _npz(config)
    if config.dataset.endswith(".npy"):
        return _npy(config)
    return _user_datasets(config)


# ---------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Micro:
    """One micro-batch of this rank in an epoch's plan."""

    lo: int  # this rank's samples are order[lo:hi]
    hi: int
    pad: bool  # no sample of the global batch fell to this rank: order[lo:hi] is a
    #            stand-in whose loss weight is 0, so every rank runs the same steps
    global_samples: int  # samples of the global micro-batch (every rank)
    window_samples: int  # samples of the optimizer step it belongs to (every rank)
    ends_window: bool  # the last micro-batch of its optimizer step
    position: int  # global samples of the epoch consumed once it is done (for an iterable
    #                dataset: this rank's micro-batches of the epoch)


def plan_epoch(
    n: int, world_size: int, rank: int, batch_size: int, accum: int, drop_last: bool,
    start: int = 0,
) -> list[Micro]:
    """This rank's micro-batches of one epoch, from global position `start` on."""
    step = world_size * batch_size
    end = n - (n - start) % step if drop_last else n
    bounds = [(lo, min(lo + step, end)) for lo in range(start, end, step)]
    plan: list[Micro] = []
    for w in range(0, len(bounds), accum):
        window = bounds[w : w + accum]
        total = window[-1][1] - window[0][0]
        for i, (lo, hi) in enumerate(window):
            size = hi - lo
            base, extra = divmod(size, world_size)
            a = lo + rank * base + min(rank, extra)
            b = a + base + (1 if rank < extra else 0)
            pad = a == b
            if pad:
                a, b = lo, lo + 1
            plan.append(Micro(a, b, pad, size, total, i == len(window) - 1, hi))
    return plan


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's sample order: a function of (seed, epoch) alone."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g)


def samples_dropped(n: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    return n % (world_size * batch_size) if drop_last else 0


def steps_per_epoch(
    n: int, world_size: int, batch_size: int, accum: int, drop_last: bool
) -> int:
    """Optimizer steps in an epoch: a short last accumulation window still steps."""
    used = n - samples_dropped(n, world_size, batch_size, drop_last)
    return math.ceil(math.ceil(used / (world_size * batch_size)) / accum)


class PlanSampler(torch.utils.data.Sampler[list[int]]):
    """Yields the index lists of the current epoch's plan (for a DataLoader)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; python and numpy follow it
    # so that augmentations in user datasets differ across workers and ranks. Workers
    # leave SIGINT/SIGTERM to the main process, which decides when to stop.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _dataloader(
    dataset: Dataset, config: TrainingConfig, ctx: DistributedContext, **kwargs: Any
) -> DataLoader:
    generator = torch.Generator()
    generator.manual_seed(config.seed + ctx.rank)
    workers = config.num_workers
    batched = hasattr(dataset, "__getitems__") and hasattr(dataset, "batch")
    return DataLoader(
        dataset,
        num_workers=workers,
        collate_fn=_batched if batched else None,
        pin_memory=ctx.device.type == "cuda",  # page-locked memory only helps a GPU copy
        persistent_workers=workers > 0,
        worker_init_fn=_seed_worker if workers > 0 else None,
        generator=generator,
        **kwargs,
    )


class TrainBatches:
    """The training batches of this rank, epoch by epoch, in the planned layout."""

    def __init__(self, dataset: Dataset, config: TrainingConfig, ctx: DistributedContext):
        self.dataset, self.config, self.ctx = dataset, config, ctx
        self.n = len(dataset)  # type: ignore[arg-type]
        if config.drop_last and self.n < ctx.world_size * config.batch_size:
            raise ConfigError(
                f"--drop_last with --batch_size {config.batch_size} on {ctx.world_size} "
                f"rank(s) drops all {self.n} training samples: lower --batch_size"
            )
        self.steps_per_epoch = steps_per_epoch(
            self.n, ctx.world_size, config.batch_size, config.grad_accum_steps, config.drop_last
        )
        # A TensorDataset is sliced a batch at a time, in this process or in each worker,
        # instead of collated sample by sample.
        dataset = self.dataset = as_sliceable(dataset)
        self.in_process = isinstance(dataset, ArrayDataset) and config.num_workers == 0
        self.sampler = PlanSampler()
        self.loader = None if self.in_process else _dataloader(
            dataset, config, ctx, batch_sampler=self.sampler
        )

    def plan(self, epoch: int, start: int) -> tuple[torch.Tensor, list[Micro]]:
        cfg, ctx = self.config, self.ctx
        plan = plan_epoch(
            self.n, ctx.world_size, ctx.rank, cfg.batch_size, cfg.grad_accum_steps,
            cfg.drop_last, start,
        )
        return epoch_order(self.n, cfg.seed, epoch), plan

    stateful = False  # the position in the plan is all a resume needs

    def state_dict(self) -> None:
        return None

    def epoch(self, epoch: int, start: int) -> Iterator[tuple[Any, Micro, float]]:
        """(batch, its place in the plan, seconds waited for it) from position `start`."""
        order, plan = self.plan(epoch, start)
        it = self.batches(order, plan)
        for micro in plan:
            t0 = time.perf_counter()
            batch = next(it)
            yield batch, micro, time.perf_counter() - t0

    def batches(self, order: torch.Tensor, plan: list[Micro]) -> Iterator[Any]:
        if self.in_process:
            dataset: ArrayDataset = self.dataset  # type: ignore[assignment]
            for m in plan:
                yield dataset.batch(order[m.lo : m.hi])
            return
        self.sampler.batches = [order[m.lo : m.hi].tolist() for m in plan]
        yield from self.loader  # type: ignore[union-attr]


# ---------------------------------------------------------------------- iterable data
class RankShard(IterableDataset):
    """Every (world_size x workers)-th item of an iterable dataset, for one (rank, worker):
    every item lands on exactly one of them."""

    def __init__(self, dataset: IterableDataset, world_size: int, rank: int) -> None:
        self.dataset, self.world_size, self.rank = dataset, world_size, rank
        self.consumed = 0  # items of the underlying stream read in this epoch
        self._start = 0  # where the next iteration starts (a resume)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, wid = (info.num_workers, info.id) if info else (1, 0)
        stride = self.world_size * workers
        offset = self.rank * workers + wid
        start, self._start = self._start, 0
        self.consumed = start
        for i, item in enumerate(self.dataset, start=start):
            self.consumed = i + 1
            if i % stride == offset:
                yield item

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "dataset": self.dataset.state_dict()}  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["dataset"])  # type: ignore[attr-defined]
        self._start = int(state["consumed"])

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


class IterableBatches:
    """An iterable dataset's batches on this rank. Ranks agree before each micro-batch on
    whether every rank has one more (one small all-reduce), so all run the same steps: the
    shortest shard decides, and what the others hold beyond it is counted as dropped."""

    def __init__(
        self, dataset: IterableDataset, config: TrainingConfig, ctx: DistributedContext
    ) -> None:
        self.loader = make_iterable_loader(dataset, config, ctx)
        self.shard: RankShard = self.loader.dataset  # type: ignore[assignment]
        self.ctx, self.accum = ctx, config.grad_accum_steps
        self._flag = torch.zeros(1, device=ctx.device)
        # Exact mid-epoch resume needs the dataset's own position, read in this process.
        self.stateful = config.num_workers == 0 and all(
            hasattr(dataset, name) for name in ("state_dict", "load_state_dict")
        )
        self.state: dict[str, Any] | None = None  # after the last batch handed out
        self._resumed = False
        try:
            n = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            n = 0
        if not n and config.warmup_epochs:
            raise ConfigError(
                f"--warmup_epochs {config.warmup_epochs} needs the length of an epoch, and "
                f"--dataset {config.dataset!r} is an IterableDataset without __len__: give "
                "it __len__ (its number of samples) or drop the flag"
            )
        if not n:
            log.warning("IterableDataset without __len__: the learning rate stays at --lr")
        self.steps_per_epoch = steps_per_epoch(
            n, ctx.world_size, config.batch_size, config.grad_accum_steps, config.drop_last
        )

    def state_dict(self) -> dict[str, Any] | None:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the interrupted epoch where this rank's shard stood."""
        self.shard.load_state_dict(state)
        self._resumed = True

    def _pull(self, it: Iterator[Any]) -> tuple[Any, bool, float, Any]:
        t0 = time.perf_counter()
        batch = next(it, None)
        state = self.shard.state_dict() if self.stateful else None  # right after this batch
        self._flag.fill_(0.0 if batch is None else 1.0)
        if self.ctx.distributed:
            dist.all_reduce(self._flag, op=dist.ReduceOp.MIN)
        return batch, bool(self._flag.item()), time.perf_counter() - t0, state

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[Any, Micro, float]]:
        """(batch, its place, seconds waited) for each micro-batch of the epoch. The
        position counts micro-batches; `start` > 0 continues a resumed epoch."""
        if not self._resumed:
            start = 0
            self.shard.set_epoch(epoch)
        self._resumed = False
        it = iter(self.loader)
        batch, ok, waited, state = self._pull(it)
        i = start
        while ok:
            nxt, more, wait_next, state_next = self._pull(it)  # one ahead: the last one?
            micro = Micro(0, 0, False, 0, 0, not more or (i + 1) % self.accum == 0, i + 1)
            self.state = state
            yield batch, micro, waited
            batch, ok, waited, state, i = nxt, more, wait_next, state_next, i + 1
        self.state = None
        self._count_dropped(epoch, [batch] if batch is not None else [], it)

    def _count_dropped(self, epoch: int, held: list[Any], it: Iterator[Any]) -> None:
        left = sum(num_samples(*split(b)) for b in [*held, *it])
        total = torch.tensor([float(left)], device=self.ctx.device)
        if self.ctx.distributed:
            dist.all_reduce(total)
        if total.item():
            log.info(
                "epoch %d: %d samples of the longer shards dropped so that every rank ran "
                "the same number of steps", epoch, int(total.item()),
            )


def make_train_batches(
    dataset: Dataset, config: TrainingConfig, ctx: DistributedContext
) -> TrainBatches | IterableBatches:
    if isinstance(dataset, IterableDataset):
        return IterableBatches(dataset, config, ctx)
    return TrainBatches(dataset, config, ctx)


def make_iterable_loader(
    dataset: IterableDataset, config: TrainingConfig, ctx: DistributedContext,
    batch_size: int | None = None,
) -> DataLoader:
    shard = RankShard(dataset, ctx.world_size, ctx.rank)
    return _dataloader(shard, config, ctx, batch_size=batch_size or config.batch_size)


# ---------------------------------------------------------------------- validation
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


def make_val_loader(dataset: Dataset, config: TrainingConfig, ctx: DistributedContext) -> Any:
    if isinstance(dataset, IterableDataset):
        return make_iterable_loader(dataset, config, ctx)
    indices = torch.arange(ctx.rank, len(dataset), ctx.world_size)  # type: ignore[arg-type]
    dataset = as_sliceable(dataset)
    if isinstance(dataset, ArrayDataset) and config.num_workers == 0:
        return _ArrayBatches(dataset, indices, config.batch_size)
    return _dataloader(dataset, config, ctx, batch_size=config.batch_size,
                       sampler=ShardSampler(len(dataset), ctx))  # type: ignore[arg-type]


class _ArrayBatches:
    """Validation batches of an in-memory dataset, sliced in-process."""

    def __init__(self, dataset: ArrayDataset, indices: torch.Tensor, batch_size: int) -> None:
        self.dataset, self.indices, self.batch_size = dataset, indices, batch_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(0, len(self.indices), self.batch_size):
            yield self.dataset.batch(self.indices[i : i + self.batch_size])
