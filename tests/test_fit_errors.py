"""`ddptrain.fit` raises ddptrain's own exception for a failure torch reports (a DataLoader
worker that died, a lost peer, out of memory, DDP's unused parameters), and its text is the
line the command line prints after `ddptrain: error: ` for the same run: the CLI only
prints what `fit` raised."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import child_env
from dist_utils import free_port
from procs import popen, reap  # noqa: F401  (reap: an autouse fixture)
from torch.utils.data import Dataset, get_worker_info

import ddptrain.cli as cli
import ddptrain.train.trainer as loop
from ddptrain import api, errors, fit
from ddptrain.config import TrainingConfig
from ddptrain.observe.oom import OutOfMemory


class _DiesInWorker(Dataset):
    """64 samples of 8 features in 4 classes; a DataLoader worker that reads one is
    SIGKILLed, as the out-of-memory killer would end it."""

    num_classes = 4

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x[:, :4].argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.x[i], self.y[i]


def dies_in_worker(config: Any) -> Dataset:
    """`--dataset test_fit_errors:dies_in_worker`."""
    return _DiesInWorker()


SMALL = ["--model", "mlp", "--width", "16", "--batch_size", "8", "--epochs", "1",
         "--no-tensorboard"]


def _cli_run(argv: list[str], monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], BaseException]:
    """`ddptrain train ARGV` in-process: its exit code, its stderr lines, and what the
    `ddptrain.fit` it called raised."""
    raised: list[BaseException] = []

    def recording_fit(*args: Any, **kwargs: Any) -> Any:
        try:
            return api.fit(*args, **kwargs)
        except BaseException as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(cli, "fit", recording_fit)
    code = cli.main(["train", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(raised) == 1, err
    return code, err, raised[0]


def _fails_in_the_loop(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """The loop's collective (the metric all-reduce) raises `error`, as torch would."""

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(loop, "reduce_snapshots", fails)


def test_a_dataloader_worker_that_dies_raises_worker_lost_with_the_cli_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(errors.WorkerLost) as raised:
        fit(TrainingConfig(model="mlp", width=16, batch_size=8, epochs=1, num_workers=1,
                           tensorboard=False, output_dir=str(tmp_path / "api")),
            datasets=_DiesInWorker())
    assert raised.value.exit_code == errors.EXIT_WORKER_LOST
    assert isinstance(raised.value.__cause__, RuntimeError)  # torch's, kept as the cause
    code, err, own = _cli_run(
        ["--dataset", "test_fit_errors:dies_in_worker", "--num_workers", "1", *SMALL,
         "--output_dir", str(tmp_path / "cli")], monkeypatch, capsys)
    assert isinstance(own, errors.WorkerLost)
    assert code == errors.EXIT_WORKER_LOST and err == [f"ddptrain: error: {own}"], err
    # (torch tells a worker's SIGKILL as such, or as an exit, as it happens to see it first)
    told = r"DataLoader worker \(pid \d+\) (was killed by signal Killed|exited unexpectedly): "
    assert re.match(told + "the out-of-memory killer or a kill; ", str(own)), own
    assert re.match(told, str(raised.value)), raised.value
    assert str(raised.value).partition(": ")[2] == str(own).partition(": ")[2]


