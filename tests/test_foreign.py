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

from ddptrain.checkpoint.integrity import file_crc
from ddptrain.cli import main


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _one_line(capsys: pytest.CaptureFixture[str], args: list[str], code: int = 2) -> str:
    capsys.readouterr()
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == code and len(err.splitlines()) == 1, (rc, err)
    assert err.startswith("ddptrain: error: "), err
    return err


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
    err = _one_line(capsys, [*other, "--resume_from", str(newest)])
    assert "pickled code" in err and "refused" in err and str(newest) in err
    err = _one_line(capsys, ["export", str(newest), str(tmp_path / "m.safetensors")])
    assert "pickled code" in err
    assert not marker.exists(), "reading the step directory ran its code"

    # auto skips it with a warning and resumes from the whole one before it
    assert main([*base, "--epochs", "3", "--resume_from", "auto"]) == 0
    out = capsys.readouterr()
    assert "skipping unusable checkpoint" in out.out + out.err
    assert not marker.exists(), "reading the step directory ran its code"
    assert (ckpt / "step_000000024").is_dir()
    assert main(["export", str(older), str(tmp_path / "m.safetensors")]) == 0


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
    err = _one_line(capsys, [*base, "--epochs", "2", "--resume_from", "auto"])
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
    err = _one_line(capsys, [*other, "--resume_from", str(step)])
    assert "does not fit this model and optimizer" in err and str(step) in err
    assert "CheckpointException" not in err


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
    err = _one_line(capsys, again)
    assert "cannot write the run's log" in err and str(metrics) in err
    metrics.rmdir()
    metrics.write_bytes(rows)

    # a read-only TensorBoard directory (a read-only tmpfs over it)
    board = run / "tensorboard"
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(board)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        err = _one_line(capsys, again)
        assert "cannot write the run's log" in err and "Read-only file system" in err
        assert metrics.read_bytes() == rows  # left as it was
    finally:
        subprocess.run(["umount", "-l", str(board)], check=False)
    assert main(again) == 0  # and the corrected directory resumes


def test_a_read_only_run_directory_is_refused_at_the_start_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run = mount / "run"
        base = ["train", "--batch_size", "64", "--output_dir", str(run)]
        assert main([*base, "--epochs", "1"]) == 0
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        err = _one_line(capsys, [*base, "--epochs", "2", "--resume_from", "auto"])
        assert "is not writable (Read-only file system)" in err and str(run) in err
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
