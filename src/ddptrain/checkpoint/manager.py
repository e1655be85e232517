"""Where a resume starts and how a checkpoint of either kind is read.

`find_resumable` picks the furthest whole checkpoint of a directory (`latest.pt`, step
files, DCP step directories), skipping torn and damaged ones (checksums) with a warning;
`locate_resume` lets rank 0 decide for every rank, and every rank checks its share of a
step directory's shards before any is loaded; `Checkpointer` is the one interface the
trainer uses to save, wait for and load a checkpoint, whichever backend writes it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ddptrain.checkpoint.common import (
    CheckpointError,
    check_model_state,
    damaged,
    forget_reads,
    link_or_copy,
    read_payload,
    saving_group,
)
from ddptrain.checkpoint.dcp import (
    LATEST_DIR,
    ShardedCheckpointer,
    follow_pointer,
    list_step_dirs,
    load_sharded,
    read_meta,
    shards_damage,
)
from ddptrain.checkpoint.kind import CheckpointKind, resolve_checkpoint
from ddptrain.checkpoint.pt import LATEST, list_checkpoints, save_checkpoint
from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.files import atomic_write_text, remove, staged

if TYPE_CHECKING:
    from ddptrain.parallel import Strategy

log = logging.getLogger("ddptrain")
# Where the EMA weights sit: a step directory's key, a `.pt` file's (whole tensors).
EMA_KEY = "ema"
EMA_FILE_KEY = "ema_state_dict"


def load_checkpoint(path: Path, device: torch.device, verify: bool = False) -> dict[str, Any]:
    """Read a ddptrain checkpoint onto `device`, or say why it can't be. For a DCP step
    directory that is its `meta.pt`: everything but the sharded weights and optimizer
    state, which `Checkpointer.load` reads into the model's shards (`shards_damage` checks
    them). `verify`: check a file's tensors against their checksums first."""
    if resolve_checkpoint(path).kind is CheckpointKind.DCP:
        return read_meta(path, device)
    return read_payload(path, device, verify)


def load_named(
    path: Path, device: torch.device, verify: bool = False
) -> tuple[Path, dict[str, Any]]:
    """The checkpoint a user named (`--resume_from PATH`): a DCP run's `latest` or
    `best` is the step directory it names (`follow_pointer`), then read as
    `load_checkpoint` reads it."""
    path = follow_pointer(path)
    return path, load_checkpoint(path, device, verify)


