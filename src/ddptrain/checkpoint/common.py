"""What both checkpoint backends share: the stamp, atomic files, agreeing on a write, and
reading a file back weights-only.

A file is written to a temporary name next to the target, fsynced and renamed into place
(`ddptrain.files`), so a crash leaves either the old file or the new one, never a torn
one. Every rank learns whether a write failed (`agree_on_write`), so all stop with the
same line. The payload is plain tensors and containers: `torch.load(path,
weights_only=True)` reads it, and a file that would need pickled code to load is refused.
The stamp carries a checksum of every tensor (`integrity`), checked before a resume
trusts the file.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain import __version__
from ddptrain.checkpoint.integrity import checksums, payload_damage
from ddptrain.checkpoint.schema import FORMAT, FORMAT_VERSION
from ddptrain.context import DistributedContext
from ddptrain.errors import EXIT_IO, ConfigError, TrainingStopped, few
from ddptrain.files import refuse_special, staged
from ddptrain.parallel.base import to_cpu

log = logging.getLogger("ddptrain")

class CheckpointError(ConfigError):
    """A checkpoint cannot be used; the message says which file and why."""


class CheckpointWriteError(TrainingStopped):
    """A checkpoint could not be written (disk full, quota, I/O error, a stuck write)."""

    exit_code = EXIT_IO


@dataclass(frozen=True)
class SaveGroup:
    """The gloo group ranks wait on for a checkpoint write, how long they wait for a
    write (`--checkpoint_timeout_s`), and how long a rank that wrote alone waits for the
    others, which had nothing to write (`--timeout_s`, as for any peer)."""

    group: Any
    timeout_s: float
    peer_timeout_s: float


def saving_group(
    ctx: DistributedContext, timeout_s: float, peer_timeout_s: float
) -> SaveGroup | None:
    """Collective: the group of `SaveGroup`; None on one process."""
    if not ctx.distributed:
        return None
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return SaveGroup(group, timeout_s, peer_timeout_s)


# ---------------------------------------------------------------------- writing
def atomic_save(payload: dict[str, Any], path: Path, links: tuple[Path, ...] = ()) -> None:
    """Write `payload` to `path` so that readers see the old file or the whole new one.

    `links` (`latest.pt`, `best.pt`) are more names for the same bytes (hard links: the
    state is written once), each committed *before* the step file gets its own name: a
    crash in between leaves `latest.pt` holding the newest state, never pointing behind
    it. Damage to those bytes reaches every name, and the checksums catch it on resume.
    A filesystem without hard links gets copies, with one warning.
    """
    with staged(path) as tmp:
        # Streamed to the file: no second copy of the state in memory. torch's zip writer
        # reports a failed write (a full disk) as a RuntimeError about file positions; the
        # sink keeps the OSError (ENOSPC, EDQUOT), which is raised as it is.
        with tmp.open("wb") as f, _without_zip_crcs():
            sink = _Sink(f)
            try:
                torch.save(payload, sink)  # type: ignore[arg-type]  # write and flush suffice
            except RuntimeError:
                if sink.error is not None:
                    raise sink.error from None
                raise
        for name in links:
            with staged(name) as other:
                link_or_copy(tmp, other)


_zip_crcs_lock = threading.Lock()


@contextmanager
def _without_zip_crcs() -> Iterator[None]:
    """torch's zip writer would sum every record again, with a CRC-32 slower than zlib's
    (as long as the write itself): the payload's checksums guard the same bytes. The
    option is torch's global: a background save and the main thread take turns."""
    with _zip_crcs_lock:
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(before)


class _Sink:
    """A file torch.save writes through, keeping the OSError of a failed write."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.file.write(data))
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


_warned_copies: list[bool] = []


def link_or_copy(source: Path, target: Path) -> None:
    """`target` another name of `source` (a copy where links are refused); `target` is a
    temporary name of the caller's, replaced whatever it holds (a link there not followed)."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
        return
    except OSError as exc:
        if not _warned_copies:
            _warned_copies.append(True)
            log.warning(
                "the checkpoint directory refuses hard links (%s): latest.pt and best.pt "
                "are written as copies", exc.strerror,
            )
    shutil.copyfile(source, target)


def stamped(state: dict[str, Any]) -> dict[str, Any]:
    """`state` on the CPU with what wrote it (the format, its version, the library
    versions) and the checksums of every tensor and of all the rest."""
    versions = {
        "ddptrain": __version__, "torch": str(torch.__version__),
        "python": sys.version.split()[0],
    }
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, **to_cpu(state),
            "versions": versions}
    return {**body, "checksums": checksums(body)}


