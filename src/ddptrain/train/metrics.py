"""Global metrics: sums kept on the device, all-reduced only when read.

Each rank adds the task's sums (summed loss, its count, metric sums) into one float64
tensor; reading it all-reduces that tensor once, so the global loss is the mean over every
sample or token of every rank (not a mean of per-rank means) and the hot loop never waits
for the host.
"""

from __future__ import annotations

import bisect
import logging
import resource
import socket
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddptrain.context import DistributedContext
from ddptrain.train.tasks import Score, Task

if TYPE_CHECKING:
    from ddptrain.train.routing import Routing

log = logging.getLogger("ddptrain")


class MetricSums:
    """Running sums of one split: the summed loss, its count, the task's metric sums and
    the number of samples.

    Micro-batches add into a pending window; at the optimizer step it is set aside
    (`hold`) and folded into the totals once the step is known to be good (`fold`: a
    skipped, non-finite step is dropped, so one bad batch does not turn every later
    figure into NaN). An update is one small in-place add
    and no host sync; counts known on the host (samples) stay Python ints.
    """

    def __init__(self, task: Task, device: torch.device, routing: Routing | None = None) -> None:
        self.task, self.routing = task, routing  # routing: a mixture of experts' figures
        self.names = ("loss", "count", *task.metric_names, *(routing.names if routing else ()))
        zero = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        # committed, the pending window, a window set aside until its step's verdict
        self._sums, self._win, self._held = zero.clone(), zero.clone(), zero.clone()
        self._zero = zero[0]
        self._count = self._samples = 0  # host-side counts, committed
        self._win_count = self._win_samples = 0  # ... pending
        self._held_count = self._held_samples = 0  # ... set aside

    def update(self, score: Score) -> None:
        """Add a scored batch: its summed loss, the count it sums over (int or tensor),
        its metric sums and its number of samples."""
        count = score.count
        if isinstance(count, int):
            self._win_count += count
            count = self._zero
        parts = [score.loss_sum.detach(), count, *(score.metrics[n] for n in self.names[2:])]
        try:  # one stack and one add into the float64 sums: this runs every micro-batch
            self._win.add_(torch.stack(parts))
        except RuntimeError:  # a task's sums of shape (1,) rather than 0-d
            self._win.add_(torch.cat([p.reshape(1).to(torch.float64) for p in parts]))
        self._win_samples += score.samples

    def window_count(self) -> torch.Tensor:
        """The pending window's count on this rank, as a float64 tensor (to all-reduce)."""
        return self._win[1:2] + self._win_count

    def commit(self) -> None:
        """Fold the pending window into the totals, and start a new one."""
        self.hold()
        self.fold(keep=True)

    def hold(self) -> None:
        """Set the pending window aside (its step's verdict is not known yet: `fold`),
        and start a new one."""
        self._win, self._held = self._held, self._win
        self._win.zero_()
        self._held_count, self._held_samples = self._win_count, self._win_samples
        self._win_count = self._win_samples = 0

    def fold(self, keep: bool) -> None:
        """Fold the window set aside into the totals, or drop it (a skipped step)."""
        if keep:
            self._sums.add_(self._held)
            self._count += self._held_count
            self._samples += self._held_samples
        self._held.zero_()
        self._held_count = self._held_samples = 0

    def snapshot(self) -> torch.Tensor:
        """This rank's committed totals as one float64 tensor, to all-reduce later (with
        `reduce_snapshots`): the device sums, then the host-side count and samples."""
        host = self._sums.new_tensor([float(self._count), float(self._samples)])
        return torch.cat([self._sums, host])

    def global_totals(self, ctx: DistributedContext) -> list[float]:
        """Totals summed over every rank so far (see `summarize`). A sync point."""
        totals, _, _, _ = reduce_snapshots(ctx, [self.snapshot()], (), 0.0)
        return totals[-1]

    def set(self, totals: list[float]) -> None:
        """Start from saved global totals (a mid-epoch resume, on one rank)."""
        self._sums.copy_(torch.tensor(totals[:-1], dtype=torch.float64))
        self._samples = int(totals[-1])

    def summarize(self, totals: list[float]) -> dict[str, float]:
        """The task's metrics from global totals (or from a difference of two)."""
        row = summarize(self.task, self.names, totals)
        named = dict(zip(self.names, totals, strict=False))
        if self.routing is not None and named["count"] > 0:
            row.update(self.routing.fields(named, named["count"]))
        return row


def reduce_snapshots(
    ctx: DistributedContext, snapshots: list[torch.Tensor], flags: Sequence[bool],
    seconds: float, own: Sequence[float] = (),
) -> tuple[list[list[float]], list[bool], float, list[list[float]]]:
    """All-reduce several snapshots of one split's sums in one collective, with whether
    each of `flags` is set on any rank (stop requests: as many as a snapshot has fields
    but one), the mean of the ranks' `seconds` and each rank's `own` figures. Returns the
    global totals of each snapshot (`names` then samples), the flags, that mean and the
    ranks' figures (a list a rank); every rank gets the same values."""
    width, device = snapshots[0].numel(), snapshots[0].device
    assert len(flags) < width, "more flags than a row has room for"
    control = torch.zeros(width, dtype=torch.float64, device=device)
    control[0] = seconds
    if flags:
        control[1 : 1 + len(flags)] = torch.tensor([float(f) for f in flags])
    if not ctx.counts_data:  # a tensor-parallel peer holds the same sums: counted once
        snapshots = [torch.zeros_like(s) for s in snapshots]
    k = len(own)
    ranks = torch.zeros(ctx.world_size * k, dtype=torch.float64, device=device)
    if k:  # this rank's slot: the sum gives every rank all of them
        ranks[ctx.rank * k : (ctx.rank + 1) * k] = torch.tensor(own, dtype=torch.float64)
    buf = torch.cat([torch.stack([*snapshots, control]).reshape(-1), ranks])
    if ctx.distributed:
        dist.all_reduce(buf)
    flat = buf.tolist()
    cut = (len(snapshots) + 1) * width
    *rows, (total_s, *set_on) = [flat[i : i + width] for i in range(0, cut, width)]
    for values in rows:
        values[1] += values[-2]  # counts kept on the host join those kept on the device
    totals = [[*values[:-2], values[-1]] for values in rows]
    per_rank = [flat[cut + r * k : cut + (r + 1) * k] for r in range(ctx.world_size)] if k else []
    return totals, [v > 0 for v in set_on[: len(flags)]], total_s / ctx.world_size, per_rank


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


