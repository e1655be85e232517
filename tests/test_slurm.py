"""The project's sbatch script on a real one-node Slurm cluster (munged, slurmctld, slurmd).

Proves that `scripts/slurm/train_cpu.sbatch` trains through srun + torchrun + c10d, and that
a job signalled with SIGTERM (as Slurm does before a time limit or a preemption) is
requeued, resumes from its checkpoint and ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from slurm_cluster import SlurmCluster, free_port, missing_tools

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "slurm" / "train_cpu.sbatch"
# Long enough (~57 steps an epoch on 2 ranks) to be interrupted after its first checkpoint;
# frequent metric points let a SIGTERM stop the run mid-epoch, the hardest resume.
TRAIN = ["--dataset", "breast_cancer", "--epochs", "20", "--batch_size", "4",
         "--save_every", "1", "--seed", "3", "--log_interval", "5"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        pytest.skip("a private Slurm cluster needs root (slurmd runs jobs as their user)")
    missing = missing_tools()
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)}): run `make slurm-deps`")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _submit(slurm: SlurmCluster, out: Path, args: list[str]) -> int:
    env = {
        "NPROC_PER_NODE": "2",
        "RDZV_PORT": str(free_port()),
        "PYTHON": sys.executable,
        "DDPTRAIN_ROOT": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    return slurm.sbatch(
        SCRIPT, [*TRAIN, "--output_dir", str(out), *args], env=env,
        opts=[f"--output={out}.log", "--job-name=ddptrain-test"], cwd=REPO,
    )


def _done(slurm: SlurmCluster, job: int, out: Path, timeout: float = 120) -> dict[str, str]:
    info = slurm.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout)
    log = Path(f"{out}.log").read_text() if Path(f"{out}.log").exists() else ""
    assert info["JobState"] == "COMPLETED", f"job {job}: {info}\n{log[-4000:]}"
    return info


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted sbatch run of TRAIN."""
    out = tmp_path_factory.mktemp("ref") / "run"
    _done(slurm, _submit(slurm, out, []), out)
    return out


def test_sbatch_cpu_job_trains_on_two_ranks(slurm: SlurmCluster, reference: Path) -> None:
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["epochs"] == 20
    assert (reference / "checkpoints" / "latest.pt").is_file()
    log = Path(f"{reference}.log").read_text()
    assert "rendezvous " + slurm.node in log  # the head node came from scontrol


