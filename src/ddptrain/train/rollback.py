"""Steps whose batches are not trained on (`--skip_steps`), and loss spikes rolled back
(`--on_spike rollback`).

A skipped step reads its batches, so the data goes on as if they had been trained on,
and runs no forward and no update; the schedule moves on one step and the step counts.
It is the remedy teams apply by hand to a spike: go back to a checkpoint before it and
step past the data that made it.

`--on_spike rollback` does that in the run. The spike detector (`steer.LossSpikes`)
names the steps of the spiking rows on every rank alike (rows are global figures) and
raises `SpikeRollback`; every rank then loads the newest checkpoint taken before the
first of those steps (rank 0 chooses it), as a resume loads one, rank 0 deletes the
newer checkpoints (the spike is in them), and the run goes on with those steps skipped.
`<run_dir>/rollbacks.json` records each rollback, so a resume of the run after a kill
skips them too. The run ends with the weights of one started with `--skip_steps` of those
steps, bit for bit. After `--max_rollbacks` rollbacks, or with no checkpoint before the
spike, a spike ends the run (`Diverged`, exit 4) without a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.checkpoint.manager import discard_from, newest_before
from ddptrain.config import TrainingConfig
from ddptrain.config_values import step_ranges
from ddptrain.context import DistributedContext, from_main
from ddptrain.errors import Diverged
from ddptrain.files import atomic_write_text
from ddptrain.observe.hang import POSITION
from ddptrain.train.resume import restore
from ddptrain.train.steer import SpikeRollback

if TYPE_CHECKING:
    from ddptrain.train.trainer import Trainer

log = logging.getLogger("ddptrain")

ROLLBACKS = "rollbacks.json"


class SkippedSteps:
    """The optimizer steps not trained on: `--skip_steps`' and those of the run's
    rollbacks (`rollbacks.json`, when it is this run's: rank 0, which knows the run's id,
    reads it for all). Collective."""

    def __init__(self, config: TrainingConfig, ctx: DistributedContext) -> None:
        self.path = config.run_dir / ROLLBACKS
        self.run_id = config.run_id
        self.ranges = step_ranges(config.skip_steps)
        self.rollbacks: list[dict[str, Any]] = from_main(
            lambda: _recorded(self.path, config.run_id), ctx)
        self.ranges += [(r["first"], r["last"]) for r in self.rollbacks]

    def covers(self, step: int) -> bool:
        return any(first <= step <= last for first, last in self.ranges)

    def add(self, record: dict[str, Any], write: bool) -> None:
        self.rollbacks.append(record)
        self.ranges.append((record["first"], record["last"]))
        if write:
            text = json.dumps({"run_id": self.run_id, "rollbacks": self.rollbacks}, indent=2)
            atomic_write_text(self.path, text + "\n")


def _recorded(path: Path, run_id: str | None) -> list[dict[str, Any]]:
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s (%s): its rolled-back steps are trained on", path, exc)
        return []
    if not isinstance(saved, dict) or saved.get("run_id") != run_id:
        return []  # another run's, before this one took the directory
    return [
        {**r, "first": int(r["first"]), "last": int(r["last"])}
        for r in saved.get("rollbacks", []) if isinstance(r, dict)
    ]


def roll_back(trainer: Trainer, spike: SpikeRollback) -> None:
    """Put every rank's `trainer` back to the newest checkpoint before `spike` and mark
    its steps skipped, or end the run (`Diverged`). Collective."""
    cfg, ctx, skips = trainer.config, trainer.ctx, trainer.skips
    trainer.checkpoints.wait()  # a save in flight is one of the candidates

    def newest() -> str | None:
        found = newest_before(trainer.checkpoints.directory, spike.first)
        return None if found is None else str(found)

    target: str | None = from_main(newest, ctx)
    if target is None or len(skips.rollbacks) >= cfg.max_rollbacks:
        why = (
            f"no checkpoint before step {spike.first} to roll back to (checkpoint more often: "
            "--save_every_steps)" if target is None
            else f"rolled back {len(skips.rollbacks)} time(s) already (--max_rollbacks)"
        )
        raise Diverged(f"{spike.what}; {why}: the run stops without a checkpoint; resume "
                       "from an earlier one with --skip_steps, a lower --lr or other data")
    if ctx.is_main:
        discard_from(trainer.checkpoints.directory, spike.first, Path(target))
    trainer.config = dataclasses.replace(cfg, resume_from=target)
    try:
        restore(trainer)
    finally:
        trainer.config = cfg
    skips.add({"first": spike.first, "last": spike.last, "to_step": trainer.progress.step,
               "checkpoint": target, "spike": spike.what}, write=ctx.is_main)
    trainer.writer.close()  # its rows after the checkpoint go, as at a resume
    trainer.writer.start(keep_step=trainer.progress.step, keep_epoch=trainer.progress.epoch)
    POSITION.update(progress=trainer.progress)
    log.warning(
        "rolled back to step %d (%s): steps %d-%d are skipped (rollback %d of at most %d)",
        trainer.progress.step, target, spike.first, spike.last, len(skips.rollbacks),
        cfg.max_rollbacks,
    )
