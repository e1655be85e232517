"""Ranks as threads of the test's own process: torch's threaded process group
(`torch.testing._internal.distributed.multi_threaded_pg`, which torch's own tests use),
for the fast tier's checks of collective logic (all-to-all, all-reduce, DTensor, DDP's
reducer) without starting a process. Each thread sees its own default group, as a rank
does; collectives meet between the threads. Not for what needs gloo's own behaviour
(send/recv, timeouts, a lost peer, the flight recorder): those stay in the slow tier."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed import multi_threaded_pg as threaded_pg

__all__ = ["threaded_ranks"]

_ONE_AT_A_TIME = threading.Lock()  # the threaded world is the process's: one group at a time


def threaded_ranks(world_size: int, fn: Callable[..., Any], *args: Any,
                   timeout_s: float = 120.0) -> list[Any]:
    """`fn(rank, *args)` on `world_size` threads, each the rank of one default process
    group (backend "threaded"); their results by rank. The first rank's exception is
    raised here (the others' collectives are woken and fail too); a rank still running
    after `timeout_s` is a TimeoutError. The process's distributed state is as it was
    afterwards."""
    with _ONE_AT_A_TIME:
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        threaded_pg._install_threaded_pg()
        store = dist.HashStore()
        results: list[Any] = [None] * world_size
        errors: list[tuple[int, BaseException]] = []

        def rank_main(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size,
                                        store=store)
                results[rank] = fn(rank, *args)
            except BaseException as exc:  # handed to the caller
                errors.append((rank, exc))
                threaded_pg.ProcessLocalGroup.exception_handle(exc)  # wake the other ranks
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()

        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True,
                                    name=f"threaded-rank{r}") for r in range(world_size)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout_s)
            stuck = [t.name for t in threads if t.is_alive()]
        finally:
            threaded_pg.ProcessLocalGroup.reset()
            threaded_pg._uninstall_threaded_pg()
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:  # the first rank's to fail (it wakes the others before they add theirs)
        raise errors[0][1]
    if stuck:
        raise TimeoutError(f"{', '.join(stuck)} still running after {timeout_s} s")
    return results
