"""Never lose work: SIGKILL at any step, torchrun restarts, SIGTERM, dead peers, NaNs.

The reference for every interrupted run is the same job run without interruption; the
weights at the end must be bitwise equal (CPU, fp32) and the metrics log must carry
every step exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import child_env, run_cli, run_torchrun, write_npz
from dist_utils import free_port, run_ranks
from procs import (  # noqa: F401  (reap: an autouse fixture)
    assert_bitwise,
    assert_same_log,
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
from workers import train_and_report

from ddptrain.checkpoint.pt import list_checkpoints
from ddptrain.cli import main
from ddptrain.data.sources import split_indices
from ddptrain.errors import EXIT_DIVERGED, EXIT_PEER_LOST, EXIT_PREEMPTED

pytestmark = pytest.mark.slow

# MiniResNet at width 8 on digits: 360 optimizer steps, slow enough to be interrupted
# anywhere, fast enough to run many times.
JOB = ["train", "--dataset", "digits", "--model", "miniresnet", "--width", "8",
       "--batch_size", "8", "--epochs", "2", "--lr", "0.05", "--log_interval", "10",
       "--save_every_steps", "7", "--keep_last", "3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = run_cli([*JOB, "--output_dir", str(run)], cwd=run.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.heavy
@pytest.mark.parametrize("kill_after", [250])  # in epoch 2 (180 steps each), past an epoch end
def test_sigkill_then_resume_is_bitwise_exact(
    reference: Path, tmp_path: Path, kill_after: int
) -> None:
    run = tmp_path / "run"
    proc = start([*JOB, "--output_dir", str(run)], tmp_path)
    wait_for_step(run / "checkpoints", kill_after, proc)
    proc.kill()
    proc.wait()
    # --keep_last 3 (one more while a kill lands between a write and the pruning)
    assert len(list_checkpoints(run / "checkpoints")) <= 4
    resumed = run_cli([*JOB, "--output_dir", str(run), "--resume_from", "auto"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert len(list_checkpoints(run / "checkpoints")) == 3
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)


@pytest.mark.heavy
def test_sigterm_checkpoints_exits_75_and_resumes_exactly(reference: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start([*JOB, "--output_dir", str(run)], tmp_path)
    wait_for_step(run / "checkpoints", 100, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    assert "stopped by SIGTERM at step" in err and "Traceback" not in err
    stopped_at = int(err.split("at step ")[1].split()[0])
    newest = list_checkpoints(run / "checkpoints")[0]
    assert torch.load(newest, weights_only=True)["step"] == stopped_at
    resumed = run_cli([*JOB, "--output_dir", str(run), "--resume_from", "auto"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)


TWO_RANK_JOB = [*JOB[:-4], "--epochs", "1", "--save_every_steps", "5"]


@pytest.fixture(scope="module")
def reference_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("reference2") / "run"
    proc = run_torchrun(2, [*TWO_RANK_JOB, "--output_dir", str(run)], cwd=run.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.heavy
def test_torchrun_restart_after_a_killed_worker_resumes_exactly(
    reference_two_ranks: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    agent = torchrun([*TWO_RANK_JOB, "--output_dir", str(run)], tmp_path, ["--max_restarts=1"])
    wait_for_step(run / "checkpoints", 40, agent)
    victims = [p for p in worker_pids(agent.pid) if rank_of(p) == 1]
    assert victims, "no rank-1 worker found"
    os.kill(victims[0], signal.SIGKILL)
    out, err = agent.communicate(timeout=240)
    assert agent.returncode == 0, err[-3000:]
    assert "the job goes on (torchrun restart or a node joined): resuming" in out + err
    assert_bitwise(weights(run), weights(reference_two_ranks))
    assert_same_log(run, reference_two_ranks)


@pytest.mark.heavy
def test_sigterm_to_one_rank_stops_all_ranks_at_the_same_step(
    reference_two_ranks: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    agent = torchrun([*TWO_RANK_JOB, "--output_dir", str(run)], tmp_path, [])
    wait_for_step(run / "checkpoints", 30, agent)
    rank1 = [p for p in worker_pids(agent.pid) if rank_of(p) == 1]
    os.kill(rank1[0], signal.SIGTERM)  # only rank 1 hears it; rank 0 must agree to stop
    _, err = agent.communicate(timeout=120)
    assert agent.returncode != 0
    assert err.count("stopped by SIGTERM at step") == 2, err[-3000:]
    steps = {int(x.split()[0]) for x in err.split("stopped by SIGTERM at step ")[1:]}
    assert len(steps) == 1, f"ranks stopped at different steps: {steps}"
    assert f"exitcode  : {EXIT_PREEMPTED}" in err or f"exitcode: {EXIT_PREEMPTED}" in err
    resumed = run_torchrun(
        2, [*TWO_RANK_JOB, "--output_dir", str(run), "--resume_from", "auto"], cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise(weights(run), weights(reference_two_ranks))
    assert_same_log(run, reference_two_ranks)


# ---------------------------------------------------------------------- dead peers
def _manual_ranks(
    args: list[str], cwd: Path, port: int, extra: dict[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    procs = []
    for rank in (0, 1):
        env = child_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(extra or {})})
        procs.append(popen([sys.executable, "-m", "ddptrain", *args], cwd, env))
    return procs


@pytest.mark.parametrize("how", ["dies", "hangs", "hangs_at_a_save", "rank_0_hangs"])
def test_surviving_rank_exits_within_the_timeout(tmp_path: Path, how: str) -> None:
    """Rank 1 dies or hangs mid-training, or hangs while rank 0 writes a checkpoint alone
    (it had nothing to write: rank 0 waits for it --timeout_s, not --checkpoint_timeout_s);
    or rank 0 hangs mid-training. The survivor ends within the timeout with one line that
    names the rank that stopped, the collective it waited in and where."""
    run = tmp_path / "run"
    timeout_s = 6
    args = [*JOB, "--epochs", "20", "--timeout_s", str(timeout_s), "--output_dir", str(run)]
    at_a_save = how == "hangs_at_a_save"
    stuck = 0 if how == "rank_0_hangs" else 1
    extra: dict[str, str] | None = None
    if at_a_save:  # rank 1 stops itself as the first checkpoint reads its model's state
        args += ["--dataset", "guardplug:augmented", "--model", "guardplug:dropout_net"]
        extra = {"GUARD_STOP_AT_SAVE": "1"}
    elif how != "dies":  # it stops itself at its 15th step's forward: never inside a save,
        # where its peers would wait --checkpoint_timeout_s for the writer (a slow disk)
        args += ["--model", "guardplug:killable_mlp"]
        extra = {"GUARD_KILL_AT": "15", "GUARD_KILL_RANK": str(stuck), "GUARD_SIGNAL": "SIGSTOP"}
    ranks = _manual_ranks(args, tmp_path, free_port(), extra)
    survivor, stopped = ranks[1 - stuck], ranks[stuck]
    try:
        if how == "dies":
            wait_for_step(run / "checkpoints", 14, survivor)
            os.kill(stopped.pid, signal.SIGKILL)
        else:
            while survivor.poll() is None and _state(stopped.pid) != "T":
                time.sleep(0.02)
        t0 = time.monotonic()
        _, err = survivor.communicate(timeout=timeout_s + 60)
        waited = time.monotonic() - t0
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    assert survivor.returncode == EXIT_PEER_LOST, err[-2000:]
    assert "lost contact with the other ranks" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert waited < timeout_s + 30
    # The line names the rank that stopped, the collective the other waited in (its number
    # on its group) and where; the report says the same, with each rank's row
    report = run / "hang" / "report.txt"
    assert f"rank {stuck} did not reach collective #" in err, err
    assert f"which rank {1 - stuck} waited in at ddptrain/" in err, err
    assert f"report: {report}" in err, err
    text = report.read_text()
    assert text.splitlines()[0] in err and f"{stuck}  -  -  -  -  no record" in text, text
    record = json.loads((run / "hang" / f"rank{1 - stuck}.json").read_text())
    assert record["step"] >= (7 if at_a_save else 14), record  # at the first save: step 7
    assert record["collectives"] and record["stacks"], record
    assert main(["diagnose", str(run)]) == 0


@pytest.mark.heavy
@pytest.mark.parametrize(("how", "stuck", "launch"), [
    ("stalls", 2, "srun"), ("stalls", 2, "torchrun"), ("sigstop", 0, "srun"),
])
def test_a_stuck_rank_is_named_by_its_three_peers(
    tmp_path: Path, how: str, stuck: int, launch: str
) -> None:
    """4 ranks, srun-style or under torchrun. Rank 2's model sleeps past --timeout_s at its
    20th training forward (user code that stalls), or rank 0 SIGSTOPs itself there. The
    3 others each end within the timeout with one line naming the stuck
    rank, the collective they waited in and its number; the lowest of them writes the
    report, which says the same. Under torchrun (ddptrain's agent, as launch.sh starts it)
    the job ends with their code, 3, in the exit file too: the SIGKILL that torchrun sends
    the stalled rank after them is no out-of-memory kill, and no line says it is."""
    run = tmp_path / "run"
    timeout_s = 6
    args = ["train", "--dataset", "breast_cancer", "--model", "guardplug:killable_mlp",
            "--width", "16", "--batch_size", "8", "--epochs", "5", "--timeout_s", str(timeout_s),
            "--save_every_steps", "5", "--no-tensorboard", "--output_dir", str(run)]
    env = {"GUARD_KILL_AT": "20", "GUARD_KILL_RANK": str(stuck),
           **({"GUARD_STALL_S": "120"} if how == "stalls" else {"GUARD_SIGNAL": "SIGSTOP"})}
    others = [r for r in range(4) if r != stuck]
    if launch == "torchrun":
        exit_file = tmp_path / "exit"
        agent = popen([sys.executable, "-m", "ddptrain.launch.torchrun", "--standalone",
                       "--nproc_per_node=4", "-m", "ddptrain", *args], tmp_path,
                      child_env({**env, "DDPTRAIN_EXIT_FILE": str(exit_file)}))
        try:
            err = agent.communicate(timeout=240)[1]
        finally:
            agent.kill()
            agent.wait()
        errs = {r: "\n".join(x for x in err.splitlines()
                             if x.startswith(f"[rank {r}] ddptrain:" if r else "ddptrain:"))
                for r in others}
        codes = dict.fromkeys(others, EXIT_PEER_LOST)
        assert agent.returncode == EXIT_PEER_LOST, err[-2000:]
        assert exit_file.read_text() == f"{EXIT_PEER_LOST} 0\n"
        assert "SIGKILL" not in err and "Traceback" not in err, err[-2000:]
    else:
        port, procs = free_port(), []
        for rank in range(4):
            procs.append(popen([sys.executable, "-m", "ddptrain", *args], tmp_path, child_env({
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env})))
        try:
            errs = {r: procs[r].communicate(timeout=180)[1] for r in others}
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        codes = {r: procs[r].returncode for r in others}
    report = (run / "hang" / "report.txt").read_text()
    waiting = ", ".join(map(str, others))
    for rank, err in errs.items():
        lines = err.strip().splitlines()
        assert codes[rank] == EXIT_PEER_LOST and len(lines) == 1, (rank, err[-2000:])
        assert f"rank {stuck} did not reach collective #" in lines[0], lines
        assert f"which ranks {waiting} waited in at ddptrain/" in lines[0], lines
        assert report.splitlines()[0] in lines[0], (report, lines)
    if how == "sigstop":  # a stopped process notes nothing
        assert "it stopped, died or stayed in its own code" in report.splitlines()[0], report
        assert f"{stuck}  -  -  -  -  no record" in report, report
        return
    # the stalled rank noted where it is stuck: the user's line, its step, its stack
    note = json.loads((run / "hang" / f"stalled{stuck}.json").read_text())
    where = f"{Path(__file__).resolve().parent / 'guardplug.py'}:"
    assert note["where"].startswith(where) and note["where"].endswith(" (tick)"), note
    assert f"rank {stuck} has been in {note['where']} since step 19" in report, report
    assert f"{stuck}  -  19  -  {note['where']}  in its own code" in report, report
    assert any("time.sleep(stall)" in line for line in note["stack"]), note


def _state(pid: int) -> str:
    """The state letter of process `pid` (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# ---------------------------------------------------------------------- non-finite steps
def _nan_data(path: Path, bad_rows: list[int]) -> Path:
    write_npz(path, 400)
    with np.load(path) as f:
        x, y = f["x"].copy(), f["y"].copy()
    x[bad_rows, 1] = np.nan
    np.savez(path, x=x, y=y)
    return path


@pytest.mark.parametrize(("strategy", "optimizer"), [("ddp", "sgd"), ("fsdp", "adamw"),
                                                   ("zero", "adamw")])
def test_nan_on_one_rank_skips_the_step_on_all_ranks(
    tmp_path: Path, strategy: str, optimizer: str
) -> None:
    """The step is skipped on the device (fused SGD; fused AdamW over fsdp's DTensor
    shards; zero's local fused AdamW over its bucket) and counted a step later, the same
    on both ranks."""
    train_rows, _ = split_indices(400, 0.2, seed=42)
    bad_rows = [int(train_rows[3]), int(train_rows[150])]
    data = _nan_data(tmp_path / "nan.npz", bad_rows)
    cfg = dict(dataset=str(data), model="mlp", batch_size=16, epochs=2, use_amp=False,
               lr=0.05, log_interval=2, output_dir=str(tmp_path / "run"),
               strategy=strategy, optimizer=optimizer)
    ranks = run_ranks(train_and_report, 2, tmp_path, cfg)
    # Each NaN sample is in one rank's batch once per epoch: 2 to 4 bad steps in all.
    assert 2 <= ranks[0]["bad_steps"] == ranks[1]["bad_steps"] <= 4
    for k, w in ranks[0]["weights"].items():
        assert torch.isfinite(w).all(), k
        assert torch.equal(w, ranks[1]["weights"][k]), f"ranks disagree on {k}"
    logged = rows(tmp_path / "run")
    assert all(np.isfinite(r["loss"]) for r in logged)  # skipped batches stay out of metrics
    assert max(r.get("bad_steps", 0) for r in logged) > 0


def test_diverged_run_stops_with_exit_4_and_keeps_last_good_checkpoint(tmp_path: Path) -> None:
    good = write_npz(tmp_path / "good.npz", 400)
    bad = _nan_data(tmp_path / "bad.npz", bad_rows=list(range(400)))
    run = tmp_path / "run"
    common = ["train", "--model", "mlp", "--batch_size", "16", "--output_dir", str(run)]
    assert run_cli([*common, "--dataset", str(good), "--epochs", "1"], cwd=tmp_path).returncode == 0
    (ckpt,) = list_checkpoints(run / "checkpoints")
    before = ckpt.read_bytes()
    proc = run_cli(
        [*common, "--dataset", str(bad), "--epochs", "2", "--resume_from", "auto",
         "--max_bad_steps", "3"], cwd=tmp_path,
    )
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-2000:]
    assert "3 optimizer steps in a row had non-finite gradients" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list_checkpoints(run / "checkpoints") == [ckpt] and ckpt.read_bytes() == before
    assert (run / "checkpoints" / "latest.pt").read_bytes() == before


TASK_JOBS = {
    # 354 training samples in batches of 2: 177 steps an epoch
    "regression": ["train", "--dataset", "diabetes", "--batch_size", "2", "--epochs", "2",
                   "--lr", "0.002", "--save_every_steps", "7", "--log_interval", "10"],
    # 2027 windows of 16 characters in batches of 16: 127 steps an epoch
    "lm": ["train", "--dataset", "chars", "--block_size", "16", "--width", "16",
           "--batch_size", "16", "--epochs", "2", "--optimizer", "adamw", "--lr", "0.003",
           "--save_every_steps", "7", "--log_interval", "10"],
}


@pytest.mark.heavy
@pytest.mark.parametrize("task", list(TASK_JOBS))
def test_sigkill_mid_epoch_then_resume_is_bitwise_exact_for_other_tasks(
    tmp_path: Path, task: str
) -> None:
    job = TASK_JOBS[task]
    reference = tmp_path / "reference"
    proc = run_cli([*job, "--output_dir", str(reference)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    killed = start([*job, "--output_dir", str(run)], tmp_path)
    wait_for_step(run / "checkpoints", 200, killed)  # in epoch 2, mid-epoch
    killed.kill()
    killed.wait()
    resumed = run_cli([*job, "--output_dir", str(run), "--resume_from", "auto"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)


@pytest.mark.heavy
def test_iterable_dataset_with_state_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    job = ["train", "--dataset", "taskplug:stateful_stream", "--model", "mlp",
           "--batch_size", "8", "--epochs", "2", "--save_every_steps", "7", "--log_interval", "10"]
    reference = tmp_path / "reference"
    proc = run_cli([*job, "--output_dir", str(reference)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    killed = start([*job, "--output_dir", str(run)], tmp_path)
    wait_for_step(run / "checkpoints", 1000, killed)  # 750 steps an epoch: in epoch 2
    killed.kill()
    killed.wait()
    resumed = run_cli([*job, "--output_dir", str(run), "--resume_from", "auto"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restarts from its beginning" not in resumed.stdout + resumed.stderr
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)
