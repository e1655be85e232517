"""Where the loop writes a checkpoint: the checks before one, and a save mid-epoch.

No checkpoint is written at a skipped (non-finite) step, so the newest stays the last
good one; and none once rank 0 could not write the run's log, so the newest stays the
last one the log covers (every rank stops with exit 74). A save mid-epoch
(`--save_every_steps`, an agreed SIGTERM, a hook's agreed stop) carries the epoch's
running metric totals, and on a stop ends the run once its checkpoint is on disk.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ddptrain.observe.writer import RunLogError
from ddptrain.train.metrics import EpochMeter
from ddptrain.train.steer import SteeredStop

if TYPE_CHECKING:
    from ddptrain.train.trainer import Trainer

log = logging.getLogger("ddptrain")


def may_save(trainer: Trainer) -> bool:
    """No checkpoint at a skipped (non-finite) step: the newest stays the last good."""
    if trainer.progress.bad_streak:
        log.warning("step %d was skipped: no checkpoint written", trainer.progress.step)
    return not trainer.progress.bad_streak


def check_logs(trainer: Trainer) -> None:
    """Before a checkpoint or an agreed stop (collective): when rank 0 could not write
    the run's log, every rank stops here with exit 74. No checkpoint follows, so the
    newest one stays the last the log covers, and a resume continues the log whole."""
    failed = trainer.writer.failure is not None
    if trainer.ctx.distributed:  # one value, only where a checkpoint is written anyway
        flag = torch.tensor([float(failed)], device=trainer.ctx.device)
        dist.all_reduce(flag)
        failed = bool(flag.item())
    if not failed:
        return
    raise RunLogError(trainer.writer.failure or (
        f"rank 0 could not write the run's log in {str(trainer.config.run_dir)!r} (its line "
        f"says why): every rank stopped at step {trainer.progress.step} without a "
        "checkpoint; the previous one is intact: resume with --resume_from auto once "
        "the directory is writable"
    ))


def save_mid_epoch(
    trainer: Trainer, meter: EpochMeter, totals: list[float], stop: bool, steered: bool = False
) -> None:
    """Checkpoint with the epoch's running totals; on an agreed stop, end the run."""
    check_logs(trainer)
    if steered and trainer.steer.finish:
        trainer.history["stop"] = {"reason": trainer.steer.agreed, "step": trainer.progress.step}
    saved = may_save(trainer)
    if saved:
        trainer.save({"totals": totals, "logged": meter.logged})
    if stop or steered:
        trainer.checkpoints.wait()  # the stop's checkpoint is on disk before the run ends
    if stop:
        raise trainer.stop.error(trainer.progress.step, saved)
    if steered:
        raise SteeredStop(trainer.steer.agreed)
