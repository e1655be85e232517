"""A resume: every part of a freshly built trainer put where the checkpoint left it.

The weights and optimizer state load through the checkpoint's backend and the strategy
(any strategy, any world size), and the strategy takes what it saved of its own layout
(DDP's gradient bucket order); then the progress, the scaler, the history and the hooks'
state; the per-rank RNG states and the data position where they still mean the same; and
the schedule, placed by epochs and global samples done, so that on another layout it
still ends at its planned end.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.optim.lr_scheduler import LambdaLR

from ddptrain.checkpoint.common import CheckpointError, DamagedCheckpoint
from ddptrain.checkpoint.dcp import BEST_DIR
from ddptrain.checkpoint.kind import CheckpointKind, resolve_checkpoint
from ddptrain.checkpoint.manager import EMA_FILE_KEY, skipping
from ddptrain.checkpoint.pt import BEST
from ddptrain.checkpoint.rng import set_rng_state
from ddptrain.checkpoint.schema import APPLIED, LAYOUT, Progress, changed, refuse_incompatible
from ddptrain.data import IterableBatches
from ddptrain.parallel.base import hyperparameters

if TYPE_CHECKING:
    from ddptrain.train.ema import EMA
    from ddptrain.train.trainer import Trainer

log = logging.getLogger("ddptrain")


def restore(trainer: Trainer) -> str | None:
    """Load the checkpoint `--resume_from` names (rank 0 decides which) into `trainer`;
    returns its path, or None for a fresh start. Collective."""
    cfg = trainer.config
    current = cfg.to_dict()
    # The run's own settings per group (lr, weight decay, ...), before the checkpoint's
    # overwrite them: the state is the checkpoint's, the settings the run's.
    fresh = [hyperparameters(g) for g in trainer.optimizer.param_groups]
    skip: list[Path] = []
    while True:  # a step directory's entries are checked as they load, each read once
        found = trainer.checkpoints.locate(cfg.resume_from, skip, checked_in_load=True)
        if found is None:
            return None
        path, payload = found
        refuse_incompatible(payload, current, trainer.task.name, str(path))
        try:
            _load_weights(trainer, path, payload)
            break
        except DamagedCheckpoint as exc:  # every rank's: the load is collective
            if cfg.resume_from != "auto":
                raise
            skipping(exc)  # the previous one overwrites all that this one loaded
            skip.append(path)
    _regroup(trainer, payload, fresh)
    trainer.model = trainer.strategy.resume_module(
        trainer.model, trainer.module, payload.get("strategy_state") or {}
    )
    trainer.scaler.load_state_dict(payload["scaler_state_dict"])
    trainer.progress = Progress.from_payload(payload)
    trainer.history.update(payload.get("history", {}))
    trainer.hooks.load_state_dict(payload.get("hooks", {}))
    _restore_position(trainer, payload)
    _place_schedule(trainer, changed(payload.get("config", {}), current, APPLIED), payload)
    trainer.steer.load_state_dict(payload.get("steer", {}))
    log.info(
        "resumed from %s: epoch %d done, step %d",
        path, trainer.progress.epoch, trainer.progress.step,
    )
    return str(path)


def take_best(trainer: Trainer) -> str | None:
    """`--export best`: the weights (and EMA weights) of the best epoch's checkpoint, put
    back into `trainer` so that the export holds them; its path. None, with a warning,
    when no epoch was best (no validation ran) or its checkpoint is gone: the last weights
    are exported then. Collective."""
    checkpoints = trainer.checkpoints
    name = BEST_DIR if checkpoints.sharded is not None else BEST
    try:
        found = checkpoints.locate(str(checkpoints.directory / name))
    except CheckpointError as exc:
        found = None
        reason = str(exc)
    else:
        reason = "no checkpoint is named best"
    if found is None:
        log.warning("--export best: %s (no validation epoch was best?); the last weights "
                    "are exported", reason)
        return None
    path, payload = found
    _load_weights(trainer, path, payload)
    log.info("--export best: the weights of %s (epoch %d, step %d)", path,
             payload["epoch"], payload["step"])
    return str(path)


def _load_weights(trainer: Trainer, path: Path, payload: dict[str, Any]) -> None:
    """A located checkpoint's weights, optimizer state and EMA weights into `trainer`."""
    ema = trainer.ema
    sharded = resolve_checkpoint(path).kind is CheckpointKind.DCP
    sharded_ema = ema.state() if ema is not None and sharded and payload.get("ema") else None
    trainer.checkpoints.load(path, payload, trainer.module, trainer.optimizer, sharded_ema)
    if ema is not None and sharded_ema is None:
        _restore_ema(ema, payload, str(path))


def _restore_ema(ema: EMA, payload: dict[str, Any], path: str) -> None:
    """The EMA weights of a `.pt` checkpoint (whole: each rank keeps its shard), after the
    weights: an average the checkpoint lacks starts from the resumed weights."""
    missing = ema.load_full(payload.get(EMA_FILE_KEY) or {})
    if missing:
        log.warning(
            "%s holds no EMA weights for %d parameter(s): their average starts from the "
            "resumed weights", path, len(missing),
        )


