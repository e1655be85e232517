"""Any batch a user's data yields, and any output a user's model returns.

A batch is a pair `(inputs, targets)` or a dict. A dict calls `model(**inputs)` with the
keys its `forward` accepts (`labels` only when accepted, as Hugging Face models do); its
targets are `batch["labels"]`. Inputs may be any nesting of tuples, lists and dicts of
tensors; `to_device` moves every tensor leaf.

A model output that is a tensor is the prediction. A dict, or an object with attributes
(a Hugging Face `ModelOutput`), gives `logits` as the prediction and `loss` when the model
computed one itself.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddptrain.data.pack import document_mask
from ddptrain.errors import ConfigError


class _Streams:
    """The CUDA calls of `to_device`, behind one seam (a CPU test puts fakes in their
    place): a side stream per device, made when first asked for, and the copy itself."""

    def __init__(self) -> None:
        self.side: dict[torch.device, torch.cuda.Stream] = {}

    def stream_for(self, device: torch.device) -> Any:
        stream = self.side.get(device)
        if stream is None:
            stream = self.side[device] = torch.cuda.Stream(device)
        return stream

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def copy(
        self, t: torch.Tensor, device: torch.device, memory_format: torch.memory_format | None
    ) -> torch.Tensor:
        return _copy(t, device, memory_format)

    def wait(self, device: torch.device, stream: Any) -> None:
        torch.cuda.current_stream(device).wait_stream(stream)

    def record(self, t: torch.Tensor, device: torch.device) -> None:
        t.record_stream(torch.cuda.current_stream(device))


_streams = _Streams()


def to_device(
    batch: Any, device: torch.device, memory_format: torch.memory_format | None = None
) -> Any:
    """Move every tensor in a nested batch to `device` (non-blocking: the copy overlaps
    with host work when the source is pinned); images (4-D) take `memory_format`.

    On a GPU the copy runs on a side stream, so it overlaps the previous step's kernels
    still queued on the current stream; the current stream waits for it (on the device:
    the host does not), and each moved tensor is recorded on the current stream, so the
    caching allocator keeps its memory until the step that reads it is done."""
    if device.type == "cpu" and memory_format is None:
        return batch  # a CPU run's batches are where they belong already
    if device.type != "cuda":
        return _moved(batch, lambda t: _copy(t, device, memory_format))
    side = _streams.stream_for(device)
    copies: list[torch.Tensor] = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        copies.append(_streams.copy(t, device, memory_format))
        return copies[-1]

    with _streams.use(side):
        moved = _moved(batch, copy)
    _streams.wait(device, side)
    for t in copies:
        _streams.record(t, device)
    return moved


def _copy(
    t: torch.Tensor, device: torch.device, memory_format: torch.memory_format | None
) -> torch.Tensor:
    if memory_format is not None and t.ndim == 4:
        return t.to(device, non_blocking=True, memory_format=memory_format)
    return t.to(device, non_blocking=True)


def _moved(batch: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`batch` with `copy` of each tensor leaf in its place."""
    if isinstance(batch, torch.Tensor):
        return copy(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: _moved(v, copy) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        moved = [_moved(v, copy) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def pin_batch(batch: Any) -> Any:
    """Every tensor of a nested batch in page-locked memory, so that `to_device`'s
    non-blocking copy to a GPU runs asynchronously (from pageable memory the host waits
    for it)."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, Mapping):
        return type(batch)({k: pin_batch(v) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (list, tuple)):
        pinned = [pin_batch(v) for v in batch]
        return type(batch)(*pinned) if hasattr(batch, "_fields") else type(batch)(pinned)
    return batch


def mark_batch_dynamic(inputs: Any) -> None:
    """Tell torch.compile the first dimension of every input varies, so an epoch's short
    last batch reuses the compiled graph instead of compiling another."""
    if isinstance(inputs, torch.Tensor):
        if inputs.ndim:
            torch._dynamo.maybe_mark_dynamic(inputs, 0)
        return
    items = inputs.values() if isinstance(inputs, Mapping) else inputs
    if isinstance(items, (list, tuple)) or isinstance(inputs, Mapping):
        for item in items:
            mark_batch_dynamic(item)


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor leaf of a nested value (its first dimension is the batch)."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(items, (list, tuple)) or isinstance(value, Mapping):
        for item in items:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def split(batch: Any) -> tuple[Any, torch.Tensor | None]:
    """(model inputs, targets) of a batch."""
    if isinstance(batch, Mapping):
        return batch, batch.get("labels")
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ConfigError(
        f"a batch must be a pair (inputs, targets) or a dict with 'labels'; the data yields "
        f"{type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else "")
        + ": return (x, y) from the dataset's __getitem__"
    )


def num_samples(inputs: Any, targets: torch.Tensor | None) -> int:
    ref = targets if targets is not None else first_tensor(inputs)
    return 0 if ref is None else int(ref.shape[0])


@dataclass
class Output:
    prediction: torch.Tensor | None  # logits, or the regression values
    loss: torch.Tensor | None  # the model's own loss (a mean over its batch)


class ModelCall:
    """Calls a module with a batch's inputs the way its `forward` wants them."""

    def __init__(self, module: nn.Module, packed: bool = False, split: Any = None) -> None:
        """`packed` (`--pack`): a model that takes an `attention_mask` (a Hugging Face
        one, whose attention does not read documents from `position_ids`, as its flash
        attention does) gets the windows' block-diagonal causal mask as it. `split`
        (`--cp`, a `parallel.cp.ContextParallel`): the model takes this rank's slice of
        each sequence (`prepare`), and its attention sees the whole sequence."""
        self.split = split
        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        self.takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.names = set(params)
        attention = str(getattr(getattr(module, "config", None), "_attn_implementation", ""))
        self.mask_packed = packed and "attention_mask" in self.names and (
            not attention.startswith("flash")) and split is None

    def prepare(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """A batch's (inputs, targets) as the model takes them: this rank's slices under
        --cp, else as they are."""
        return (inputs, targets) if self.split is None else self.split.shard(inputs, targets)

    def __call__(self, model: nn.Module, inputs: Any) -> Output:
        if isinstance(inputs, Mapping):
            kwargs = {k: v for k, v in inputs.items() if self.takes_any or k in self.names}
            if self.mask_packed and "position_ids" in kwargs:
                kwargs.setdefault("attention_mask", document_mask(kwargs["position_ids"]))
            out = model(**kwargs)
        else:
            out = model(inputs)
        return parse_output(out)


def parse_output(out: Any) -> Output:
    if isinstance(out, torch.Tensor):
        return Output(out, None)
    get = out.get if isinstance(out, Mapping) else (lambda k: getattr(out, k, None))
    logits, loss = get("logits"), get("loss")
    if isinstance(logits, torch.Tensor) or isinstance(loss, torch.Tensor):
        return Output(logits if isinstance(logits, torch.Tensor) else None,
                      loss if isinstance(loss, torch.Tensor) else None)
    raise ConfigError(
        f"the model returned {type(out).__name__}, which is neither a tensor nor holds "
        "'logits' or 'loss': return the predictions as a tensor"
    )
