"""What a run directory holds is never trusted to run code or to be written through: a
planted DCP `.metadata`, a `.lock` that is a symlink, a DCP checkpoint of another model,
a run directory that cannot be written."""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import one_error_line, tmpfs

from ddptrain.cli import main
from ddptrain.files import file_crc


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))




def _plant(step_dir: Path, marker: Path) -> None:
    """Replace a step directory's `.metadata` with a pickle that runs code, and record
    its checksum in `meta.pt` as an attacker who rewrites the directory would."""
    (step_dir / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    meta = torch.load(step_dir / "meta.pt", weights_only=True)
    meta["shards"][".metadata"] = file_crc(step_dir / ".metadata")
    torch.save(meta, step_dir / "meta.pt")


def test_a_planted_dcp_metadata_is_refused_and_never_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    base = ["train", "--batch_size", "64", "--checkpoint_format", "dcp", "--output_dir", str(run)]
    assert main([*base, "--epochs", "2"]) == 0
    ckpt = run / "checkpoints"
    older, newest = ckpt / "step_000000008", ckpt / "step_000000016"
    assert older.is_dir() and newest.is_dir()
    marker = tmp_path / "pwned"
    _plant(newest, marker)

    other = ["train", "--batch_size", "64", "--output_dir", str(tmp_path / "r2"), "--epochs", "3"]
    err = one_error_line(capsys, [*other, "--resume_from", str(newest)])
    assert "pickled code" in err and "refused" in err and str(newest) in err
    err = one_error_line(capsys, ["export", str(newest), str(tmp_path / "m.safetensors")])
    assert "pickled code" in err
    assert not marker.exists(), "reading the step directory ran its code"

    # auto skips it with a warning and resumes from the whole one before it
    assert main([*base, "--epochs", "3", "--resume_from", "auto"]) == 0
    out = capsys.readouterr()
    assert "skipping unusable checkpoint" in out.out + out.err
    assert not marker.exists(), "reading the step directory ran its code"
    assert (ckpt / "step_000000024").is_dir()
    assert main(["export", str(older), str(tmp_path / "m.safetensors")]) == 0


def test_a_device_or_fifo_given_as_weights_is_refused_before_it_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """/dev/zero would be read until memory runs out, a FIFO would block for good."""
    fifo = tmp_path / "weights.safetensors"
    os.mkfifo(fifo)
    (tmp_path / "config.yaml").write_text("dataset: digits\n")
    out = str(tmp_path / "m.safetensors")
    for args in (["evaluate", "/dev/zero"], ["evaluate", str(fifo)], ["export", "/dev/zero", out],
                 ["train", "--init_from", str(fifo), "--output_dir", str(tmp_path / "r")],
                 ["train", "--resume_from", "/dev/zero", "--output_dir", str(tmp_path / "r")]):
        err = one_error_line(capsys, args)
        assert "is not a regular file (a device, FIFO or socket)" in err, (args, err)


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    base = ["train", "--batch_size", "64", "--output_dir", str(run)]
    assert main([*base, "--epochs", "1"]) == 0
    target = tmp_path / "precious"
    target.write_bytes(b"keep these bytes\n")
    lock = run / ".lock"
    lock.unlink()
    lock.symlink_to(target)
    err = one_error_line(capsys, [*base, "--epochs", "2", "--resume_from", "auto"])
    assert str(lock) in err and "symlink" in err
    assert target.read_bytes() == b"keep these bytes\n"
    assert lock.is_symlink()


def test_a_dcp_checkpoint_of_another_width_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    base = ["train", "--batch_size", "64", "--checkpoint_format", "dcp", "--epochs", "1"]
    assert main([*base, "--output_dir", str(run)]) == 0
    step = run / "checkpoints" / "step_000000008"
    other = [*base, "--epochs", "2", "--width", "32", "--output_dir", str(tmp_path / "r2")]
    err = one_error_line(capsys, [*other, "--resume_from", str(step)])
    assert "does not fit this model and optimizer" in err and str(step) in err
    assert "CheckpointException" not in err


# TensorBoard's writer thread must not print its own traceback over ddptrain's line
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_run_logs_that_cannot_be_written_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    base = ["train", "--batch_size", "64", "--output_dir", str(run)]
    assert main([*base, "--epochs", "1"]) == 0
    again = [*base, "--epochs", "2", "--resume_from", "auto"]

    # metrics.jsonl that cannot be replaced (a directory in its place): no root needed
    metrics = run / "metrics.jsonl"
    rows = metrics.read_bytes()
    metrics.unlink()
    metrics.mkdir()
    err = one_error_line(capsys, again)
    assert "cannot write the run's log" in err and str(metrics) in err
    metrics.rmdir()
    metrics.write_bytes(rows)

    # a read-only TensorBoard directory (a read-only tmpfs over it)
    with tmpfs(run / "tensorboard", "size=64k,ro"):
        err = one_error_line(capsys, again)
        assert "cannot write the run's log" in err and "Read-only file system" in err
        assert metrics.read_bytes() == rows  # left as it was
    assert main(again) == 0  # and the corrected directory resumes


def test_a_read_only_run_directory_is_refused_at_the_start_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with tmpfs(tmp_path / "ro", "size=8m") as mount:
        run = mount / "run"
        base = ["train", "--batch_size", "64", "--output_dir", str(run)]
        assert main([*base, "--epochs", "1"]) == 0
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        err = one_error_line(capsys, [*base, "--epochs", "2", "--resume_from", "auto"])
        assert "is not writable (Read-only file system)" in err and str(run) in err


@pytest.mark.slow
@pytest.mark.heavy
def test_a_log_that_fails_mid_run_stops_every_rank_with_exit_74(tmp_path: Path) -> None:
    """metrics.jsonl on a filesystem that fills up while two ranks (started by hand, no
    agent) train: rank 0 names the file and the errno, its peer says what happened, both
    exit 74 at once, no checkpoint follows the failure, and the run resumes once there is
    room, its log without a gap."""
    import json
    import sys
    import time

    from conftest import child_env
    from dist_utils import free_port
    from procs import popen, reap  # noqa: F401  (reap: an autouse fixture)

    from ddptrain.checkpoint.pt import list_checkpoints
    from ddptrain.errors import EXIT_IO

    with tmpfs(tmp_path / "small", "size=1m") as mount:
        run, ckpt = mount / "run", tmp_path / "ckpt"
        args = ["train", "--dataset", "digits", "--model", "mlp", "--batch_size", "4",
                "--width", "16", "--epochs", "1", "--log_interval", "1", "--save_every_steps", "20",
                "--timeout_s", "20", "--output_dir", str(run), "--checkpoint_dir", str(ckpt)]
        port = str(free_port())
        ranks = [popen([sys.executable, "-m", "ddptrain", *args], tmp_path, child_env({
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})) for r in (0, 1)]
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not list_checkpoints(ckpt):
            assert all(p.poll() is None for p in ranks) and time.monotonic() < deadline
            time.sleep(0.05)
        filler = mount / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True)
        t0 = time.monotonic()
        errs = [p.communicate(timeout=60)[1] for p in ranks]
        assert time.monotonic() - t0 < 30
        assert [p.returncode for p in ranks] == [EXIT_IO, EXIT_IO], errs
        lines = [e.strip().splitlines() for e in errs]
        assert all(len(x) == 1 for x in lines), errs
        assert lines[0][0].startswith("ddptrain: ") and str(metrics) in lines[0][0]
        assert "No space left on device (errno 28)" in lines[0][0]
        assert lines[1][0].startswith("[rank 1] ddptrain: ")
        assert "rank 0 could not write the run's log" in lines[1][0]
        newest = int(list_checkpoints(ckpt)[0].stem.split("_")[1])
        logged = [json.loads(x)["step"] for x in metrics.read_text().splitlines()
                  if x.endswith("}") and '"train"' in x]
        assert max(logged) >= newest  # no checkpoint past what the log holds

        filler.unlink()
        resumed = run_ranks_by_hand(args, tmp_path)
        assert resumed == [0, 0]
        steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()
                 if '"train"' in x]
        assert steps == list(range(1, len(steps) + 1))  # every step once, no gap


def run_ranks_by_hand(args: list[str], cwd: Path) -> list[int]:
    import sys

    from conftest import child_env
    from dist_utils import free_port
    from procs import popen

    port = str(free_port())
    ranks = [popen([sys.executable, "-m", "ddptrain", *args, "--resume_from", "auto"], cwd,
                   child_env({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}))
             for r in (0, 1)]
    for p in ranks:
        p.communicate(timeout=300)
    return [p.returncode for p in ranks]
