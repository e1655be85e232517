"""A run is finished once its exports are (`finished.json`, written last): a SIGTERM or a
full disk during the export leaves a run a resume finishes, exports a resume trained past
are known to be stale, and an export or prediction that cannot be written is one line.

Every run trains in this process (the public CLI) on `afterplug`'s tiny set; a stop
during the export is a real SIGTERM to this process from inside it, a full disk a real
tmpfs filled up."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import one_error_line, tmpfs
from safetensors.torch import load_file

import ddptrain.train.trainer as trainer_module
from ddptrain.checkpoint import find_resumable
from ddptrain.checkpoint.finished import FINISHED
from ddptrain.cli import main
from ddptrain.errors import EXIT_IO, preempt_exit_code

CODE = ["--dataset", "afterplug:pair", "--model", "afterplug:net"]
RUN = ["train", *CODE, "--batch_size", "16", "--epochs", "1", "--lr", "0.1",
       "--no-tensorboard", "--no-curves"]
CPU = torch.device("cpu")


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _sigterm_in_export(monkeypatch: pytest.MonkeyPatch, after: bool) -> None:
    """SIGTERM to this process from inside the run's export: once its files are written
    (`after`; summary.json is not yet), or before it writes any."""
    real = trainer_module.export_run

    def export(*args: Any, **kwargs: Any) -> None:
        if after:
            real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises here

    monkeypatch.setattr(trainer_module, "export_run", export)


def _val_rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "val"]


def test_a_run_stopped_during_its_export_is_finished_by_its_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    args = [*RUN, "--output_dir", str(run)]
    _sigterm_in_export(monkeypatch, after=True)
    assert main(args) == preempt_exit_code(None)
    monkeypatch.undo()
    assert (run / "model.safetensors").is_file()  # the old code called this run finished
    assert not (run / "summary.json").exists() and not (run / FINISHED).exists()
    checkpoints = _snapshot(run / "checkpoints")
    rows = (run / "metrics.jsonl").read_text()

    capsys.readouterr()
    assert main([*args, "--resume_from", "auto"]) == 0
    out = capsys.readouterr().out
    assert "already finished" not in out and "exports were not all written" in out
    # the exports of the final checkpoint, nothing trained again
    assert _snapshot(run / "checkpoints") == checkpoints
    assert (run / "metrics.jsonl").read_text() == rows
    found = find_resumable(run / "checkpoints", CPU)
    assert found is not None
    payload = found[1]
    weights = load_file(run / "model.safetensors")
    assert weights.keys() == payload["model_state_dict"].keys()
    assert all(torch.equal(weights[k], payload["model_state_dict"][k]) for k in weights)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == payload["step"] and summary["epochs"] == 1
    last = _val_rows(run)[-1]
    assert summary["val_loss"] == pytest.approx(last["loss"], rel=1e-6)
    record = json.loads((run / FINISHED).read_text())
    assert (record["run_id"], record["step"]) == (summary["run_id"], payload["step"])
    assert {"model.safetensors", "summary.json"} <= set(record["files"])

    # now it has finished: said so, nothing touched
    before = _snapshot(run)
    assert main([*args, "--resume_from", "auto"]) == 0
    assert "already finished" in capsys.readouterr().out
    assert _snapshot(run) == before


def test_exports_a_resume_trained_past_are_stale_and_evaluate_takes_the_newest_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    args = [*RUN, "--output_dir", str(run)]
    assert main(args) == 0
    assert (run / FINISHED).is_file()
    out = tmp_path / "m1.json"
    assert main(["evaluate", str(run), *CODE, "--output", str(out)]) == 0
    assert json.loads(out.read_text())["source"] == str(run / "model.safetensors")
    exported = (run / "model.safetensors").read_bytes()

    # trained on to epoch 2, stopped before its exports: epoch 1's stay beside it
    marked: list[bool] = []
    train_epoch = trainer_module.Trainer.train_epoch

    def watched(self: Any, epoch: int) -> Any:
        marked.append((run / FINISHED).exists())
        return train_epoch(self, epoch)

    monkeypatch.setattr(trainer_module.Trainer, "train_epoch", watched)
    _sigterm_in_export(monkeypatch, after=False)
    assert main([*args, "--epochs", "2", "--resume_from", "auto"]) == preempt_exit_code(None)
    monkeypatch.undo()
    assert marked == [False]  # gone before the first new step
    assert (run / "model.safetensors").read_bytes() == exported
    newest = find_resumable(run / "checkpoints", CPU)
    assert newest is not None and newest[1]["epoch"] == 2

    capsys.readouterr()
    for command in ("evaluate", "predict"):
        target = tmp_path / ("m2.json" if command == "evaluate" else "p.jsonl")
        assert main([command, str(run), *CODE, "--output", str(target)]) == 0
    said = capsys.readouterr()
    assert "is not the export of the run's newest checkpoint" in said.out + said.err
    figures = json.loads((tmp_path / "m2.json").read_text())
    assert figures["source"] != str(run / "model.safetensors")
    row = _val_rows(run)[-1]
    assert row["epoch"] == 2 and figures["loss"] == pytest.approx(row["loss"], rel=1e-6)


def _fill(mount: Path) -> Path:
    """Fill the filesystem at `mount` to its last byte; the filler's path."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_during_the_export_is_one_line_exit_74_and_the_resume_writes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with tmpfs(tmp_path / "small", "size=1m") as mount:
        run = mount / "run"
        args = [*RUN, "--output_dir", str(run), "--checkpoint_dir", str(tmp_path / "ckpt")]
        real = trainer_module.export_run
        filled: list[Path] = []

        def fill_then_export(*a: Any, **k: Any) -> None:
            filled.append(_fill(mount))
            real(*a, **k)

        monkeypatch.setattr(trainer_module, "export_run", fill_then_export)
        capsys.readouterr()
        assert main(args) == EXIT_IO
        monkeypatch.undo()
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert err[0].startswith("ddptrain: stopped: rank 0 could not write the run's exports")
        assert "No space left on device (errno 28)" in err[0] and "--resume_from auto" in err[0]
        assert not (run / FINISHED).exists() and not (run / "summary.json").exists()
        assert not [p for p in os.listdir(run) if p.endswith(".tmp")]  # nothing half-written

        filled[0].unlink()
        assert main([*args, "--resume_from", "auto"]) == 0
        assert (run / FINISHED).is_file() and (run / "summary.json").is_file()
        assert load_file(run / "model.safetensors")


