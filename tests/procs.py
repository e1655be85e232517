"""Processes the fault and lifecycle tests start: launched in their own process group,
reaped after every test, and watched for checkpoints; plus weight and log comparisons."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import BIN, child_env, run_torchrun
from safetensors.torch import load_file

from ddptrain.checkpoint.pt import list_checkpoints


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def sigkill_then_resume(
    nproc: int, args: list[str], run: Path, cwd: Path, kill_at: int,
    between: Callable[[], None] = lambda: None,
) -> subprocess.CompletedProcess[str]:
    """Run `args` into `run` on `nproc` ranks until rank 1 SIGKILLs itself at its
    `kill_at`-th training forward (guardplug's GUARD_KILL_AT), call `between`, then resume
    with `--resume_from auto`; returns the resumed run, checked to have ended with 0."""
    job = [*args, "--output_dir", str(run)]
    killed = run_torchrun(nproc, job, cwd=cwd, env={"GUARD_KILL_AT": str(kill_at)})
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert not (run / "model.safetensors").exists()
    between()
    resumed = run_torchrun(nproc, [*job, "--resume_from", "auto"], cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return resumed


def checkpoint_steps(ckpt_dir: Path) -> dict[int, Path]:
    """The whole checkpoints in `ckpt_dir` (`.pt` files, DCP step directories) by step."""
    return {int(p.name.split("_")[1].split(".")[0]): p for p in ckpt_dir.glob("step_*")
            if not p.name.endswith(".tmp")}


def sigkill_after_checkpoint(nproc: int, args: list[str], run: Path, cwd: Path,
                             step: int) -> None:
    """Run `args` into `run` on `nproc` ranks under torchrun until a checkpoint of `step`
    or later is there, then SIGKILL rank 1; checked to have ended with nothing exported."""
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", "-m",
           "ddptrain", *args, "--output_dir", str(run), "--no-curves"]
    proc = popen(cmd, cwd, child_env())
    deadline = time.monotonic() + 240
    while not any(s >= step for s in checkpoint_steps(run / "checkpoints")):
        assert proc.poll() is None, f"ended before step {step}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"no checkpoint of step {step} in 240 s"
        time.sleep(0.02)
    os.kill(worker_pids(proc.pid)[1], signal.SIGKILL)
    proc.wait(timeout=120)
    assert proc.returncode != 0 and not (run / "model.safetensors").exists()


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_log(run: Path, reference: Path) -> None:
    """Every train step and every epoch once, with the reference's values."""
    got, want = rows(run), rows(reference)
    key = [(r["split"], r["epoch"], r["step"]) for r in got]
    assert key == [(r["split"], r["epoch"], r["step"]) for r in want]
    for g, w in zip(got, want, strict=True):
        for field in ("loss", "accuracy", "mse", "perplexity", "lr", "samples"):
            if field in w:
                assert g[field] == pytest.approx(w[field], rel=1e-9, abs=1e-12, nan_ok=True), (
                    g, w)


STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def reap() -> Iterator[None]:
    """Kill whatever a test started and left running (a failed assertion, a timeout)."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def popen(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, so reap gets the workers too
    )
    STARTED.append(proc)
    return proc


def start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return popen([sys.executable, "-m", "ddptrain", *args], cwd, child_env())


def wait_for_step(ckpt_dir: Path, step: int, proc: subprocess.Popen[str], limit: float = 120):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = list_checkpoints(ckpt_dir)
        if found and int(found[0].stem.split("_")[1]) >= step:
            return
        assert proc.poll() is None, f"finished before step {step}: {proc.stderr.read()[-2000:]}"
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint at step {step} within {limit}s")


def worker_pids(agent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def torchrun(args: list[str], cwd: Path, extra: list[str]) -> subprocess.Popen[str]:
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", *extra,
           "-m", "ddptrain", *args]
    return popen(cmd, cwd, child_env())


