"""`TrainingConfig` as flags and YAML: the `ddptrain train` parser generated from its
fields (help text, defaults, types), `--config FILE` under the command line, and the run's
`config.yaml` written and read back.

    ddptrain train --dataset digits --epochs 3 --batch_size 32
    ddptrain train --config run.yaml --lr 0.05      # the flag wins over the file
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

import yaml

from ddptrain.config import SECTIONS, TrainingConfig, _recompute_mode
from ddptrain.errors import ConfigError


class ErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one `ddptrain: error:` line, exit code 2, and
    takes every flag spelled in full: an abbreviation (`--ep 2` for `--epochs 2`) would
    change meaning the day a flag that shares its prefix is added."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            message += self._did_you_mean(message.split(": ", 1)[1].split())
        raise ConfigError(message)

    def _did_you_mean(self, words: list[str]) -> str:
        """The flags a misspelt or cut one was likely meant as (`--stratgy`: --strategy;
        `--epo`: --epochs, spelled in full)."""
        flags = [o for action in self._actions for o in action.option_strings
                 if o.startswith("--")]
        for word in words:
            if word.startswith("--"):
                name = word.split("=", 1)[0]
                close = [f for f in flags if f.startswith(name)][:2] or difflib.get_close_matches(
                    name, flags, n=2, cutoff=0.8)
                if close:
                    return f" (did you mean {' or '.join(close)}?)"
        return ""


def _field_type(tp: Any) -> tuple[Any, bool]:
    """Return (base type, optional?) for `X | None` / `Optional[X]` annotations."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return tp, False


def _converter(name: str, tp: Any) -> Any:
    base, optional = _field_type(tp)
    if typing.get_origin(base) is Literal:
        return str
    if base is bool:
        return _parse_bool

    words = TrainingConfig.__dataclass_fields__[name].metadata.get("words", {})

    def convert(text: str) -> Any:
        if optional and text.lower() in ("none", "null", ""):
            return None
        if text in words:  # `--batch_size auto`
            return words[text]
        try:
            return base(text)
        except ValueError:
            example = "a whole number in digits, e.g. 42" if base is int else "a number, e.g. 0.01"
            raise argparse.ArgumentTypeError(
                f"expected {base.__name__}, got {text!r}: give {example}"
            ) from None

    convert.__name__ = base.__name__
    return convert


def parse_pair(text: str) -> tuple[str, Any]:
    """`key=value`; the value is read as YAML, so 3 is an int, true a bool, a/b a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        return key, yaml.safe_load(value) if value else ""
    except yaml.YAMLError:
        return key, value


def _parse_glob_pair(text: str) -> tuple[str, Any]:
    """`GLOB=value`: a key that is a pattern of names (`layers.*.bias=0.1`)."""
    key, sep, value = text.rpartition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected GLOB=VALUE, got {text!r}")
    try:
        return key, yaml.safe_load(value) if value else ""
    except yaml.YAMLError:
        return key, value


class _MergePairs(argparse.Action):
    """`--model_args a=1 b=x --model_args c=2` -> {'a': 1, 'b': 'x', 'c': 2}."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        merged = dict(getattr(namespace, self.dest) or {})
        merged.update(values)
        setattr(namespace, self.dest, merged)


def _parse_bool(text: str) -> bool:
    lowered = str(text).lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, spelled as the field (`--batch_size`, `--no-use_amp`), grouped
    by the field's section in `--help`."""
    parser.add_argument(
        "--config", metavar="FILE.yaml",
        help="YAML file of field: value, flat or under the sections' names below (flags "
        "override it)",
    )
    fields = {f.name: f for f in dataclasses.fields(TrainingConfig)}
    hints = typing.get_type_hints(TrainingConfig)
    for section, (title, names) in SECTIONS.items():
        group = parser.add_argument_group(section, title)
        for name in names:
            _add_field(group, fields[name], hints[name])


def _add_field(parser: Any, f: dataclasses.Field[Any], tp: Any) -> None:
    """The flag of field `f`, of type `tp`."""
    base, _ = _field_type(tp)
    missing = f.default is dataclasses.MISSING
    default = f.default_factory() if missing else f.default  # type: ignore[operator]
    help_text = f"{f.metadata['help']} (default: {default})"
    if typing.get_origin(base) is dict:
        globs = f.metadata.get("glob_keys", False)
        parser.add_argument(
            f"--{f.name}", type=_parse_glob_pair if globs else parse_pair, nargs="+",
            action=_MergePairs, default={}, metavar="GLOB=VALUE" if globs else "KEY=VALUE",
            help=help_text,
        )
        return
    if typing.get_origin(base) is list:
        parser.add_argument(
            f"--{f.name}", nargs="+", action="extend", default=[],
            metavar=f.metadata.get("metavar", "GLOB"), help=help_text,
        )
        return
    if base is bool:
        parser.add_argument(
            f"--{f.name}", action=argparse.BooleanOptionalAction, default=f.default,
            help=help_text,
        )
        return
    choices = typing.get_args(base) if typing.get_origin(base) is Literal else None
    metavar = None if choices else base.__name__.upper()
    # A choice the flag means when given alone (`--activation_checkpointing`)
    bare = {"nargs": "?", "const": f.metadata["bare"]} if "bare" in f.metadata else {}
    parser.add_argument(
        f"--{f.name}", type=_converter(f.name, tp), default=f.default, choices=choices,
        metavar=metavar, help=help_text, **bare,
    )


