"""torch's errors that end a run, as ddptrain's own exceptions carrying the one line the
command line prints (`ddptrain: error: LINE`), so that `ddptrain.fit` raises what the
command line says:

| torch raises | ddptrain raises | exit code |
| --- | --- | --- |
| DDP's reducer: parameters left out of the loss | `UnusedParameters` (a `ConfigError`) | 2 |
| a DataLoader worker died | `WorkerLost` | 71 |
| a DataLoader worker raised (a stream's `__iter__`, a collate) | `ConfigError` | 2 |
| a collective or the store failed | `PeerLost`, naming the rank(s) that did not reach it | 3 |

Out of memory is raised as `observe.oom.OutOfMemory` where the trainer catches it: its
line needs the trainer (the model's state, the knobs).

    with own_errors():  # around `fit`'s run, and the command line's commands
        ...
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path

from ddptrain.errors import (
    EXIT_WORKER_LOST,
    ConfigError,
    PeerLost,
    TrainingStopped,
    UnusedParameters,
    WorkerLost,
)


@contextlib.contextmanager
def own_errors(tell: Callable[[PeerLost], None] | None = None) -> Iterator[None]:
    """A torch error that ends a run raised in the block, raised as ddptrain's exception
    (`own_error`) with torch's as its cause; any other error as it is. `tell` (the command
    line's, around a command) says a lost peer's line, where it is found, while SIGTERM and
    SIGINT wait: torchrun stops the other ranks as the first one ends. A run's position
    (`observe.hang.POSITION`) starts empty here: an earlier run's in this process (a
    second `fit`, an `evaluate` after it) is never where this one's hang record goes."""
    if (hang := sys.modules.get("ddptrain.observe.hang")) is not None:  # not loaded: unset
        hang.POSITION.update(run_dir=None, progress=None)
    token = _TELL.set(tell) if tell is not None else None
    try:
        yield
    except Exception as exc:
        own = own_error(exc)
        if own is None:
            raise
        raise own from exc
    finally:
        if token is not None:
            _TELL.reset(token)


_TELL: ContextVar[Callable[[PeerLost], None] | None] = ContextVar("ddptrain_tell", default=None)


def own_error(exc: BaseException) -> Exception | None:
    """ddptrain's exception for a torch error that ends a run, with its line; None for
    ddptrain's own errors and any other."""
    if isinstance(exc, ConfigError | TrainingStopped) or "torch" not in sys.modules:
        return None
    from ddptrain.data.loader import worker_failure
    from ddptrain.launch.process_group import lost_peer
    from ddptrain.parallel.ddp import reducer_advice

    unused = reducer_advice(exc)
    if unused is not None:
        return UnusedParameters(unused)
    worker = worker_failure(exc)
    if worker is not None:
        line, code = worker
        return WorkerLost(line) if code == EXIT_WORKER_LOST else ConfigError(line)
    if lost_peer(exc):
        return _peer_lost(exc)
    return None


def _peer_lost(exc: BaseException) -> PeerLost:
    from ddptrain.launch.signals import signals_deferred

    found_at = time.monotonic()
    with signals_deferred():  # torchrun stops the other workers as the first one ends
        culprit = who_stopped(exc)
        why = culprit or "a peer died, hung longer than --timeout_s, or the network failed"
        lost = PeerLost(f"lost contact with the other ranks ({first_line(exc)}): {why}; "
                        "restart the job with --resume_from auto", found_at=found_at)
        tell = _TELL.get()
        if tell is not None:
            tell(lost)
            lost.told = True
    return lost


def who_stopped(exc: BaseException) -> str | None:
    """This rank's record of the collective that broke, and, from its peers' records,
    which rank(s) did not reach it (`observe.hang`); None without a run directory."""
    from ddptrain.observe.hang import POSITION, culprit_line, write_record

    rank, world = _rank_and_world()
    if write_record(exc, rank, world) is None:
        return None
    return culprit_line(Path(POSITION["run_dir"]), world, rank)


def first_line(exc: BaseException) -> str:
    """The first line of torch's message, without its C++ source location or its advice."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)  # drop the C++ source location
    return text.split(". This is typically")[0][:200]


def _rank_and_world() -> tuple[int, int]:
    """This process's rank (0 unknown) and the world size, as the launcher set them."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    world = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    return int(rank) if rank.isdigit() else 0, int(world)
