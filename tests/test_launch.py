"""`scripts/launch.sh`: the one-node default runs, and a multi-node mistake stops at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

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