def _restore_position(trainer: Trainer, payload: dict[str, Any]) -> None:
    """Per-rank random state and the epoch's running metrics, where they still mean
    the same; the data position (global samples) means the same on any layout."""
    cfg, ctx, progress = trainer.config, trainer.ctx, trainer.progress
    saved = payload.get("config", {})
    same_layout = payload.get("world_size") == ctx.world_size and all(
        saved.get(k) == getattr(cfg, k) for k in LAYOUT
    )
    if same_layout:
        set_rng_state(payload["rng"][ctx.rank], ctx.device)
    meter = payload.get("epoch_meter") or None
    if meter and payload.get("task") == trainer.task.name:
        trainer.resumed_meter = meter
    if not progress.samples_in_epoch:
        return
    if trainer.data.iterable:
        why = _stream_cannot_continue(trainer, payload, same_layout)
        if why is None:
            trainer.train_batches.load_state_dict(payload["data_state"][ctx.rank])
            return
        log.warning("%s: the stream cannot start part-way, epoch %d restarts from its "
                    "beginning (each sample of it read once, as this run splits the stream)",
                    why, progress.epoch + 1)
        progress.samples_in_epoch = 0
        trainer.resumed_meter = None
    elif not same_layout:
        log.warning(
            "checkpoint was taken mid-epoch with another world size or batch layout: "
            "epoch %d continues at global sample %d",
            progress.epoch + 1, progress.samples_in_epoch,
        )


def _stream_cannot_continue(
    trainer: Trainer, payload: dict[str, Any], same_layout: bool
) -> str | None:
    """Why an iterable dataset's interrupted epoch cannot continue from the positions the
    checkpoint saved (the same on every rank: the stream, the config, the layout, the kind
    of position), or None when it can. A position is the stream's own (`--num_workers 0`)
    or each DataLoader worker's (torchdata's StatefulDataLoader); of a stream that shards
    itself, each (rank, worker)'s shard's, which only that reader reads again."""
    cfg, ctx, batches = trainer.config, trainer.ctx, trainer.train_batches
    saved = payload.get("config") or {}
    states = payload.get("data_state") or [None]
    if not batches.stateful:
        return getattr(batches, "no_position", None) or "the stream keeps no position"
    world = payload.get("world_size")
    if world != ctx.world_size:
        return (f"the checkpoint's stream positions are those of the shards of {world} ranks, "
                f"this run has {ctx.world_size} (each rank reads another share of the stream now)")
    if not same_layout:
        what = ", ".join(changed(saved, cfg.to_dict(), LAYOUT))
        return ("the checkpoint's stream positions were taken with another batch layout ("
                + (what or "--batch_size, --grad_accum_steps, --drop_last or --seed") + ")")
    workers = saved.get("num_workers", cfg.num_workers)
    if workers != cfg.num_workers:
        return (f"the checkpoint's stream positions were taken with --num_workers {workers}, "
                f"this run has {cfg.num_workers} (each worker reads another share now, and a "
                "DataLoader continues only the positions of as many workers)")
    fits = batches.fits if isinstance(batches, IterableBatches) else lambda state, rank: True
    if len(states) != ctx.world_size or not all(fits(s, r) for r, s in enumerate(states)):
        return "the checkpoint holds no stream position this run's DataLoader can take"
    return None


def _regroup(trainer: Trainer, payload: dict[str, Any], fresh: list[dict[str, Any]]) -> None:
    """Give each parameter group the run's settings again. The state loads by parameter
    name into whichever group a parameter is in now, so a checkpoint of another grouping
    (one group, from before biases and norms went without weight decay) continues too."""
    groups = trainer.optimizer.param_groups
    for group, settings in zip(groups, fresh, strict=True):
        group.update(settings)
    saved = (payload.get("optimizer_state_dict") or {}).get("param_groups")
    if saved is not None and len(saved) != len(groups):
        log.warning(
            "the checkpoint's optimizer has %d parameter group(s), this run %d: each "
            "parameter's state continues, in the group this run puts it in, with that "
            "group's settings", len(saved), len(groups),
        )


def _place_schedule(trainer: Trainer, applied: list[str], payload: dict[str, Any]) -> None:
    """Put the schedule where the data is: on another layout the step count means
    another thing, so the built-in schedule's position comes from epochs and global
    samples done. A user's scheduler continues from its own state."""
    cfg, progress = trainer.config, trainer.progress
    groups, sched = trainer.optimizer.param_groups, trainer.scheduler
    world_size, steps_per_epoch = trainer.ctx.data_world, trainer.steps_per_epoch
    if cfg.scheduler != "cosine":
        sched.load_state_dict(payload["scheduler_state_dict"])
        for group, lr in zip(groups, sched.get_last_lr(), strict=True):
            group["lr"] = lr
        if payload.get("world_size") != trainer.ctx.world_size:
            log.warning("--scheduler %s continues at its own step count (%d), taken on "
                        "another world size", cfg.scheduler, sched.last_epoch)
        return
    assert isinstance(sched, LambdaLR)
    micro = math.ceil(progress.samples_in_epoch / (world_size * cfg.batch_size))
    position = progress.epoch * steps_per_epoch + math.ceil(micro / cfg.grad_accum_steps)
    if not steps_per_epoch or trainer.data.iterable:
        position = progress.step  # no layout to place it by: the step count is all
    if position != progress.step:
        log.warning(
            "resumed on another layout (world size or batch): the schedule continues at "
            "step %d of %d, so it still ends at its planned end", position, trainer.total_steps,
        )
    # Each group's own peak: --lr (scaled) times its --lr_scale factor.
    sched.base_lrs = [g["initial_lr"] for g in groups]
    sched.last_epoch = position
    sched._last_lr = [
        base * fn(position) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)
    ]
    for group, lr in zip(groups, sched._last_lr, strict=True):
        group["lr"] = lr
    if applied:
        log.warning(
            "resume applies %s: the schedule is rebuilt for them and continues from its "
            "current step (no warm-up again)", ", ".join(applied),
        )
