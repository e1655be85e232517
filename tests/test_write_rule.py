"""Every file ddptrain writes: never through a link, never over a file of the user's.

An attacker (or an unlucky operator) plants a symlink, or leaves their own file, at each name
a run writes; the run refuses in one line before it writes anything, or writes its own file
beside the link, and nothing outside changes (docs/ROBUSTNESS.md, "What ddptrain writes")."""

from __future__ import annotations

import os
import socket
import types
from pathlib import Path

import pytest
import torch
from conftest import run_cli, write_npz

from ddptrain.api import fit
from ddptrain.config import TrainingConfig
from ddptrain.errors import ConfigError
from ddptrain.files import LinkRefused, atomic_write_text, staged, staged_dir
from ddptrain.launch import signals
from ddptrain.launch.rundir import CHECKPOINT_NAMES, RUN_NAMES, refuse_occupied
from ddptrain.observe import hang, oom

SECRET = "the user's own bytes\n"


def _outside(tmp_path: Path) -> tuple[Path, Path]:
    """A file and a folder outside the run, each holding the user's bytes."""
    folder = tmp_path / "outside"
    folder.mkdir(exist_ok=True)
    for name in ("secret.txt", "report.txt", "rank0.json", "rank1.json", "stalled1.json",
                 "rank0.txt", "model.safetensors"):
        (folder / name).write_text(SECRET)
    return folder / "secret.txt", folder


def _unchanged(folder: Path) -> None:
    for path in folder.iterdir():
        assert path.read_text() == SECRET, f"{path} was written through a link"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["secret.txt", "report.txt", "rank0.json", "rank1.json", "stalled1.json", "rank0.txt",
         "model.safetensors"]), "a file appeared outside the run"


# ---------------------------------------------------------------- the claim: every name
@pytest.mark.parametrize("kind", ["link", "file"])
def test_each_name_a_run_writes_held_by_someone_else_refuses_the_run(
    tmp_path: Path, kind: str
) -> None:
    secret, folder = _outside(tmp_path)
    names = [*RUN_NAMES, *(f"checkpoints/{n}" for n in CHECKPOINT_NAMES)]
    for name in names:
        run = tmp_path / f"run-{name.replace('/', '-')}"
        planted = run / name
        planted.parent.mkdir(parents=True)
        if kind == "link":
            planted.symlink_to(folder if "." not in planted.name else secret)
        else:
            planted.write_text(SECRET)
        for resume in (None, "auto"):
            config = TrainingConfig(output_dir=str(run), resume_from=resume)
            with pytest.raises(ConfigError, match="holds no run of ddptrain's"):
                refuse_occupied(config)
    _unchanged(folder)


def test_a_users_project_folder_is_refused_whole(tmp_path: Path) -> None:
    """`--output_dir proj` where proj/hf holds the user's base model and notes, and
    proj/curves.png a figure of theirs: refused, fresh or `--resume_from auto`."""
    proj = tmp_path / "proj"
    (proj / "hf").mkdir(parents=True)
    (proj / "hf" / "config.json").write_text('{"model_type": "gpt2"}')
    (proj / "hf" / "notes.txt").write_text(SECRET)
    (proj / "curves.png").write_bytes(b"\x89PNG user's figure")
    data = write_npz(tmp_path / "d.npz", 64)
    before = {p: p.read_bytes() for p in proj.rglob("*") if p.is_file()}
    for resume in (None, "auto"):
        with pytest.raises(ConfigError, match="holds no run of ddptrain's"):
            fit(dataset=str(data), output_dir=str(proj), epochs=1, batch_size=16,
                resume_from=resume)
    assert {p: p.read_bytes() for p in proj.rglob("*") if p.is_file()} == before
    assert sorted(os.listdir(proj)) == ["curves.png", "hf"]


def test_another_projects_best_and_latest_in_the_checkpoint_dir_are_not_replaced(
    tmp_path: Path,
) -> None:
    theirs = tmp_path / "models"
    theirs.mkdir()
    for name in ("best.pt", "latest.pt"):
        torch.save({"theirs": torch.ones(3)}, theirs / name)
    before = {n: (theirs / n).read_bytes() for n in ("best.pt", "latest.pt")}
    data = write_npz(tmp_path / "d.npz", 64)
    with pytest.raises(ConfigError, match="holds no run of ddptrain's"):
        fit(dataset=str(data), output_dir=str(tmp_path / "run"), checkpoint_dir=str(theirs),
            epochs=1, batch_size=16)
    assert {n: (theirs / n).read_bytes() for n in ("best.pt", "latest.pt")} == before
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- records and reports
def test_hang_and_oom_reports_never_write_through_a_planted_folder_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, folder = _outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "hang").symlink_to(folder)
    (run / "oom").symlink_to(folder)
    monkeypatch.setitem(hang.POSITION, "run_dir", str(run))
    assert hang.write_record(RuntimeError("peer gone"), 0, 2) is None
    hang.StallWatch(run, 1, 2, 10.0)._note(3)
    assert hang.culprit_line(run, 1, 0, wait_s=0.0) is None  # no record of its own
    trainer = types.SimpleNamespace(
        config=TrainingConfig(output_dir=str(run)),
        ctx=types.SimpleNamespace(device=torch.device("cpu"), rank=0),
        progress=types.SimpleNamespace(step=3),
        strategy=types.SimpleNamespace(
            rank_bytes=lambda *_: {"params": 1, "grads": 1, "optimizer": 1}),
        module=None, optimizer=None,
    )
    line = str(oom.report(RuntimeError("DefaultCPUAllocator: can't allocate memory"), trainer))
    assert "report:" not in line  # said on the console, no file written
    _unchanged(folder)


