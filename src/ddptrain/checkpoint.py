"""Checkpoints that are never half-written and always load back exactly.

Rank 0 writes a temporary file next to the target, fsyncs it and renames it into place
(`ddptrain.files`), so a crash leaves either the old file or the new one, never a torn
one; `latest.pt` (and `best.pt`) are independent copies of the newest (best) file.
Every rank passes a barrier after the write so none reads ahead of it.

The payload is plain tensors and containers: `torch.load(path, weights_only=True)` reads
it, and a file that would need pickled code to load is refused.
"""

from __future__ import annotations

import io
import logging
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ddptrain import __version__
from ddptrain.distributed import DistributedContext
from ddptrain.errors import EXIT_IO, ConfigError, TrainingStopped
from ddptrain.files import staged
from ddptrain.state import FORMAT, FORMAT_VERSION

log = logging.getLogger("ddptrain")

LATEST = "latest.pt"
BEST = "best.pt"  # the best epoch's state by the task's metric; never pruned
_NAME = re.compile(r"^step_(\d+)\.pt$")


class CheckpointError(ConfigError):
    """A checkpoint cannot be used; the message says which file and why."""


class CheckpointWriteError(TrainingStopped):
    """A checkpoint could not be written (disk full, quota, I/O error)."""

    exit_code = EXIT_IO


def checkpoint_name(step: int) -> str:
    return f"step_{step:09d}.pt"


# ---------------------------------------------------------------------- RNG state
def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random generators, as weights-only-loadable values."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(_as_tuple(state["python"]))
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, key.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def gather_to_main(value: Any, ctx: DistributedContext) -> list[Any] | None:
    """Every rank's `value` (plain data, CPU tensors), as a list on rank 0; None elsewhere."""
    if not ctx.distributed:
        return [value]
    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(value, out, dst=0)
    return out


def gather_rng_states(ctx: DistributedContext) -> list[dict[str, Any]] | None:
    """Every rank's RNG state, on rank 0 (None elsewhere)."""
    mine = rng_state(ctx.device)
    cpu_mine = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in mine.items()}
    return gather_to_main(cpu_mine, ctx)


# ---------------------------------------------------------------------- writing
def atomic_save(payload: dict[str, Any], path: Path, copies: tuple[Path, ...] = ()) -> None:
    """Write `payload` to `path` so that readers see the old file or the whole new one.

    `copies` (`latest.pt`, `best.pt`) are independent copies, each committed *before*
    the step file gets its own name: a crash in between leaves `latest.pt` holding the
    newest state, never pointing behind it, and damage to one file never reaches another.
    """
    # Serialized in memory first: torch's zip writer reports a full disk as a RuntimeError
    # about file positions, a plain write as the OSError (ENOSPC, EDQUOT) it is.
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    with staged(path) as tmp:
        with tmp.open("wb") as f:
            f.write(buffer.getbuffer())
        del buffer
        for copy in copies:
            with staged(copy) as other:
                shutil.copyfile(tmp, other)