def agree_on_write(
    failure: BaseException | None, path: Path, directory: Path, ctx: DistributedContext,
    who: str = "rank 0", group: SaveGroup | None = None, wrote_alone: bool = False,
) -> None:
    """Collective (also the barrier after a write): every rank learns whether any rank's
    write failed, and all stop with the same line naming the path and the errno.

    On `group` (`saving_group`, gloo) the wait has the checkpoint's own timeout, and a
    write that outlasts it is its own line (exit 74), not "a peer died". The rank that
    `wrote_alone` waits only for ranks that had nothing to write: one that does not come
    within --timeout_s hung or died, and this rank says so (exit 3) then, not after the
    checkpoint's timeout."""
    code = 0
    if failure is not None:
        code = (getattr(failure, "errno", None) or -1) if isinstance(failure, OSError) else -1
    if ctx.distributed:
        # gloo reduces on the CPU; NCCL (no group given) on the GPU
        status = torch.tensor([float(code)], device="cpu" if group else ctx.device)
        try:  # also the barrier: none reads ahead
            if group is None:
                dist.all_reduce(status, op=dist.ReduceOp.MAX)
            else:
                opts = dist.AllreduceOptions()
                opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)
                if wrote_alone:  # gloo's own per-operation timeout: nothing is left pending
                    opts.timeout = timedelta(seconds=group.peer_timeout_s)
                group.group.allreduce([status], opts).wait()
        except Exception as exc:
            if group is None or wrote_alone or not timed_out(exc):
                raise
            raise CheckpointWriteError(
                f"{who} did not finish writing the checkpoint {str(path)!r} within "
                f"--checkpoint_timeout_s {group.timeout_s:g}: the storage is slow or stuck "
                "(its rank is still connected); the previous checkpoint is intact: check the "
                "filesystem or raise --checkpoint_timeout_s, then resume with "
                "--resume_from auto"
            ) from None
        code = int(status.item())
    if not code:
        return
    if code > 0:
        reason = f"{os.strerror(code)} (errno {code})"
    elif failure is not None and not isinstance(failure, OSError):
        reason = first_line(failure)
    else:
        reason = "an OS error"
    name = getattr(failure, "filename", None) if failure is not None else None
    where = repr(str(name or path))
    raise CheckpointWriteError(
        f"{who} could not write the checkpoint {where}: {reason}; the "
        f"previous checkpoint in {directory} is intact: free space or give another "
        "--checkpoint_dir, then resume with --resume_from auto"
    )


def timed_out(exc: BaseException) -> bool:
    """Whether a failed collective gave up waiting (rather than lost its peer)."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


# Payloads read in this process, by file identity: a resume reads a checkpoint once even
# when the finished-run check, the locating rank and the load all ask for it. They are
# memory-mapped, so holding one costs no memory; `forget_reads` lets the files go (a
# pruned file's blocks are freed only once no map holds them).
_reads: dict[tuple[int, ...], dict[str, Any]] = {}
_verified: set[tuple[int, ...]] = set()
_KEEP_READS = 4


def forget_reads() -> None:
    """Drop the payloads kept by `read_payload`."""
    _reads.clear()
    _verified.clear()


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's bytes do not match the checksums written with them."""


def damaged(path: Path, damage: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(
        f"checkpoint {str(path)!r} is damaged: {damage}; give another checkpoint, or "
        "--resume_from auto (which skips damaged ones)"
    )


def read_payload(path: Path, device: torch.device, verify: bool = False) -> dict[str, Any]:
    """Read a checkpoint file written by ddptrain, weights only: a file that would need
    pickled code to load is refused. With `verify`, every tensor is checked against the
    checksum written with it first, and a damaged file is refused.

    The tensors are memory-mapped from the file, on the CPU whatever `device` is: reading
    the progress of a checkpoint (where a resume starts, whether a run finished) costs
    its metadata, not its gigabytes, and loading the weights into the model copies each
    byte once from the page cache onto the model's device, never through a second whole
    copy in host or GPU memory. A file is read once per process (`forget_reads`)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist") from None
    refuse_special(path, "checkpoint")
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    payload = _reads.get(key)
    if payload is None:
        payload = _read(path)
        while len(_reads) >= _KEEP_READS:
            _reads.pop(next(iter(_reads)))
        _reads[key] = payload
    if verify and key not in _verified:
        damage = payload_damage(payload)
        if damage is not None:
            raise damaged(path, damage)
        _verified.add(key)
    return payload


def _read(path: Path) -> dict[str, Any]:
    try:
        zipped = zipfile.is_zipfile(path)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: {exc.strerror}") from None
    if not zipped:  # ddptrain writes torch's zip format only: nothing else is unpickled
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read: it is not a torch zip file (a "
            "truncated or foreign file; a bare pickle is never loaded, it could run code); "
            "give a file written by ddptrain (or --resume_from auto)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
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
        problems.append(f"missing {few(missing)}")
    if unexpected:
        problems.append(f"unexpected {few(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch (checkpoint vs model) {few(shapes)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit this model: {'; '.join(problems)}; "
            "resume with the same --model, --width and dataset it was trained with"
        )
