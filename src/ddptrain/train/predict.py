"""Prediction: the model's output for every sample of a set, one row per sample, in the
set's order, on any world size.

    ddptrain predict runs/mine --dataset digits --output predictions.npy
    torchrun --standalone --nproc_per_node=2 -m ddptrain predict runs/mine \\
        --dataset digits --split train --output predictions.jsonl

Rank r predicts samples r, r+N, ... (the evaluation shard, no padding: a sample is
predicted once), a batch at a time. After each round of batches the rows are gathered on
rank 0, which interleaves them back into the set's order and appends them to the output:
memory holds one round, whatever the size of the set. The output appears whole or not at
all (a temporary name, renamed once every row is in).

| suffix | what |
| --- | --- |
| `.npy` | one array `(N, *row)`, written into a memory map as rows arrive |
| `.pt` | the same array as one tensor (`torch.load(path)`), saved from that memory map |
| `.jsonl` | one line per sample: `{"index": i, "prediction": [...]}` (rows of any shape) |
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext, gather_to_main
from ddptrain.data import ModelCall, make_val_loader, split, to_device
from ddptrain.data.loader import read
from ddptrain.errors import ConfigError
from ddptrain.files import atomic_write_text, publish, temp_name
from ddptrain.files import check_output as check_new_output
from ddptrain.train.precision import Precision

SUFFIXES = (".npy", ".pt", ".jsonl")


def check_output(path: Path, overwrite: bool = False) -> None:
    """Refuse an output the writers cannot make, or that would replace a file unasked,
    before any work starts."""
    if path.suffix not in SUFFIXES:
        raise ConfigError(
            f"--output {str(path)!r} has an unknown suffix: end it in "
            f"{', '.join(SUFFIXES)}"
        )
    if path.is_dir():
        raise ConfigError(f"--output {str(path)!r} is a directory: give a file name")
    check_new_output(path, "--output", overwrite)
    check_writable(path, "--output")


def check_writable(path: Path, flag: str) -> None:
    """Refuse, before any work, an output whose folder cannot be written (a read-only
    filesystem, no permission, a file in its way): a file is created in the nearest folder
    of `path` that exists, and removed (exit 2, as `ddptrain train` refuses an
    --output_dir it cannot write)."""
    folder = path.absolute().parent
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {str(path)!r} cannot be written ({str(folder)!r}: "
            f"{exc.strerror or exc}): choose a directory you can write to"
        ) from None


def write_output(path: Path, text: str, overwrite: bool) -> None:
    """A small output (`evaluate --output`) written whole, or one line saying why not."""
    try:
        atomic_write_text(path, text, overwrite)
    except OSError as exc:
        if isinstance(exc, ConfigError):  # a link refused: as it is
            raise
        raise ConfigError(_why(exc, path)) from None


@torch.no_grad()
def predict_set(
    module: nn.Module, dataset: Dataset, config: TrainingConfig, precision: Precision,
    ctx: DistributedContext, output: Path, collate: Callable[[list[Any]], Any] | None = None,
    overwrite: bool = False,
) -> int:
    """Write the model's output for every sample of `dataset` to `output` (rank 0), in
    the dataset's order; returns the number of rows. Collective."""
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise ConfigError(f"--dataset {config.dataset!r} holds no samples to predict")
    loader = read(make_val_loader(dataset, config, ctx, collate))
    memory_format = torch.channels_last if config.channels_last else None
    call = ModelCall(module, packed=config.pack)
    module.eval()

    def round_of(_: int) -> torch.Tensor | None:
        batch = next(loader, None)
        if batch is None:
            return None
        inputs = model_inputs(to_device(batch, ctx.device, memory_format))
        with precision.autocast():
            out = call(module, inputs)
        return _rows(out.prediction)

    # Rank 0's shard is the longest (ceil(n / N) samples): every rank runs its rounds.
    rounds = math.ceil(math.ceil(n / ctx.world_size) / config.batch_size)
    write_rounds(rounds, round_of, lambda: _writer(output, n, overwrite), output, ctx)
    return n


