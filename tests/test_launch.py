"""`scripts/launch.sh`: the one-node default runs, and a multi-node mistake stops at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

LAUNCH = Path(__file__).resolve().parent.parent / "scripts" / "launch.sh"
DROP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NNODES",
        "NODE_RANK", "NPROC_PER_NODE", "LOCAL_ADDR", "RDZV_ID", "MAX_RESTARTS", "COMMAND")


def launch(args: list[str], cwd: Path, timeout: float = 20, **env: str
           ) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in DROP}
    full.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(LAUNCH), *args], cwd=cwd, env=full, text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.slow
def test_default_is_one_node_standalone(tmp_path: Path) -> None:
    # No NNODES, no MASTER_ADDR: torchrun --standalone, nothing to wait for.
    res = launch(["--epochs", "1", "--batch_size", "32", "--output_dir", "run"], tmp_path,
                 timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--standalone" not in res.stderr  # no torchrun complaint
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 1


@pytest.mark.slow
def test_a_failed_job_ends_with_the_ranks_line_and_code_not_torchruns_traceback(
    tmp_path: Path,
) -> None:
    """Through launch.sh (torchrun's agent, `ddptrain.launch.torchrun`), a job whose ranks
    refuse the config ends with their `ddptrain: error:` lines and exit 2: no
    ChildFailedError traceback, no start-up banner, not torchrun's exit 1."""
    res = launch(["--epochs", "0", "--output_dir", "run"], tmp_path, timeout=120,
                 NPROC_PER_NODE="2")
    assert res.returncode == 2, res.stderr[-3000:]
    # The agent stops the other rank once one has failed: it may not get to say why, or it
    # says that it was stopped (SIGTERM while it started); the code stays the refusal's.
    lines = {x.removeprefix("[rank 0] ").removeprefix("[rank 1] ")
             for x in res.stderr.splitlines() if x.strip()}
    lines -= {x for x in lines if x.startswith("ddptrain: stopped: stopped by SIGTERM")}
    assert lines == {"ddptrain: error: --epochs 0 is invalid: use a whole number of at least 1"
                     }, res.stderr[-3000:]


# A user's dataset whose files are missing on rank 1's node (its first read, the sample
# ddptrain looks at before the process group, excepted): rank 1 fails reading its first
# batch, after the process group started, and rank 0 then loses it (exit 3, a line of its own).
MISSING_FILES = '''
import os
from pathlib import Path

import torch
from torch.utils.data import Dataset


class Files(Dataset):
    def __init__(self, folder):
        self.folder, self.reads = folder, 0

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.reads += 1
        if os.environ["RANK"] == "0":
            return torch.zeros(4), 0
        return torch.load(self.folder / ("here.pt" if self.reads == 1 else f"{i}.pt")), 0


def files(config):
    folder = Path(__file__).parent
    torch.save(torch.zeros(4), folder / "here.pt")
    return Files(folder)
'''


@pytest.mark.slow
def test_ddprun_ends_a_failed_job_with_the_ranks_line_and_code(tmp_path: Path) -> None:
    """`ddprun` (the console name of `ddptrain.launch.torchrun`, as the README launches): a
    job whose rank 1 fails after the process group started (a sample's file is missing)
    ends with that rank's `ddptrain: error:` line last, after rank 0's line that it lost
    rank 1 (without ddprun's repeat, that line came last), exit 2, no torchrun traceback."""
    (tmp_path / "missing_files.py").write_text(MISSING_FILES)
    ddprun = Path(sys.executable).with_name("ddprun")
    env = {k: v for k, v in os.environ.items() if k not in DROP}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path))
    res = subprocess.run(
        [str(ddprun), "--standalone", "--nproc_per_node=2", "-m", "ddptrain", "train",
         "--dataset", "missing_files:files", "--num_classes", "2", "--model", "mlp",
         "--epochs", "1", "--output_dir", "run"],
        cwd=tmp_path, env=env, text=True, capture_output=True, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ddptrain: error: reading sample "), res.stderr[-3000:]
    assert "No such file or directory" in last, last
    assert "ChildFailedError" not in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_ddprun_is_the_launchers_console_name_and_the_readme_launches_with_it() -> None:
    """pyproject declares `ddprun` for `ddptrain.launch.torchrun:main`, and no command of
    the README or of the guides it links (docs/ but the generated benchmark report) starts
    jobs with plain torchrun (whose failures end in its traceback)."""
    import tomllib

    from ddptrain.launch import torchrun

    root = Path(__file__).resolve().parent.parent
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ddprun"] == "ddptrain.launch.torchrun:main"
    assert callable(torchrun.main)
    pages = [root / "README.md", *sorted(p for p in (root / "docs").rglob("*.md")
                                         if p.name != "BENCHMARKS.md")]
    plain = []
    for page in pages:
        fenced = False  # commands are in code blocks; prose may name torchrun
        for line in page.read_text().splitlines():
            fenced ^= line.lstrip().startswith("```")
            if fenced and line.lstrip().startswith("torchrun "):
                plain.append(f"{page.name}: {line}")
    assert plain == [], plain


def test_the_root_causes_line_is_said_again_after_a_stopped_ranks_line() -> None:
    """Rank 1 failed (2) and rank 0, stopped by the agent, said so after it: the launcher
    says rank 1's line again, last; not where no stopped rank spoke."""
    from ddptrain.launch.torchrun import last_word

    class Failure:
        def __init__(self, code: int, message: str) -> None:
            self.exitcode, self.message, self.timestamp = code, message, 0

    cause = "ddptrain: error: reading sample 3 of the dataset raised OSError: gone"
    stopped = "ddptrain: stopped: stopped by SIGTERM outside the training loop"
    assert last_word({0: Failure(75, stopped), 1: Failure(2, cause)}, 1) == cause
    assert last_word({0: Failure(2, cause), 1: Failure(2, cause)}, 1) is None
    assert last_word({0: Failure(75, ""), 1: Failure(2, cause)}, 1) is None
    assert last_word({0: Failure(75, stopped), 1: Failure(75, stopped)}, 1) is None


def test_a_rank_killed_by_a_signal_is_one_line_and_128_plus_its_number() -> None:
    """A rank with an exit code said why itself; one killed by a signal could not, so the
    launcher says it (and how many other ranks the job stopped)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddptrain.launch.torchrun import failure_report

    def failed(rank: int, code: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                              error_file="<N/A>")

    killed = {0: failed(0, -15), 1: failed(1, -9)}
    assert failure_report(killed, 1) == (
        "ddptrain: error: rank 1 (pid 101) was killed by SIGKILL (often the out-of-memory "
        "killer); the job stopped its 1 other failed rank(s); restart the job with "
        "--resume_from auto", 137)
    assert failure_report({3: failed(3, -6)}, 3)[1] == 134
    assert failure_report({0: failed(0, 3), 1: failed(1, -15)}, 0) == (None, 3)


def test_the_root_cause_is_the_rank_that_failed_of_itself_not_one_the_agent_stopped() -> None:
    """torchrun picks its first failure by whole seconds: rank 0, stopped by the agent
    (SIGTERM: exit 75), may tie with rank 1's own refusal (2) and come first."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddptrain.launch.torchrun import root_cause

    def failed(rank: int, code: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                              error_file="<N/A>")

    assert root_cause({0: failed(0, 75), 1: failed(1, 2)}, 0) == 1
    assert root_cause({0: failed(0, -15), 1: failed(1, 143), 2: failed(2, 3),
                       3: failed(3, -9)}, 0) == 3
    assert root_cause({0: failed(0, 2), 1: failed(1, 2)}, 1) == 1
    assert root_cause({0: failed(0, 75), 1: failed(1, 75)}, 1) == 1


def test_the_exit_file_keeps_the_rank_that_failed_of_itself_over_those_then_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """launch.sh and slurm/run.sh exit with the code noted in DDPTRAIN_EXIT_FILE: a rank the
    job stopped after another refused (75, 3) must not replace that rank's 2, but does
    replace an earlier restart round's; the agent's root cause replaces anything."""
    from ddptrain.launch.signals import note_exit, noted_exit

    path = tmp_path / "exit"
    monkeypatch.setenv("DDPTRAIN_EXIT_FILE", str(path))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    note_exit(2)
    note_exit(75)
    note_exit(3)
    assert noted_exit(str(path)) == (2, 0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    note_exit(75)  # a later round, preempted
    assert path.read_text() == "75 1\n"
    note_exit(4)
    note_exit(143)
    assert noted_exit(str(path)) == (4, 1)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    note_exit(137, cause=True)  # the agent saw a rank killed by SIGKILL
    assert noted_exit(str(path)) == (137, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exit"]
    path.write_text("3\n")  # scripts/rdzv.sh's watchdog writes the code alone
    assert noted_exit(str(path)) == (3, 0)


def test_the_agent_notes_the_root_cause_over_a_stopped_rank0s_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 refused its config (2) while rank 0, still starting, was stopped by the agent
    and noted 75 (as happened in CI): the job's code is 2, in the file launch.sh reads too."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    from ddptrain.launch import torchrun as launcher

    def failed(rank: int, code: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                              error_file="<N/A>")

    def run(args: Any) -> None:
        raise ChildFailedError("ddptrain", {0: failed(0, 75), 1: failed(1, 2)})

    path = tmp_path / "exit"
    path.write_text("75 0\n")
    monkeypatch.setenv("DDPTRAIN_EXIT_FILE", str(path))
    monkeypatch.setattr(torchrun, "run", run)
    assert launcher.main(["--nproc_per_node=2", "-m", "ddptrain", "train"]) == 2
    assert path.read_text() == "2 0\n"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"NNODES": "2", "NODE_RANK": "0"}, "MASTER_ADDR=127.0.0.1, a loopback address"),
        ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "localhost"}, "loopback"),
        ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.1.2.3"}, "loopback"),
        ({"NNODES": "2", "MASTER_ADDR": "10.0.0.1"}, "NNODES=2 needs NODE_RANK"),
        ({"NNODES": "2", "MASTER_ADDR": "10.0.0.1", "NODE_RANK": "2"}, "NODE_RANK=2: use 0..1"),
        ({"NNODES": "two"}, "NNODES=two is not a whole number"),
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0: use 1 or more"),
    ],
)
def test_mistakes_stop_with_one_message(env: dict[str, str], needle: str, tmp_path: Path
                                        ) -> None:
    res = launch(["--epochs", "1"], tmp_path, **env)  # the 20 s timeout is the "no hang"
    assert res.returncode == 2
    assert res.stderr.startswith("launch.sh: error:") and needle in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["train.sbatch", "train_cpu.sbatch"])
