"""`ddptrain evaluate` and `predict` before anything is built: what they decide from their
arguments and the run's stored config alone, and the sets evaluation reports.

    ddptrain evaluate runs/mixed                     # the run's validation data, each --val set
    ddptrain evaluate runs/mixed --dataset new.npz   # new.npz whole: the stored --mix is not used

Every refusal that needs only the arguments and the stored config (a flag's value, code the
config names, a missing checkpoint) comes from `prepare`, before any checkpoint's checksums
are checked, any data loaded, a process group started or a model built: the config is read
as stored (a run's `config.yaml`, the one a checkpoint carries, without its tensors), then
checked, and only then are the weights found and checked. A refusal of stored code ends with
the exact command that allows it (the same one with `--trust_checkpoint_code`). Those that
need the data (`--split all` of a stream) come from `pick_sets`/`pick_rows`, once the data is
loaded and before the model is built.

Data the command names (`--dataset`, `--mix`, a dataset object) replaces the run's: the
stored `--mix` and `--val` sets then no longer apply unless the command names them too.
`evaluate` reports each `--val` set that applies beside the main set as training does
(`NAME/METRIC`, also in its `--output` file); `predict` writes one set's rows and loads none
of them.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddptrain.checkpoint import load_checkpoint
from ddptrain.checkpoint.dcp import follow_pointer
from ddptrain.checkpoint.kind import resolve_checkpoint
from ddptrain.config import TrainingConfig
from ddptrain.config_cli import build_parser, config_file_fields, load_yaml
from ddptrain.context import DistributedContext
from ddptrain.data import DataBundle
from ddptrain.errors import ConfigError
from ddptrain.files import check_output
from ddptrain.train.evaluate import named_figures
from ddptrain.train.inference import (
    Source,
    default_split,
    evaluate_set,
    find_source,
    pick_split,
    refuse_streams,
    source_config,
)
from ddptrain.train.precision import Precision
from ddptrain.train.predict import check_writable, write_output
from ddptrain.train.tasks import Task

# The fields that say which data a run reads, and what follows from its --val sets.
_DATA_FIELDS = ("dataset", "mix", "val", "best_metric")


def prepare(
    source: Path, argv: Sequence[str], fields: Mapping[str, Any], prog: str,
    given: Collection[str], trust_code: bool, needs: Collection[str], split: str | None,
    own: Sequence[str] | None,
) -> tuple[Source, TrainingConfig, str]:
    """The weights `source` names, the config to rebuild them with (`source_config`: the
    stored one, `argv` and then `fields` over it; `given`: the fields Python objects stand
    in for) and the split (`split`, or `default_split`), every refusal of those before any
    weights are checked. `own`: the command's own arguments (the source first), for the
    exact command a refusal of stored code gives; None where Python objects or `fields`
    were given, which no command line carries."""
    stored = _stored(source)
    fields = {**_dropped(stored.config, argv, fields, given, prog), **fields}
    command = None if own is None else shlex.join(
        [*prog.split(), *own, *argv, "--trust_checkpoint_code"])
    config = _checked(stored, argv, fields, prog, given, trust_code, needs, command)
    return find_source(source), config, split or default_split(stored.config, config)


def command_flags(source: str | Path, split: str | None, output: str | Path | None,
                  overwrite: bool) -> list[str]:
    """The source and the flags of `ddptrain evaluate`/`predict` itself, as typed."""
    return [str(source), *(["--split", split] if split else []),
            *(["--output", str(output)] if output is not None else []),
            *(["--overwrite"] if overwrite else [])]


def _stored(path: Path) -> Source:
    """The config `path` was trained under, read without checking any weights (`find_source`
    checks them once the config is found good); `weights`, for messages, is what a run
    directory's weights most often are (its export), or `path` as given."""
    if path.exists():
        target = follow_pointer(path)
        if resolve_checkpoint(target).run_dir:
            export = target / "model.safetensors"
            return Source(load_yaml(str(target / "config.yaml")),
                          export if export.is_file() else path)
        if target.is_file() and target.suffix != ".safetensors":  # a .pt: memory-mapped
            payload = load_checkpoint(target, torch.device("cpu"))
            return Source(dict(payload.get("config") or {}), path)
    return find_source(path)  # what it refuses, or a config it reads as cheaply


