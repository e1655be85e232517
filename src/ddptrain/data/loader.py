"""The DataLoader every path uses: seeded per rank, workers that leave signals to the main
process, pinned memory on a GPU, pre-batched datasets passed through, and a sample that
fails to load named by its index (`SampleError`), in a worker or in the main process, and a
worker that dies named by its pid however its death reaches the main process (`read`).
"""

from __future__ import annotations

import random
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from multiprocessing import AuthenticationError
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Subset,
    default_collate,
)

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.arrays import pass_through
from ddptrain.errors import EXIT_USAGE, EXIT_WORKER_LOST, ConfigError


def seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; python and numpy follow it
    # so that augmentations in user datasets differ across workers and ranks. Workers
    # leave SIGINT/SIGTERM to the main process, which decides when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.excepthook = _quiet_lost_reader(sys.excepthook)
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _quiet_lost_reader(previous: Callable[..., Any]) -> Callable[..., Any]:
    """A worker hands each batch's storage over through a socket that a thread of its own
    serves (`multiprocessing.resource_sharer`). When the main process is gone or stops
    mid-handover (its run failed: a peer worker died, a sample raised), that thread's
    broken connection is printed as a traceback under the rank's one error line; the main
    process tells what happened, so those errors alone go unprinted."""

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        serving = tb is not None and tb.tb_frame.f_code.co_filename.endswith(
            "resource_sharer.py"
        )
        if serving and issubclass(kind, (EOFError, OSError, AuthenticationError)):
            return
        previous(kind, value, tb)

    return hook


class WorkerSafeError(ConfigError):
    """An error of the data that is raised in a DataLoader worker and comes back to the main
    process rebuilt from the worker's traceback: its own line is kept."""

    def __init__(self, message: str) -> None:
        if message.startswith("Caught "):  # the worker's wrapping: keep the last line
            message = message.rstrip().splitlines()[-1].partition(": ")[2] or message
        super().__init__(message)


class CollateError(WorkerSafeError):
    """Samples that do not make a batch."""


class SampleError(WorkerSafeError):
    """The user's dataset raised while reading a sample; the message names its index."""

    @classmethod
    def reading(cls, dataset: Any, indices: list[int], exc: Exception) -> SampleError:
        source, where = _source(dataset, indices)
        what = (
            f"sample {where[0]}" if len(where) == 1
            else f"one of the samples {', '.join(map(str, where[:8]))}"
            + (", ..." if len(where) > 8 else "")
        )
        reason = str(exc).strip().splitlines()
        said = f"{type(exc).__name__}: {reason[-1][:200]}" if reason else type(exc).__name__
        return cls(
            f"reading {what} of the dataset ({type(source).__name__}) raised {said}: fix "
            "or remove that sample, then resume with --resume_from auto"
        )


def _source(dataset: Any, indices: list[int]) -> tuple[Any, list[int]]:
    """The user's dataset under the split's `Subset`s, and the indices in it."""
    while isinstance(dataset, (Subset, Samples)):
        if isinstance(dataset, Subset):
            indices = [int(dataset.indices[i]) for i in indices]
        dataset = dataset.dataset
    return dataset, indices


class NamedSamples(Dataset):
    """Reads a map-style dataset as it is, and turns an error of one of its samples into
    a `SampleError` naming the sample: one line for the user, wherever it was read."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        try:
            return self.dataset[i]
        except ConfigError:
            raise
        except Exception as exc:
            raise SampleError.reading(self.dataset, [i], exc) from None


class NamedBatches(NamedSamples):
    """A dataset read a batch at a time (`__getitems__`: pre-batched arrays, Hugging Face
    sets): an error names the batch's samples."""

    def __getitems__(self, indices: list[int]) -> Any:
        try:
            return self.dataset.__getitems__(indices)  # type: ignore[attr-defined]
        except ConfigError:
            raise
        except Exception as exc:
            raise SampleError.reading(self.dataset, list(indices), exc) from None


def named(dataset: Dataset) -> Dataset:
    """`dataset` read through `NamedSamples`, batch-wise where the dataset under its split
    reads batches itself (a `Subset` of anything else reads sample by sample anyway)."""
    if isinstance(dataset, IterableDataset):
        return dataset
    source, _ = _source(dataset, [])
    if callable(getattr(source, "__getitems__", None)):
        return NamedBatches(dataset)
    return NamedSamples(dataset)


def stack_samples(samples: list[Any]) -> Any:
    """torch's default collate, with samples of unequal sizes told as one line."""
    try:
        return default_collate(samples)
    except RuntimeError:
        where = _unequal(samples)
        if where is None:
            raise
        raise CollateError(
            f"the samples of a batch differ in size ({where}), so they cannot be stacked: "
            "pad them with --collate package.module:fn (collate= in ddptrain.fit), a "
            "function from a list of samples to a batch"
        ) from None


def _unequal(samples: list[Any]) -> str | None:
    """Where the samples' tensors first differ in shape: 'input_ids: (7,) and (4,)'."""
    shapes: dict[str, tuple[int, ...]] = {}
    for sample in samples:
        for name, shape in _shapes(sample, ""):
            if shapes.setdefault(name, shape) != shape:
                label = f"{name}: " if name else ""
                return f"{label}{tuple(shapes[name])} and {tuple(shape)}"
    return None


