"""Shared fixtures: subprocess runners for the CLI and torchrun, and small datasets; the
test tiers, and the guard that keeps several processes out of the fast one."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.multiprocessing

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


# ---------------------------------------------------------------- tiers
# A test's tier is what it costs, and every test runs in exactly one stage of CI:
#   fast  (no mark)  one process, pure logic or one in-process run: `make test-fast`
#   slow             several processes (ranks, torchrun, daemons) or a CLI end to end
#   heavy            the slowest of those (heavy implies slow): `make test-heavy`
# `make test` runs the fast tier, then `-m "slow and not heavy"`.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("heavy") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        # Under pytest-xdist (`-n 2 --dist loadgroup`): a module that starts a cluster of
        # its own (Slurm's daemons, a local Ray) keeps its tests on one worker.
        group = _ONE_WORKER.get(item.path.stem)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


_ONE_WORKER = {"test_slurm": "slurm", "test_ray": "ray"}
_SLOW = {"now": True}  # whether the test being set up or run may start several processes


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before the test's fixtures: a module-scoped fixture that spawns ranks is checked
    # against the first test that asks for it.
    _SLOW["now"] = item.get_closest_marker("slow") is not None


def _several(what: str) -> None:
    if not _SLOW["now"]:
        pytest.fail(
            f"{what} starts several processes in a test not marked slow: the fast tier is "
            "single-process; mark the test @pytest.mark.slow", pytrace=False,
        )


_MULTI = {"torchrun", "srun", "sbatch", "slurmd", "slurmctld"}


class _GuardedPopen(subprocess.Popen):  # type: ignore[type-arg]
    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        names = {Path(os.fsdecode(w)).name for w in words[:8]}
        if names & _MULTI or any(str(w).startswith("--nproc_per_node") for w in words):
            _several(" ".join(map(str, words[:3])))
        super().__init__(args, *rest, **kwargs)


subprocess.Popen = _GuardedPopen  # type: ignore[misc]
_SPAWN = sys.modules["torch.multiprocessing.spawn"]  # mp.spawn calls its start_processes
_start = _SPAWN.start_processes


def _guarded_start(fn: Any, args: Any = (), nprocs: int = 1, *rest: Any, **kwargs: Any) -> Any:
    if nprocs > 1:
        _several("torch.multiprocessing.spawn")
    return _start(fn, args, nprocs, *rest, **kwargs)


_SPAWN.start_processes = torch.multiprocessing.start_processes = _guarded_start


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


# ---------------------------------------------------------------- curves.png
# Drawing a run's curves.png costs a CPU-second a run (a child importing matplotlib) and
# the job waits for it. Test runs leave it out unless they name --curves: the jobs the
# helpers below start get --no-curves, and in-process runs find no matplotlib unless the
# test is marked `curves`. tests/test_observability.py checks the drawing itself.
def no_curves(args: list[str]) -> list[str]:
    """`ddptrain train ARGS` with --no-curves, unless ARGS name --curves/--no-curves."""
    if args[:1] != ["train"] or {"--curves", "--no-curves"} & set(args):
        return list(args)
    return ["train", "--no-curves", *args[1:]]


@pytest.fixture(autouse=True)
def _no_curves_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("curves") is None:
        monkeypatch.setattr("ddptrain.observe.plot.matplotlib_available", lambda: False)


def run_cli(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """`python -m ddptrain ARGS` as a user would run it (`no_curves`)."""
    return subprocess.run(
        [sys.executable, "-m", "ddptrain", *no_curves(args)], cwd=cwd, env=child_env(env),
        text=True, capture_output=True, timeout=timeout,
    )


def one_error_line(capsys: pytest.CaptureFixture[str], args: list[str], code: int = 2) -> str:
    """`ddptrain.cli.main(args)` in this process: exit `code` and one `ddptrain: error:`
    line on stderr, which it returns."""
    from ddptrain.cli import main

    capsys.readouterr()
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == code and len(err.splitlines()) == 1, (rc, err)
    assert err.startswith("ddptrain: error: "), err
    return err


def run_torchrun(
    nproc: int, args: list[str], cwd: Path, env: dict[str, str] | None = None,
    timeout: float = 300, torchrun_args: list[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc_per_node=N -m ddptrain ARGS` (`no_curves`)."""
    cmd = [
        str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
        *(torchrun_args or []), "-m", "ddptrain", *no_curves(args),
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


@pytest.fixture(scope="session")
def plain_gpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, Any]]:
    """`plain_gpt(**fields)`: plain training (one process, the whole global batch) of the
    layout tests' GPT job with `fields`, trained once per configuration for the whole
    session: every layout test that must equal it shares it."""
    from nd_workers import GLOBAL_BATCH, GPT, fit_runs

    done: dict[str, dict[str, Any]] = {}

    def plain(**fields: Any) -> dict[str, Any]:
        key = json.dumps(fields, sort_keys=True)
        if key not in done:
            out = tmp_path_factory.mktemp("plain") / "run"
            job = {**GPT, "batch_size": GLOBAL_BATCH, "output_dir": str(out), **fields}
            done[key] = fit_runs(0, [job])[0]
        return done[key]

    return plain


@pytest.fixture
def plain(plain_gpt: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The plain run of the layout tests' GPT job that every layout must equal."""
    return plain_gpt()


@contextlib.contextmanager
def tmpfs(mount: Path, options: str) -> Iterator[Path]:
    """A real tmpfs mounted at `mount` with `options` (`size=1m`: a disk that fills up),
    unmounted after; the test is skipped where mounting needs root."""
    mount.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chat tokenizer's directory, built here (`chatplug.make_tokenizer`)."""
    from chatplug import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tokdir: Path) -> Any:
    from ddptrain.data.tokenizer import load_tokenizer

    return load_tokenizer(f"hf:{tokdir}")