def test_a_staged_file_is_created_new_and_a_link_at_its_name_replaced_not_followed(
    tmp_path: Path,
) -> None:
    secret, folder = _outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").symlink_to(secret)  # the file's own name: the link is replaced
    (run / f".summary.json.{os.getpid()}.tmp").symlink_to(secret)  # its temporary name
    atomic_write_text(run / "summary.json", "{}\n")
    assert not (run / "summary.json").is_symlink()
    assert (run / "summary.json").read_text() == "{}\n"
    (run / "hf").symlink_to(folder)  # a directory's name: the link removed, a folder made
    with staged_dir(run / "hf") as partial:
        (partial / "config.json").write_text("{}")
    assert not (run / "hf").is_symlink() and (run / "hf" / "config.json").is_file()
    (run / "sub").symlink_to(folder)
    with pytest.raises(LinkRefused, match="symlink"), staged(run / "sub" / "x", under=run):
        pass
    _unchanged(folder)


def test_the_exit_note_never_writes_through_a_link_in_the_shared_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret, folder = _outside(tmp_path)
    exit_file = tmp_path / "exit"
    monkeypatch.setenv("DDPTRAIN_EXIT_FILE", str(exit_file))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    # another local user's links at the names a rank could write
    (tmp_path / f"exit.{socket.gethostname()}.{os.getpid()}").symlink_to(secret)
    signals.note_exit(2)
    assert exit_file.read_text() == "2 0\n" and not exit_file.is_symlink()
    _unchanged(folder)


def test_a_record_the_run_reads_back_is_not_read_through_a_link(tmp_path: Path) -> None:
    from ddptrain.train.rollback import _recorded

    secret, folder = _outside(tmp_path)
    (tmp_path / "rollbacks.json").symlink_to(secret)
    with pytest.raises(ConfigError, match="is a link or no regular file") as refused:
        _recorded(tmp_path / "rollbacks.json", "run")
    assert SECRET.strip() not in str(refused.value)
    _unchanged(folder)


# ---------------------------------------------------------------- the audit, end to end
@pytest.mark.slow
def test_write_audit_a_run_with_every_output_never_writes_outside(tmp_path: Path) -> None:
    """Every output on (curves, TensorBoard, the profiler, checkpoints each epoch): planted
    as links and as the user's files, each name refuses a fresh run in one line; a run of
    ddptrain's own, continued with links planted at every name it writes, writes its files
    beside them and nothing outside changes."""
    secret, folder = _outside(tmp_path)
    data = write_npz(tmp_path / "d.npz", 96)
    every = ["train", "--dataset", str(data), "--batch_size", "16", "--curves",
             "--tensorboard", "--enable_profiling", "--save_every", "1", "--optimizer", "sgd"]
    planted = tmp_path / "planted"
    for name in RUN_NAMES:
        (planted / "checkpoints").mkdir(parents=True, exist_ok=True)
        if name != "checkpoints":
            (planted / name).symlink_to(folder if "." not in name else secret)
    for name in CHECKPOINT_NAMES:
        (planted / "checkpoints" / name).write_text(SECRET)
    proc = run_cli([*every, "--epochs", "1", "--output_dir", str(planted)], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds no run of ddptrain's" in lines[0], proc.stderr[-2000:]
    # a run of its own, continued with links where its outputs go
    run = tmp_path / "run"
    first = run_cli([*every, "--epochs", "1", "--output_dir", str(run)], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    for name in ("summary.json", "model.safetensors", "metrics.jsonl", "curves.png",
                 "finished.json"):
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to(secret)
    for name in ("hang", "oom", "hf", "adapter"):
        (run / name).symlink_to(folder)
    again = run_cli([*every, "--epochs", "2", "--output_dir", str(run),
                     "--resume_from", "auto"], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    for name in ("summary.json", "model.safetensors", "metrics.jsonl", "curves.png"):
        assert (run / name).is_file() and not (run / name).is_symlink(), name
    # a folder another library writes (TensorBoard's) planted as a link: one line, exit 2
    os.rename(run / "tensorboard", tmp_path / "tb")
    (run / "tensorboard").symlink_to(folder)
    refused = run_cli([*every, "--epochs", "3", "--output_dir", str(run),
                       "--resume_from", "auto"], tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "tensorboard' is a symlink" in lines[0], refused.stderr[-2000:]
    _unchanged(folder)