def test_a_lost_peer_raises_peer_lost_with_the_cli_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    npz400: Path,
) -> None:
    """gloo's error for a peer that closed its connection, where the loop's collective is."""
    _fails_in_the_loop(monkeypatch, RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:29500"))
    exit_file = tmp_path / "exit"
    monkeypatch.setenv("DDPTRAIN_EXIT_FILE", str(exit_file))
    code, err, own = _cli_run(["--dataset", str(npz400), *SMALL, "--log_interval", "2",
                               "--output_dir", str(tmp_path / "r")], monkeypatch, capsys)
    assert isinstance(own, errors.PeerLost) and own.exit_code == errors.EXIT_PEER_LOST
    assert code == errors.EXIT_PEER_LOST and err == [f"ddptrain: error: {own}"], err
    assert exit_file.read_text() == f"{errors.EXIT_PEER_LOST} 0\n"
    assert str(own).startswith("lost contact with the other ranks (Connection closed by "
                               "peer [127.0.0.1]:29500): "), own
    assert str(own).endswith("; restart the job with --resume_from auto")
    assert ".cc:" not in str(own)


# A rank of `ddptrain train ARGV` whose `ddptrain.fit` leaves what it raised in RAISED_TO.
RECORDING_RANK = """
import json, os, sys
import ddptrain.cli as cli
from ddptrain import api

def fit(*args, **kwargs):
    try:
        return api.fit(*args, **kwargs)
    except BaseException as exc:
        with open(os.environ["RAISED_TO"], "w") as f:
            json.dump({"type": type(exc).__name__, "text": str(exc)}, f)
        raise

cli.fit = fit
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_peer_that_dies_raises_peer_lost_on_the_survivor_with_its_line(
    tmp_path: Path, npz400: Path,
) -> None:
    """Two ranks started by hand; rank 1 is SIGKILLed at its 3rd training forward."""
    args = ["train", "--dataset", str(npz400), "--model", "guardplug:killable_mlp", *SMALL[2:],
            "--epochs", "20", "--timeout_s", "20", "--output_dir", str(tmp_path / "run")]
    port = str(free_port())
    ranks = [
        popen([sys.executable, "-c", RECORDING_RANK, *args], tmp_path, child_env({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GUARD_KILL_AT": "3",
            "GUARD_KILL_RANK": "1", "RAISED_TO": str(tmp_path / f"raised{rank}.json"),
        }))
        for rank in (0, 1)
    ]
    try:
        _, err = ranks[0].communicate(timeout=120)
    except subprocess.TimeoutExpired:
        for proc in ranks:
            proc.kill()
        raise
    ranks[1].communicate(timeout=30)
    assert ranks[1].returncode == -signal.SIGKILL
    raised = json.loads((tmp_path / "raised0.json").read_text())
    assert raised["type"] == "PeerLost", raised
    assert ranks[0].returncode == errors.EXIT_PEER_LOST, err[-2000:]
    assert err.strip().splitlines() == [f"ddptrain: error: {raised['text']}"], err[-2000:]
    assert raised["text"].startswith("lost contact with the other ranks (")
    assert "rank 1" in raised["text"], raised  # the line names the rank that stopped


def test_out_of_memory_raises_out_of_memory_with_the_cli_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    code, err, own = _cli_run(["--dataset", "breast_cancer", "--model", "guardplug:oom_mlp",
                               "--batch_size", "16", "--output_dir", str(run)],
                              monkeypatch, capsys)
    assert isinstance(own, OutOfMemory) and isinstance(own, errors.ConfigError)
    assert code == errors.EXIT_USAGE and err == [f"ddptrain: error: {own}"], err
    assert str(own).startswith("out of memory on rank 0 (cpu) after step 2: ")
    assert str(own).endswith(f"; report: {run / 'oom' / 'rank0.txt'}")


def test_unused_parameters_raise_unused_parameters_with_the_cli_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    npz400: Path,
) -> None:
    """DDP's reducer on a model that left parameters out of the loss."""
    _fails_in_the_loop(monkeypatch, RuntimeError(
        "Expected to have finished reduction in the prior iteration before starting a new "
        "one. This error indicates that your module has parameters that were not used in "
        "producing loss. You can enable unused parameter detection by passing the keyword "
        "argument `find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`"
        "\nParameter indices which did not receive grad for rank 0: 2 3"))
    code, err, own = _cli_run(["--dataset", str(npz400), *SMALL, "--log_interval", "2",
                               "--output_dir", str(tmp_path / "r")], monkeypatch, capsys)
    assert isinstance(own, errors.UnusedParameters) and isinstance(own, errors.ConfigError)
    assert code == errors.EXIT_USAGE and err == [f"ddptrain: error: {own}"], err
    assert "--find_unused_parameters" in str(own)


def test_a_lost_peer_is_told_where_it_is_found_while_signals_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The command line's line for a lost peer is said as `fit` finds it, while SIGTERM
    waits (torchrun stops the other ranks as the first one ends), and once."""
    from ddptrain.launch.failures import own_errors
    from ddptrain.observe import hang

    monkeypatch.setitem(hang.POSITION, "run_dir", None)  # (no run directory: no records)
    before = signal.getsignal(signal.SIGTERM)
    told: list[tuple[str, bool]] = []

    def tell(exc: errors.PeerLost) -> None:
        told.append((str(exc), signal.getsignal(signal.SIGTERM) is before))

    with pytest.raises(errors.PeerLost) as raised, own_errors(tell=tell), own_errors():
        raise RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:29500")
    assert told == [(str(raised.value), False)] and raised.value.told
    assert signal.getsignal(signal.SIGTERM) is before
    assert str(raised.value) == (
        "lost contact with the other ranks (Connection closed by peer [127.0.0.1]:29500): a "
        "peer died, hung longer than --timeout_s, or the network failed; restart the job "
        "with --resume_from auto")


def test_a_lost_peer_never_writes_its_record_into_an_earlier_runs_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An earlier run in this process left its position (`observe.hang.POSITION`); a run
    that loses its peers before its trainer starts (a second `fit`, an `evaluate`) has
    none of its own, and writes no hang record into the earlier run's directory."""
    from ddptrain.launch.failures import own_errors
    from ddptrain.observe import hang

    old = tmp_path / "old"
    old.mkdir()
    monkeypatch.setattr(hang, "POSITION", {"run_dir": str(old), "progress": None})
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(errors.PeerLost), own_errors():
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert not (old / "hang").exists()
