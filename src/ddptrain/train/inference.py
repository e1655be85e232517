"""After training: a run's model rebuilt from its config and weights, then evaluated over a
whole set or applied to every sample of one (`ddptrain.train.predict`).

    ddptrain evaluate runs/mine                                  # the run's validation set
    torchrun --standalone --nproc_per_node=2 -m ddptrain evaluate runs/mine --dataset digits
    ddptrain evaluate runs/mine/checkpoints/step_000000040.pt --output metrics.json

What is given is a run directory (its `config.yaml`, and `model.safetensors` where its
`finished.json` names the run's newest checkpoint, else that checkpoint), a checkpoint (a
`.pt` file or a DCP step directory, which carry the config they were written under) or a
`.safetensors` file beside a `config.yaml`. Every rank rebuilds the whole model (plain,
unwrapped: evaluation and prediction run no backward) and loads the weights after their
checksums are checked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import ConcatDataset, Dataset, IterableDataset, Subset

from ddptrain import models
from ddptrain.checkpoint import (
    checkpoint_model_state,
    find_resumable,
    load_checkpoint,
    read_safetensors_state,
)
from ddptrain.checkpoint.common import check_model_state
from ddptrain.checkpoint.dcp import follow_pointer
from ddptrain.checkpoint.finished import exports_current
from ddptrain.checkpoint.kind import resolve_checkpoint
from ddptrain.config import TrainingConfig
from ddptrain.config_cli import build_parser, config_file_fields, load_yaml
from ddptrain.config_values import ARGS_FIELDS, CODE_FIELDS, OBJECT_FIELDS, code_args, names_code
from ddptrain.context import DistributedContext
from ddptrain.data import DataBundle, ModelCall, make_val_loader
from ddptrain.errors import ConfigError
from ddptrain.parallel import Strategy
from ddptrain.parallel.lora import plain_state
from ddptrain.train.evaluate import Evaluator
from ddptrain.train.precision import Precision
from ddptrain.train.tasks import Scorer, Task, head_size

log = logging.getLogger("ddptrain")
SPLITS = ("val", "train", "all")
# How a run trained: evaluation and prediction step no optimizer and run the whole plain
# model on every rank, whatever the layout and the number of ranks.
_TRAINING = ("optimizer", "optimizer_args", "scheduler", "scheduler_args", "dp_replicate",
             "tp", "pp", "cp", "pp_schedule", "pp_microbatches", "pp_split", "tp_plan",
             "sequence_parallel", "float8", "activation_checkpointing")
# What a run's config may say that means nothing once it has finished: evaluation starts
# no run of its own, resumes nothing, logs to no tracker, and is none of the above.
_NOT_AFTER: dict[str, Any] = {
    "resume_from": None, "tracker": "none", "dry_run": False,
    **{f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
       for f in dataclasses.fields(TrainingConfig) if f.name in _TRAINING},
}


@dataclass(frozen=True)
class Source:
    """A trained model: the config it was trained under, and where its weights are."""

    config: dict[str, Any]
    weights: Path


def find_source(path: Path) -> Source:
    """The config and weights `path` names (a run directory, a checkpoint, a safetensors
    file beside its `config.yaml`), or a ConfigError that says what to give instead."""
    if not path.exists():
        raise ConfigError(
            f"{str(path)!r} does not exist: give a run directory, a checkpoint (.pt file or "
            "DCP step directory) or a model.safetensors beside its config.yaml"
        )
    path = follow_pointer(path)
    found = resolve_checkpoint(path)
    if found.directory and not found.whole:
        return _run_dir(path)
    if path.suffix == ".safetensors":
        config_file = path.parent / "config.yaml"
        if not config_file.is_file():
            raise ConfigError(
                f"{str(path)!r} has no config.yaml beside it to rebuild the model from: give "
                "the run directory, or a checkpoint (which carries its config)"
            )
        return Source(load_yaml(str(config_file)), path)
    # a .pt file or a DCP step directory: the config it was written under is inside
    payload = load_checkpoint(path, torch.device("cpu"), verify=path.is_file())
    return Source(dict(payload.get("config") or {}), path)


def _run_dir(path: Path) -> Source:
    config_file = path / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(
            f"{str(path)!r} is neither a run directory (no config.yaml) nor a whole DCP step "
            "directory: give the directory a run wrote, or one of its checkpoints"
        )
    config = load_yaml(str(config_file))
    weights = path / "model.safetensors"
    if weights.is_file():  # the run's own export, if it is its newest checkpoint's
        newest = find_resumable(_checkpoint_dir(path, config), torch.device("cpu"))
        if newest is None or exports_current(path, newest[1], whole=False):
            return Source(config, weights)
        log.warning(
            "%s is not the export of the run's newest checkpoint (%s): the run trained on "
            "after it, or stopped before its exports were written (a resume with "
            "--resume_from auto writes them); using that checkpoint", weights, newest[0].name,
        )
    return Source(config, newest_checkpoint(path, config))


def _checkpoint_dir(run_dir: Path, config: Mapping[str, Any]) -> Path:
    if config.get("checkpoint_dir"):
        return Path(config["checkpoint_dir"])
    return run_dir / "checkpoints"


def newest_checkpoint(run_dir: Path, config: Mapping[str, Any] | None = None) -> Path:
    """The newest whole checkpoint of a run directory (`ddptrain export RUN_DIR`)."""
    if config is None:
        config = load_yaml(str(run_dir / "config.yaml"))
    ckpt_dir = _checkpoint_dir(run_dir, config)
    found = find_resumable(ckpt_dir, torch.device("cpu"), verify=True)
    if found is None:
        raise ConfigError(
            f"run directory {str(run_dir)!r} holds no whole "
            f"checkpoint in {str(ckpt_dir)!r}: train it first, or give a checkpoint"
        )
    return found[0]


class _Unnamed(list):
    """A list-valued code field (`--mix`) the command line leaves to the stored config:
    empty unless the command gives the flag, whose values argparse extends it with."""


def source_config(
    source: Source, argv: Sequence[str] = (), fields: Mapping[str, Any] | None = None,
    prog: str = "ddptrain evaluate", given: Collection[str] = (), trust_code: bool = False,
    needs: Collection[str] = tuple(OBJECT_FIELDS),
) -> TrainingConfig:
    """The run's config with the user's `--config` file, then `argv` (any `ddptrain train`
    flag), then `fields` over it, validated; what only a training run means (resuming, a
    tracker) is dropped. Code the stored config names (`module:fn`) is imported only where
    the user names that field again (in `argv`, their `--config` file or `fields`; `given`:
    the fields an object of theirs stands in for), or with `trust_code`: a downloaded
    checkpoint or run directory runs nothing the user did not ask for. So too a stored
    `--model_args` (`--dataset_args`, `--task_args`) entry that lets transformers run code
    (`trust_remote_code`: a directory's `auto_map`; `config_values.code_args`): used only
    where the user gives that entry again, or with `trust_code`."""
    names = {f.name for f in dataclasses.fields(TrainingConfig)}
    stored = {k: v for k, v in source.config.items() if k in names}
    parser = build_parser(prog)
    defaults = {name: parser.get_default(name) for name in CODE_FIELDS}
    own = config_file_fields(argv)
    unnamed = object()  # a code field the user's command line leaves to the stored config
    parser.set_defaults(**{**stored, **own})
    parser.set_defaults(**{name: _Unnamed() if isinstance(defaults[name], list) else unnamed
                           for name in CODE_FIELDS if name not in own})
    # the user's own entries of the key=value fields, the stored ones merged under them
    parser.set_defaults(**{name: dict(own.get(name) or {}) for name in ARGS_FIELDS})
    args = vars(parser.parse_args(list(argv)))
    args.pop("config", None)
    named = set(fields or {}) | set(given)
    stored_args: list[str] = []  # stored entries that would run code: "--field key=value"
    for name in ARGS_FIELDS:
        mine = args[name]
        if name not in own:  # a --config file's mapping replaces the stored one, as a flag adds
            args[name] = {**(stored.get(name) or {}), **mine}
        if name not in (fields or {}):
            stored_args += [f"--{name} {key}={_flag_value(value)}"
                            for key, value in code_args(args[name]).items() if key not in mine]
    for name in CODE_FIELDS:
        value = args[name]
        if value is unnamed or (isinstance(value, _Unnamed) and not value):
            args[name] = stored.get(name, defaults[name])
        else:
            args[name] = list(value) if isinstance(value, _Unnamed) else value
            named.add(name)
    # A run fit() trained on Python objects: its config names defaults, not what ran.
    missing = [n for n in stored.get("given_in_python", []) if n not in named and n in needs]
    if missing:
        what = " and ".join(missing)
        objects = ", ".join(f"{OBJECT_FIELDS[n]}=..." for n in missing)
        raise ConfigError(
            f"{str(source.weights)!r} was trained on the {what} given to ddptrain.fit as "
            f"Python objects, which its config cannot name: pass the same objects "
            f"(ddptrain.{prog.split()[-1]}(..., {objects})), or name them with "
            f"{' '.join(f'--{n} ...' for n in missing)}"
        )
    args["given_in_python"] = [n for n in OBJECT_FIELDS if n in given]
    stored_code = [n for n in CODE_FIELDS if n not in named and n not in _NOT_AFTER
                   and names_code(n, args[n])]
    if (stored_code or stored_args) and not trust_code:
        flags = " ".join([*(f"--{n} {' '.join(v) if isinstance(v := args[n], list) else v}"
                            for n in stored_code), *stored_args])
        raise ConfigError(
            f"the config stored with {str(source.weights)!r} names code to import and run "
            f"({flags}); ddptrain runs only code your command names: give {flags} again "
            "if you trust it, or add --trust_checkpoint_code"
        )
    config = dataclasses.replace(TrainingConfig(**args), **{**(fields or {}), **_NOT_AFTER})
    return config.validate()


def _flag_value(value: Any) -> str:
    """A key=value entry's value as the command line gives it (read back as YAML)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"--split {split!r} is invalid: choose {', '.join(SPLITS)}")


def default_split(stored: Mapping[str, Any], config: TrainingConfig) -> str:
    """`all` where the command names a dataset other than the run's stored one (another
    `--dataset`, or other `--dataset_args`): the data given is predicted or evaluated
    whole. `val` (the run's validation set) with the run's own dataset."""
    same = (config.dataset == stored.get("dataset", config.dataset)
            and dict(config.dataset_args or {}) == dict(stored.get("dataset_args") or {}))
    return "val" if same else "all"


def pick_split(data: DataBundle, split: str) -> Dataset:
    """The part of the data `split` names: for a dataset ddptrain splits, the seeded
    split of training (`--val_fraction`, `--seed`); `all`: every sample, the one dataset
    as it was given (unsplit, in its order), or a pair's train then val."""
    check_split(split)
    if split != "all":
        return data.val if split == "val" else data.train
    train, val = data.train, data.val
    if isinstance(train, IterableDataset) or isinstance(val, IterableDataset):
        raise ConfigError(
            "--split all needs map-style datasets, and this data streams: give "
            "--split train and --split val in turn"
        )
    whole = _split_from(train, val)
    return whole if whole is not None else ConcatDataset([train, val])


def _split_from(train: Dataset, val: Dataset) -> Dataset | None:
    """The one dataset `train` and `val` are the split of (two subsets that together hold
    each of its samples once), or None."""
    if not (isinstance(train, Subset) and isinstance(val, Subset)
            and train.dataset is val.dataset):
        return None
    whole = train.dataset
    indices = {*train.indices, *val.indices}
    if len(indices) != len(train.indices) + len(val.indices):
        return None
    if len(indices) != len(whole) or indices != set(range(len(indices))):  # type: ignore[arg-type]
        return None
    return whole


def split_size(data: DataBundle, split: str) -> tuple[int | None, int | None]:
    """How many samples `split` holds, and how many the data holds in all (None where a
    stream does not say)."""
    def size(d: Dataset) -> int | None:
        try:
            return len(d)  # type: ignore[arg-type]
        except TypeError:
            return None

    train, val = size(data.train), size(data.val)
    total = None if train is None or val is None else train + val
    return {"train": train, "val": val}.get(split, total), total


def describe_split(data: DataBundle, split: str, name: str) -> str:
    """`all 37 of NAME`, or `the val split: 7 of the 37 samples of NAME; ...`."""
    held, total = split_size(data, split)
    if split == "all":
        return f"all {held} of {name}"
    return (f"the {split} split: {held} of the {total} samples of {name}; "
            "--split all takes every one")


def build_model(
    config: TrainingConfig, data: DataBundle, task: Task, device: torch.device,
    model: nn.Module | Callable[[], nn.Module] | None = None,
) -> nn.Module:
    """The model as the run built it (`--model`, or the given module or factory), on
    `device`, before its weights are loaded."""
    return models.build_model(
        config, data, head_size(task, data.facts), device, task=task.name, model=model
    )


def load_weights(module: nn.Module, weights: Path, ctx: DistributedContext,
                 config: TrainingConfig) -> None:
    """Fill `module` with the weights of `weights` (checksums checked first; collective
    for a DCP step directory, whose files the ranks check a share each), refusing any
    that do not fit it. A LoRA run's checkpoint is merged into the plain model."""
    if weights.suffix == ".safetensors":
        state = read_safetensors_state(weights)
    else:
        state = plain_state(checkpoint_model_state(weights, ctx), module, config)
    check_model_state(module, state, weights)
    module.load_state_dict(state)


def evaluate_set(
    module: nn.Module, dataset: Dataset, config: TrainingConfig, task: Task,
    precision: Precision, ctx: DistributedContext,
    collate: Callable[[list[Any]], Any] | None = None,
) -> dict[str, float]:
    """The task's figures over every sample of `dataset` once, on any world size (the
    validation pass of training, on the plain module). Collective."""
    loader = make_val_loader(dataset, config, ctx, collate)
    memory_format = torch.channels_last if config.channels_last else None
    evaluator = Evaluator(
        module, ModelCall(module, packed=config.pack), Scorer(task, ctx.device), precision,
        Strategy(ctx, config), ctx, loader, memory_format,
    )
    figures = evaluator.run(None)
    module.eval()
    return figures


def refuse_streams(dataset: Dataset, what: str) -> None:
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"{what} needs a map-style dataset (with __len__ and indexing) to keep its "
            "order: give one, or predict over the stream in your own loop"
        )
