"""No process outlives its job: a sample whose `__getitem__` raises, or a DataLoader worker
SIGKILLed, with `--num_workers 2` on one of two ranks, under torchrun and as plain
srun-style ranks started by hand (no agent to clean up). Every process, ranks and their
workers, is gone within `--timeout_s` + 15 s of the fault; the failing rank says one
`ddptrain: error:` line naming the sample or the worker, and exits with its code (2 for
the sample, 71 for the worker); its peer exits with 3 (lost contact)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing import resource_sharer
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, child_env, run_cli
from dist_utils import free_port
from procs import popen, reap  # noqa: F401  (reap: an autouse fixture)

from ddptrain.cli import main
from ddptrain.data.loader import raise_lost_worker, read, seed_worker, worker_failure
from ddptrain.errors import (
    EXIT_INTERRUPTED,
    EXIT_PEER_LOST,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    EXIT_WORKER_LOST,
)

TIMEOUT_S = 20
MARGIN_S = 15
BAD = 200  # a training sample (the split of 256 with seed 42 keeps it out of validation)
JOB = ["train", "--dataset", "hangplug:samples", "--model", "mlp", "--width", "16",
       "--batch_size", "8", "--num_workers", "2", "--timeout_s", str(TIMEOUT_S)]


def _launch(
    how: str, args: list[str], cwd: Path, env: dict[str, str]
) -> list[subprocess.Popen[str]]:
    """torchrun (one agent), or two ranks started by hand as srun starts its tasks."""
    if how == "torchrun":
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "ddptrain", *args]
        return [popen(cmd, cwd, child_env(env))]
    port = str(free_port())
    return [
        popen([sys.executable, "-m", "ddptrain", *args], cwd, child_env({
            **env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }))
        for rank in (0, 1)
    ]


def _wait_for(path: Path, procs: list[subprocess.Popen[str]], limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        assert all(p.poll() is None for p in procs), "the job ended before the fault"
        assert time.monotonic() < deadline, f"no {path.name} within {limit}s"
        time.sleep(0.05)


def _all_gone(procs: list[subprocess.Popen[str]], since: float) -> list[str]:
    """Wait for the launched processes and every process of their groups (the ranks'
    DataLoader workers); returns their stderr, asserting it all ended in time."""
    limit = since + TIMEOUT_S + MARGIN_S
    errs = [p.communicate(timeout=max(1.0, limit - time.monotonic()))[1] for p in procs]
    for p in procs:
        while True:
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < limit, f"a process of group {p.pid} outlived its job"
            time.sleep(0.1)
    assert time.monotonic() < limit
    return errs


def _rank_lines(err: str, rank: int) -> list[str]:
    """ddptrain's lines of one rank, and any of torch's traceback lines of it."""
    prefix = f"[rank {rank}] " if rank else ""
    return [line for line in err.splitlines()
            if line.startswith(f"{prefix}ddptrain:") or line.startswith(f"[rank{rank}]:")]


def _check(how: str, procs: list[subprocess.Popen[str]], errs: list[str], what: str,
           code: int) -> None:
    if how == "torchrun":
        err = errs[0]
        failing, peer = _rank_lines(err, 1), _rank_lines(err, 0)
        assert f"exitcode: {code} " in err or f"exitcode  : {code} " in err, err[-3000:]
    else:
        failing, peer = _rank_lines(errs[1], 1), _rank_lines(errs[0], 0)
        assert procs[1].returncode == code, errs[1][-3000:]
        assert procs[0].returncode == EXIT_PEER_LOST, errs[0][-3000:]
        assert "Traceback" not in errs[1] + errs[0], errs
    assert len(failing) == 1 and failing[0].startswith("[rank 1] ddptrain: error: "), failing
    assert what in failing[0], failing
    assert len(peer) == 1 and "lost contact with the other ranks" in peer[0], peer
    # ...and it says why: rank 1 recorded its own end before its peer gave up waiting
    assert "rank 1 ended on its own error (rank 1: " in peer[0], peer


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("how", ["torchrun", "srun"])
def test_a_sample_that_raises_in_a_worker_ends_every_process(tmp_path: Path, how: str) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    args = [*JOB, "--epochs", "20", "--output_dir", str(tmp_path / "run")]
    procs = _launch(how, args, tmp_path, {"HANG_AT": str(BAD), "HANG_STARTED": str(marks)})
    _wait_for(marks / "failed", procs)
    errs = _all_gone(procs, time.monotonic())
    _check(how, procs, errs, f"sample {BAD} of the dataset (_Samples) raised ValueError: row "
           f"{BAD} has a truncated record", EXIT_USAGE)


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("how", ["torchrun", "srun"])
def test_a_killed_worker_ends_every_process(tmp_path: Path, how: str) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    args = [*JOB, "--epochs", "200", "--output_dir", str(tmp_path / "run")]
    # The failing rank is slow to exit after its peers see it gone: torchrun must still
    # name it, not the peer that lost it (`cli.PEER_LOST_LINGER_S`).
    procs = _launch(how, args, tmp_path, {"HANG_STARTED": str(marks), "HANG_SLOW_EXIT": "1.5"})
    deadline = time.monotonic() + 120
    while len(workers := list(marks.glob("r1-*"))) < 2:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # training, its workers busy or waiting
    victim = int(workers[0].name.split("-")[1])
    os.kill(victim, signal.SIGKILL)
    errs = _all_gone(procs, time.monotonic())
    _check(how, procs, errs, f"DataLoader worker (pid {victim}) ", EXIT_WORKER_LOST)


class _Handover:
    """A DataLoader iterator whose worker was SIGKILLed while it served a batch's storage:
    the read fails on the broken socket before the worker is seen dead."""

    def __init__(self, worker: multiprocessing.process.BaseProcess) -> None:
        self._workers = [worker]

    def __iter__(self) -> _Handover:
        return self

    def __next__(self) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_worker_killed_mid_handover_is_told_as_its_death() -> None:
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    worker.start()
    try:
        raise_lost_worker([worker], ConnectionResetError(), wait=0.1)  # alive: no verdict
        os.kill(worker.pid, signal.SIGKILL)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError) as raised:
            next(read(_Handover(worker)))  # type: ignore[arg-type]
    finally:
        worker.kill()
        worker.join()
    assert worker_failure(raised.value) == (
        f"DataLoader worker (pid {worker.pid}) was killed by signal Killed: the out-of-memory "
        "killer or a kill; lower --num_workers or the memory each worker holds (dmesg tells "
        "an OOM kill), then resume with --resume_from auto", EXIT_WORKER_LOST,
    )


def _serve_a_batch(address: Any, err: str) -> None:
    """A DataLoader worker's start (`seed_worker`), then the socket it serves a batch's
    storage through; a reader connects and goes away mid-handshake."""
    sys.stderr = open(err, "w", buffering=1)  # noqa: SIM115  (the process ends here)
    os.dup2(sys.stderr.fileno(), 2)
    seed_worker(0)
    resource_sharer.DupFd(os.dup(0))  # starts this process's serving thread
    address.send(resource_sharer._resource_sharer._address)  # type: ignore[attr-defined]
    address.recv()  # the reader came and went
    time.sleep(0.5)
    os._exit(0)


def test_a_worker_whose_reader_is_gone_mid_handover_prints_no_traceback(
    tmp_path: Path,
) -> None:
    """The failing rank's one line is not followed by a worker's traceback: its serving
    thread meets the dead main process's broken connection (`loader._quiet_lost_reader`)."""
    ours, theirs = multiprocessing.Pipe()
    err = tmp_path / "worker.err"
    worker = multiprocessing.get_context("fork").Process(
        target=_serve_a_batch, args=(theirs, str(err)))
    worker.start()
    try:
        assert ours.poll(30), "the worker did not start serving"
        reader = socket.socket(socket.AF_UNIX)
        reader.connect(ours.recv())
        reader.close()  # before the handshake's answer
        ours.send(True)
        worker.join(timeout=30)
    finally:
        worker.kill()
    assert worker.exitcode == 0
    assert err.read_text() == ""


