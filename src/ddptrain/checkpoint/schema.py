"""What a checkpoint holds, and the format version that names this layout.

Version 2 (this one) keeps the position inside an epoch as *global samples consumed*, a
function of the data order alone, so a resume continues at the exact next sample. Version
1 kept micro-batches done on each rank; it is read by converting that count.

| key | what |
| --- | --- |
| `format`, `format_version`, `versions` | what wrote the file |
| `epoch`, `step`, `samples_in_epoch`, `bad_steps`, `bad_streak` | `Progress` |
| `model_state_dict` | the user module's own state (no wrapper prefix) |
| `optimizer_state_dict`, `scheduler_state_dict`, `scaler_state_dict` | optimisation state |
| `epoch_meter` | the epoch's global metric totals at a mid-epoch save |
| `task`, `metric_names` | the task's name and the sums `epoch_meter` holds |
| `world_size`, `config` | the layout it was written under |
| `rng` | every rank's random generators |
| `data_state` | every rank's iterable-dataset state, when the dataset has one |
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddptrain.errors import Diverged

log = logging.getLogger("ddptrain")
FORMAT = "ddptrain-checkpoint"
FORMAT_VERSION = 2


@dataclass
class Progress:
    """Where training stands; enough to continue from exactly here."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken in total (skipped non-finite ones included)
    samples_in_epoch: int = 0  # global training samples consumed in epoch `epoch + 1`
    bad_steps: int = 0  # steps skipped for non-finite gradients, in total
    bad_streak: int = 0  # ... in a row, up to now

    def judge(self, good: bool, step: int, max_bad_steps: int, ckpt_dir: Path) -> None:
        """Count optimizer step `step` (already in `step`) as taken or skipped; too many
        skipped ones in a row end the run."""
        if good:
            self.bad_streak = 0
            return
        self.bad_steps += 1
        self.bad_streak += 1
        log.warning(
            "step %d: non-finite gradients on at least one rank; step skipped on all "
            "(%d in a row)", step, self.bad_streak,
        )
        if self.bad_streak >= max_bad_steps:
            raise Diverged(
                f"{self.bad_streak} optimizer steps in a row had non-finite gradients (last "
                f"at step {step}); no checkpoint holds a skipped step: resume from "
                f"{ckpt_dir / 'best.pt'} (or an earlier step file) with a lower --lr or "
                "--max_grad_norm, or check the data for NaN/inf"
            )

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Progress:
        samples = payload.get("samples_in_epoch")
        if samples is None:  # version 1: micro-batches per rank, every one of them full
            saved = payload.get("config", {})
            per_batch = saved.get("batch_size", 0) * payload.get("world_size", 1)
            samples = payload.get("batches_in_epoch", 0) * per_batch
        return cls(
            payload["epoch"], payload["step"], int(samples),
            payload["bad_steps"], payload["bad_streak"],
        )


# What a resume may change, and what it may not. The run continues with the settings it
# is resumed with, and config.yaml shows them.
#   --lr, --momentum, --weight_decay, --scale_lr: applied to the restored optimizer and
#       schedule (the LR at the current position of the new peak's curve)
#   --epochs, --warmup_epochs: the schedule is rebuilt for the new total and continues
#       from the current step; a warm-up that is over is not repeated
#   world size, --batch_size, --grad_accum_steps, --global_batch_size: the data continues
#       at the next global sample; the schedule is placed where the data is, so it still
#       ends at its planned end
#   --lr_scale, --decay_all, --optimizer_args: the parameter groups get the new settings
#       (the state of each parameter continues in whichever group it is in now)
#   --model / --width (the weights must fit), --optimizer, --scheduler, --freeze, --task,
#       --lora_rank, --lora_alpha, --lora_targets, --lora_quantize: refused
APPLIED = (
    "lr", "momentum", "weight_decay", "scale_lr", "epochs", "warmup_epochs", "lr_scale",
    "decay_all", "optimizer_args",
)
LAYOUT = ("batch_size", "grad_accum_steps", "drop_last", "seed")


def changed(saved: dict[str, Any], current: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    """'--lr 0.01 -> 0.5' for every setting in `names` the resume changes."""
    return [
        f"--{k} {saved[k]} -> {current[k]}"
        for k in names if k in saved and saved[k] != current.get(k)
    ]


def refuse_incompatible(
    payload: dict[str, Any], current: dict[str, Any], task: str, path: str
) -> None:
    """A resume that would silently train something else is a usage error."""
    from ddptrain.errors import ConfigError

    saved = payload.get("config", {})
    if saved.get("optimizer", current["optimizer"]) != current["optimizer"]:
        raise ConfigError(
            f"checkpoint {path!r} was trained with --optimizer {saved['optimizer']}, whose "
            f"state {current['optimizer']} cannot continue: resume with --optimizer "
            f"{saved['optimizer']}, or start a new run (another --output_dir)"
        )
    # another schedule's state; other parameters', other adapters'; other samples at the
    # epoch's positions; the best so far judged by another figure
    for flag in ("scheduler", "freeze", "lora_rank", "lora_alpha", "lora_targets",
                 "lora_quantize", "mix", "best_metric"):
        if flag in saved and saved[flag] != current[flag]:
            was, now = (" ".join(v) if isinstance(v, list) else v
                        for v in (saved[flag], current[flag]))
            raise ConfigError(
                f"checkpoint {path!r} was trained with --{flag} {was or '(none)'}, not "
                f"{now or '(none)'}: resume with the same --{flag}, or start a new run "
                "(another --output_dir)"
            )
    if payload.get("task", task) != task:
        raise ConfigError(
            f"checkpoint {path!r} was trained for --task {payload['task']}, not {task}: "
            f"resume with --task {payload['task']}, or start a new run"
        )
