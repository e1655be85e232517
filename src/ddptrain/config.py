"""The single source of truth for every setting of a run.

`TrainingConfig` is a dataclass; the `ddptrain train` flags, their defaults and their help
text are generated from its fields (`config_cli`), a YAML file given with `--config` fills
in values under the command line, and `validate()` refuses bad values before any process
group starts.

    ddptrain train --dataset digits --epochs 3 --batch_size 32
    ddptrain train --config run.yaml --lr 0.05      # the flag wins over the file
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddptrain.checkpoint_kind import CheckpointKind
from ddptrain.checkpoint_kind import checkpoint_kind as decide_kind
from ddptrain.config_checks import (  # noqa: F401 (the names the flags take, re-exported)
    BUILTIN_DATASETS,
    BUILTIN_MODELS,
    BUILTIN_OPTIMIZERS,
    BUILTIN_SCHEDULERS,
    BUILTIN_TASKS,
    DEFAULT_DATASET,
    SECTION_CHECKS,
    SEED_MAX,
    WIDTH_MAX,
    check_across,
)
from ddptrain.config_sections import (
    SECTIONS,
    CheckpointSection,
    DataSection,
    FinetuneSection,
    ModelSection,
    ObserveSection,
    OptimizationSection,
    ParallelSection,
    PrecisionSection,
    RuntimeSection,
    SteerSection,
)
from ddptrain.config_values import OBJECT_FIELDS
from ddptrain.config_values import bad as _bad
from ddptrain.errors import ConfigError

__all__ = ["SECTIONS", "ConfigError", "TrainingConfig"]


@dataclass
class TrainingConfig(  # the last base's fields come first: data, model, ..., runtime
    RuntimeSection, SteerSection, ObserveSection, CheckpointSection, FinetuneSection,
    PrecisionSection, ParallelSection, OptimizationSection, ModelSection, DataSection,
):
    """Every parameter the pipeline reads, section by section (`config_sections`).
    Nothing else is hard-coded."""

    given_in_python: list[str] = field(default_factory=list, metadata={"internal": True, "help": (
        "the fields Python objects stood in for (`ddptrain.fit(model=..., datasets=...)`): "
        "what ran is not in this config, and `evaluate`, `predict` and `--config` say so")})

    # ------------------------------------------------------------------ derived values
    @property
    def run_dir(self) -> Path:
        assert self.output_dir is not None, "resolve the run directory first (api.fit)"
        return Path(self.output_dir)

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.checkpoint_dir) if self.checkpoint_dir else self.run_dir / "checkpoints"

    @property
    def checkpoint_kind(self) -> CheckpointKind:
        """What `--checkpoint_format auto` means under this strategy and layout, before the
        model's size is known (`checkpoint_kind.checkpoint_kind`)."""
        return decide_kind(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ validation
    def validate(self) -> TrainingConfig:
        """Refuse values no run can use; each message names the field, the value, the fix.

        What any field must be (a finite number) first, then each section's own checks
        (`config_checks.SECTION_CHECKS`, one per entry of `SECTIONS`, each typed by its
        section, so it can read no other), then the rules between sections
        (`check_across`). What needs more than the config (the data's shape, the
        model, the world size) is checked beside the code that needs it, still before the
        process group:
        `parallel.mesh.plan_mesh`, `parallel.resolve` (strategy flags, the model's layout),
        `data.sources`."""
        if isinstance(self.activation_checkpointing, bool):  # Python's True: the flag alone
            self.activation_checkpointing = _recompute_mode(self.activation_checkpointing)
        strangers = sorted(set(self.given_in_python) - set(OBJECT_FIELDS))
        if strangers:
            _bad("given_in_python", strangers, f"name fields of {', '.join(OBJECT_FIELDS)}")
        for f in dataclasses.fields(self):  # nan compares false with every bound: first
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                _bad(f.name, value, "use a finite number")
        for section in SECTIONS:
            SECTION_CHECKS[section](self)
        check_across(self)
        return self

def _recompute_mode(on: bool) -> Any:
    """--activation_checkpointing as a yes/no (older run directories, `True` in Python)."""
    return "block" if on else "off"
