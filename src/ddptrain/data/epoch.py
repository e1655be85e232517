"""The layout of an epoch (map-style data): a function of (seed, epoch) and the global
micro-batch alone.

The epoch's order is a seeded permutation, cut into consecutive global micro-batches of
`world_size x batch_size` samples, each split across the ranks as evenly as it goes: no
sample is repeated to pad a shard, and the last global batch of an epoch may give a rank
fewer samples, or none. So N ranks x batch B see exactly the samples of 1 rank x batch
N*B, and a position in the epoch is a count of global samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


# ---------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Micro:
    """One micro-batch of this rank in an epoch's plan."""

    lo: int  # this rank's samples are order[lo:hi]
    hi: int
    pad: bool  # no sample of the global batch fell to this rank: order[lo:hi] is a
    #            stand-in whose loss weight is 0, so every rank runs the same steps
    global_samples: int  # samples of the global micro-batch (every rank)
    window_samples: int  # samples of the optimizer step it belongs to (every rank)
    ends_window: bool  # the last micro-batch of its optimizer step
    position: int  # global samples of the epoch consumed once it is done (for an iterable
    #                dataset: this rank's micro-batches of the epoch read once it is done)


def plan_epoch(
    n: int, world_size: int, rank: int, batch_size: int, accum: int, drop_last: bool,
    start: int = 0,
) -> list[Micro]:
    """This rank's micro-batches of one epoch, from global position `start` on."""
    step = world_size * batch_size
    end = n - (n - start) % step if drop_last else n
    bounds = [(lo, min(lo + step, end)) for lo in range(start, end, step)]
    plan: list[Micro] = []
    for w in range(0, len(bounds), accum):
        window = bounds[w : w + accum]
        total = window[-1][1] - window[0][0]
        for i, (lo, hi) in enumerate(window):
            size = hi - lo
            base, extra = divmod(size, world_size)
            a = lo + rank * base + min(rank, extra)
            b = a + base + (1 if rank < extra else 0)
            pad = a == b
            if pad:
                a, b = lo, lo + 1
            plan.append(Micro(a, b, pad, size, total, i == len(window) - 1, hi))
    return plan


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's sample order: a function of (seed, epoch) alone."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g)


def samples_dropped(n: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    return n % (world_size * batch_size) if drop_last else 0


def steps_per_epoch(
    n: int, world_size: int, batch_size: int, accum: int, drop_last: bool
) -> int:
    """Optimizer steps in an epoch: a short last accumulation window still steps."""
    used = n - samples_dropped(n, world_size, batch_size, drop_last)
    return math.ceil(math.ceil(used / (world_size * batch_size)) / accum)
