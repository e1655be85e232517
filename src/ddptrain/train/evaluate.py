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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddptrain.context import DistributedContext
from ddptrain.data import ModelCall, split, to_device
from ddptrain.data.loader import read
from ddptrain.parallel import Strategy
from ddptrain.train.metrics import MetricSums
from ddptrain.train.precision import Precision
from ddptrain.train.tasks import Scorer


def named_figures(name: str, figures: dict[str, float]) -> dict[str, float]:
    """One validation set's figures as the val rows carry them: the run's own set ("")
    as they are, a `--val NAME=DATASET` set's as NAME/METRIC."""
    return {f"{name}/{k}" if name else k: v for k, v in figures.items()}


class Evaluator:
    """Validation of the plain module over this rank's validation loader (collective).

    It holds the parts it uses, never the trainer: a trainer in a reference cycle would be
    freed by the cyclic collector, which finalises DataLoader iterators in no set order
    and can leave their worker processes behind (and the job waiting for them at exit)."""

    def __init__(
        self, module: nn.Module, call: ModelCall, scorer: Scorer, precision: Precision,
        strategy: Strategy, ctx: DistributedContext, loader: Iterable[Any],
        memory_format: torch.memory_format | None, rounds: int | None = None,
    ) -> None:
        """`rounds`: the most batches any rank's loader yields, where every rank knows it
        (`data.most_val_batches`; None: a stream)."""
        self.module, self.call, self.scorer, self.precision = module, call, scorer, precision
        self.strategy, self.ctx, self.loader = strategy, ctx, loader
        self.memory_format, self.rounds = memory_format, rounds

    @torch.no_grad()
    def run(self, filler: Any) -> dict[str, float]:
        """`filler`: model inputs for the forwards a rank runs in step with its peers
        once its own shard is done (fsdp)."""
        ctx, module, precision = self.ctx, self.module, self.precision
        self.strategy.share_buffers(module)
        module.eval()
        sums = MetricSums(self.scorer.task, ctx.device)
        for batch in self._batches():
            if batch is None:  # this rank is done, a peer is not: forward in step with it
                with precision.autocast():
                    self.strategy.forward(self.call, module, filler)
                continue
            inputs, targets = self.call.prepare(
                *split(to_device(batch, ctx.device, self.memory_format)))
            with precision.autocast():
                out = self.strategy.forward(self.call, module, inputs)
            if out is not None:  # None: an earlier pipeline stage, the last one scores
                sums.update(self.scorer.score(out, targets, inputs))
            filler = inputs
        sums.commit()
        module.train()
        return sums.summarize(sums.global_totals(ctx))

    def _batches(self) -> Iterator[Any]:
        """This rank's validation batches; under a strategy whose forward is collective,
        then None until every rank has run out: up to `rounds`, which every rank knows,
        or (a stream) while a flag all-reduced per batch says a rank has more."""
        if not self.strategy.even_forwards:
            yield from read(self.loader)
            return
        batches = read(self.loader)
        if self.rounds is not None:
            for _ in range(self.rounds):
                yield next(batches, None)
            assert next(batches, None) is None, "a validation shard outgrew its rounds"
            return
        while True:
            batch = next(batches, None)
            more = torch.tensor([float(batch is not None)], device=self.ctx.device)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not more.item():
                return
            yield batch