def write_rounds(rounds: int, round_of: Callable[[int], Any],
                 writer: Callable[[], _Writer], output: Path, ctx: DistributedContext) -> None:
    """Run `rounds` rounds on every rank, each giving this rank's next rows
    (`round_of(k)`: a sequence, or None when the rank has none left), gathered on rank 0,
    which writes them, back in the set's order, through `writer()`: the output appears
    whole or not at all. Collective."""
    sink: _Writer | None = None
    failure: str | None = None
    if ctx.is_main:
        try:
            sink = writer()
        except OSError as exc:  # the peers still gather and learn it (`_agree`)
            failure = _why(exc, output)
    try:
        for k in range(rounds):
            gathered = gather_to_main(round_of(k), ctx)
            if sink is not None and failure is None and gathered is not None:
                try:
                    sink.write(interleave(gathered))
                except (OSError, ConfigError) as exc:
                    failure = _why(exc, output)  # the peers keep gathering: no one hangs
        failure = _agree(failure, ctx)
        if failure is None and sink is not None:
            try:
                sink.close()
            except OSError as exc:  # every peer is done: rank 0 alone reports it
                raise ConfigError(_why(exc, output)) from None
    finally:
        if sink is not None:
            sink.abort()
    if failure is not None:
        raise ConfigError(failure)


def model_inputs(batch: Any) -> Any:
    """A batch's model inputs: targets, if the samples carry any, are left out (a dict
    keeps them: `ModelCall` passes `labels` only to a model that asks for them)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (list, tuple)) and len(batch) == 1:
        return batch[0]
    return batch if isinstance(batch, Mapping) else split(batch)[0]


def _rows(prediction: torch.Tensor | None) -> torch.Tensor:
    if prediction is None:
        raise ConfigError(
            "the model returned a loss but no predictions ('logits'): predict needs a model "
            "that returns its outputs"
        )
    rows = prediction.detach()
    return (rows.float() if rows.is_floating_point() else rows).cpu()


def interleave(parts: Sequence[Sequence[Any] | None]) -> list[Any]:
    """Rows of one round, back in the set's order: rank r's j-th row is sample
    (start + j) * N + r. A rank's batch is never shorter than a later rank's by more
    than the one sample its shard lacks, so the order is that of the ranks, row by row.
    The ranks' rows may differ in shape (each batch padded to its own longest sample)."""
    shards = [p for p in parts if p is not None]
    return [p[j] for j in range(max(len(p) for p in shards)) for p in shards if len(p) > j]


def _agree(failure: str | None, ctx: DistributedContext) -> str | None:
    """Every rank learns whether rank 0 could write the rows."""
    if not ctx.distributed:
        return failure
    message = [failure]
    dist.broadcast_object_list(message, src=0)
    return message[0]


def _why(exc: BaseException, output: Path) -> str:
    if isinstance(exc, OSError):
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        return (
            f"could not write {str(output)!r}: {exc.strerror or exc} "
            f"(nothing was left there): {'free space or ' if full else ''}give another --output"
        )
    return str(exc)


def _remove_abandoned(path: Path) -> None:
    """Remove the temporary files of earlier predictions into `path` that were killed
    mid-way: a writer holds an flock on its own while it lives (the kernel drops it when
    the writer dies), so one nobody holds is abandoned."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        try:
            with tmp.open("rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live prediction writes it
        tmp.unlink(missing_ok=True)
        tmp.with_name(tmp.name + ".npy").unlink(missing_ok=True)  # a .pt writer's rows


class _Writer:
    """Rows appended to a temporary file beside `path`, renamed to it by `close`; the
    temporary file is locked while this process writes it (`_remove_abandoned`)."""

    def __init__(self, path: Path, n: int, overwrite: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(path)
        self.path, self.n, self.tmp, self.done = path, n, temp_name(path), 0
        self.overwrite = overwrite
        self._held = self.tmp.open("ab")  # the writers reopen the same file (same lock)
        fcntl.flock(self._held, fcntl.LOCK_EX)

    def write(self, rows: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Flush what is written into the temporary file."""

    def close(self) -> None:
        if self.done != self.n:
            raise RuntimeError(f"wrote {self.done} of {self.n} rows")
        self.finish()
        with self.tmp.open("rb+") as f:
            os.fsync(f.fileno())
        publish(self.tmp, self.path, self.overwrite)
        self._held.close()

    def abort(self) -> None:
        self.finish()
        self.tmp.unlink(missing_ok=True)
        self._held.close()


