"""Several datasets in one run: `--mix DATASET=WEIGHT ...`, one training set drawn from
several by weight, and `--val NAME=DATASET ...`, more validation sets beside the run's own.

    ddptrain train --mix chars=0.7 mymod:code=0.2 mymod:math=0.1 --model gpt
    ddptrain train --dataset digits --val noisy=mymod:noisy_digits --best_metric noisy/loss

Each source is a dataset as `--dataset` takes it (built-in, a file, `package.module:fn`,
map-style). An epoch holds as many samples as the sources together (their training
parts); which source fills each of its positions is drawn once by a generator seeded
from `--seed`, with the weights as probabilities, and the j-th position a source fills
takes that source's j-th sample in a seeded order of its own (round again when a source
is drawn more often than it holds samples: upsampled; a source drawn less often has
samples left out of every epoch: downsampled). The mixture is then one map-style dataset
of global sample positions like any other: how an epoch falls on ranks, the shuffle,
every sample once, a resume mid-epoch at another world size are the epoch plan's
(`ddptrain.data.epoch`), unchanged. What an epoch draws from each source is logged and in
`summary.json` (`mix`); a resume with another `--mix` is refused. The validation set is
every source's, one after another.

The sources must agree on what a sample is (input and target shapes, classes, vocabulary):
a mixture of another tokenizer's ids, or of images and token windows, is one line.

Each `--val` set is a dataset's validation part (as `--dataset` would split it), alike to
the training data; every rank evaluates its share of each, every sample once, and the
val rows carry its figures as NAME/METRIC (`val/NAME/METRIC` in the trackers);
`--best_metric NAME/METRIC` lets one of them choose the best epoch and early stopping.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from torch.utils.data import ConcatDataset, Dataset, IterableDataset

from ddptrain.config import TrainingConfig
from ddptrain.config_values import mix_weights, val_sets
from ddptrain.data.bundle import DataBundle
from ddptrain.errors import ConfigError

log = logging.getLogger("ddptrain")

_STREAM = 0x6D6978  # the mixture's own generator stream beside --seed ("mix")


class Mixture(Dataset):
    """The training samples of several datasets, position by position as drawn (see the
    module's text): `source[i]` is the source of position i, `counts` what an epoch draws
    from each."""

    def __init__(self, sources: list[Dataset], names: list[str], weights: list[float],
                 seed: int, vocab_size: int | None = None) -> None:
        self.sources, self.names, self.vocab_size = sources, names, vocab_size
        sizes = [len(s) for s in sources]  # type: ignore[arg-type]
        total = sum(weights)
        if not (all(math.isfinite(w) and w > 0 for w in weights) and math.isfinite(total)):
            raise ConfigError(
                f"--mix weights {', '.join(map(str, weights))} cannot be drawn by: give "
                "finite positive weights whose sum is finite, e.g. 0.7 and 0.3"
            )
        self.weights = [w / total for w in weights]
        generator = np.random.default_rng([seed, _STREAM])
        # 3 to 6 bytes a position on every rank (an epoch of 100M samples: 0.5 GB)
        self.source = generator.choice(len(sources), size=sum(sizes), p=self.weights).astype(
            np.uint8 if len(sources) < 256 else np.uint16)
        index = np.int32 if len(self.source) < 2**31 else np.int64
        self.nth = np.empty(len(self.source), dtype=index)  # j: the source's j-th draw
        for s in range(len(sources)):
            where = np.flatnonzero(self.source == s)
            self.nth[where] = np.arange(len(where), dtype=index)
        self.orders = [generator.permutation(n) for n in sizes]
        self.counts = {n: int(c) for n, c in zip(
            names, np.bincount(self.source, minlength=len(sources)), strict=True)}

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> Any:
        s = int(self.source[i])
        order = self.orders[s]
        return self.sources[s][int(order[int(self.nth[i]) % len(order)])]


def load_mixture(
    config: TrainingConfig, load: Callable[[TrainingConfig], DataBundle]
) -> DataBundle:
    """`--mix`: each source loaded by `load` as `--dataset` would be, then mixed: the
    training set drawn by weight, the validation sets one after another, the facts the
    sources agree on."""
    names, weights = zip(*mix_weights(config.mix), strict=True)
    bundles = [load(dataclasses.replace(config, dataset=name, mix=[])) for name in names]
    return _mixed(bundles, list(names), list(weights), config.seed)


def _mixed(bundles: list[DataBundle], names: list[str], weights: list[float],
           seed: int) -> DataBundle:
    first = bundles[0]
    for name, bundle in zip(names, bundles, strict=True):
        if isinstance(bundle.train, IterableDataset):
            raise ConfigError(
                f"--mix {name}: it is an IterableDataset; --mix takes map-style datasets "
                "(with a length), whose positions can be drawn"
            )
        refuse_unlike(first, bundle, f"--mix: {names[0]} and {name}")
    mixture = Mixture([b.train for b in bundles], names, weights, seed,
                      first.facts.vocab_size)
    share = ", ".join(
        f"{n} {c:,} ({c / len(mixture):.1%}, weight {w:.3g})"
        for (n, c), w in zip(mixture.counts.items(), mixture.weights, strict=True)
    )
    log.info("--mix: an epoch of %s samples draws %s", f"{len(mixture):,}", share)
    val = ConcatDataset([b.val for b in bundles]) if len(bundles) > 1 else first.val
    return DataBundle(mixture, val, first.facts)


def refuse_unlike(first: DataBundle, other: DataBundle, which: str) -> None:
    """A `ConfigError` when two datasets' samples are not alike (`which`: who they are)."""
    for fact in ("input_shape", "target_shape", "target_is_float", "num_classes",
                 "vocab_size", "dict_batches"):
        mine, theirs = getattr(other.facts, fact), getattr(first.facts, fact)
        if mine != theirs:
            raise ConfigError(
                f"{which} disagree on {fact} ({theirs} vs {mine}): give datasets whose "
                "samples are alike (one tokenizer, one input shape, one set of classes)"
            )


def with_val_sets(
    bundle: DataBundle, config: TrainingConfig, load: Callable[[TrainingConfig], DataBundle]
) -> DataBundle:
    """`--val NAME=DATASET ...`: the bundle with each dataset's validation part beside its
    own, each loaded by `load` as `--dataset` would be and checked alike."""
    more: dict[str, Dataset] = {}
    for name, dataset in val_sets(config.val):
        other = load(dataclasses.replace(config, dataset=dataset, mix=[], val=[]))
        refuse_unlike(bundle, other, f"--val {name}={dataset} and the training data")
        more[name] = other.val
    return dataclasses.replace(bundle, more_val=more)


def mix_counts(dataset: Any) -> dict[str, int] | None:
    """What an epoch draws from each source of a `Mixture`, or None."""
    return dict(dataset.counts) if isinstance(dataset, Mixture) else None
