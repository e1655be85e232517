"""Shared fixtures: subprocess runners for the CLI and torchrun, and small datasets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


_DIST_VARS = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "TORCHELASTIC_RUN_ID",
}


def run_cli(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """`python -m ddptrain ARGS` as a user would run it."""
    return subprocess.run(
        [sys.executable, "-m", "ddptrain", *args], cwd=cwd, env=child_env(env), text=True,
        capture_output=True, timeout=timeout,
    )


def run_torchrun(
    nproc: int, args: list[str], cwd: Path, env: dict[str, str] | None = None,
    timeout: float = 300, torchrun_args: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc_per_node=N -m ddptrain ARGS`."""
    cmd = [
        str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
        *(torchrun_args or []), "-m", "ddptrain", *args,
    ]
    return subprocess.run(
        cmd, cwd=cwd, env=child_env(env), text=True, capture_output=True, timeout=timeout
    )


def write_npz(path: Path, n: int, features: int = 6, classes: int = 3, seed: int = 0) -> Path:
    """A learnable tabular dataset; feature 0 holds index / n (for coverage checks)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype(np.float32)
    w = rng.normal(size=(features - 1, classes))
    y = np.argmax(x[:, 1:] @ w, axis=1).astype(np.int64)
    x[:, 0] = np.arange(n, dtype=np.float32) / n
    np.savez(path, x=x, y=y)
    return path


@pytest.fixture
def npz400(tmp_path: Path) -> Path:
    """400 samples: 320 train (divisible by 2 ranks x 16 x 10) and 80 val."""
    return write_npz(tmp_path / "data.npz", 400)