class _NpyWriter(_Writer):
    """An `(N, *row)` array in a memory-mapped `.npy` file, filled as rows arrive."""

    def __init__(self, path: Path, n: int, overwrite: bool) -> None:
        super().__init__(path, n, overwrite)
        self.array: np.memmap | None = None

    def write(self, rows: list[torch.Tensor]) -> None:
        if self.array is None:
            self.array = np.lib.format.open_memmap(
                self.tmp, mode="w+", dtype=rows[0].numpy().dtype, shape=(self.n, *rows[0].shape)
            )
        for row in rows:
            if tuple(row.shape) != self.array.shape[1:]:
                raise ConfigError(
                    f"the model's outputs change shape from {tuple(self.array.shape[1:])} to "
                    f"{tuple(row.shape)} between batches: write --output as .jsonl"
                )
        self.array[self.done : self.done + len(rows)] = torch.stack(rows).numpy()
        self.done += len(rows)

    def finish(self) -> None:
        if self.array is not None:
            self.array.flush()
            self.array = None


class _PtWriter(_NpyWriter):
    """The `.npy` memory map, saved as one tensor: `torch.save` reads it from the map."""

    def __init__(self, path: Path, n: int, overwrite: bool) -> None:
        super().__init__(path, n, overwrite)
        self.rows_file = self.tmp.with_name(self.tmp.name + ".npy")
        self.tmp, self.pt_tmp = self.rows_file, self.tmp

    def close(self) -> None:
        if self.done != self.n:
            raise RuntimeError(f"wrote {self.done} of {self.n} rows")
        self.finish()
        rows = torch.from_numpy(np.load(self.rows_file, mmap_mode="r+"))
        torch.save(rows, self.pt_tmp)
        del rows
        self.rows_file.unlink()
        self.tmp = self.pt_tmp
        super().close()

    def abort(self) -> None:
        super().abort()
        self.pt_tmp.unlink(missing_ok=True)


class _JsonlWriter(_Writer):
    """One JSON line per sample, its index and its output (rows of any shape)."""

    def __init__(self, path: Path, n: int, overwrite: bool) -> None:
        super().__init__(path, n, overwrite)
        self.file: TextIO | None = self.tmp.open("w")

    def write(self, rows: list[torch.Tensor]) -> None:
        assert self.file is not None
        for row in rows:
            self.file.write(json.dumps({"index": self.done, "prediction": row.tolist()}) + "\n")
            self.done += 1
        self.file.flush()  # a round leaves the process as it is written

    def finish(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class ReplyWriter(_JsonlWriter):
    """One JSON line per prompt: `{"index": i, "prompt": ..., "reply": "..."}`
    (`train.generate`); rows are `(prompt, reply)` pairs."""

    def write(self, rows: Sequence[Any]) -> None:
        assert self.file is not None
        for prompt, reply in rows:
            self.file.write(json.dumps({"index": self.done, "prompt": prompt, "reply": reply},
                                       ensure_ascii=False) + "\n")
            self.done += 1
        self.file.flush()


def _writer(path: Path, n: int, overwrite: bool) -> _Writer:
    kinds = {".npy": _NpyWriter, ".pt": _PtWriter, ".jsonl": _JsonlWriter}
    return kinds[path.suffix](path, n, overwrite)
