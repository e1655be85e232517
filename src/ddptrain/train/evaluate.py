"""Evaluation: the task's figures over every validation sample exactly once, on any world
size.

It runs the plain module: DDP's forward would broadcast buffers, a collective that ranks
with unequal shard lengths would call a different number of times. Rank 0's BatchNorm
statistics are broadcast first, so every rank evaluates the same model (the one the
checkpoint holds). Under fsdp every forward all-gathers parameters, so a rank with fewer
batches runs extra forwards whose outputs it does not count.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddptrain.data import split, to_device
from ddptrain.train.metrics import MetricSums

if TYPE_CHECKING:
    from ddptrain.train.trainer import Trainer


class Evaluator:
    """Validation of a trainer's module over its validation loader (collective)."""

    def __init__(self, trainer: Trainer, loader: Iterable[Any]) -> None:
        self.trainer, self.loader = trainer, loader

    @torch.no_grad()
    def run(self, filler: Any) -> dict[str, float]:
        """`filler`: model inputs for the forwards a rank runs in step with its peers
        once its own shard is done (fsdp)."""
        t = self.trainer
        ctx, module, precision = t.ctx, t.module, t.precision
        if ctx.distributed:
            for buf in module.buffers():
                dist.broadcast(buf, src=0)
        module.eval()
        sums = MetricSums(t.task, ctx.device)
        for batch in self._batches():
            if batch is None:  # this rank is done, a peer is not: forward in step with it
                with precision.autocast():
                    t.call(module, filler)
                continue
            inputs, targets = split(to_device(batch, ctx.device, t.memory_format))
            with precision.autocast():
                out = t.call(module, inputs)
            sums.update(t.scorer.score(out, targets, inputs))
            filler = inputs
        sums.commit()
        module.train()
        return sums.summarize(sums.global_totals(ctx))

    def _batches(self) -> Iterator[Any]:
        """This rank's validation batches; under a strategy whose forward is collective,
        then None until every rank has run out (one flag all-reduced per batch)."""
        if not self.trainer.strategy.even_forwards:
            yield from self.loader
            return
        device = self.trainer.ctx.device
        batches = iter(self.loader)
        while True:
            batch = next(batches, None)
            more = torch.tensor([float(batch is not None)], device=device)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not more.item():
                return
            yield batch
