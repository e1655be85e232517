"""`ddptrain evaluate` and `predict` of runs trained on several datasets (`--mix`, `--val`),
and the refusals that need only the arguments and the stored config, which come before
any weights are read, any data loaded or any model built.

Runs train in this process (the public CLI) on tiny .npz files; one process throughout.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import run_torchrun, write_npz

import ddptrain
from ddptrain.checkpoint.common import forget_reads
from ddptrain.cli import main

TINY = ["--model", "mlp", "--width", "8", "--epochs", "1", "--batch_size", "32",
        "--num_workers", "0", "--no-tensorboard", "--no-curves"]
# stored code: a mixture and a validation set of functions, and a model function
CODED = ["--mix", "guardplug:augmented=1", "guardplug:flipped=1",
         "--val", "extra=guardplug:flipped", "--model", "guardplug:dropout_net"]


def _last_val_row(run: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "val"][-1]


def _one_line(capfd: pytest.CaptureFixture[str]) -> str:
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptrain: error: "), err
    return err[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    where = tmp_path_factory.mktemp("data")
    return {name: str(write_npz(where / f"{name}.npz", n, seed=seed))
            for seed, (name, n) in enumerate((("a", 120), ("b", 80), ("c", 60)))}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, data: dict[str, str]) -> Path:
    """A run drawn from two sources, with two more validation sets, one choosing best."""
    run = tmp_path_factory.mktemp("mixed") / "run"
    assert main(["train", "--mix", f"{data['a']}=0.6", f"{data['b']}=0.4",
                 "--val", f"extra={data['c']}", f"again={data['a']}",
                 "--best_metric", "extra/loss", *TINY, "--output_dir", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def coded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("coded") / "run"
    assert main(["train", *CODED, "--epochs", "1", "--num_workers", "0", "--no-tensorboard",
                 "--no-curves", "--output_dir", str(run)]) == 0
    return run


def _without_export(run: Path, where: Path) -> Path:
    """The run's config and checkpoints (hard links), without model.safetensors: its
    weights are then its newest checkpoint, whose checksums are checked when read."""
    copy = where / "copy"
    shutil.copytree(run / "checkpoints", copy / "checkpoints", copy_function=os.link)
    shutil.copy(run / "config.yaml", copy / "config.yaml")
    return copy


@pytest.fixture
def nothing_heavy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a checkpoint's weights (their checksums), loading the data and building the
    model each fail the test."""
    def fails(what: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"{what} before the refusal")
        return call

    forget_reads()
    monkeypatch.setattr("ddptrain.checkpoint.common.payload_damage", fails("weights checked"))
    monkeypatch.setattr("ddptrain.api.resolve_run", fails("data loaded"))
    monkeypatch.setattr("ddptrain.train.inference.build_model", fails("model built"))


