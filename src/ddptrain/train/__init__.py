"""Training: the `Trainer` (building, the loop), its resume (`resume`) and evaluation
(`evaluate`); what is learned (`tasks`), the optimizer and schedule (`optim`), precision,
the metric sums (`metrics`), the run's arithmetic (`plan`), stop requests (`stop`), what
hooks may steer (`steer`) and the EMA of the weights (`ema`)."""

from __future__ import annotations

from ddptrain.train.evaluate import Evaluator
from ddptrain.train.metrics import MetricSums
from ddptrain.train.optim import build_scheduler, peak_lr
from ddptrain.train.plan import RunPlan, as_trained, format_plan, make_plan
from ddptrain.train.precision import Precision, resolve_precision
from ddptrain.train.tasks import Task, head_size, ranking, resolve_task
from ddptrain.train.trainer import Trainer

__all__ = [
    "Evaluator",
    "MetricSums",
    "Precision",
    "RunPlan",
    "Task",
    "Trainer",
    "as_trained",
    "build_scheduler",
    "format_plan",
    "head_size",
    "make_plan",
    "peak_lr",
    "ranking",
    "resolve_precision",
    "resolve_task",
]
