"""What is being learned: how predictions and targets become a loss and metrics.

A task owns the loss as a *sum with its count* (samples, or tokens for a language model),
named metric *sums* (so they add up across micro-batches and ranks exactly) and which
metric defines the best model. The trainer divides the summed loss by the global count of
the whole optimizer step (every rank, every micro-batch), so N ranks x batch B is one rank
x batch N*B for every task, however the count varies between batches.

Built in: `classification`, `regression`, `multilabel`, `lm`. Your own task is a subclass
of `Task` (or any object with the same attributes) returned by `--task package.module:fn`:

    class Huber(Task):
        name, best, mode, metric_names = "huber", "mae", "min", ("abs_err",)

        def loss(self, prediction, targets):
            per_sample = F.huber_loss(prediction.squeeze(-1), targets, reduction="none")
            return per_sample.sum(), targets.shape[0]

        def metrics(self, prediction, targets):
            return {"abs_err": (prediction.squeeze(-1) - targets).abs().sum()}

        def summarize(self, totals, count):  # totals: global sums; count: the loss's count
            return {"loss": totals["loss"] / count, "mae": totals["abs_err"] / count}
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ddptrain.data import DataFacts, Output, num_samples
from ddptrain.errors import ConfigError

IGNORE_INDEX = -100  # target positions a language model is not scored on (padding)


class Task:
    """The interface the trainer calls; subclass it for your own task."""

    name = "task"
    best = "loss"  # the metric that makes a model the best so far ...
    mode = "min"  # ... when it is at its "min" or "max"
    metric_names: tuple[str, ...] = ()  # keys of `metrics`, the same on every call
    dynamic_count = False  # True when the loss's count is only known from the batch (tokens)
    output_size: int | None = None  # what a built-in model's head should output

    def check(self, prediction: torch.Tensor, targets: torch.Tensor) -> None:
        """Refuse predictions and targets that do not fit this task (first batch only)."""

    def loss(self, prediction: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(summed loss, the count it is a sum over: an int or a 0-d tensor)."""
        raise NotImplementedError

    def count(self, prediction: torch.Tensor | None, targets: torch.Tensor) -> Any:
        """The count of a batch whose loss the model computed itself (as a mean)."""
        return int(targets.shape[0])

    def metrics(self, prediction: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Metric sums of a batch, keyed by `metric_names`."""
        return {}

    def summarize(self, totals: Mapping[str, float], count: float) -> dict[str, float]:
        """Metrics from global sums: `totals` has 'loss' and every metric name."""
        return {"loss": totals["loss"] / count, **{k: totals[k] / count for k in self.metric_names}}


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point()


class Classification(Task):
    """Cross-entropy over (B, C) logits and (B,) integer labels; accuracy, and top-5
    accuracy when there are more than 5 classes."""

    name, best, mode = "classification", "accuracy", "max"

    def __init__(self, num_classes: int) -> None:
        self.output_size = num_classes
        self.top5 = num_classes > 5
        self.metric_names = ("correct", "correct_top5") if self.top5 else ("correct",)

    def check(self, prediction: torch.Tensor, targets: torch.Tensor) -> None:
        if _is_float(targets):
            raise ConfigError(
                f"--task classification needs integer class labels, but the targets are "
                f"{_describe(targets)}: use --task regression (or multilabel for multi-hot)"
            )
        if prediction.ndim != 2 or targets.ndim != 1:
            hint = " (token sequences: use --task lm)" if prediction.ndim == 3 else ""
            raise ConfigError(
                f"--task classification needs (B, classes) predictions and (B,) labels; the "
                f"model gives {_describe(prediction)} for targets {_describe(targets)}{hint}"
            )

    def loss(self, prediction: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return F.cross_entropy(prediction.float(), targets, reduction="sum"), targets.shape[0]

    def metrics(self, prediction: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"correct": (prediction.argmax(dim=1) == targets).sum()}
        if self.top5:
            top = prediction.topk(5, dim=1).indices
            out["correct_top5"] = (top == targets[:, None]).any(dim=1).sum()
        return out

    def summarize(self, totals: Mapping[str, float], count: float) -> dict[str, float]:
        out = {"loss": totals["loss"] / count, "accuracy": totals["correct"] / count}
        if self.top5:
            out["top5_accuracy"] = totals["correct_top5"] / count
        return out


class Regression(Task):
    """Mean squared error; `mse`, `mae` and `r2` (averaged over outputs, as sklearn's
    `r2_score`). Predictions (B,) or (B, k) match targets of the same shape; a (B, 1) head
    with (B,) targets is squeezed, never broadcast."""

    name, best, mode = "regression", "mse", "min"

    def __init__(self, target_shape: tuple[int, ...]) -> None:
        self.outputs = math.prod(target_shape) if target_shape else 1
        self.output_size = self.outputs
        k = range(self.outputs)
        self.metric_names = (
            "abs_err", *(f"sse_{j}" for j in k), *(f"y_{j}" for j in k), *(f"y2_{j}" for j in k)
        )

    def _align(self, prediction: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if prediction.ndim == targets.ndim + 1 and prediction.shape[-1] == 1:
            prediction = prediction.squeeze(-1)
        return prediction

    def check(self, prediction: torch.Tensor, targets: torch.Tensor) -> None:
        aligned = self._align(prediction, targets)
        if aligned.shape != targets.shape or not _is_float(prediction):
            raise ConfigError(
                f"--task regression needs predictions shaped like the targets; the model gives "
                f"{_describe(prediction)} for targets {_describe(targets)}"
                + (": token sequences need --task lm" if prediction.ndim == 3 else "")
            )

    def _err(self, prediction: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        p = self._align(prediction, targets).float()
        return (p - targets.float()).reshape(targets.shape[0], -1)

    def loss(self, prediction: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        err = self._err(prediction, targets)
        return err.square().sum() / self.outputs, targets.shape[0]

    def metrics(self, prediction: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        err = self._err(prediction, targets)
        y = targets.float().reshape(targets.shape[0], -1)
        sums = torch.cat([
            err.abs().sum().view(1) / self.outputs, err.square().sum(0), y.sum(0), y.square().sum(0)
        ])
        return dict(zip(self.metric_names, sums.unbind(), strict=True))

    def summarize(self, totals: Mapping[str, float], count: float) -> dict[str, float]:
        r2 = []
        for j in range(self.outputs):
            sst = totals[f"y2_{j}"] - totals[f"y_{j}"] ** 2 / count
            r2.append(1.0 - totals[f"sse_{j}"] / sst if sst > 0 else float("nan"))
        mse = totals["loss"] / count
        return {"loss": mse, "mse": mse, "mae": totals["abs_err"] / count, "r2": sum(r2) / len(r2)}


class MultiLabel(Task):
    """Binary cross-entropy with logits over (B, L) predictions and float multi-hot (B, L)
    targets; micro-averaged `f1` and `exact_match` (every label of a sample right)."""

    name, best, mode = "multilabel", "f1", "max"
    metric_names = ("tp", "fp", "fn", "exact")

    def __init__(self, labels: int) -> None:
        self.output_size = labels

    def check(self, prediction: torch.Tensor, targets: torch.Tensor) -> None:
        if prediction.shape != targets.shape or targets.ndim != 2:
            raise ConfigError(
                f"--task multilabel needs (B, labels) predictions and multi-hot (B, labels) "
                f"targets; the model gives {_describe(prediction)} for {_describe(targets)}"
            )

    def loss(self, prediction: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        bce = F.binary_cross_entropy_with_logits(
            prediction.float(), targets.float(), reduction="sum"
        )
        return bce / targets.shape[1], targets.shape[0]

    def metrics(self, prediction: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        pred, truth = prediction > 0, targets > 0.5
        return {
            "tp": (pred & truth).sum(), "fp": (pred & ~truth).sum(), "fn": (~pred & truth).sum(),
            "exact": (pred == truth).all(dim=1).sum(),
        }

    def summarize(self, totals: Mapping[str, float], count: float) -> dict[str, float]:
        tp, fp, fn = totals["tp"], totals["fp"], totals["fn"]
        f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0
        return {"loss": totals["loss"] / count, "f1": f1, "exact_match": totals["exact"] / count}


class LanguageModel(Task):
    """Next-token cross-entropy over (B, T, V) logits and (B, T) targets, ignoring targets
    of -100; the loss is the mean over every target token of the global batch.

    Pairs `(x, y)` carry targets already aligned with the predictions (y = x shifted by
    one). Dict batches follow the Hugging Face convention: `labels` equal `input_ids`, so
    position t predicts label t + 1."""

    name, best, mode = "lm", "perplexity", "min"
    metric_names = ("correct",)
    dynamic_count = True

    def __init__(self, vocab_size: int | None, shift: bool) -> None:
        self.output_size, self.shift = vocab_size, shift

    def _aligned(
        self, prediction: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shift:
            prediction, targets = prediction[:, :-1], targets[:, 1:]
        return prediction.reshape(-1, prediction.shape[-1]), targets.reshape(-1)

    def check(self, prediction: torch.Tensor, targets: torch.Tensor) -> None:
        if prediction.ndim != 3 or targets.ndim != 2 or prediction.shape[:2] != targets.shape:
            raise ConfigError(
                f"--task lm needs (B, T, vocab) logits and (B, T) token targets; the model "
                f"gives {_describe(prediction)} for targets {_describe(targets)}"
            )
        if _is_float(targets):
            raise ConfigError(f"--task lm needs integer token targets, got {_describe(targets)}")

    def loss(self, prediction: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        logits, labels = self._aligned(prediction, targets)
        loss = F.cross_entropy(
            logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return loss, (labels != IGNORE_INDEX).sum()

    def count(self, prediction: torch.Tensor | None, targets: torch.Tensor) -> Any:
        labels = targets[:, 1:] if self.shift else targets
        return (labels != IGNORE_INDEX).sum()

    def metrics(self, prediction: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        logits, labels = self._aligned(prediction, targets)
        return {"correct": ((logits.argmax(dim=-1) == labels) & (labels != IGNORE_INDEX)).sum()}

    def summarize(self, totals: Mapping[str, float], count: float) -> dict[str, float]:
        loss = totals["loss"] / count
        return {
            "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "accuracy": totals["correct"] / count, "tokens": int(count),
        }


class ModelLoss(Task):
    """Batches without targets: the model computes its own loss; nothing else is scored."""

    name = "model_loss"

    def count(self, prediction: torch.Tensor | None, targets: Any) -> Any:
        return int(targets) if isinstance(targets, int) else super().count(prediction, targets)


def head_size(task: Any, facts: DataFacts) -> int | None:
    """How many outputs a built-in model's head needs: what the task says, else what the
    targets imply (classes, vocabulary, or one per target value)."""
    size = getattr(task, "output_size", None)
    if size is not None:
        return int(size)
    if facts.num_classes is not None and not facts.target_is_float:
        return facts.num_classes
    if facts.vocab_size is not None:
        return facts.vocab_size
    if facts.target_shape is not None:
        return math.prod(facts.target_shape) or 1
    return None


def ranking(config: Any, task: Task) -> tuple[str, str]:
    """The val row's figure that chooses the best epoch (`--best_metric`: METRIC or
    NAME/METRIC of a `--val` set; default the task's own), and its direction."""
    if not config.best_metric:
        return task.best, task.mode
    metric = config.best_metric.rpartition("/")[2]
    if metric == task.best:
        return config.best_metric, task.mode
    if metric == "loss":
        return config.best_metric, "min"
    raise ConfigError(
        f"--best_metric {config.best_metric!r} is invalid: --task {task.name} ranks epochs "
        f"by {task.best} (best at its {task.mode}) or by loss; give one of them"
    )


def resolve_task(config: Any, facts: DataFacts) -> Task:
    """The task `--task` names, or the one the targets imply (`auto`)."""
    from ddptrain.plugins import call_factory

    name = config.task
    if ":" in name:
        task = call_factory(name, "task", config, config.task_args, facts.as_kwargs())
        needed = ("loss", "metrics", "summarize", "best", "mode", "metric_names")
        missing = [a for a in needed if not hasattr(task, a)]
        if missing:
            raise ConfigError(
                f"--task {name!r} returned {type(task).__name__}, which lacks "
                f"{', '.join(missing)}: return a ddptrain.Task subclass instance"
            )
        return task
    if facts.target_shape is None:
        if name != "auto":
            raise ConfigError(
                f"--task {name} scores targets, and the samples of --dataset "
                f"{config.dataset!r} hold none (a dict without 'labels'): add labels to "
                "them (a causal LM's are its input_ids; the lm task shifts them), or leave "
                "--task auto to train the loss the model computes itself"
            )
        return ModelLoss()
    if name == "auto":
        name = _auto_task(facts)
    shape = facts.target_shape or ()
    if name == "classification":
        if facts.target_is_float:
            raise ConfigError(
                f"--dataset {config.dataset!r} has float targets, which --task classification "
                "cannot use: use --task regression, or integer class labels"
            )
        if facts.num_classes is None:
            raise ConfigError(
                f"--dataset {config.dataset!r} does not say how many classes it has: "
                "pass --num_classes, or give the dataset a num_classes attribute"
            )
        return Classification(facts.num_classes)
    if name == "regression":
        return Regression(shape)
    if name == "multilabel":
        if len(shape) != 1:
            raise ConfigError(
                f"--task multilabel needs multi-hot targets of shape (labels,) per sample; "
                f"--dataset {config.dataset!r} has targets of shape {shape}"
            )
        return MultiLabel(shape[0])
    return LanguageModel(facts.vocab_size, shift=facts.dict_batches)


def _auto_task(facts: DataFacts) -> str:
    if facts.target_is_float:
        return "regression"
    if facts.vocab_size is not None or len(facts.target_shape or ()) == 1:
        return "lm"  # a sequence of integer targets per sample: tokens
    return "classification"


@dataclass
class Score:
    """One batch, scored: what `MetricSums.update` adds up."""

    loss_sum: torch.Tensor
    count: Any  # what loss_sum is a sum over: an int, or a 0-d tensor (tokens)
    metrics: dict[str, torch.Tensor]  # the task's metric sums
    samples: int


class Scorer:
    """A task applied to a model's output: the summed loss with its count, and the metric
    sums. A model that computed its own loss (a mean over its batch) is trained on that,
    weighted back to a sum; the task then only counts and scores."""

    def __init__(self, task: Task, device: torch.device, split: Any = None) -> None:
        """`split` (`--cp`, a `parallel.cp.ContextParallel`): the model scores this rank's
        slices of the rows, their targets already aligned; one cp rank counts the rows."""
        if split is not None and task.name != "lm":
            raise ConfigError(f"--cp {split.size} splits the sequences of a language model "
                              f"(--task lm), and this run's task is {task.name}: run it "
                              "without --cp")
        if split is not None and getattr(task, "shift", False):
            # a Hugging Face batch's labels are shifted as the rows are cut: not here
            task, split.shift = copy.copy(task), True
            task.shift = False  # type: ignore[attr-defined]
        self.task = task
        self._zero = torch.zeros((), device=device)
        self._checked = False
        self._counts_rows = split is None or split.rank == 0

    def score(self, out: Output, targets: Any, inputs: Any) -> Score:
        loss_sum, count = self.loss(out, targets, inputs)
        samples = num_samples(inputs, targets) if self._counts_rows else 0
        return Score(loss_sum, count, self.metrics(out, targets), samples)

    def loss(self, out: Output, targets: Any, inputs: Any) -> tuple[torch.Tensor, Any]:
        if out.loss is not None:
            count = (
                num_samples(inputs, None) if targets is None
                else self.task.count(out.prediction, targets)
            )
            return out.loss.float() * count, count
        if targets is None:
            raise ConfigError(
                "the batches hold no 'labels' and the model returned no 'loss': add labels "
                "to the dataset's samples, or have the model compute its loss"
            )
        if out.prediction is None:
            raise ConfigError("the model returned neither predictions ('logits') nor a 'loss'")
        if not self._checked:  # shapes and dtypes stay the same after the first batch
            self.task.check(out.prediction, targets)
            self._checked = True
        return self.task.loss(out.prediction, targets)

    def metrics(self, out: Output, targets: Any) -> dict[str, torch.Tensor]:
        if out.prediction is None or targets is None:
            return dict.fromkeys(self.task.metric_names, self._zero)
        with torch.no_grad():
            return self.task.metrics(out.prediction.detach(), targets)
