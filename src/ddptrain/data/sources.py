"""Where samples come from: built-in sets, files, and a user's own datasets.

Built in (no download): `breast_cancer` (30 features, 2 classes, seed 004's classifier),
`digits` (1x8x8 images, 10 classes), `diabetes` (10 features, a float target: regression),
`synthetic` (3x32x32 images for throughput work) and `chars` (a character-level corpus for
`--model gpt`, see `ddptrain.data.text`). Users bring `path/to/data.npz` (arrays `x`, `y`),
`path/to/x.npy` with `y.npy` beside it (memory-mapped, never loaded whole), files of raw
text or chats tokenized as the run starts (`chat:PATH`, `text:PATH`:
`ddptrain.data.tokenized`), or
`package.module:fn` returning `(train, val)`, `{'train': ..., 'val': ...}` (a Hugging Face
`DatasetDict`), or one dataset that `--val_fraction` splits; a map-style `Dataset`, an
`IterableDataset` or a Hugging Face `datasets` one (`ddptrain.data.hf`). The train/val
split is fixed by the seed alone; how an epoch's samples fall on ranks is
`ddptrain.data.epoch`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    Dataset,
    IterableDataset,
    Subset,
)

from ddptrain.config import TrainingConfig
from ddptrain.config_values import names_code, npy_targets
from ddptrain.data import hf
from ddptrain.data.arrays import ArrayDataset, MemmapDataset, as_targets
from ddptrain.data.batch import first_tensor, split
from ddptrain.data.bundle import DataBundle, DataFacts, attr_through
from ddptrain.data.mix import load_mixture, refuse_unlike, with_val_sets
from ddptrain.data.pack import pack_bundle
from ddptrain.data.tokenized import is_tokenized, load_tokenized
from ddptrain.errors import ConfigError
from ddptrain.plugins import call_factory, load_ref


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
    y = as_targets(y)
    if standardize:
        x = _standardize(x, train_idx).astype(np.float32)
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)
    train = ArrayDataset(xt[train_idx], yt[train_idx])
    val = ArrayDataset(xt[val_idx], yt[val_idx])
    return DataBundle(train, val, _array_facts(x.shape[1:], y, config))


def _array_facts(input_shape: tuple[int, ...], y: np.ndarray, config: TrainingConfig) -> DataFacts:
    is_float = not np.issubdtype(y.dtype, np.integer)
    num_classes, source = None, None
    if not is_float and y.ndim == 1:
        num_classes = _num_classes(int(y.min()), int(y.max()), config)
        source = "--num_classes" if config.num_classes else "the labels seen"
    return DataFacts(tuple(input_shape), tuple(y.shape[1:]), is_float, num_classes,
                     classes_from=source)


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
    from ddptrain.data.bundled import breast_cancer

    x, y = breast_cancer()
    return _bundle(x, y, config, standardize=True)


def _digits(config: TrainingConfig) -> DataBundle:
    from ddptrain.data.bundled import digits

    images, y = digits()
    x = (images[:, None, :, :] / 16.0 - 0.5) / 0.5  # 0..16 pixel values to [-1, 1]
    return _bundle(x, y, config)


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
    from ddptrain.data.text import char_lm_datasets

    windows = char_lm_datasets(config.block_size, val_fraction(config), config.seed)
    train, val, vocab = windows[0], windows[1], windows[2]
    facts = DataFacts((config.block_size,), (config.block_size,), False, vocab_size=vocab)
    return DataBundle(ArrayDataset(train.x, train.y, targets_each=train.targets_each),
                      ArrayDataset(val.x, val.y), facts)


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


def _user_datasets(config: TrainingConfig, num_labels: int | None = None) -> DataBundle:
    made = call_factory(config.dataset, "dataset", config, config.dataset_args, {})
    return bundle_datasets(made, config, num_labels)


VAL_KEYS = ("val", "validation", "valid", "test")


def bundle_datasets(made: Any, config: TrainingConfig, num_labels: int | None = None) -> DataBundle:
    """A user's `(train, val)` pair, a dict with `train` and `val` (or `validation`,
    `test`: a Hugging Face `DatasetDict` as it is), or one dataset that `--val_fraction`
    splits. Hugging Face datasets are taken as they are (`ddptrain.data.hf`).
    `num_labels`: the classes a given model says it has (a Hugging Face config's)."""
    if isinstance(made, Mapping):
        made = _pair_of(made, config)
    if isinstance(made, (tuple, list)) and len(made) == 2:
        if config.val_fraction is not None:
            raise ConfigError(
                f"--val_fraction {config.val_fraction} cannot apply: --dataset "
                f"{config.dataset!r} returns its own validation set; drop the flag, or "
                "return one dataset for ddptrain to split"
            )
        train, val = (hf.adapt(d, config.dataset) for d in made)
    elif isinstance(made, Dataset) or hf.is_hf(made):
        if isinstance(made, IterableDataset) or hf.is_hf_iterable(made):
            raise ConfigError(
                f"--dataset {config.dataset!r} returned one IterableDataset, which cannot be "
                "split: return (train, val)"
            )
        made = hf.adapt(made, config.dataset)
        train_idx, val_idx = split_indices(len(made), val_fraction(config), config.seed)
        train, val = Subset(made, train_idx.tolist()), Subset(made, val_idx.tolist())
    else:
        raise ConfigError(
            f"--dataset {config.dataset!r} gave {type(made).__name__}: give "
            "(train_dataset, val_dataset), {'train': ..., 'val': ...} or one map-style "
            "Dataset"
        )
    if config.pack:  # documents, not samples: packed into the samples
        return pack_bundle(train, val, config.block_size, config.dataset)
    return DataBundle(train, val, _probe(train, config, num_labels))


def _pair_of(made: Mapping[str, Any], config: TrainingConfig) -> tuple[Any, Any]:
    val_key = next((k for k in VAL_KEYS if k in made), None)
    if "train" not in made or val_key is None:
        raise ConfigError(
            f"--dataset {config.dataset!r} gave a dict with keys {sorted(made)}: give "
            f"'train' and one of {', '.join(repr(k) for k in VAL_KEYS)}"
        )
    return made["train"], made[val_key]


def _first_of_stream(stream: IterableDataset) -> Any:
    """A stream's first item, leaving a stream that keeps its position where it stood."""
    stateful = all(hasattr(stream, n) for n in ("state_dict", "load_state_dict"))
    saved = stream.state_dict() if stateful else None  # type: ignore[attr-defined]
    try:
        return next(iter(stream))
    finally:
        if stateful:
            stream.load_state_dict(saved)  # type: ignore[attr-defined]


def _probe(train: Dataset, config: TrainingConfig, num_labels: int | None = None) -> DataFacts:
    """Read the facts a task and a model need from the first training sample."""
    try:
        sample = _first_of_stream(train) if isinstance(train, IterableDataset) else train[0]
    except (IndexError, StopIteration):
        raise ConfigError(f"--dataset {config.dataset!r} holds no training samples") from None
    dict_batches = isinstance(sample, dict)
    inputs, target = split(sample)
    x = first_tensor(inputs) if not isinstance(inputs, (np.ndarray, int, float)) else inputs
    input_shape = () if dict_batches or x is None else tuple(torch.as_tensor(x).shape)
    num_classes, source = _classes(train, config, num_labels)
    if target is None:
        return DataFacts(input_shape, None, False, num_classes,
                         attr_through(train, "vocab_size"), True, source)
    t = torch.as_tensor(target)
    return DataFacts(
        input_shape, tuple(t.shape), t.is_floating_point(), num_classes,
        attr_through(train, "vocab_size"), dict_batches, source,
    )


def _classes(
    train: Dataset, config: TrainingConfig, num_labels: int | None
) -> tuple[int | None, str | None]:
    """How many classes integer labels have, and where that came from: --num_classes,
    `dataset.classes` (an image-folder list), `dataset.num_classes`, a Hugging Face
    `ClassLabel` on `labels`, the model's `config.num_labels`, or the labels themselves."""
    if config.num_classes:
        return config.num_classes, "--num_classes"
    classes = attr_through(train, "classes")
    if isinstance(classes, (list, tuple, Mapping)) and len(classes) >= 2:
        return len(classes), "dataset.classes"
    counted = attr_through(train, "num_classes")
    if counted is not None:
        return int(counted), "dataset.num_classes"
    counted = hf.class_label_count(train)
    if counted is not None:
        return int(counted), "features['labels']"
    if num_labels is not None:
        return int(num_labels), "the model's config.num_labels"
    labels = hf.labels_column(train)
    if labels is not None and len(labels):
        lo, hi = int(labels.min()), int(labels.max())
        return _num_classes(lo, hi, config), "the labels seen"
    return None, None


def load_data(config: TrainingConfig, num_labels: int | None = None) -> DataBundle:
    """The run's data. `num_labels`: the classes the given model says it has."""
    if config.val:
        return with_val_sets(load_data(dataclasses.replace(config, val=[]), num_labels),
                             config, lambda other: load_data(other, num_labels))
    if config.mix:
        return load_mixture(config, lambda source: load_data(source, num_labels))
    builders = {
        "breast_cancer": _breast_cancer, "digits": _digits, "diabetes": _diabetes,
        "synthetic": _synthetic, "chars": _chars,
    }
    if is_tokenized(config.dataset):  # chat:PATH, text:PATH: files of text, tokenized here
        return load_tokenized(config, lambda n: split_indices(
            n, val_fraction(config), config.seed))
    if config.pack and not names_code("dataset", config.dataset):
        raise ConfigError(
            f"--pack packs token documents, and --dataset {config.dataset!r} gives fixed "
            "samples: give a package.module:fn dataset of documents (1-D token ids, or dicts "
            "with input_ids)"
        )
    if config.dataset in builders:
        return builders[config.dataset](config)
    if config.dataset.endswith(".npz"):
        return _npz(config)
    if config.dataset.endswith(".npy"):
        return _npy(config)
    return _user_datasets(config, num_labels)


def with_collate(data: DataBundle, config: TrainingConfig, collate: Any = None) -> DataBundle:
    """The bundle with the user's collate: `collate` as given (`ddptrain.fit`), else
    `--collate package.module:fn`."""
    if collate is None and config.collate:
        collate = load_ref(config.collate, "collate")
    if collate is None:
        return data
    if not callable(collate):
        raise ConfigError(
            f"collate {collate!r} is not callable: give a function of a list of samples"
        )
    return dataclasses.replace(data, collate=collate)


def with_val_objects(
    bundle: DataBundle, config: TrainingConfig, sets: Mapping[str, Any]
) -> DataBundle:
    """`ddptrain.fit(..., val={NAME: dataset})`: the bundle with those datasets (taken
    whole) beside its own validation sets, each checked alike from its first sample."""
    more = dict(bundle.more_val)
    for name, dataset in sets.items():
        if name in more:
            raise ConfigError(f"validation set {name!r} is given twice (--val and val=): "
                              "give each name once")
        alone = dataclasses.replace(config, val_fraction=None)  # a pair: not split
        refuse_unlike(bundle, bundle_datasets((dataset, dataset), alone),
                      f"validation set {name!r} and the training data")
        more[name] = dataset
    return dataclasses.replace(bundle, more_val=more)