def _dropped(stored: Mapping[str, Any], argv: Sequence[str], fields: Mapping[str, Any],
             given: Collection[str], prog: str) -> dict[str, Any]:
    """The stored settings that no longer apply, as fields that clear them: the `--mix`
    where the command names other data, the `--val` sets (and a `--best_metric` that may
    name one) there too and for `predict`, unless the command names them itself."""
    named = _named(argv) | set(fields) | set(given)
    new_data = bool({"dataset", "mix"} & named)
    dropped: dict[str, Any] = {}
    if stored.get("mix") and new_data and "mix" not in named:
        dropped["mix"] = []
    if stored.get("val") and (new_data or prog.endswith("predict")) and "val" not in named:
        dropped["val"] = []
        if "best_metric" not in named:
            dropped["best_metric"] = None
    return dropped


def _named(argv: Sequence[str]) -> set[str]:
    """Which of the data's fields `argv` (or its `--config` file) names."""
    parser = build_parser("ddptrain")
    parser.set_defaults(**dict.fromkeys(_DATA_FIELDS))  # None: not given
    args = vars(parser.parse_args(list(argv)))
    return {n for n in _DATA_FIELDS if args[n] is not None} | set(config_file_fields(argv))


def _checked(stored: Source, argv: Sequence[str], fields: Mapping[str, Any], prog: str,
             given: Collection[str], trust_code: bool, needs: Collection[str],
             command: str | None) -> TrainingConfig:
    """`source_config`, whose refusal of stored code ends with the exact way to allow it:
    the command again with `--trust_checkpoint_code`."""
    try:
        return source_config(stored, argv, fields, prog, given, trust_code, needs)
    except ConfigError as refused:
        if trust_code:
            raise
        try:  # was it the stored code? Then trusting it gets further (or through)
            source_config(stored, argv, fields, prog, given, True, needs)
        except ConfigError as other:
            if str(other) == str(refused):
                raise refused from None
        how = ("the command with it: " + command if command is not None
               else "in Python: trust_checkpoint_code=True")
        raise ConfigError(f"{refused}; {how}") from None


def pick_sets(data: DataBundle, split: str) -> dict[str, Dataset]:
    """What `evaluate` reports: the set `split` names (""), then each `--val` set that
    applies, as training evaluates them. A refusal of the data comes here, before the
    model is built."""
    return {"": pick_split(data, split), **data.more_val}


def pick_rows(data: DataBundle, split: str) -> Dataset:
    """What `predict` writes: the set `split` names, map-style (its rows keep its order)."""
    dataset = pick_split(data, split)
    refuse_streams(dataset, "predict")
    return dataset


def check_figures_output(output: Path, overwrite: bool) -> None:
    """`evaluate --output FILE.json`, refused before any work: an existing file (without
    `overwrite`), a special file, a folder that cannot be written (a read-only filesystem)."""
    check_output(output, "--output", overwrite)
    check_writable(output, "--output")


def write_figures(output: Path, figures: Mapping[str, float], source: Path,
                  config: TrainingConfig, split: str, overwrite: bool) -> None:
    """`evaluate --output`: the figures, with the weights, the data and the split they
    are of (rank 0)."""
    record = {"source": str(source), "dataset": config.dataset,
              **({"mix": list(config.mix)} if config.mix else {}), "split": split, **figures}
    write_output(output, json.dumps(record, indent=2) + "\n", overwrite)


def evaluate_sets(
    module: nn.Module, sets: Mapping[str, Dataset], config: TrainingConfig, task: Task,
    precision: Precision, ctx: DistributedContext, collate: Any = None,
) -> dict[str, float]:
    """Each set's figures (`evaluate_set`), the main one's as they are and each `--val`
    set's as NAME/METRIC, as training's val rows name them. Collective."""
    figures: dict[str, float] = {}
    for name, dataset in sets.items():
        got = evaluate_set(module, dataset, config, task, precision, ctx, collate)
        figures.update(named_figures(name, got))
    return figures
