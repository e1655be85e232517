"""Every rank's random generators (python, numpy, torch, CUDA) as weights-only-loadable
values, gathered on rank 0 into each checkpoint and restored on the same layout.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ddptrain.context import DistributedContext, gather_to_main


# ---------------------------------------------------------------------- RNG state
def seed_process(seed: int) -> None:
    """Seed every generator a checkpoint saves (python, numpy, torch and CUDA), so that a
    run's augmentations repeat with its `--seed` whichever library draws them."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random generators, as weights-only-loadable values."""
    kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(np.asarray(key).astype(np.int64)), pos, has_gauss,
                  gauss],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(_as_tuple(state["python"]))
    kind, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, key.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def gather_rng_states(ctx: DistributedContext) -> list[dict[str, Any]] | None:
    """Every rank's RNG state, on rank 0 (None elsewhere)."""
    mine = rng_state(ctx.device)
    cpu_mine = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in mine.items()}
    return gather_to_main(cpu_mine, ctx)
