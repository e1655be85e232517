"""Which fields of a metrics row are the task's figures, and how a row reads as text.

The console, the plots and the trackers share this one list, so a new bookkeeping field is
added in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


# Fields of a row that are bookkeeping, not a figure of the task.
NOT_METRICS = {
    "split", "epoch", "step", "samples", "lr", "samples_per_sec", "step_time_s",
    "data_wait_frac", "peak_rss_mb", "bad_steps", "epoch_time_s", "tokens", "peak_cuda_mb",
    "tflops_per_sec", "mfu", "run_id", "first_step_s", "stragglers",
    "startup_s", "expert_tokens", "expert_tokens_min", "expert_tokens_max",
}


def is_bookkeeping(name: str) -> bool:
    """Whether a row's field is bookkeeping (`samples`, also a `--val` set's `NAME/samples`)."""
    return name.rpartition("/")[2] in NOT_METRICS


def metric_text(row: dict[str, Any], prefix: str = "") -> str:
    """'loss 0.1234 accuracy 0.9500' from the task's figures in a row."""
    names = [
        k for k in row
        if k.startswith(prefix) and not is_bookkeeping(k[len(prefix):])
        and (prefix or not k.startswith("train_"))
    ]
    return " ".join(f"{k[len(prefix):]} {row[k]:.4f}" for k in names)