def find_resumable(
    directory: Path, device: torch.device, verify: bool = False, skip: Sequence[Path] = (),
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in `directory` that loads: `latest.pt`, the newest whole step
    file or the newest whole DCP step directory, whichever is furthest on. Torn ones, and
    with `verify` files whose tensors fail their checksums, are skipped with a warning, as
    are the paths in `skip`. None when there is none (a fresh start)."""
    best: tuple[Path, dict[str, Any]] | None = None
    # A step directory missing a file is damaged (it was renamed into place whole): its
    # warning says so, like any other damage.
    kinds = ([directory / LATEST], list_checkpoints(directory),
             list_step_dirs(directory, whole=False))
    skip = list(skip)  # and the files refused, whatever other name they have (latest.pt)
    for candidates in kinds:
        for path in candidates:
            if not path.exists() or _same_file(path, skip):
                continue
            named = re.search(r"step_(\d+)", path.name)
            if best is not None and named and int(named.group(1)) <= best[1]["step"]:
                break  # not further on than one already read: no need to load it
            try:
                payload = load_checkpoint(path, device, verify)
            except CheckpointError as exc:
                skipping(exc)
                skip.append(path)
                continue
            if best is None or payload["step"] > best[1]["step"]:
                best = (path, payload)
            break  # newest first: the first whole one is the newest of its kind
    return best


def newest_before(directory: Path, step: int) -> Path | None:
    """The newest whole step checkpoint in `directory` (a file or a DCP step directory)
    taken before optimizer step `step`; None when there is none."""
    found = [(_step_of(p), p) for p in (*list_checkpoints(directory), *list_step_dirs(directory))]
    return max((f for f in found if f[0] < step), default=(0, None))[1]


def discard_from(directory: Path, step: int, kept: Path) -> None:
    """Delete the step checkpoints of optimizer step `step` and later (a rolled-back loss
    spike is in them); `latest` names `kept` again. `best` stays what it was."""
    for path in (*list_checkpoints(directory), *list_step_dirs(directory, whole=False)):
        if _step_of(path) >= step:
            remove(path)
    if resolve_checkpoint(kept).kind is CheckpointKind.DCP:
        atomic_write_text(directory / LATEST_DIR, kept.name + "\n")
        return
    with staged(directory / LATEST) as other:
        link_or_copy(kept, other)


def _step_of(path: Path) -> int:
    return int(re.findall(r"step_(\d+)", path.name)[0])


def skipping(error: CheckpointError) -> None:
    """Warn of an unusable checkpoint once per start, however often it is looked for
    (the run directory's claim and the resume each look); `Checkpointer.load` forgets."""
    if str(error) not in _skipped:
        _skipped.add(str(error))
        log.warning("skipping unusable checkpoint: %s", error)


_skipped: set[str] = set()


def whole_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole copies in host memory of tensors that may be DTensor shards (collective when
    they are: every rank gathers each, in the same order)."""
    out = {}
    for name, t in state.items():
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = whole.detach().cpu().clone()
    return out


def buffers_apart(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """`state` with the tensors that are `module`'s buffers cloned (on their device). A
    forward changes buffers in place (batch norm's statistics) while a save staged in
    the background may still be copying them; the weights change only at a step, which
    waits for the copy (`settle`)."""
    held = {
        (b.to_local() if isinstance(b, DTensor) else b).data_ptr() for b in module.buffers()
    }

    def apart(t: Any) -> Any:
        local = t.to_local() if isinstance(t, DTensor) else t
        if isinstance(local, torch.Tensor) and local.numel() and local.data_ptr() in held:
            return t.clone()
        return t

    return {k: apart(v) for k, v in state.items()}


def _same_file(path: Path, others: Sequence[Path]) -> bool:
    return any(path == other or (other.exists() and path.samefile(other)) for other in others)


def locate_resume(
    source: str | None, directory: Path, ctx: DistributedContext,
    skip: Sequence[Path] = (), checked_in_load: bool = False,
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a run resumes from (`--resume_from PATH | auto`), checked, or None;
    never one of `skip`.

    Collective: rank 0 decides and every rank loads what it chose, so ranks that see the
    job differently (a node that joined an elastic job, a checkpoint written meanwhile)
    never start from different states; an unusable checkpoint is the same error on all.
    Rank 0 checks a file's checksums as it locates it; a step directory's shards are
    checked by every rank, its share, unless `checked_in_load` and the directory has the
    checksums of its entries (the load checks each as it reads it: `Checkpointer.load`).
    A damaged newest checkpoint is skipped with a warning under `auto` (the previous
    whole one is used); a damaged path is refused."""
    skip = list(skip)
    while True:
        found = _agree_on(source, directory, ctx, skip)
        if found is None or resolve_checkpoint(found[0]).kind is not CheckpointKind.DCP:
            return found
        if checked_in_load and found[1].get("items"):
            return found
        damage = shards_damage(found[0], found[1], ctx)
        if damage is None:
            return found
        error = damaged(found[0], damage)
        if source != "auto":
            raise error
        skipping(error)
        skip.append(found[0])


def _agree_on(
    source: str | None, directory: Path, ctx: DistributedContext, skip: list[Path]
) -> tuple[Path, dict[str, Any]] | None:
    choice: list[Any] = [None, None]
    found: tuple[Path, dict[str, Any]] | None = None
    if ctx.is_main:
        try:
            found = _locate(source, directory, ctx.device, skip)
            choice[0] = str(found[0]) if found else None
        except CheckpointError as exc:
            choice[1] = str(exc)
    if ctx.distributed:
        dist.broadcast_object_list(choice, src=0)
    if choice[1] is not None:
        raise CheckpointError(choice[1])
    if not ctx.is_main and choice[0] is not None:
        found = Path(choice[0]), load_checkpoint(Path(choice[0]), ctx.device)
    return found


def _locate(
    source: str | None, directory: Path, device: torch.device, skip: list[Path]
) -> tuple[Path, dict[str, Any]] | None:
    if source is None:
        return None
    if source != "auto":
        return load_named(Path(source), device, verify=True)
    found = find_resumable(directory, device, verify=True, skip=skip)
    if found is None:
        log.info("no checkpoint in %s: starting fresh", directory)
    return found


class Checkpointer:
    """The one checkpoint interface of a run: save, wait for a save in flight, find where
    a resume starts, load it. Collective, every method. Behind it a `.pt` file (rank 0
    writes the whole state, `checkpoint.pt`) or a DCP step directory (every rank writes its
    shard, `checkpoint.dcp`), by the strategy's checkpoint kind; a resume reads either."""

    def __init__(
        self, config: TrainingConfig, ctx: DistributedContext, strategy: Strategy,
        kind: CheckpointKind | str,
    ) -> None:
        self.directory, self.ctx, self.strategy = config.ckpt_dir, ctx, strategy
        self.keep_last = config.keep_last
        # Ranks wait for a write on a group of its own, with its own timeout: a slow
        # filesystem is told apart from a lost peer (`--timeout_s` on the main group).
        self.group = saving_group(ctx, config.checkpoint_timeout_s, config.timeout_s)
        self.sharded = (
            ShardedCheckpointer(
                config.ckpt_dir, ctx, config.keep_last, config.async_checkpoint, self.group
            )
            if kind == CheckpointKind.DCP else None
        )

    @property
    def background(self) -> bool:
        """Whether saves are written while training goes on."""
        return self.sharded is not None and self.sharded.background

    @property
    def blocking_s(self) -> list[float]:
        """How long each save held training up (DCP saves)."""
        return self.sharded.blocking_s if self.sharded is not None else []

    def save(
        self, step: int, meta: dict[str, Any], module: nn.Module,
        optimizer: torch.optim.Optimizer, best: bool = False,
        averages: dict[str, torch.Tensor] | None = None,
    ) -> Path:
        """Write `meta` (progress, RNG, schedule: plain values) with the model's and the
        optimizer's state, and `averages` (the EMA weights, held like the weights) when
        given; returns the checkpoint's path."""
        if self.sharded is not None:
            model, optim = self.strategy.sharded_state(module, optimizer)
            if self.sharded.async_staging:
                model = buffers_apart(model, module)
            state = {"model": model, "optim": optim}
            if averages is not None:
                state[EMA_KEY] = averages  # DTensor shards: each rank writes its own
            return self.sharded.save(step, meta, state, best)
        model, optim = self.strategy.full_state(module, optimizer)
        state = {**meta, "model_state_dict": model, "optimizer_state_dict": optim}
        if averages is not None:
            state[EMA_FILE_KEY] = whole_tensors(averages)
        return save_checkpoint(
            self.directory, step, state, self.ctx, self.keep_last, best=best, group=self.group
        )

    def settle(self) -> None:
        """Wait until the save in flight has copied the state it saves (not until it is
        written): before the weights change in place. A no-op unless a GPU run's
        background save is still copying (`ShardedCheckpointer.settle`)."""
        if self.sharded is not None:
            self.sharded.settle()

    def wait(self) -> None:
        """Finish the save in flight, if any."""
        if self.sharded is not None:
            self.sharded.wait()

    def close(self) -> None:
        """Finish the save in flight and free what saves keep between them."""
        if self.sharded is not None:
            self.sharded.close()

    def locate(
        self, source: str | None, skip: Sequence[Path] = (), checked_in_load: bool = False
    ) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint `--resume_from` names (a path, or `auto`), as rank 0 chose it,
        other than `skip`; `checked_in_load`: a step directory's entries are left to
        `load` to check, as it reads them (`locate_resume`)."""
        return locate_resume(source, self.directory, self.ctx, skip, checked_in_load)

    def load(
        self, path: Path, payload: dict[str, Any], module: nn.Module,
        optimizer: torch.optim.Optimizer, averages: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Load a located checkpoint's weights and optimizer state, whichever strategy and
        world size wrote it: DCP reshards a step directory, a whole state is loaded as it is.
        `averages`: the EMA tensors a step directory's are loaded into, in place (a `.pt`
        file holds them whole under `EMA_FILE_KEY`). The files read are let go afterwards
        (`forget_reads`)."""
        if resolve_checkpoint(path).kind is CheckpointKind.DCP:
            model, optim = self.strategy.sharded_state(module, optimizer)
            state: dict[str, Any] = {"model": model, "optim": optim}
            if averages is not None:
                state[EMA_KEY] = averages
            load_sharded(path, state, payload)
            self.strategy.load_state(module, optimizer, state["model"], state["optim"], full=False)
        else:
            check_model_state(module, payload["model_state_dict"], path)
            self.strategy.load_state(
                module, optimizer, payload["model_state_dict"], payload["optimizer_state_dict"],
                full=True,
            )
        forget_reads()
        _skipped.clear()
