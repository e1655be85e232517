"""Settings given as lists of small values (`--mix`, `--val`, `--skip_steps`), read one
way for `TrainingConfig.validate` and for the code that uses them, and the one form of a
refused value."""

from __future__ import annotations

import glob
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from ddptrain.errors import ConfigError


def bad(name: str, value: Any, fix: str) -> NoReturn:
    raise ConfigError(f"--{name} {value!r} is invalid: {fix}")


def is_import_ref(value: str) -> bool:
    """Whether `value` has the form `package.module:fn`."""
    module, sep, attr = value.partition(":")
    return bool(sep and module and attr.isidentifier())


def npy_targets(inputs: Path) -> Path:
    """The targets file beside an inputs file: x.npy -> y.npy, train_x.npy -> train_y.npy."""
    return inputs.with_name(inputs.stem[:-1] + "y.npy")


def check_dataset(builtin: tuple[str, ...], ds: str, flag: str) -> None:
    """A dataset given by `flag`: one of `builtin`, an existing .npz, an x.npy with its
    y.npy, or package.module:fn."""
    kind, _, files = ds.partition(":")
    if kind in ("chat", "text") and files:  # raw text or chats, tokenized as the run starts
        if not (glob.glob(files, recursive=True) if glob.has_magic(files) else
                Path(files).is_file()):
            bad(flag, ds, f"no file matches {files!r}; give a path or a glob of .jsonl, "
                ".jsonl.gz or .parquet files")
    elif ds.endswith(".npz") and not is_import_ref(ds):
        if not Path(ds).is_file():
            bad(flag, ds, "no such file; give the path of an .npz with arrays x and y")
    elif ds.endswith(".npy") and not is_import_ref(ds):
        if not Path(ds).stem.endswith("x"):
            bad(flag, ds, "name the inputs file x.npy or NAME_x.npy (targets: y.npy)")
        for path in (Path(ds), npy_targets(Path(ds))):
            if not path.is_file():
                bad(flag, ds, f"no such file {str(path)!r}; put y.npy beside x.npy")
    elif not (ds in builtin or is_import_ref(ds)):
        bad(flag, ds, f"choose one of {', '.join(builtin)}, a path to an .npz or x.npy "
            "file, chat:PATH or text:PATH (.jsonl, .jsonl.gz or .parquet files), or "
            "package.module:fn")


def step_ranges(values: list[Any]) -> list[tuple[int, int]]:
    """`--skip_steps`' entries (STEP or FIRST-LAST) as (first, last), both counted."""
    ranges = []
    for value in values:
        first, _, last = str(value).partition("-")
        if not (first.isdigit() and (last or first).isdigit()) or not 1 <= int(first) <= int(
                last or first):
            bad("skip_steps", value, "give optimizer steps as STEP or FIRST-LAST, e.g. "
                "120-135 (the first step is 1)")
        ranges.append((int(first), int(last or first)))
    return ranges


_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def mix_weights(entries: list[str]) -> list[tuple[str, float]]:
    """`--mix`' DATASET=WEIGHT entries as (dataset, weight), each named once."""
    def parse(entry: str) -> tuple[str, float] | None:
        name, sep, text = entry.rpartition("=")
        try:
            weight = float(text)
        except ValueError:
            return None
        return (name, weight) if sep and name and math.isfinite(weight) and weight > 0 else None

    weights = _keyed("mix", entries, parse, "give DATASET=WEIGHT with a positive weight, e.g. "
                     "--mix chars=0.7 mymod:code=0.3", ("", "dataset"))
    if not math.isfinite(sum(w for _, w in weights)):  # each finite, their sum not: 1e308 x 2
        bad("mix", " ".join(map(str, entries)), "the weights sum past the largest float; "
            "give weights of the same proportions that sum to 1, e.g. chars=0.7 code=0.3")
    return weights


def val_sets(entries: list[str]) -> list[tuple[str, str]]:
    """`--val`' NAME=DATASET entries as (name, dataset), each name once."""
    def parse(entry: str) -> tuple[str, str] | None:
        name, sep, dataset = entry.partition("=")
        return (name, dataset) if sep and dataset and _SET_NAME.fullmatch(name) else None

    return _keyed("val", entries, parse, "give NAME=DATASET, a name of letters, digits, '_', "
                  "'.' or '-', e.g. --val heldout=mymod:heldout bench=bench.npz",
                  ("the set ", "name"))


def _keyed(flag: str, entries: list[str], parse: Callable[[str], Any], form: str,
           names: tuple[str, str]) -> list[Any]:
    """KEY=VALUE entries as `parse` reads them (None: malformed, refused with `form`),
    each key once (`names`: how the refusal calls a key, and what to give once)."""
    parsed: list[Any] = []
    for entry in entries:
        item = parse(str(entry))
        if item is None:
            bad(flag, entry, form)
        if item[0] in (key for key, _ in parsed):
            bad(flag, entry, f"it names {names[0]}{item[0]!r} twice: give each {names[1]} once")
        parsed.append(item)
    return parsed


# The fields whose value can name code a run imports and calls (`package.module:fn`).
CODE_FIELDS = ("dataset", "mix", "val", "collate", "model", "task", "optimizer", "scheduler",
               "tp_plan", "pp_split")
# The fields a Python object can stand in for, and the `fit` argument that gives it.
OBJECT_FIELDS = {"model": "model", "dataset": "datasets", "task": "task", "collate": "collate"}


def names_code(field: str, value: Any) -> bool:
    """Whether `value`, given for config field `field`, names code to import and call
    (`hf:DIR`, a model's weights and config, does not)."""
    if field in ("mix", "val") and isinstance(value, list):  # DATASET=WEIGHT, NAME=DATASET
        return any(is_import_ref(str(entry).rpartition("=")[0 if field == "mix" else 2])
                   for entry in value)
    if field not in CODE_FIELDS or not isinstance(value, str):
        return False
    return not (field == "model" and value.startswith("hf:")) and is_import_ref(value)


# The key=value fields given to what `--model`, `--dataset` and `--task` build (a Hugging
# Face directory's `from_pretrained`, a user's function, which may hand them on to one).
ARGS_FIELDS = ("model_args", "dataset_args", "task_args")
# Their entries that make transformers or `datasets` run code from elsewhere: a
# directory's own Python (`auto_map`) or a dataset script, and kernels from the hub.
_CODE_SWITCHES = ("trust_remote_code", "use_kernels")


def code_args(value: Any) -> dict[str, Any]:
    """The entries of a `--model_args`-like mapping that lead to code nobody named as
    `module:fn`: `trust_remote_code` or `use_kernels` set, an `*_implementation` that is a
    hub repository (`org/name`, an attention kernel), at any depth (an entry whose value
    holds one counts whole)."""
    def runs(key: Any, item: Any) -> bool:
        if key in _CODE_SWITCHES:
            return bool(item) and str(item).strip().lower() not in ("false", "0", "no", "off")
        if isinstance(item, str) and str(key).endswith("_implementation") and "/" in item:
            return True
        if isinstance(item, dict):
            return any(runs(k, v) for k, v in item.items())
        if isinstance(item, (list, tuple)):
            return any(runs(key, v) for v in item)
        return False

    return {k: v for k, v in value.items() if runs(k, v)} if isinstance(value, dict) else {}
