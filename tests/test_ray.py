"""`ddptrain ray`: the same training in Ray Train workers, on a real local Ray cluster.

Inside a worker the process group is Ray's: ddptrain adopts it (no second
init_process_group) and leaves it up for Ray. The heavy tests start the cluster the way a
user does (the subcommand starts a local one) and compare the weights with a torchrun run
of the same job: 2 gloo ranks sum a + b in either launcher, so they are bitwise equal.
A worker that SIGKILLs itself mid-run (`guardplug`, GUARD_KILL_AT) is retried by Ray's
FailureConfig, and the retry resumes from the newest checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_cli, run_torchrun
from dist_utils import run_ranks
from procs import assert_bitwise, assert_same_log, weights

from ddptrain.cli import main
from ddptrain.config import TrainingConfig
from ddptrain.errors import ConfigError
from ddptrain.launch.ray import RayFailed, _failure

# breast_cancer on 2 ranks x 16: 15 steps an epoch, 30 in all; a checkpoint every 5.
JOB = ["--dataset", "breast_cancer", "--model", "guardplug:killable_mlp", "--width", "16",
       "--batch_size", "16", "--epochs", "2", "--lr", "0.05", "--save_every_steps", "5",
       "--log_interval", "5", "--no-tensorboard"]


def _one_line(proc_err: str) -> str:
    lines = [x for x in proc_err.strip().splitlines() if x]
    assert len(lines) == 1, proc_err
    assert lines[0].startswith("ddptrain: error: "), proc_err
    return lines[0]


# ---------------------------------------------------------------- before any Ray start
@pytest.mark.parametrize(("argv", "needle"), [
    (["--workers", "0"], "--workers 0 is invalid"),
    (["--workers", "2", "--batch_size", "0"], "--batch_size 0 is invalid"),
    (["--workers", "2", "--max_failures", "-2"], "--max_failures -2 is invalid"),
    (["--workers", "2", "--global_batch_size", "24", "--batch_size", "8"],
     "is not a multiple of 2 data-parallel rank(s)"),
    ([], "the following arguments are required: --workers"),
])
def test_bad_input_ends_before_ray_starts(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(["ray", *argv, "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in _one_line(err)


def test_an_occupied_run_dir_is_refused_before_ray_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run_id: other\n")
    assert main(["ray", "--workers", "2", "--output_dir", str(run)]) == 2
    assert "already holds a run" in _one_line(capsys.readouterr().err)
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]  # no ray/ either


def test_without_ray_installed_one_line_says_how_to_install_it(tmp_path: Path) -> None:
    # A `ray` package that cannot be imported, first on the path: Ray is not installed.
    shadow = tmp_path / "shadow" / "ray"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    proc = run_cli(["ray", "--workers", "2", "--output_dir", str(tmp_path / "run")],
                   cwd=tmp_path, env={"PYTHONPATH": f"{shadow.parent}:{_pythonpath()}"})
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'ddptrain[ray]'" in _one_line(proc.stderr)


def _pythonpath() -> str:
    import os

    return os.environ.get("PYTHONPATH", "")


def test_a_worker_config_error_is_reported_as_one_line_with_exit_2() -> None:
    ray_train = pytest.importorskip("ray.train")
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    cause = ConfigError("--dataset 'x.npz' is invalid: no such file")
    # what trainer.fit() raises when Ray gives up: each worker's error, wrapped by Ray
    failed = ray_train.WorkerGroupError("rank 1 failed", {
        0: UserExceptionWithTraceback(RuntimeError("peer gone"), "Traceback ..."),
        1: UserExceptionWithTraceback(cause, "Traceback ..."),
    })
    assert _failure(failed, max_failures=2) is cause


@pytest.mark.parametrize("survivor", ["torch's error", "ddptrain's PeerLost"])
def test_a_worker_that_died_is_reported_as_a_lost_peer_with_exit_3(survivor: str) -> None:
    ray_train = pytest.importorskip("ray.train")
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.exceptions import (
        UserExceptionWithTraceback,
        WorkerHealthCheckFailedError,
    )

    from ddptrain.errors import PeerLost

    # as Ray gives up after rank 1 was SIGKILLed: rank 0 lost its gloo peer (as torch
    # says it, or as `ddptrain.fit` raises it: the dead worker is still the one named),
    # rank 1's actor stopped answering its health check
    lost = (RuntimeError("gloo: Connection reset by peer") if survivor == "torch's error"
            else PeerLost("lost contact with the other ranks (gloo: Connection reset)"))
    failed = ray_train.WorkerGroupError("workers failed", {
        0: UserExceptionWithTraceback(lost, "tb"),
        1: WorkerHealthCheckFailedError("A worker health check failed.", ActorDiedError()),
    })
    error = _failure(failed, max_failures=0)
    assert isinstance(error, RayFailed) and error.exit_code == 3
    assert str(error).startswith(
        "Ray worker rank 1 died (The actor died unexpectedly before finishing this task.) "
        "with no retries"
    )


@pytest.mark.parametrize("how", ["message", "exception"])
def test_a_worker_rays_memory_monitor_killed_is_one_line_with_exit_71(how: str) -> None:
    ray_train = pytest.importorskip("ray.train")
    from ray.exceptions import ActorDiedError, OutOfMemoryError
    from ray.train.v2._internal.exceptions import (
        UserExceptionWithTraceback,
        WorkerHealthCheckFailedError,
    )

    # rank 1's actor as the raylet reports a worker it killed for memory, or Ray's own type
    killed: BaseException = OutOfMemoryError("Task was killed due to the node running low on "
                                             "memory.") if how == "exception" else ActorDiedError()
    if how == "message":
        killed.error_msg = ("The actor is dead because its worker process has died. Worker "
                            "exit type: NODE_OUT_OF_MEMORY Worker exit detail: Task was killed "
                            "due to the node running low on memory.")
    failed = ray_train.WorkerGroupError("workers failed", {
        0: UserExceptionWithTraceback(RuntimeError("gloo: Connection reset by peer"), "tb"),
        1: WorkerHealthCheckFailedError("A worker health check failed.", killed),
    })
    error = _failure(failed, max_failures=2)
    assert isinstance(error, RayFailed) and error.exit_code == 71
    assert str(error).startswith("Ray's memory monitor killed worker rank 1 (its node ran low "
                                 "on host memory) after 2 restart(s): lower --batch_size")
    assert "\n" not in str(error)


def test_bad_input_a_worker_refused_ends_the_retry_at_once(tmp_path: Path) -> None:
    """A worker's ddptrain error is raised from the worker's own frame (Ray logs the
    traceback: one frame, then the line), and bad input is written down, so that Ray's
    retry ends at once with the same line on every rank instead of running again with
    --resume_from auto."""
    import traceback

    from ddptrain.checkpoint.common import CheckpointError
    from ddptrain.launch.ray import REFUSED, RayJob, _train_worker

    calls = []

    def refuse(config: TrainingConfig, hooks: object) -> dict[str, object]:
        calls.append(config.resume_from)
        raise CheckpointError("checkpoint 'x.pt' cannot be read: give a file ddptrain wrote")

    job = {"job": RayJob(("--dataset", "breast_cancer", "--output_dir", str(tmp_path / "run")),
                         str(tmp_path), str(tmp_path / "attempts" / "started"), refuse)}
    with pytest.raises(CheckpointError) as first:
        _train_worker(job)
    frames = traceback.extract_tb(first.value.__traceback__)
    assert [f.name for f in frames][1:] == ["_train_worker"], frames  # under this test
    assert _train_worker(job) == {REFUSED: "checkpoint 'x.pt' cannot be read: give a file "
                                           "ddptrain wrote"}
    assert calls == [None]  # the retry did not train


# ---------------------------------------------------------------- adopting a group
def _adopt(rank: int, run: str) -> dict[str, object]:
    from ddptrain.api import fit

    dist.init_process_group("gloo")  # as Ray's worker does, before ddptrain runs
    try:
        fit(TrainingConfig(dataset="breast_cancer", epochs=1, batch_size=32, width=8,
                           output_dir=run, tensorboard=False).validate())
        alive = dist.is_initialized()
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)  # the group still works for its maker
        return {"alive": alive, "sum": total.item()}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fit_adopts_a_process_group_it_did_not_create_and_leaves_it_up(tmp_path: Path) -> None:
    results = run_ranks(_adopt, 2, tmp_path, str(tmp_path / "run"))
    assert results == [{"alive": True, "sum": 3.0}] * 2
    assert (tmp_path / "run" / "model.safetensors").exists()


# ---------------------------------------------------------------- a real Ray cluster
@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job under torchrun on 2 ranks, uninterrupted."""
    base = tmp_path_factory.mktemp("ray-reference")
    proc = run_torchrun(2, ["train", *JOB, "--output_dir", str(base / "run")], cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base / "run"


@pytest.mark.slow
@pytest.mark.heavy
def test_a_sigkilled_worker_is_retried_by_ray_and_resumes_bitwise(
    reference: Path, tmp_path: Path
) -> None:
    """Two Ray workers, one SIGKILLed and retried, end with the weights and the log of
    the same job under torchrun (one Ray cluster serves both proofs)."""
    run = tmp_path / "run"
    # rank 1 dies at step 23's forward; the newest checkpoint is step 20's, and the retried
    # worker (same environment) has only 10 forwards left, so it is not killed again
    proc = run_cli(["ray", "--workers", "2", "--max_failures", "1", *JOB, "--output_dir",
                    str(run)], cwd=tmp_path, env={"GUARD_KILL_AT": "23"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "Ray restarted the worker group: resuming from the newest checkpoint" in out
    assert "done: 2 epochs, 30 steps on 2 rank(s)" in proc.stdout
    # Ray Train's placement-group cleaner is left out on a cluster of our own: without
    # the dashboard it warned every second that it cannot ask the State API
    assert "Failed to query Ray Train Controller" not in out
    (attempts,) = (run / "ray").glob("*/attempts")
    assert [line.split()[-1] for line in attempts.read_text().splitlines()] == ["0", "20"]
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)


def test_a_ray_address_nothing_answers_at_is_one_line_at_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ray.init` would retry a dead address for minutes and end in a traceback."""
    monkeypatch.setenv("RAY_ADDRESS", "ray://127.0.0.1:9")  # the discard port: closed
    t0 = time.monotonic()
    assert main(["ray", "--workers", "2", "--output_dir", str(tmp_path / "run")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "RAY_ADDRESS 'ray://127.0.0.1:9': nothing answers at 127.0.0.1:9" in line, line
    assert time.monotonic() - t0 < 30