def test_a_sample_that_raises_without_workers_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HANG_AT", str(BAD))
    monkeypatch.setenv("HANG_RANK", "0")
    capsys.readouterr()
    args = [*JOB, "--num_workers", "0", "--epochs", "20", "--output_dir", str(tmp_path / "run")]
    assert main(args) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err == (
        f"ddptrain: error: reading sample {BAD} of the dataset (_Samples) raised ValueError: "
        f"row {BAD} has a truncated record: fix or remove that sample, then resume with "
        "--resume_from auto"
    ), err


# ---------------------------------------------------------------------- start-up signals
@pytest.mark.slow
@pytest.mark.parametrize("sig, phase", [
    pytest.param(signal.SIGTERM, "data", id="SIGTERM-data"),
    pytest.param(signal.SIGINT, "group", id="SIGINT-group", marks=pytest.mark.heavy),
])
def test_a_signal_during_start_up_is_one_line_and_its_code(
    tmp_path: Path, sig: signal.Signals, phase: str
) -> None:
    """While the data loads (Python: the handler raises) or while rank 0 waits in the
    process group's rendezvous for a peer that never comes (C++: a thread ends it)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    run = tmp_path / "run"
    args = ["train", "--dataset", "hangplug:slow" if phase == "data" else "hangplug:samples",
            "--timeout_s", "120", "--output_dir", str(run)]
    env = {"HANG_STARTED": str(marks)}
    if phase == "group":
        env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    proc = popen([sys.executable, "-m", "ddptrain", *args], tmp_path, child_env(env))
    _wait_for(marks / "loading" if phase == "data" else run / ".lock", [proc])
    time.sleep(1.0)
    proc.send_signal(sig)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 10
    code = EXIT_PREEMPTED if sig == signal.SIGTERM else EXIT_INTERRUPTED
    assert proc.returncode == code, err[-3000:]
    assert err.strip() == (
        f"ddptrain: stopped: stopped by {sig.name} outside the training loop (while the run "
        "started or after it trained): nothing was left half-written; run the same command "
        "with --resume_from auto to go on (a run that had not trained starts afresh)"
    ), err
    assert not (run / "config.yaml").exists() and not (run / ".job").exists()


@pytest.mark.slow
def test_a_stream_that_raises_in_a_worker_is_one_line(tmp_path: Path) -> None:
    """No index to name in a stream: the line names the worker and the error."""
    proc = run_cli(["train", "--dataset", "hangplug:stream", "--num_workers", "2",
                    "--batch_size", "8", "--output_dir", str(tmp_path / "run")],
                   cwd=tmp_path, env={"HANG_AT": "40", "HANG_RANK": "0"}, timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == EXIT_USAGE, err[-3000:]
    assert len(err.splitlines()) == 1 and err.startswith("ddptrain: error: DataLoader worker ")
    assert "failed: ValueError: row 40 has a truncated record" in err


def test_a_rank_torchrun_sigkilled_after_its_peers_lost_it_is_no_oom_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """A rank stalls in its own code; its peers time out and exit 3 (lost peer); torchrun
    SIGTERMs it, which it sleeps through, and SIGKILLs it 30 s later, a failure it sees
    after theirs. That SIGKILL is the job's own: the job's code is 3, in the exit file
    too, and no line calls it killed by the out-of-memory killer. A rank SIGKILLed before
    its peers lost it (the out-of-memory killer) is still the cause: 137 and that line."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    from ddptrain.launch import torchrun as launcher

    def failed(rank: int, code: int, at: int) -> ProcessFailure:
        failure = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                                 error_file="<N/A>")
        failure.timestamp = at  # when torchrun saw it end (whole seconds)
        return failure

    stall = {0: failed(0, EXIT_PEER_LOST, 1000), 1: failed(1, EXIT_PEER_LOST, 1000),
             2: failed(2, -signal.SIGKILL, 1031), 3: failed(3, EXIT_PEER_LOST, 1001)}
    oom = {0: failed(0, EXIT_PEER_LOST, 1003), 1: failed(1, -signal.SIGKILL, 1000)}
    assert launcher.root_cause(stall, 0) == 0 and launcher.root_cause(oom, 0) == 1
    path = tmp_path / "exit"
    monkeypatch.setenv("DDPTRAIN_EXIT_FILE", str(path))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for failures, code, said in ((stall, EXIT_PEER_LOST, ""), (oom, 137, (
            "ddptrain: error: rank 1 (pid 101) was killed by SIGKILL (often the out-of-memory "
            "killer); the job stopped its 1 other failed rank(s); restart the job with "
            "--resume_from auto\n"))):
        path.write_text(f"{EXIT_PEER_LOST} 0\n")  # what the peers that lost it noted

        def run(args: Any, failures: dict[int, ProcessFailure] = failures) -> None:
            raise ChildFailedError("ddptrain", failures)

        monkeypatch.setattr(torchrun, "run", run)
        assert launcher.main(["--nproc_per_node=4", "-m", "ddptrain", "train"]) == code
        assert path.read_text() == f"{code} 0\n"
        assert capsys.readouterr().err == said