@pytest.mark.heavy
def test_sigterm_requeues_and_resumes_to_the_same_weights(
    slurm: SlurmCluster, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    job = _submit(slurm, out, [])
    latest = out / "checkpoints" / "latest.pt"
    deadline = time.monotonic() + 90
    while not latest.exists():
        assert time.monotonic() < deadline, f"no checkpoint: {slurm.job(job)}"
        assert slurm.job(job).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING")
        time.sleep(0.1)
    # SIGTERM to the training step, as Slurm sends it ahead of the time limit
    # (--signal=TERM@60 in the script). The script requeues the job (Restarts=1).
    slurm.run("scancel", "--signal=TERM", f"{job}.0")
    # Slurm holds a requeued batch job back until the first run's credential has expired
    # (cred_expire, 10 s on this test cluster; 120 s by default), then runs it again.
    deadline = time.monotonic() + 60
    while slurm.job(job).get("Restarts") != "1":
        state = slurm.job(job)
        assert time.monotonic() < deadline, f"job was not requeued: {state}"
        assert state.get("JobState") in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING"), (
            f"{state}\n" + Path(f"{out}.log").read_text()[-4000:]
        )
        time.sleep(0.3)
    info = _done(slurm, job, out, timeout=90)
    log = Path(f"{out}.log").read_text()
    assert info.get("Restarts") == "1", log[-4000:]
    assert "requeueing job" in log
    assert "restart 1:" in log
    assert "resumed from" in log, "the requeued run did not resume from a checkpoint"
    got, want = _weights(out), _weights(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name



def test_srun_tasks_without_torchrun_form_one_group(slurm: SlurmCluster, tmp_path: Path) -> None:
    # Two tasks started by srun itself: ranks from SLURM_PROCID, MASTER_ADDR from the node
    # list, MASTER_PORT from the job id. The doctor runs the same set-up as training.
    script = tmp_path / "srun.sbatch"
    script.write_text(
        f"#!/bin/bash\nsrun {sys.executable} -m ddptrain doctor --sizes 4K --timeout_s 30\n"
    )
    out = tmp_path / "doctor"
    job = slurm.sbatch(script, [], env={"OMP_NUM_THREADS": "1"},
                       opts=["--ntasks=2", f"--output={out}.log"], cwd=tmp_path)
    _done(slurm, job, out, timeout=90)
    report = Path(f"{out}.log").read_text()
    port = 15000 + job % 15000
    assert f"launcher   slurm: world size 2, MASTER_ADDR={slurm.node} MASTER_PORT={port}" in (
        report
    ), report
    assert "ranks      2 on 1 host(s)" in report
    assert re.search(r"rank +1 +local +1 ", report), report
    assert "ok: all 2 ranks reached each other" in report


@pytest.mark.heavy
def test_an_array_task_requeues_alone_into_its_own_run_directory(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # Two array tasks side by side, one rank each, one --output_dir: each trains into
    # DIR/task_<index>. One task's job id is the array's own, which `scontrol requeue`
    # takes for the whole array: a SIGTERM to its step must requeue that task alone.
    out = tmp_path / "sweep"
    env = {"NPROC_PER_NODE": "1", "PYTHON": sys.executable, "DDPTRAIN_ROOT": str(REPO),
           "OMP_NUM_THREADS": "1"}
    # 10 epochs: the signal must land while the task still trains (one that finished
    # its 3 epochs before the signal reached its step had nothing left to resume)
    array = slurm.sbatch(
        SCRIPT, [*TRAIN, "--epochs", "10", "--output_dir", str(out)], env=env,
        opts=["--array=0-1", "--cpus-per-task=1", f"--output={tmp_path}/task-%a.log",
              "--job-name=ddptrain-array"], cwd=REPO,
    )

    def task(index: int) -> dict[str, str]:
        text = slurm.run("scontrol", "show", "-o", "job", f"{array}_{index}", check=False)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def log(index: int) -> str:
        path = tmp_path / f"task-{index}.log"
        return path.read_text() if path.exists() else ""

    # The task that carries the array's own job id (Slurm hands it to one of them).
    deadline = time.monotonic() + 120
    while not any(task(i).get("JobId") == str(array) for i in (0, 1)):
        assert time.monotonic() < deadline, f"{task(0)}\n{task(1)}"
        time.sleep(0.2)
    lead = next(i for i in (0, 1) if task(i).get("JobId") == str(array))
    other = 1 - lead
    latest = out / f"task_{lead}" / "checkpoints" / "latest.pt"
    while not latest.exists():
        assert time.monotonic() < deadline, f"no checkpoint: {task(lead)}\n{log(lead)[-3000:]}"
        time.sleep(0.2)
    slurm.run("scancel", "--signal=TERM", f"{array}_{lead}.0")
    deadline = time.monotonic() + 240
    while not all(task(i).get("JobState") == "COMPLETED" and "summary.json" in {
            p.name for p in (out / f"task_{i}").glob("*")} for i in (0, 1)):
        states = [task(i).get("JobState") for i in (0, 1)]
        assert time.monotonic() < deadline, f"{states}\n{log(0)[-3000:]}\n{log(1)[-3000:]}"
        assert not {"FAILED", "CANCELLED", "TIMEOUT"} & set(states), (
            f"{states}\n{log(0)[-3000:]}\n{log(1)[-3000:]}")
        time.sleep(0.5)
    assert (task(lead).get("Restarts"), task(other).get("Restarts")) == ("1", "0")
    assert f"requeueing job {array}_{lead} " in log(lead), log(lead)[-3000:]
    assert "resumed from" in log(lead) and "resumed from" not in log(other)
    for i in (0, 1):
        summary = json.loads((out / f"task_{i}" / "summary.json").read_text())
        assert (summary["world_size"], summary["epochs"]) == (1, 10), summary
    assert not (out / "checkpoints").exists()  # nothing trained into the shared directory
