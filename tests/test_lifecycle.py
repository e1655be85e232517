"""One run, one history: run identity, the lock, honest resume, exact on any world size,
clean ends. Real processes and real torchrun; each test reproduces an operator's case."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import REPO, child_env, run_cli, run_torchrun, tmpfs, write_npz
from dist_utils import run_ranks
from procs import (  # noqa: F401  (reap: an autouse fixture)
    popen,
    rank_of,
    reap,
    rows,
    start,
    torchrun,
    wait_for_step,
    weights,
    worker_pids,
)
from workers import run_training

from ddptrain.checkpoint.manager import load_checkpoint
from ddptrain.checkpoint.pt import list_checkpoints
from ddptrain.errors import EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_IO, EXIT_PREEMPTED

pytestmark = pytest.mark.slow

QUICK = ["train", "--epochs", "2", "--batch_size", "32", "--log_interval", "4"]
# MiniResNet at width 8 on digits: a few seconds, long enough to act on mid-run.
LONG = ["train", "--dataset", "digits", "--model", "miniresnet", "--width", "8",
        "--batch_size", "8", "--epochs", "3", "--lr", "0.05", "--save_every_steps", "5"]


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(directory)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(directory.rglob("*")) if p.is_file()
    }


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddptrain: error:"), proc.stderr[-2000:]
    return lines[0]


# ---------------------------------------------------------------- 1. run identity
def test_a_fresh_run_never_writes_into_another_runs_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert run_cli([*QUICK, "--output_dir", str(run)], cwd=tmp_path).returncode == 0
    before = _snapshot(run)
    again = run_cli([*QUICK, "--dataset", "digits", "--output_dir", str(run)], cwd=tmp_path)
    assert again.returncode == 2
    line = _one_error_line(again)
    assert "already holds a run" in line and "--resume_from auto" in line
    assert _snapshot(run) == before  # nothing there was touched


def test_each_fresh_run_gets_its_own_directory_and_id(tmp_path: Path) -> None:
    for dataset in ("breast_cancer", "digits"):
        proc = run_cli([*QUICK, "--epochs", "1", "--dataset", dataset, "--model", "mlp"],
                       cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
    dirs = sorted((tmp_path / "runs").iterdir())
    assert [d.name.split("-")[0] for d in dirs] == ["breast_cancer", "digits"]
    ids = set()
    for d in dirs:
        summary = json.loads((d / "summary.json").read_text())
        config = (d / "config.yaml").read_text()
        assert f"run_id: {summary['run_id']}" in config
        payload = load_checkpoint(d / "checkpoints" / "latest.pt", torch.device("cpu"))
        assert payload["config"]["run_id"] == summary["run_id"]
        assert {r["run_id"] for r in rows(d)} == {summary["run_id"]}
        ids.add(summary["run_id"])
    assert len(ids) == 2


@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.heavy), 2])
def test_a_failed_start_leaves_the_directory_to_the_corrected_command(
    tmp_path: Path, ranks: int
) -> None:
    def launch(args: list[str]) -> subprocess.CompletedProcess[str]:
        if ranks == 1:
            return run_cli(args, cwd=tmp_path)
        return run_torchrun(2, args, cwd=tmp_path)

    run = tmp_path / "run"  # a directory of the user's, holding a file of theirs
    run.mkdir()
    (run / "notes.txt").write_text("mine\n")
    args = [*QUICK, "--epochs", "1", "--output_dir", str(run)]
    # fails once the model is built, after the lock and the process group
    failed = launch([*args, "--model", "gpt"])
    assert failed.returncode != 0
    errors = [x for x in failed.stderr.splitlines() if "ddptrain: " in x]
    assert len(errors) == ranks and all("--model gpt needs token windows" in x for x in errors)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    proc = launch([*args, "--model", "mlp"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run / "config.yaml").is_file() and (run / "notes.txt").read_text() == "mine\n"
    if ranks == 1:  # a start that fails in a directory it made leaves no directory
        other = tmp_path / "other"
        assert run_cli([*QUICK, "--model", "gpt", "--output_dir", str(other)],
                       cwd=tmp_path).returncode == 2
        assert not other.exists()
        # a model of 3 inputs on 30 features: fails in its first forward, once config.yaml
        # and the metrics file were written
        proc = run_cli([*QUICK, "--model", "guardplug:recorder", "--output_dir", str(other)],
                       cwd=tmp_path)
        assert proc.returncode != 0 and "mat1 and mat2" in proc.stderr
        assert not other.exists()


@pytest.mark.heavy
def test_a_refused_resume_leaves_the_runs_config_and_job_as_they_were(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*QUICK, "--epochs", "1", "--output_dir", str(run)]
    assert run_torchrun(2, args, cwd=tmp_path).returncode == 0
    marks = {name: (run / name).read_bytes() for name in ("config.yaml", ".job")}
    refused = run_torchrun(2, [*QUICK, "--epochs", "2", "--width", "32", "--output_dir", str(run),
                               "--resume_from", "auto"], cwd=tmp_path)
    assert refused.returncode != 0 and "does not fit this model" in refused.stderr
    assert {name: (run / name).read_bytes() for name in marks} == marks
    proc = run_cli(["train", "--config", str(run / "config.yaml"), "--epochs", "2",
                    "--resume_from", "auto"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from" in proc.stdout + proc.stderr


# ---------------------------------------------------------------- 2. the lock
def test_a_second_job_is_refused_while_the_first_owns_the_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = start([*LONG, "--output_dir", str(run)], tmp_path)
    wait_for_step(run / "checkpoints", 5, first)
    second = run_cli([*LONG, "--output_dir", str(run), "--resume_from", "auto"], cwd=tmp_path)
    assert second.returncode == 2
    assert f"pid {first.pid}" in _one_error_line(second)
    first.kill()  # SIGKILL: the kernel drops the lock with its holder
    first.wait()
    third = run_cli([*LONG, "--epochs", "1", "--output_dir", str(run), "--resume_from", "auto"],
                    cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-2000:]


def test_workers_stop_after_a_checkpoint_when_their_torchrun_agent_dies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    agent = torchrun([*LONG, "--epochs", "20", "--output_dir", str(run)], tmp_path, [])
    wait_for_step(run / "checkpoints", 10, agent)
    workers = worker_pids(agent.pid)
    assert len(workers) == 2
    os.kill(agent.pid, signal.SIGKILL)  # the agent only: its workers are orphaned
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
        time.sleep(0.2)
        for p in workers:  # reap nothing: they are not our children; zombies count as gone
            stat = Path(f"/proc/{p}/stat")
            if stat.exists() and stat.read_text().split()[2] == "Z":
                workers = [w for w in workers if w != p]
    assert not [p for p in workers if Path(f"/proc/{p}").exists()], "orphaned workers still run"
    newest = load_checkpoint(run / "checkpoints" / "latest.pt", torch.device("cpu"))
    assert newest["step"] > 10  # they checkpointed on the way out


# ---------------------------------------------------------------- 3. restarts
@pytest.mark.heavy
def test_a_torchrun_restart_resumes_the_newest_checkpoint_not_resume_from(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    proc = run_cli([*LONG, "--epochs", "1", "--output_dir", str(run)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    early = list_checkpoints(run / "checkpoints")[-1]  # step 5
    agent = torchrun(
        [*LONG, "--output_dir", str(run), "--resume_from", str(early)],
        tmp_path, ["--max_restarts=1"],
    )
    # past the first job's 180 steps (2 ranks: 90 steps an epoch, 270 in all)
    wait_for_step(run / "checkpoints", 200, agent)
    (victim,) = [p for p in worker_pids(agent.pid) if rank_of(p) == 1]
    os.kill(victim, signal.SIGKILL)
    out, err = agent.communicate(timeout=240)
    assert agent.returncode == 0, err[-3000:]
    resumed = [line for line in (out + err).splitlines() if "resumed from" in line]
    assert str(early) in resumed[0]  # the first attempt honours --resume_from
    step = int(resumed[-1].split("step ")[-1])
    assert step >= 200  # the restart went on from the newest, not back to step 5


# ---------------------------------------------------------------- 4. honest resume
def test_changed_settings_on_resume_are_applied_or_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*QUICK, "--warmup_epochs", "1", "--output_dir", str(run)]
    assert run_cli(args, cwd=tmp_path).returncode == 0
    steps_before = rows(run)[-1]["step"]
    refused = run_cli([*args, "--epochs", "4", "--optimizer", "adamw", "--resume_from", "auto"],
                      cwd=tmp_path)
    assert refused.returncode == 2 and "--optimizer sgd" in _one_error_line(refused)
    proc = run_cli([*args, "--epochs", "4", "--lr", "0.5", "--momentum", "0",
                    "--resume_from", "auto"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--lr 0.01 -> 0.5" in proc.stdout
    config = (run / "config.yaml").read_text()
    assert "lr: 0.5" in config and "momentum: 0.0" in config
    payload = load_checkpoint(run / "checkpoints" / "latest.pt", torch.device("cpu"))
    groups = payload["optimizer_state_dict"]["param_groups"]
    assert all(g["momentum"] == 0.0 for g in groups)
    after = [r for r in rows(run) if r["split"] == "train" and r["step"] > steps_before]
    lrs = [r["lr"] for r in after]
    # the new peak's cosine from the current step on: no warm-up again, decaying to 0
    assert lrs == sorted(lrs, reverse=True) and 0.2 < lrs[0] < 0.5 and lrs[-1] < 0.05


def _global_batch_job(npz: Path, out: Path, **kw: Any) -> dict[str, Any]:
    cfg = dict(dataset=str(npz), model="mlp", epochs=2, lr=0.05, warmup_epochs=0.5,
               use_amp=False, log_interval=2, seed=7, output_dir=str(out), tensorboard=False,
               batch_size=8, global_batch_size=32, save_every_steps=3)
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_mid_epoch_resume_on_another_world_size_continues_the_same_run(
    tmp_path: Path, before: int, after: int
) -> None:
    npz = write_npz(tmp_path / "d.npz", 401)  # 321 training samples: nothing divides
    reference = tmp_path / "reference"
    run_ranks(run_training, before, tmp_path, _global_batch_job(npz, reference))
    mid = reference / "checkpoints" / "step_000000006.pt"  # epoch 1 has 11 steps
    assert load_checkpoint(mid, torch.device("cpu"))["samples_in_epoch"] == 6 * 32
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(mid, resumed / "checkpoints" / mid.name)
    run_ranks(run_training, after, tmp_path,
              _global_batch_job(npz, resumed, resume_from=str(resumed / "checkpoints" / mid.name)))
    a, b = weights(reference), weights(resumed)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    ref_lr = {r["step"]: r["lr"] for r in rows(reference) if r["split"] == "train"}
    for r in rows(resumed):
        if r["split"] == "train":
            assert r["lr"] == pytest.approx(ref_lr[r["step"]], rel=1e-9)


@pytest.mark.heavy
def test_world_size_change_without_a_global_batch_keeps_the_schedule_end(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    args = [*QUICK, "--batch_size", "16", "--epochs", "2", "--output_dir", str(run)]
    assert run_cli(args, cwd=tmp_path).returncode == 0
    proc = run_torchrun(2, [*args, "--epochs", "4", "--resume_from", "auto"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "schedule continues at step" in proc.stdout + proc.stderr
    lrs = [r["lr"] for r in rows(run) if r["split"] == "train"]
    assert min(lrs[:-1]) > 0 and lrs[-1] < 0.001  # never 0 before the end, ~0 at it


# ---------------------------------------------------------------- 6. clean ends
def test_resuming_a_finished_run_says_so_and_touches_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert run_cli([*QUICK, "--output_dir", str(run)], cwd=tmp_path).returncode == 0
    before = _snapshot(run)
    proc = run_cli([*QUICK, "--output_dir", str(run), "--resume_from", "auto"], cwd=tmp_path)
    assert proc.returncode == 0 and "already finished" in proc.stdout
    assert _snapshot(run) == before


@pytest.mark.heavy
def test_a_finished_runs_checkpoint_of_another_model_is_refused_not_finished(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    assert run_cli([*QUICK, "--output_dir", str(run)], cwd=tmp_path).returncode == 0
    before = _snapshot(run)
    ckpt = next((run / "checkpoints").glob("step_*.pt"))
    for other in (["--width", "32"], ["--dataset", "digits", "--model", "mlp"]):
        proc = run_cli([*QUICK, *other, "--output_dir", str(tmp_path / "again"),
                        "--resume_from", str(ckpt)], cwd=tmp_path)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "already finished" not in proc.stdout
        assert "does not fit this model" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    proc = run_cli([*QUICK, "--optimizer", "adamw", "--output_dir", str(run),
                    "--resume_from", "auto"], cwd=tmp_path)
    assert proc.returncode == 2 and "was trained with --optimizer sgd" in proc.stderr
    assert _snapshot(run) == before
    assert not (tmp_path / "again").exists()


def test_summary_covers_every_resume_and_the_best_checkpoint_survives(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*QUICK, "--keep_last", "1", "--output_dir", str(run)]
    assert run_cli(args, cwd=tmp_path).returncode == 0
    first = json.loads((run / "summary.json").read_text())
    assert run_cli([*args, "--epochs", "4", "--resume_from", "auto"], cwd=tmp_path).returncode == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["samples"] == 4 * 455 and summary["train_time_s"] > first["train_time_s"]
    assert summary["run_id"] == first["run_id"]
    val = {r["epoch"]: r["accuracy"] for r in rows(run) if r["split"] == "val"}
    assert summary["best_val_accuracy"] == max(val.values())
    best = load_checkpoint(run / "checkpoints" / "best.pt", torch.device("cpu"))
    assert best["epoch"] == summary["best_epoch"]
    assert len(list_checkpoints(run / "checkpoints")) == 1  # pruned; best.pt is not


def test_a_full_disk_is_one_line_on_every_rank_and_the_last_checkpoint_survives(
    tmp_path: Path,
) -> None:
    with tmpfs(tmp_path / "small", "size=1200k") as mount:
        run = mount / "run"
        proc = run_torchrun(2, [*LONG, "--epochs", "20", "--output_dir", str(run)],
                            cwd=tmp_path)
        assert proc.returncode != 0
        errors = [x for x in proc.stderr.splitlines() if "ddptrain: " in x]
        assert len(errors) == 2, proc.stderr[-3000:]
        for line in errors:
            assert "rank 0 could not write the checkpoint" in line
            assert "No space left on device (errno 28)" in line
        assert f"exitcode  : {EXIT_IO}" in proc.stderr or f"exitcode: {EXIT_IO}" in proc.stderr
        assert "Traceback" not in "\n".join(errors)
        newest = list_checkpoints(run / "checkpoints")[0]
        assert load_checkpoint(newest, torch.device("cpu"))["step"] > 0


def test_divergence_leaves_a_good_checkpoint_that_resumes_with_a_lower_lr(
    tmp_path: Path,
) -> None:
    npz = write_npz(tmp_path / "d.npz", 400)
    run = tmp_path / "run"
    common = ["train", "--dataset", str(npz), "--model", "mlp", "--batch_size", "16",
              "--max_bad_steps", "2", "--output_dir", str(run)]
    assert run_cli([*common, "--epochs", "1"], cwd=tmp_path).returncode == 0
    # An LR far too high: the weights blow up within a few steps.
    proc = run_cli([*common, "--epochs", "2", "--lr", "1e6", "--save_every_steps", "1",
                    "--resume_from", "auto"], cwd=tmp_path)
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-2000:]
    newest = load_checkpoint(run / "checkpoints" / "latest.pt", torch.device("cpu"))
    assert newest["bad_streak"] == 0  # no checkpoint at a skipped step
    assert "best.pt" in proc.stderr  # where the last state before the blow-up is
    # The newest good step may already hold huge (finite) weights; the best epoch does not.
    best = run / "checkpoints" / "best.pt"
    again = run_cli([*common, "--epochs", "2", "--lr", "1e-3", "--resume_from", str(best)],
                    cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "--lr 0.01 -> 0.001" in again.stdout  # applied, not the checkpoint's
    assert np.isfinite(json.loads((run / "summary.json").read_text())["val_loss"])


def test_ctrl_c_stops_after_a_checkpoint_with_exit_130(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start([*LONG, "--output_dir", str(run)], tmp_path)
    wait_for_step(run / "checkpoints", 10, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err[-2000:]
    assert "stopped by SIGINT at step" in err and "Traceback" not in err
    stopped = int(err.split("at step ")[1].split()[0])
    latest = load_checkpoint(run / "checkpoints" / "latest.pt", torch.device("cpu"))
    assert latest["step"] == stopped


def test_sigterm_with_dataloader_workers_checkpoints_and_exits_75(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start(["train", "--dataset", "taskplug:regression", "--dataset_args", "n=20000",
                  "--model", "mlp", "--num_workers", "2", "--batch_size", "8", "--epochs", "5",
                  "--save_every_steps", "50", "--output_dir", str(run)], tmp_path)
    wait_for_step(run / "checkpoints", 100, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    assert "stopped by SIGTERM" in err and "Traceback" not in err


def test_launch_script_returns_75_when_the_workers_stopped_for_preemption(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    proc = popen([str(REPO / "scripts" / "launch.sh"), *LONG[1:], "--epochs", "20",
                  "--output_dir", str(run)], tmp_path,
                 child_env({"NPROC_PER_NODE": "2", "COMMAND": "train"}))
    wait_for_step(run / "checkpoints", 10, proc)
    proc.send_signal(signal.SIGTERM)  # as Slurm or Kubernetes would
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert np.isfinite(load_checkpoint(run / "checkpoints" / "latest.pt",
                                       torch.device("cpu"))["step"])
