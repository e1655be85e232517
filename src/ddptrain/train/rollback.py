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
from ddptrain.errors import ConfigError, Diverged
from ddptrain.files import atomic_write_text, read_regular
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
        # rank 0's verdict on the file, records or what is wrong with it, is every rank's:
        # a bad file ends every rank with the same line, none waiting for another
        recorded, bad = from_main(lambda: _read_recorded(self.path, config.run_id), ctx)
        if bad is not None:
            raise ConfigError(bad)
        self.rollbacks: list[dict[str, Any]] = recorded
        self.ranges += [(r["first"], r["last"]) for r in self.rollbacks]

    def covers(self, step: int) -> bool:
        return any(first <= step <= last for first, last in self.ranges)

    def add(self, record: dict[str, Any], write: bool) -> None:
        self.rollbacks.append(record)
        self.ranges.append((record["first"], record["last"]))
        if write:
            text = json.dumps({"run_id": self.run_id, "rollbacks": self.rollbacks}, indent=2)
            atomic_write_text(self.path, text + "\n")


def _read_recorded(path: Path, run_id: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """`_recorded`'s records, or what is wrong with the file (plain data, to broadcast)."""
    try:
        return _recorded(path, run_id), None
    except ConfigError as exc:
        return [], str(exc)


def _recorded(path: Path, run_id: str | None) -> list[dict[str, Any]]:
    """The rollbacks `path` records for the run `run_id` (none for another run's file),
    checked by shape: `ConfigError` naming the file and what is wrong."""
    def bad(what: str) -> ConfigError:
        return ConfigError(
            f"{str(path)!r} is not a rollback record ddptrain can use: {what}; it is written "
            "by --on_spike rollback as {\"run_id\": ..., \"rollbacks\": [{\"first\": STEP, "
            "\"last\": STEP, ...}]}: fix it, or remove it (its rolled-back steps are then "
            "trained on again; --skip_steps skips them)"
        )

    try:
        text = read_regular(path)  # the file itself: a link is not read
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise bad(f"it cannot be read, or is a link or no regular file ({exc.strerror})") from None
    try:
        saved = json.loads(text)
    except (ValueError, RecursionError) as exc:  # nested past Python's stack: not ours
        raise bad(f"it is not JSON ({exc})") from None
    if not isinstance(saved, dict):
        raise bad(f"it holds a {type(saved).__name__}, not an object")
    if saved.get("run_id") != run_id:
        return []  # another run's, before this one took the directory
    rollbacks = saved.get("rollbacks", [])
    if not isinstance(rollbacks, list):
        raise bad(f"its \"rollbacks\" is a {type(rollbacks).__name__}, not a list")
    for i, record in enumerate(rollbacks):
        if not isinstance(record, dict):
            raise bad(f"rollback {i} is a {type(record).__name__}, not an object")
        for key in ("first", "last"):
            value = record.get(key)
            if type(value) is not int or value < 0:
                raise bad(f"rollback {i}'s {key!r} is {value!r}, not a step number")
        if record["first"] > record["last"]:
            raise bad(f"rollback {i}'s first step {record['first']} is after its last "
                      f"{record['last']}")
    return [dict(record) for record in rollbacks]


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