def test_export_predict_and_evaluate_onto_a_read_only_or_full_filesystem_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main([*RUN, "--output_dir", str(run)]) == 0

    with tmpfs(tmp_path / "ro", "size=64k,ro") as ro:
        for args in (["export", str(run), str(ro / "m.safetensors")],
                     ["export", str(run / "checkpoints" / "latest.pt"), str(ro / "a" / "m.st")],
                     ["predict", str(run), *CODE, "--output", str(ro / "p.npy")],
                     ["predict", str(run), *CODE, "--output", str(ro / "a" / "p.jsonl")],
                     ["evaluate", str(run), *CODE, "--output", str(ro / "m.json")]):
            err = one_error_line(capsys, args, 2)
            assert "cannot be written" in err and "Read-only file system" in err, err
        assert os.listdir(ro) == []

    with tmpfs(tmp_path / "full", "size=64k") as full:
        _fill(full)
        err = one_error_line(capsys, ["export", str(run), str(full / "m.safetensors")], EXIT_IO)
        assert "No space left on device (errno 28)" in err
        assert sorted(os.listdir(full)) == ["filler"]


def _fit_killed_in_export(rank: int, overrides: dict[str, Any], kill: bool) -> Any:
    """`ddptrain.fit` on this rank; with `kill`, rank 1 SIGKILLs itself as its export
    starts (rank 0, at its end or in its export, is then ended by the launcher)."""
    from ddptrain.api import fit

    if kill and rank == 1:
        def export(*args: Any, **kwargs: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        trainer_module.export_run = export  # type: ignore[assignment]
    return fit(**overrides)


@pytest.mark.slow
def test_a_rank_sigkilled_during_the_fsdp_export_leaves_a_run_its_resume_finishes(
    tmp_path: Path,
) -> None:
    from dist_utils import run_ranks

    run = tmp_path / "run"
    job = {"dataset": "afterplug:pair", "model": "afterplug:net", "batch_size": 8,
           "epochs": 1, "strategy": "fsdp", "tensorboard": False, "curves": False,
           "timeout_s": 30, "output_dir": str(run)}
    with pytest.raises(Exception, match=r"process 1 terminated with signal SIGKILL"):
        run_ranks(_fit_killed_in_export, 2, tmp_path, job, True)
    assert not (run / "summary.json").exists() and not (run / FINISHED).exists()
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())

    summaries = run_ranks(_fit_killed_in_export, 2, tmp_path,
                          {**job, "resume_from": "auto"}, False)
    assert not any(s.get("already_finished") for s in summaries)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == steps  # none trained
    record = json.loads((run / FINISHED).read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert (record["run_id"], record["step"]) == (summary["run_id"], summary["steps"])
    assert load_file(run / "model.safetensors")
    again = run_ranks(_fit_killed_in_export, 2, tmp_path, {**job, "resume_from": "auto"}, False)
    assert all(s.get("already_finished") for s in again)