def test_a_mixed_run_evaluates_every_validation_set_as_training_did(
    mixed: Path, data: dict[str, str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """With no --dataset, the run's own validation data (every source's) and each --val
    set, named NAME/METRIC: the figures of the run's last val row, in the console line
    and the --output file too."""
    row = _last_val_row(mixed)
    figures = ddptrain.evaluate(mixed)
    named = {k for k in row if k.startswith(("extra/", "again/"))}
    assert named == {f"{s}/{m}" for s in ("extra", "again") for m in ("loss", "accuracy",
                                                                      "samples")}
    for key in ("loss", "accuracy", "samples", *named):
        assert figures[key] == pytest.approx(row[key], rel=1e-6), key
    out = tmp_path / "eval.json"
    capfd.readouterr()
    assert main(["evaluate", str(mixed), "--output", str(out)]) == 0
    said = capfd.readouterr().out  # the log line, then the figures
    assert f"samples of the --mix of {data['a']}, {data['b']};" in said, said
    said = said.splitlines()[-1]
    assert "extra/loss" in said and "again/accuracy" in said, said
    sizes = (f"({row['samples']} samples; extra {row['extra/samples']}; "
             f"again {row['again/samples']}):")
    assert sizes in said and "/samples" not in said, said  # each set's size, in the head
    written = json.loads(out.read_text())
    assert written["again/accuracy"] == pytest.approx(row["again/accuracy"], rel=1e-6)


@pytest.mark.slow
def test_two_ranks_evaluate_every_validation_set_of_a_mixed_run_as_one(
    mixed: Path, tmp_path: Path
) -> None:
    row = _last_val_row(mixed)
    out = tmp_path / "m.json"
    done = run_torchrun(2, ["evaluate", str(mixed), "--output", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    for key in ("loss", "samples", "extra/loss", "extra/samples", "again/accuracy"):
        assert figures[key] == pytest.approx(row[key], rel=1e-6), key


def test_another_dataset_replaces_a_stored_mixture(
    mixed: Path, data: dict[str, str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`--dataset X` names the data: the stored mixture (and its validation sets) no longer
    apply, X is taken whole; predict likewise, and with no --dataset predicts the run's
    validation data."""
    figures = ddptrain.evaluate(mixed, argv=["--dataset", data["c"]])
    assert figures["samples"] == 60 and not [k for k in figures if "/" in k], figures
    assert main(["evaluate", str(mixed), "--dataset", data["c"]]) == 0
    assert "(60 samples)" in capfd.readouterr().out
    assert ddptrain.predict(mixed, tmp_path / "c.npy", argv=["--dataset", data["c"]]) == 60
    assert np.load(tmp_path / "c.npy").shape == (60, 3)
    assert main(["predict", str(mixed), "--output", str(tmp_path / "own.npy")]) == 0
    assert np.load(tmp_path / "own.npy").shape == (_last_val_row(mixed)["samples"], 3)


def test_a_stored_code_refusal_gives_the_exact_command_before_anything_is_read(
    coded: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, nothing_heavy: None,
) -> None:
    """A run whose config names code is refused before its weights are checked, its data
    loaded or its model built, in one line ending with the command that runs it."""
    copy = _without_export(coded, tmp_path)
    commands = []
    for source in (copy, coded / "checkpoints" / "latest.pt"):
        for command in (["evaluate", str(source)],
                        ["predict", str(source), "--output", str(tmp_path / "p.npy")]):
            capfd.readouterr()
            assert main(command) == 2
            line = _one_line(capfd)
            assert "names code to import and run (--mix guardplug:augmented=1" in line, line
            exact = line.rpartition("the command with it: ")[2]
            assert exact == shlex.join(["ddptrain", *command, "--trust_checkpoint_code"]), line
            commands.append(shlex.split(exact)[1:])
    monkeypatch.undo()
    forget_reads()
    for command in commands:
        (tmp_path / "p.npy").unlink(missing_ok=True)
        assert main(command) == 0, command


def test_refusals_of_the_arguments_come_before_anything_is_read(
    mixed: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], nothing_heavy: None,
) -> None:
    """A bad flag value, a --dataset that is not there, a run with no weights: one line,
    exit 2, before any checkpoint is checked, the data loaded or a model built."""
    copy = _without_export(mixed, tmp_path)
    for source in (copy, mixed / "checkpoints" / "latest.pt"):
        for flags, said in ((["--val_fraction", "2"], "--val_fraction 2.0 is invalid"),
                            (["--dataset", str(tmp_path / "no.npz")], "no such file")):
            for command in ("evaluate", "predict"):
                capfd.readouterr()
                assert main([command, str(source), *flags,
                             "--output", str(tmp_path / "p.npy")]) == 2
                assert said in _one_line(capfd)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(mixed / "config.yaml", bare / "config.yaml")
    capfd.readouterr()
    assert main(["evaluate", str(bare)]) == 2
    assert "holds no whole checkpoint" in _one_line(capfd)


def test_data_a_split_cannot_take_is_refused_before_the_model_is_built(
    data: dict[str, str], tmp_path: Path, capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--split all` of a stream, and predict of a stream, need only the data: refused
    once it is loaded, before the model is built or any weights are read."""
    def fails(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("model built before the refusal")

    run = tmp_path / "run"
    assert main(["train", "--dataset", data["c"], *TINY, "--output_dir", str(run)]) == 0
    monkeypatch.setattr("ddptrain.train.inference.build_model", fails)
    stream = ["--dataset", "guardplug:epoch_stream"]
    for command, said in ((["evaluate", str(run), *stream, "--split", "all"],
                           "--split all needs map-style datasets"),
                          (["predict", str(run), *stream, "--split", "train",
                            "--output", str(tmp_path / "p.npy")], "needs a map-style dataset")):
        capfd.readouterr()
        assert main(command) == 2
        assert said in _one_line(capfd)
