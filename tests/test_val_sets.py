"""`--val NAME=DATASET ...`: more validation sets beside the run's own, each sample of each
counted once (on one rank and on two), their figures NAME/METRIC in the val rows, and
`--best_metric NAME/METRIC` choosing the best epoch and early stopping. Bad input is one
line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_torchrun

from ddptrain.cli import main
from ddptrain.errors import ConfigError


def _noisy_digits(path: Path, n: int = 100) -> Path:
    """Samples shaped as digits' (1x8x8, 10 classes), with labels that mean nothing."""
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.normal(size=(n, 1, 8, 8)).astype(np.float32),
             y=(np.arange(n) % 10).astype(np.int64))
    return path


def _job(tmp_path: Path) -> list[str]:
    return ["train", "--dataset", "digits", "--model", "mlp", "--width", "16",
            "--val", "again=digits", f"noisy={_noisy_digits(tmp_path / 'noisy.npz')}",
            "--batch_size", "32", "--lr", "0.05", "--num_workers", "0",
            "--no-tensorboard", "--no-curves"]


def _val_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "val"]


def test_each_validation_set_is_counted_once_and_the_chosen_one_decides_best(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main([*_job(tmp_path), "--epochs", "3", "--best_metric", "noisy/loss",
                 "--output_dir", str(run)]) == 0
    rows = _val_rows(run)
    assert len(rows) == 3
    for row in rows:
        # digits' own validation part again: the same samples, the same figures
        assert row["again/samples"] == row["samples"] == 359
        assert row["again/loss"] == row["loss"] and row["again/accuracy"] == row["accuracy"]
        assert row["noisy/samples"] == 20  # --val_fraction's 0.2 of 100
    said = capfd.readouterr()
    assert "noisy/loss" in said.out + said.err  # the console's val line names every figure
    summary = json.loads((run / "summary.json").read_text())
    losses = [row["noisy/loss"] for row in rows]
    assert summary["best_metric"] == "noisy/loss"
    assert summary["best_epoch"] == 1 + losses.index(min(losses))
    assert summary["best_val_noisy/loss"] == min(losses)
    # the best so far was judged by noisy/loss: a resume may not judge by another figure
    capfd.readouterr()
    assert main([*_job(tmp_path), "--epochs", "4", "--best_metric", "loss",
                 "--output_dir", str(run), "--resume_from", "auto"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was trained with --best_metric noisy/loss" in err[0], err
    # early stopping follows the chosen figure: no change counts, so it stops at once
    stopped = tmp_path / "stopped"
    assert main([*_job(tmp_path), "--epochs", "5", "--best_metric", "noisy/loss",
                 "--early_stopping", "1", "--early_stopping_min_delta", "100",
                 "--output_dir", str(stopped)]) == 0
    summary = json.loads((stopped / "summary.json").read_text())
    assert "val noisy/loss did not improve" in summary["stop_reason"]
    assert len(_val_rows(stopped)) == 2


@pytest.mark.parametrize("args, says", [
    (["--val", "again"], "give NAME=DATASET"),
    (["--val", "a=digits", "a=digits"], "it names the set 'a' twice"),
    (["--val", "a/b=digits"], "give NAME=DATASET"),
    (["--val", "a=nosuch"], "--val 'nosuch' is invalid: choose one of"),
    (["--val", "a=breast_cancer"], "--val a=breast_cancer and the training data disagree"),
    (["--best_metric", "other/loss"], "NAME one of --val's sets (none given)"),
    (["--val", "a=digits", "--best_metric", "a/f1"], "ranks epochs by accuracy"),
])
def test_bad_validation_sets_are_one_line_and_exit_2(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    run = tmp_path / "run"
    assert main(["train", "--dataset", "digits", *args, "--epochs", "1",
                 "--output_dir", str(run)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptrain: error:") and says in err[0], err
    assert not (run / "model.safetensors").exists()


@pytest.mark.slow
def test_two_ranks_count_each_validation_set_once(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([*_job(tmp_path), "--epochs", "1", "--output_dir", str(one)]) == 0
    done = run_torchrun(2, [*_job(tmp_path), "--epochs", "1", "--batch_size", "16",
                            "--output_dir", str(two)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (a,), (b,) = _val_rows(one), _val_rows(two)
    for key in ("samples", "again/samples", "noisy/samples"):
        assert b[key] == a[key], key
    assert b["again/loss"] == b["loss"] and b["noisy/loss"] == pytest.approx(a["noisy/loss"],
                                                                             abs=1e-5)


def test_the_python_api_takes_validation_sets_as_datasets_or_names(tmp_path: Path) -> None:
    import torch
    from torch.utils.data import TensorDataset

    import ddptrain

    x = torch.randn(40, 6)
    data = (TensorDataset(x, torch.arange(40) % 3), TensorDataset(x[:10], torch.arange(10) % 3))
    extra = TensorDataset(torch.randn(12, 6), torch.arange(12) % 3)
    # a name as --dataset takes it is loaded and checked alike too (digits' are images)
    with pytest.raises(ConfigError, match="--val again=digits and the training data"):
        ddptrain.fit(datasets=data, val={"extra": extra, "again": "digits"}, epochs=1,
                     output_dir=str(tmp_path / "refused"))
    summary = ddptrain.fit(datasets=data, val={"extra": extra}, epochs=1, batch_size=8,
                           num_workers=0, tensorboard=False, curves=False,
                           output_dir=str(tmp_path / "run"))
    assert summary["val_extra/samples"] == 12 and "val_extra/loss" in summary