# List fields of KEY=VALUE entries, which a config file may also give as a mapping.
_KEYED_LISTS = ("mix", "val")


def _coerce(name: str, value: Any) -> Any:
    """Check a YAML value against the field's type, as the flag's parser would."""
    tp = typing.get_type_hints(TrainingConfig)[name]
    base, optional = _field_type(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name}: null is invalid in the config file: give a value")
    if typing.get_origin(base) is Literal:
        choices = typing.get_args(base)
        if isinstance(value, bool) and name == "activation_checkpointing":
            return _recompute_mode(value)  # written before the flag took a mode
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} in the config file is invalid: choose {choices}")
        return value
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}: {value!r} in the config file is invalid: use true or false")
    if typing.get_origin(base) is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
        raise ConfigError(f"{name}: {value!r} in the config file is invalid: use a mapping")
    if typing.get_origin(base) is list:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        if isinstance(value, dict) and name in _KEYED_LISTS:  # mix: {chars: 0.7, ...}
            return [f"{k}={v}" for k, v in value.items()]
        raise ConfigError(f"{name}: {value!r} in the config file is invalid: use a list")
    words = TrainingConfig.__dataclass_fields__[name].metadata.get("words", {})
    if isinstance(value, str) and value in words:
        return words[value]
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, base) or isinstance(value, bool):
        raise ConfigError(
            f"{name}: {value!r} in the config file is invalid: expected {base.__name__}"
        )
    return value


def load_yaml(path: str) -> dict[str, Any]:
    """Read a config file; unknown keys and wrong types are errors, not silent no-ops."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(
            f"--config {path!r} cannot be read ({exc.strerror}): check the path"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"--config {path!r} is not valid YAML{where}: fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path!r} must hold a mapping of field: value")
    data = _flatten_sections(data, path)
    names = {f.name for f in dataclasses.fields(TrainingConfig)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"--config {path!r} has unknown field(s) {', '.join(map(str, unknown))}: "
            "see 'ddptrain train --help' for the field names"
        )
    return {key: _coerce(key, value) for key, value in data.items()}


def _flatten_sections(data: dict[Any, Any], path: str) -> dict[Any, Any]:
    """A file's fields, flat: a section's mapping (`optimization: {lr: 0.1}`) gives its
    own fields, a flat field stays as it is. `model:` is the section when it holds a
    mapping, the field (`model: gpt`) when it holds a name."""
    flat: dict[Any, Any] = {}
    for key, value in data.items():
        if key not in SECTIONS or not isinstance(value, dict):
            _put(flat, key, value, path)
            continue
        own = SECTIONS[key][1]
        for name, item in value.items():
            if name not in own:
                home = [s for s, (_, names) in SECTIONS.items() if name in names]
                raise ConfigError(
                    f"--config {path!r}: {name!r} under {key}: is "
                    + (f"a field of {home[0]}:, not of {key}:: move it there" if home else
                       "no field: see 'ddptrain train --help' for each section's fields")
                )
            _put(flat, name, item, path)
    return flat


def _put(flat: dict[Any, Any], name: Any, value: Any, path: str) -> None:
    if name in flat:
        raise ConfigError(f"--config {path!r} gives {name!r} twice: keep one")
    flat[name] = value


def build_parser(prog: str = "ddptrain train") -> argparse.ArgumentParser:
    parser = ErrorParser(
        prog=prog, usage="%(prog)s [--config FILE.yaml] [--FIELD VALUE ...]",
        description="Train a model on one process or many (torchrun, Slurm, Ray): every "
        "field below is a flag, grouped by section.",
    )
    add_config_arguments(parser)
    return parser


def config_file_fields(argv: Sequence[str]) -> dict[str, Any]:
    """The fields of the `--config FILE.yaml` among `argv`; none without one."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(list(argv))
    return load_yaml(known.config) if known.config else {}


def parse_config(argv: list[str] | None = None) -> TrainingConfig:
    """Parse flags over an optional YAML file over the dataclass defaults, then validate."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    stored = config_file_fields(argv)
    parser.set_defaults(**stored)
    args = vars(parser.parse_args(argv))
    file = args.pop("config")
    unnamed = [n for n in args.pop("given_in_python", []) if args[n] == stored.get(n)]
    if unnamed:
        raise ConfigError(
            f"--config {file!r} is of a run whose {' and '.join(unnamed)} were Python objects "
            f"given to ddptrain.fit, which the file cannot name: give "
            f"{' '.join(f'--{n} ...' for n in unnamed)}, or train from Python again"
        )
    return TrainingConfig(**args).validate()


def dump_yaml(config: TrainingConfig, path: Path) -> None:
    """Write the resolved config so the run can be repeated with `--config`."""
    from ddptrain.files import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