def test_sbatch_scripts_requeue_on_a_term_signal_to_the_steps(name: str) -> None:
    script = LAUNCH.parent / "slurm" / name
    headers = [line.split(None, 1)[1].strip() for line in script.read_text().splitlines()
               if line.startswith("#SBATCH")]
    assert "--requeue" in headers
    # Without "B:" the signal goes to the job steps (torchrun and its workers).
    assert any(h.startswith("--signal=TERM@") for h in headers), headers
    assert "--ntasks-per-node=1" in headers  # one torchrun per node
    for path in (script, LAUNCH.parent / "slurm" / "run.sh", LAUNCH.parent / "slurm" / "step.sh"):
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, path


def test_a_host_name_that_resolves_to_loopback_is_refused(tmp_path: Path) -> None:
    host = socket.gethostname()
    try:
        loopback = socket.gethostbyname(host).startswith("127.")
    except OSError:
        pytest.skip(f"host name {host!r} does not resolve")
    if not loopback:
        pytest.skip(f"host name {host!r} does not resolve to a loopback address here")
    res = launch(["--epochs", "1"], tmp_path, NNODES="2", NODE_RANK="0", MASTER_ADDR=host)
    assert res.returncode == 2 and f"MASTER_ADDR={host} (127." in res.stderr, res.stderr


def test_a_fresh_runs_directory_is_named_after_its_data(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddptrain.config import TrainingConfig
    from ddptrain.launch.rundir import default_output_dir

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    for dataset, name in (("digits", "digits"), ("data/my-set.npz", "my_set"),
                          ("mypkg.corpus:build", "corpus_build"), ("corpus:build", "corpus_build")):
        assert default_output_dir(TrainingConfig(dataset=dataset)) == f"runs/{name}-job7"