def prune(directory: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step checkpoints (0 keeps all), and the
    temporary files of writers that were killed mid-write."""
    mine = f".{os.getpid()}.tmp"
    for stale in directory.glob(".*.tmp"):
        if not stale.name.endswith(mine):
            stale.unlink(missing_ok=True)
    if keep_last <= 0:
        return
    for old in list_checkpoints(directory)[keep_last:]:
        old.unlink(missing_ok=True)


def list_checkpoints(directory: Path) -> list[Path]:
    """Step checkpoints in `directory`, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def stamped(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with what wrote it: the format, its version, the library versions."""
    versions = {
        "ddptrain": __version__, "torch": str(torch.__version__),
        "python": sys.version.split()[0],
    }
    return {"format": FORMAT, "format_version": FORMAT_VERSION, **state, "versions": versions}


def save_checkpoint(
    directory: Path, step: int, state: dict[str, Any], ctx: DistributedContext, keep_last: int,
    best: bool = False,
) -> Path:
    """Collective: every rank calls it; rank 0 writes, then all learn whether it could.

    A failed write (a full disk, a quota, a vanished mount) leaves the previous checkpoint
    as it was, and every rank stops with the same line naming the path and the errno,
    instead of the other ranks blaming the network once rank 0 is gone."""
    path = directory / checkpoint_name(step)
    failure: OSError | None = None
    if ctx.is_main:
        payload = stamped(state)
        copies = (directory / LATEST, *((directory / BEST,) if best else ()))
        try:
            atomic_save(payload, path, copies)
            prune(directory, keep_last)
        except OSError as exc:
            failure = exc
    agree_on_write(failure, path, directory, ctx)
    return path


def agree_on_write(
    failure: BaseException | None, path: Path, directory: Path, ctx: DistributedContext,
    who: str = "rank 0",
) -> None:
    """Collective (also the barrier after a write): every rank learns whether any rank's
    write failed, and all stop with the same line naming the path and the errno."""
    code = 0
    if failure is not None:
        code = (getattr(failure, "errno", None) or -1) if isinstance(failure, OSError) else -1
    if ctx.distributed:
        status = torch.tensor([float(code)], device=ctx.device)  # NCCL reduces on the GPU
        dist.all_reduce(status, op=dist.ReduceOp.MAX)  # also the barrier: none reads ahead
        code = int(status.item())
    if not code:
        return
    if code > 0:
        reason = f"{os.strerror(code)} (errno {code})"
    elif failure is not None and not isinstance(failure, OSError):
        reason = _first_line(failure)
    else:
        reason = "an OS error"
    name = getattr(failure, "filename", None) if failure is not None else None
    where = repr(str(name or path))
    raise CheckpointWriteError(
        f"{who} could not write the checkpoint {where}: {reason}; the "
        f"previous checkpoint in {directory} is intact: free space or give another "
        "--checkpoint_dir, then resume with --resume_from auto"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


# ---------------------------------------------------------------------- reading
def load_checkpoint(path: Path, device: torch.device) -> dict[str, Any]:
    """Read a ddptrain checkpoint onto `device` (not onto GPU 0), or say why it can't be.
    For a DCP step directory that is its `meta.pt`: everything but the sharded weights
    and optimizer state, which `checkpoint_dcp.load_sharded` reads."""
    if path.is_dir():
        from ddptrain.checkpoint_dcp import META, is_whole

        if not is_whole(path):
            raise CheckpointError(
                f"checkpoint {str(path)!r} is not a whole DCP step directory (its save did "
                "not finish): give a step_XXXXXXXXX directory, or --resume_from auto"
            )
        return load_checkpoint(path / META, device)
    try:
        payload = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist") from None
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            reason = "it holds pickled Python objects, which are refused (they could run code)"
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read: {reason}; "
            "give a file written by ddptrain (or --resume_from auto)"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a ddptrain checkpoint: "
            "give a file written by ddptrain"
        )
    if payload.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {payload['format_version']}, newer "
            f"than this ddptrain reads ({FORMAT_VERSION}): upgrade ddptrain"
        )
    return payload


def check_model_state(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse weights that do not fit `model` strictly, naming every missing, unexpected
    or mis-shaped entry."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if state[k].shape != own[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected {_few(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch (checkpoint vs model) {_few(shapes)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit this model: {'; '.join(problems)}; "
            "resume with the same --model, --width and dataset it was trained with"
        )


def _few(items: list[str], n: int = 4) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def find_resumable(directory: Path, device: torch.device) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in `directory` that loads: `latest.pt`, the newest whole step
    file or the newest whole DCP step directory, whichever is furthest on. Corrupt ones
    are skipped with a warning. None when there is none (a fresh start)."""
    from ddptrain.checkpoint_dcp import list_step_dirs

    best: tuple[Path, dict[str, Any]] | None = None
    kinds = ([directory / LATEST], list_checkpoints(directory), list_step_dirs(directory))
    for candidates in kinds:
        for path in candidates:
            if not path.exists():
                continue
            named = re.search(r"step_(\d+)", path.name)
            if best is not None and named and int(named.group(1)) <= best[1]["step"]:
                break  # not further on than one already read: no need to load it
            try:
                payload = load_checkpoint(path, device)
            except CheckpointError as exc:
                log.warning("skipping unusable checkpoint: %s", exc)
                continue
            if best is None or payload["step"] > best[1]["step"]:
                best = (path, payload)
            break  # newest first: the first whole one is the newest of its kind
    return best


def locate_resume(
    source: str | None, directory: Path, ctx: DistributedContext
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a run resumes from (`--resume_from PATH | auto`), or None.

    Collective: rank 0 decides and every rank loads what it chose, so ranks that see the
    job differently (a node that joined an elastic job, a checkpoint written meanwhile)
    never start from different states; an unusable checkpoint is the same error on all."""
    choice: list[Any] = [None, None]
    found: tuple[Path, dict[str, Any]] | None = None
    if ctx.is_main:
        try:
            found = _locate(source, directory, ctx.device)
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
    source: str | None, directory: Path, device: torch.device
) -> tuple[Path, dict[str, Any]] | None:
    if source is None:
        return None
    if source != "auto":
        return Path(source), load_checkpoint(Path(source), device)
    found = find_resumable(directory, device)
    if found is None:
        log.info("no checkpoint in %s: starting fresh", directory)
    return found


def export_safetensors_state(state: dict[str, torch.Tensor], out: Path) -> int:
    """Write model weights to a safetensors file atomically; returns the tensor count.

    Tied weights (one tensor under two names, like a language model's embedding and
    output head) are stored once, under the name safetensors' own helper keeps; load the
    file with `safetensors.torch.load_model(model, path)`, which restores the tie, or with
    `model.load_state_dict(load_file(path), strict=False)`.
    """
    from safetensors.torch import _remove_duplicate_names, save_file

    # A tensor that is a view into a bigger buffer (FSDP's gathered state) is copied out:
    # safetensors stores whole storages only.
    owned: dict[int, torch.Tensor] = {}  # one copy per tensor: tied names stay tied
    weights = {k: owned.setdefault(id(v), _own_storage(v.detach())) for k, v in state.items()}
    shared = _remove_duplicate_names(weights)  # {kept name: [aliases of the same tensor]}
    aliases = {alias: name for name, names in shared.items() for alias in names}
    tensors = {k: v.cpu().contiguous() for k, v in weights.items() if k not in aliases}
    metadata = {"format": "pt", **{f"tied:{a}": n for a, n in aliases.items()}}
    with staged(out) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return len(tensors)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def export_safetensors(checkpoint: Path, out: Path) -> int:
    """`ddptrain export`: the whole model of a checkpoint (a `.pt` file or a DCP step
    directory of any world size), for inference."""
    if checkpoint.is_dir():
        from ddptrain.checkpoint_dcp import model_state_from_dir

        load_checkpoint(checkpoint, torch.device("cpu"))  # whole, and written by ddptrain
        return export_safetensors_state(model_state_from_dir(checkpoint), out)
    payload = load_checkpoint(checkpoint, torch.device("cpu"))
    return export_safetensors_state(payload["model_state_dict"], out)
