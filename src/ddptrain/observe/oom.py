"""Out of memory: which rank, at which step, what the memory held, and which knob to turn.

An `OutOfMemoryError` during training (CUDA's; on a CPU, the allocator's "can't allocate
memory") ends the rank with one line and exit 2, a configuration that does not fit:

    ddptrain: error: out of memory on rank 3 (cuda:3) after step 87: 76.2 GiB of 79.1 GiB
    held by tensors, of which the model's state is 41.3 GiB per rank (parameters 10.3,
    gradients 10.3, optimizer 20.7); lower --batch_size (now 16), add
    --activation_checkpointing, shard the state with --strategy fsdp; report:
    runs/x/oom/rank3.txt

`oom/rank<R>.txt` holds the line, the state's bytes and, on CUDA, the allocator's summary.
With `--memory_snapshot` (CUDA only) the allocator records every allocation's stack from
the start, and the error dumps them to `oom/rank<R>.pickle` (open it at
https://pytorch.org/memory_viz): the largest tensors and the code that made them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from ddptrain.errors import ConfigError
from ddptrain.files import atomic_write_text, own_dir
from ddptrain.layout import Layout
from ddptrain.parallel.memory import human_bytes

SNAPSHOT_ENTRIES = 100_000  # allocations the history keeps (torchtitan's default)


class OutOfMemory(ConfigError):
    """The run does not fit this device as configured; the message says what to change."""


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)
    )


def record_history(device: torch.device) -> None:
    """`--memory_snapshot`: record the CUDA allocator's history from here on."""
    torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, device=device)


def report(exc: BaseException, trainer: Any) -> OutOfMemory:
    """The error that ends an out-of-memory rank, after its report is written."""
    cfg, ctx = trainer.config, trainer.ctx
    device, rank = ctx.device, ctx.rank
    state = trainer.strategy.rank_bytes(trainer.module, trainer.optimizer)
    held = ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        held = (f"{human_bytes(torch.cuda.memory_allocated(device))} of "
                f"{human_bytes(total)} held by tensors, of which ")
    line = (
        f"out of memory on rank {rank} ({device}) after step {trainer.progress.step}: {held}"
        f"the model's state is {human_bytes(sum(state.values()))} per rank (parameters "
        f"{human_bytes(state['params'])}, gradients {human_bytes(state['grads'])}, optimizer "
        f"{human_bytes(state['optimizer'])}); {_knobs(cfg)}"
    )
    folder = cfg.run_dir / "oom"
    body = [line, "", f"error: {str(exc).strip()}", ""]
    if device.type == "cuda":
        body.append(torch.cuda.memory_summary(device))
        if cfg.memory_snapshot:
            snapshot = snapshot_file(cfg.run_dir, rank)
            with contextlib.suppress(OSError):  # in oom/ of its own, a link at its name gone
                own_dir(folder, under=cfg.run_dir)
                snapshot.unlink(missing_ok=True)
                torch.cuda.memory._dump_snapshot(str(snapshot))
                body.append(f"allocation history: {snapshot} (https://pytorch.org/memory_viz)")
    path = folder / f"rank{rank}.txt"
    try:  # oom/ a real folder of the run's: never written through a link
        atomic_write_text(path, "\n".join(body) + "\n", under=cfg.run_dir)
    except OSError:
        return OutOfMemory(line)
    return OutOfMemory(f"{line}; report: {path}")


def _knobs(cfg: Any) -> str:
    """What to turn, in the order that costs least."""
    knobs = [f"lower --batch_size (now {cfg.batch_size}; --grad_accum_steps keeps the "
             "global batch)"]
    if cfg.activation_checkpointing == "off":
        knobs.append("add --activation_checkpointing")
    if cfg.strategy == "ddp" and not Layout.of(cfg).splits_model:
        knobs.append("shard the state with --strategy fsdp")
    else:
        knobs.append("split the layers further (--tp, --pp) or offload with --fsdp_cpu_offload")
    return ", ".join(knobs)


def snapshot_file(run_dir: Path, rank: int) -> Path:
    return run_dir / "oom" / f"rank{rank}.pickle"
