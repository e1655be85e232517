"""The forward and backward of one micro-batch, and the scale its loss is backpropagated at.

Each micro-batch's loss is the task's *sum*, scaled by the data-parallel world size over
the global count of its accumulation window, so that the gradients reduced at the
window's end are the mean over the whole optimizer step (see `ddptrain.train.trainer`).
Where the count is only known from the data (tokens some of which are not scored,
iterable datasets) the scale uses a nominal count, and `stepping.optimizer_step` rescales
by the true global one; windows of a token stream score every token, and their count is
their samples' times their length (`counting`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ddptrain.data import Micro, mark_batch_dynamic, parse_output, split, to_device
from ddptrain.data.bundle import DataBundle, attr_through
from ddptrain.train.metrics import MetricSums

if TYPE_CHECKING:
    from ddptrain.train.trainer import Trainer


def forward_backward(
    trainer: Trainer, batch: Any, micro: Micro, sums: MetricSums, sync: bool | None = None
) -> Any:
    """Forward and backward of one micro-batch, through the strategy (a plain forward
    or a pipeline's schedule); gradients are reduced only on the last micro-batch of
    a window (`sync` False: on none, the caller reduces them). Returns the model inputs
    (for FLOP counting)."""
    inputs, targets = trainer.call.prepare(
        *split(to_device(batch, trainer.ctx.device, trainer.memory_format)))
    scale = 0.0 if micro.pad else loss_scale(trainer, micro)
    if trainer.config.compile:
        mark_batch_dynamic(inputs)

    def loss(output: Any, rows: torch.Tensor | None) -> torch.Tensor:
        """The scaled loss of `output`: the whole micro-batch's, or (a pipeline's last
        stage) that of `rows` of it, padding rows left out."""
        if rows is None:
            score = trainer.scorer.score(output, targets, inputs)
        else:
            held: Any = targets  # a pipeline's batches hold targets (`Pipeline._pad`)
            start, stop = int(rows[0]), min(int(rows[-1]) + 1, len(held))
            if stop <= start:  # padding alone: no loss, the graph still runs backward
                return output.sum() * 0.0
            score = trainer.scorer.score(
                parse_output(output[: stop - start]), held[start:stop], None
            )
        # the routers' balancing loss trains; the figures logged are the task's
        total = score.loss_sum if trainer.routing is None else trainer.routing.add(score, micro.pad)
        if not micro.pad:
            sums.update(score)
        return trainer.scaler.scale(total if scale == 1.0 else total * scale)

    trainer.strategy.forward_backward(
        trainer.call, trainer.model, inputs, loss, micro.ends_window if sync is None else sync,
        trainer.precision.autocast,
    )
    return inputs


def counting(task: Any, data: DataBundle) -> tuple[bool, int]:
    """Whether a step's count is known only from the data (tokens, iterable samples): the
    loss is then scaled by a nominal count, and the step rescales by the true global one,
    a collective (`stepping.rescale_to_global_count`); and the targets each sample counts
    otherwise: windows whose every target is scored (`data.text.TokenWindows`) count T
    tokens each, known without one."""
    each = attr_through(data.train, "targets_each") if task.dynamic_count else None
    return (task.dynamic_count and each is None) or data.iterable, int(each or 1)


def loss_scale(trainer: Trainer, micro: Micro) -> float:
    """What a micro-batch's summed loss is multiplied by before backward."""
    # DDP averages gradients over the (data-parallel x cp) ranks, hence their number.
    if trainer.dynamic:
        return trainer.ctx.grad_world / trainer.nominal
    return trainer.ctx.grad_world / (micro.window_samples * trainer.targets_each)
