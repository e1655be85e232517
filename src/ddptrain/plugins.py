"""User code named on the command line: `--dataset / --model / --task package.module:fn`.

`fn(config, **kwargs)` is called with the user's own `--<what>_args key=value` pairs, plus
the facts ddptrain already knows (`num_classes`, `input_shape`, `vocab_size`, ...) where
the function's signature asks for them by name or takes `**kwargs`; a plain `fn(config)`
keeps working.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from ddptrain.errors import ConfigError


def load_ref(ref: str, what: str) -> Any:
    """Import `package.module:name`, reporting a failure as one line."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"--{what} {ref!r}: cannot import {module_name!r} ({exc}): "
            "check the module is on PYTHONPATH"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"--{what} {ref!r}: {module_name!r} has no {attr!r}") from None


def accepted(fn: Any, offered: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `offered` that `fn` takes as keyword arguments."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in params}


def call_factory(
    ref: str, what: str, config: Any, user_args: Mapping[str, Any], facts: Mapping[str, Any],
    positional: tuple[Any, ...] = (),
) -> Any:
    """Call the user's `fn(config, *positional, **user_args, **facts it accepts)`."""
    fn = load_ref(ref, what)
    kwargs = {**accepted(fn, facts), **user_args}
    try:
        inspect.signature(fn).bind(config, *positional, **kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"--{what} {ref!r} cannot be called with --{what}_args {dict(user_args)}: {exc}"
        ) from None
    except ValueError:
        pass  # no signature to check against: let the call say
    return fn(config, *positional, **kwargs)