class EpochMeter:
    """The running train metrics of an epoch, and the timing of the interval since the
    last log point."""

    def __init__(self, sums: MetricSums, step: int) -> None:
        self.sums = sums
        self.logged = [0.0] * (len(sums.names) + 1)  # global totals at the last log point
        self.t_last = time.perf_counter()
        self.wait = 0.0  # seconds blocked on the loader since the last log point
        self.step_last = step

    def restore(self, saved: dict[str, Any], is_main: bool) -> None:
        """Continue from a mid-epoch checkpoint's global totals (added in on one rank)."""
        if len(saved.get("totals", ())) != len(self.logged):
            return  # written for another task's sums
        self.logged = list(saved["logged"])
        if is_main:
            self.sums.set(saved["totals"])

    def mark(self, step: int) -> tuple[float, dict[str, float]]:
        """End the interval at `step`: its seconds and the row fields timed on this rank."""
        now = time.perf_counter()
        elapsed = now - self.t_last
        fields = {
            "step_time_s": elapsed / max(1, step - self.step_last),
            "data_wait_frac": self.wait / elapsed,
            "peak_rss_mb": peak_rss_mb(),
        }
        self.t_last, self.wait, self.step_last = now, 0.0, step
        return elapsed, fields

    def row(self, totals: list[float], mark: tuple[float, dict[str, float]]) -> dict[str, Any]:
        """The task's metrics and the throughput of the interval `mark` up to `totals`."""
        interval = [a - b for a, b in zip(totals, self.logged, strict=True)]
        elapsed, fields = mark
        self.logged = totals
        return {
            **self.sums.summarize(interval), "samples_per_sec": interval[-1] / elapsed, **fields
        }


def summarize(task: Task, names: tuple[str, ...], totals: list[float]) -> dict[str, float]:
    named = dict(zip(names, totals, strict=False))
    samples = int(totals[len(names)])
    count = named["count"]
    if count <= 0:
        return {"loss": float("nan"), "samples": samples}
    return {**task.summarize(named, count), "samples": samples}


class Sync:
    """When the next metric all-reduce is due, and the train rows it will complete."""

    def __init__(self, step: int, every: int) -> None:
        self.rows: list[tuple[torch.Tensor, tuple[dict[str, Any], Any]]] = []
        self.restart(step, every)

    def restart(self, step: int, every: int) -> None:
        self.rows.clear()
        self.step, self.every, self.t = step, every, time.perf_counter()
        self.wait = 0.0  # seconds this rank waited for its batches since

    def due(self, step: int) -> bool:
        return step - self.step >= self.every


class Stragglers:
    """The ranks holding the others back in data loading: a rank whose wait for its
    batches per step stays above `factor` times the other ranks' median, and above a
    tenth of the step, for `SYNCS` metric syncs running (the ranks' waits travel with the
    sync's all-reduce: no collective of their own). Under synchronous data parallelism
    every rank steps as slowly as the slowest; where the time goes tells them apart."""

    SYNCS = 3

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.streak: dict[int, int] = {}
        self.named: list[int] = []  # every rank named in the run, in the order named

    def update(
        self, waits: list[float], step_s: float, ctx: DistributedContext | None = None
    ) -> list[tuple[int, float, float]]:
        """The ranks named at this sync: (rank, its wait per step, the others' median),
        each in a line from rank 0 and one from the rank itself, which names its host."""
        if not self.factor or len(waits) < 2:
            return []
        found, ordered = [], sorted(waits)  # sorted once: hundreds of ranks, every sync
        for rank, wait in enumerate(waits):
            others = _median_without(ordered, wait)
            slow = wait > self.factor * others and wait - others > 0.1 * step_s
            self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
            if self.streak[rank] == self.SYNCS:
                found.append((rank, wait, others))
                if rank not in self.named:
                    self.named.append(rank)
                if ctx is not None and (ctx.is_main or rank == ctx.rank):
                    host = f" on {socket.gethostname()}" if rank == ctx.rank else ""
                    log.warning(
                        "straggler: rank %d%s waits %.3fs per step for its batches, the other "
                        "ranks %.3fs (%d metric syncs running): its data loading holds every "
                        "rank back (more --num_workers, faster storage or preprocessing)",
                        rank, host, wait, others, self.SYNCS,
                    )
        return found

    def now(self) -> list[int]:
        """The ranks slow at the last sync and for `SYNCS` syncs running."""
        return sorted(r for r, n in self.streak.items() if n >= self.SYNCS)


def _median_without(ordered: list[float], value: float) -> float:
    """The median of sorted `ordered` with one occurrence of `value` left out, by index."""
    gone = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k if k < gone else k + 1]

    return (at((m - 1) // 2) + at(m // 2)) / 2


def improves(score: float, best: float, mode: str) -> bool:
    if score != score:  # NaN is never better
        return False
    if best != best:
        return True
    return score > best if mode == "max" else score < best
