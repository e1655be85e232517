"""ddptrain: a distributed training pipeline, correct on N ranks.

    from ddptrain import TrainingConfig, fit, evaluate, predict, Task, Hook, RunView

`fit` runs the whole lifecycle (see `ddptrain.api`), `evaluate` and `predict` use what it
trained; `Task` is the interface of a task (`ddptrain.train.tasks`), `Hook` that of a step
hook and `RunView` what each of its calls gets (`ddptrain.observe.hooks`). They are
imported on first use, so `ddptrain --help` answers without loading torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "ConfigError", "Hook", "RunView", "Task", "TrainingConfig", "evaluate", "fit", "predict",
]

_EXPORTS = {
    "fit": "ddptrain.api", "evaluate": "ddptrain.api_after", "predict": "ddptrain.api_after",
    "TrainingConfig": "ddptrain.config", "ConfigError": "ddptrain.errors",
    "Task": "ddptrain.train.tasks", "Hook": "ddptrain.observe.hooks",
    "RunView": "ddptrain.observe.hooks",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ddptrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
