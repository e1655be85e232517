"""Host reads of device values, counted by dispatch: what makes the host wait for the
device on a GPU. A read is `.item()`, `bool()`, `float()`, `int()` and `if t:` (all
dispatched as `aten._local_scalar_dense`), a copy from a device to the CPU, and
`.tolist()` / `.numpy()` / `.cpu()` (a CPU tensor answers those without any dispatch, so
they are patched).

On CPU every tensor is a CPU tensor, so reads of host values by design are left out by
where they are made: the data code's index lists (before the batch moves to the device)
and torch.optim's step counters (CPU tensors, also on a GPU). Each read is filed under
`step` as it happens, as `what at file:line function` (the innermost ddptrain frame).
Used by tests/test_gpu_path.py and bench/step_costs.py.
"""

from __future__ import annotations

import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SRC = str(Path(__file__).resolve().parent.parent / "src" / "ddptrain")
HOST_SIDE = (f"{SRC}/data/",)  # index lists and host batches, before the device move


def _site() -> str | None:
    """Where in ddptrain a read was made (`file:line function`), or None when it is a
    host read by design."""
    frames = traceback.extract_stack()[:-3]
    for frame in reversed(frames):
        if "/torch/optim/" in frame.filename:
            return None  # an optimizer's step counter: a CPU tensor, also on a GPU
        if frame.filename.startswith(SRC):
            if frame.filename.startswith(HOST_SIDE) and not frame.filename.endswith(
                "iterable.py"
            ):
                return None
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return None  # outside ddptrain (the caller's own code)


class HostReads(TorchDispatchMode):
    """Records each host read of a tensor while active, with `step` as its step."""

    def __init__(self) -> None:
        super().__init__()
        self.step = -1
        self.reads: dict[int, list[str]] = defaultdict(list)
        self._patched: list[tuple[str, Any]] = []

    def _record(self, what: str) -> None:
        site = _site()
        if site is not None:
            self.reads[self.step].append(f"{what} at {site}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self._record("item")
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get(
                "device", src.device
            )
            if src.device.type != "cpu" and torch.device(dst).type == "cpu":
                self._record("copy to cpu")
        return func(*args, **kwargs)

    @property
    def active(self) -> bool:
        return bool(self._patched)

    def __enter__(self) -> HostReads:
        for name in ("tolist", "numpy", "cpu"):
            real = getattr(torch.Tensor, name)

            def counted(t: torch.Tensor, *a: Any, _real: Any = real, _name: str = name,
                        **k: Any) -> Any:
                self._record(_name)
                return _real(t, *a, **k)

            self._patched.append((name, real))
            setattr(torch.Tensor, name, counted)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, real in self._patched:
            setattr(torch.Tensor, name, real)
        self._patched.clear()
