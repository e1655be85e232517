"""Settings given as lists of small values (`--mix`, `--val`, `--skip_steps`), read one
way for `TrainingConfig.validate` and for the code that uses them, and the one form of a
refused value."""

from __future__ import annotations

import math
import re
from typing import Any, NoReturn

from ddptrain.errors import ConfigError


def bad(name: str, value: Any, fix: str) -> NoReturn:
    raise ConfigError(f"--{name} {value!r} is invalid: {fix}")


def mix_weights(entries: list[str]) -> list[tuple[str, float]]:
    """`--mix`' DATASET=WEIGHT entries as (dataset, weight), each named once."""
    parsed: list[tuple[str, float]] = []
    for entry in entries:
        name, sep, text = str(entry).rpartition("=")
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not sep or not name or not math.isfinite(weight) or weight <= 0:
            bad("mix", entry, "give DATASET=WEIGHT with a positive weight, e.g. --mix "
                "chars=0.7 mymod:code=0.3")
        if name in (n for n, _ in parsed):
            bad("mix", entry, f"it names {name!r} twice: give each dataset once")
        parsed.append((name, weight))
    return parsed


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


def val_sets(entries: list[str]) -> list[tuple[str, str]]:
    """`--val`' NAME=DATASET entries as (name, dataset), each name once."""
    parsed: list[tuple[str, str]] = []
    for entry in entries:
        name, sep, dataset = str(entry).partition("=")
        if not sep or not dataset or not _SET_NAME.fullmatch(name):
            bad("val", entry, "give NAME=DATASET, a name of letters, digits, '_', '.' or "
                "'-', e.g. --val heldout=mymod:heldout bench=bench.npz")
        if name in (n for n, _ in parsed):
            bad("val", entry, f"it names the set {name!r} twice: give each name once")
        parsed.append((name, dataset))
    return parsed