def _shapes(value: Any, name: str) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(value, torch.Tensor):
        return [(name, tuple(value.shape))]
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in _shapes(v, f"{name}.{k}" if name else k)]
    if isinstance(value, (list, tuple)):
        return [s for i, v in enumerate(value) for s in _shapes(v, f"{name}[{i}]")]
    return []


def is_batched(dataset: Any) -> bool:
    """ddptrain's pre-batched protocol: `__getitems__` returns a whole batch, `batch`."""
    return hasattr(dataset, "__getitems__") and hasattr(dataset, "batch")


class Samples(Dataset):
    """A pre-batched dataset read sample by sample, for a user's collate."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]


def make_loader(
    dataset: Dataset, config: TrainingConfig, ctx: DistributedContext, persistent: bool = True,
    collate: Callable[[list[Any]], Any] | None = None, kind: type[DataLoader] = DataLoader,
    **kwargs: Any,
) -> DataLoader:
    """`collate`: the user's, given a list of samples (a pre-batched dataset is then read
    sample by sample); without it, pre-batched data passes through and other samples are
    stacked. `kind`: DataLoader, or a subclass that takes its arguments (torchdata's
    StatefulDataLoader)."""
    generator = torch.Generator()
    generator.manual_seed(config.seed + ctx.data_rank)
    workers = config.num_workers
    if collate is not None and is_batched(dataset):
        dataset = Samples(dataset)
    collate_fn = collate or (pass_through if is_batched(dataset) else stack_samples)
    return kind(
        named(dataset),
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=ctx.device.type == "cuda",  # page-locked memory only helps a GPU copy
        persistent_workers=persistent and workers > 0,
        worker_init_fn=seed_worker if workers > 0 else None,
        generator=generator,
        **kwargs,
    )


def read(loader: Iterable[Any]) -> Iterator[Any]:
    """The batches of `loader`. A worker killed while it hands a batch over (the batch's
    storage travels through a socket the worker serves) can fail the read with a broken
    connection before the worker is seen dead; that is then told as the worker's death,
    with its pid, as torch tells one it sees in time."""
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (ConnectionError, EOFError) as exc:
            raise_lost_worker(getattr(it, "_workers", []), exc)
            raise
        yield batch


def raise_lost_worker(workers: list[Any], cause: BaseException, wait: float = 5.0) -> None:
    """Raise torch's worker-death error for the first of `workers` found dead within
    `wait` seconds (a SIGKILLed process closes its sockets a moment before it can be
    reaped); return if every one stays alive."""
    deadline = time.monotonic() + wait
    while not (dead := [w for w in workers if not w.is_alive()]):
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    code = dead[0].exitcode
    how = (
        f"is killed by signal: {signal.strsignal(-code)}"
        if code is not None and code < 0 else "exited unexpectedly"
    )
    raise RuntimeError(f"DataLoader worker (pid {dead[0].pid}) {how}") from cause


def stop_workers(*loaders: Any) -> None:
    """Shut down the persistent workers of these DataLoaders. A run that ends on an error
    may leave their iterator to the cyclic collector, and the workers, which leave SIGTERM
    to the main process, would keep the interpreter's exit waiting for them. The run has
    failed already: torch's SIGCHLD handler, which raises in the main thread wherever it
    is when a worker ends (in a logging lock, printed as a traceback), is not wanted."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for loader in loaders:
        it = getattr(loader, "_iterator", None)
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()


def end_worker_processes() -> None:
    """On a failed exit, SIGKILL the DataLoader workers still alive. They ignore SIGTERM
    (see `seed_worker`), and at interpreter exit multiprocessing joins its children without
    a timeout: a worker left running (an iterator not shut down, a worker stuck in the
    user's `__getitem__`) would keep the rank alive for good, its peers waiting on it."""
    import multiprocessing

    children = multiprocessing.active_children()
    if not children:
        return
    # torch's SIGCHLD handler would raise in the main thread for each worker killed here
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.kill()
    for child in children:
        child.join(timeout=5.0)


def worker_failure(exc: BaseException) -> tuple[str, int] | None:
    """A DataLoader worker that died, or that raised something not ddptrain's own (a
    stream's `__iter__`, a user's collate), as (the line, the exit code); None otherwise."""
    text = str(exc)
    died = _WORKER_DIED.search(text)
    if isinstance(exc, RuntimeError) and died:
        how = f"was killed by signal {died.group(2)}" if died.group(2) else "exited unexpectedly"
        return (
            f"DataLoader worker (pid {died.group(1)}) {how}: the out-of-memory killer or a "
            "kill; lower --num_workers or the memory each worker holds (dmesg tells an OOM "
            "kill), then resume with --resume_from auto", EXIT_WORKER_LOST,
        )
    caught = _WORKER_RAISED.match(text)
    if caught:
        last = text.rstrip().splitlines()[-1][:200]
        return (
            f"DataLoader worker {caught.group(2)} failed: {last}: fix the dataset or "
            "--collate, then resume with --resume_from auto", EXIT_USAGE,
        )
    return None


_WORKER_DIED = re.compile(
    r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) (?:is killed by signal: (\w+)|exited)"
)
_WORKER_RAISED = re.compile(r"Caught (\w+) in DataLoader worker process (\d+)")
