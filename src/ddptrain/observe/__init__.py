"""Everything that watches a run: the `Hook` interface and the `RunView` each hook gets (a
hook may also steer the run through it), the hooks (metrics file and TensorBoard, console,
curves, profiler, MLflow), the figures of a row, FLOPs and MFU, and `ddptrain plot`."""

from __future__ import annotations

from ddptrain.observe.console import Console, Curves
from ddptrain.observe.fields import NOT_METRICS, metric_text
from ddptrain.observe.hooks import Hook, Hooks, RunView
from ddptrain.observe.writer import MetricsWriter

__all__ = [
    "NOT_METRICS", "Console", "Curves", "Hook", "Hooks", "MetricsWriter", "RunView", "metric_text",
]
