"""`--tracker mlflow`: what a real training run leaves in a real MLflow store.

Each test trains in this process (the public CLI or `ddptrain.fit`) with its own run
directory, so the default store (`<run_dir>/mlruns`) is isolated in tmp_path, and reads
the store back with `MlflowClient`. The MLFLOW_* variables are reset for every test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import run_torchrun

from ddptrain import fit
from ddptrain.cli import main
from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError, Preempted
from ddptrain.observe.hooks import Hook
from ddptrain.observe.trackers import (
    MISSING_MLFLOW,
    MLflowTracker,
    flatten_params,
    row_metrics,
    tracker_hooks,
)

needs_mlflow = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="needs mlflow (pip install mlflow-skinny)"
)

QUICK = ["--batch_size", "16", "--log_interval", "5", "--tracker", "mlflow"]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def mlflow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No MLFLOW_* setting from outside; MLFLOW_ALLOW_FILE_STORE starts unset (the tracker
    opts in itself) and is unset again after the test."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    # set, then delete: the undo then deletes whatever the tracker sets in between
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


def train(run: Path, *args: str) -> None:
    assert main(["train", *QUICK, "--output_dir", str(run), *args]) == 0


def client_for(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def store_of(run: Path) -> Any:
    """A client of the run directory's default store."""
    return client_for((run / "mlruns").resolve().as_uri())


def only_run(client: Any, experiment: str = "ddptrain") -> Any:
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def jsonl_rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def expected_metrics(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """`<split>/<field>` -> [(step, value)] as the rows of metrics.jsonl say."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        for name, value in row.items():
            if name in ("split", "step") or isinstance(value, bool | str) or value is None:
                continue
            out[f"{row['split']}/{name}"].append((row["step"], float(value)))
    return out


def history(client: Any, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


def assert_same_metrics(client: Any, run: Any, rows: list[dict[str, Any]]) -> None:
    expected = expected_metrics(rows)
    assert set(run.data.metrics) == set(expected)
    for name, points in expected.items():
        logged = history(client, run.info.run_id, name)
        assert [s for s, _ in logged] == [s for s, _ in points], name
        assert [v for _, v in logged] == pytest.approx([v for _, v in points], rel=1e-6), name


@needs_mlflow
@pytest.mark.curves
def test_run_holds_config_metrics_and_artifacts(tmp_path: Path) -> None:
    run_dir = tmp_path / "first"
    train(run_dir, "--epochs", "2")

    client = store_of(run_dir)
    run = only_run(client)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "first"
    assert run.data.tags["ddptrain.run_dir"] == str(run_dir.resolve())

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert run.data.params == {name: str(value) for name, value in config.items()}
    assert run.data.params["lr"] == "0.01"
    assert run.data.params["batch_size"] == "16"

    rows = jsonl_rows(run_dir)
    assert {r["split"] for r in rows} == {"train", "val"}
    assert_same_metrics(client, run, rows)
    assert [v for _, v in history(client, run.info.run_id, "val/epoch")] == [1.0, 2.0]

    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "model.safetensors", "summary.json"} <= artifacts
    if _has_matplotlib():
        assert "curves.png" in artifacts
    model = Path(client.download_artifacts(run.info.run_id, "model.safetensors", str(tmp_path)))
    assert model.read_bytes() == (run_dir / "model.safetensors").read_bytes()


@needs_mlflow
def test_resume_continues_the_same_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(run_dir, "--epochs", "1")
    first = only_run(store_of(run_dir))
    assert first.info.status == "FINISHED"
    saved = torch.load(run_dir / "checkpoints" / "latest.pt", weights_only=True)
    assert saved["hooks"]["MLflowTracker"]["run_id"] == first.info.run_id

    train(run_dir, "--epochs", "2", "--resume_from", "auto")

    client = store_of(run_dir)
    run = only_run(client)
    assert run.info.run_id == first.info.run_id
    assert run.info.status == "FINISHED"
    val_steps = [r["step"] for r in jsonl_rows(run_dir) if r["split"] == "val"]
    assert len(val_steps) == 2
    assert [s for s, _ in history(client, run.info.run_id, "val/loss")] == val_steps
    assert [v for _, v in history(client, run.info.run_id, "val/epoch")] == [1.0, 2.0]
    assert_same_metrics(client, run, jsonl_rows(run_dir))
    # a param keeps its first value; what the resumed session ran with is a tag
    assert run.data.params["epochs"] == "1"
    assert run.data.tags["resumed.epochs"] == "2"
    assert run.data.tags["resumed.resume_from"] == "auto"


@needs_mlflow
def test_tracking_uri_and_experiment_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = (tmp_path / "shared-store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mine")
    run_dir = tmp_path / "run"
    train(run_dir, "--epochs", "1")

    assert not (run_dir / "mlruns").exists()
    run = only_run(client_for(store), "mine")
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"


@needs_mlflow
def test_sigterm_stop_ends_killed_and_resume_finishes_it(tmp_path: Path) -> None:
    class SigtermAtStep(Hook):
        """What a scheduler does to a preempted job, in the middle of epoch 2."""

        def on_step_end(self, run: Any) -> None:
            if run.step == 40:
                os.kill(os.getpid(), signal.SIGTERM)

    run_dir = tmp_path / "run"
    settings: dict[str, Any] = {
        "epochs": 2, "batch_size": 16, "log_interval": 5, "tracker": "mlflow",
        "output_dir": str(run_dir),
    }
    with pytest.raises(Preempted):
        fit(hooks=[SigtermAtStep()], **settings)
    client = store_of(run_dir)
    stopped = only_run(client)
    assert stopped.info.status == "KILLED"
    # the rows up to the stop were sent although no validation row came after them
    assert history(client, stopped.info.run_id, "train/loss")[-1][0] == 40

    fit(resume_from="auto", **settings)
    run = only_run(store_of(run_dir))
    assert (run.info.run_id, run.info.status) == (stopped.info.run_id, "FINISHED")


@needs_mlflow
@pytest.mark.slow
def test_two_ranks_make_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    proc = run_torchrun(
        2, ["train", *QUICK, "--epochs", "2", "--output_dir", str(run_dir)], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the tracker set it in its own process
    client = store_of(run_dir)
    run = only_run(client)
    assert run.info.status == "FINISHED"
    assert_same_metrics(client, run, jsonl_rows(run_dir))


@needs_mlflow
def test_crash_ends_failed(tmp_path: Path) -> None:
    class Boom(Hook):
        def on_row(self, run: Any, row: dict[str, Any]) -> None:
            if row["step"] == 10:
                raise RuntimeError("boom")

    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="boom"):
        fit(
            epochs=1, batch_size=16, log_interval=5, tracker="mlflow",
            output_dir=str(run_dir), hooks=[Boom()],
        )
    client = store_of(run_dir)
    run = only_run(client)
    assert run.info.status == "FAILED"
    assert [s for s, _ in history(client, run.info.run_id, "train/loss")] == [5, 10]


@needs_mlflow
def test_rows_are_buffered_until_a_val_row_or_the_interval(tmp_path: Path) -> None:
    run = _Stand(tmp_path / "run")
    hook = MLflowTracker(flush_every_s=3600)
    hook.on_fit_start(run)
    client = store_of(run.config.run_dir)
    assert hook.run_id is not None
    hook.on_row(run, {"split": "train", "epoch": 1, "step": 5, "loss": 0.5})
    hook.on_row(run, {"split": "train", "epoch": 1, "step": 10, "loss": 0.4})
    assert client.get_metric_history(hook.run_id, "train/loss") == []
    hook.on_row(run, {"split": "val", "epoch": 1, "step": 10, "loss": 0.3})
    assert history(client, hook.run_id, "train/loss") == [(5, 0.5), (10, 0.4)]
    assert history(client, hook.run_id, "val/loss") == [(10, 0.3)]

    hook.flush_every_s = 0.0  # the interval has passed at every row
    hook.on_row(run, {"split": "train", "epoch": 2, "step": 15, "loss": 0.2})
    assert history(client, hook.run_id, "train/loss")[-1] == (15, 0.2)
    hook.close()
    assert client.get_run(hook.run_id).info.status == "FAILED"  # closed without on_fit_end


@needs_mlflow
def test_a_run_missing_from_the_store_starts_a_new_one(tmp_path: Path) -> None:
    run = _Stand(tmp_path / "run")
    hook = MLflowTracker()
    hook.load_state_dict({"run_id": "0" * 32, "tracking_uri": "file:///elsewhere"})
    hook.on_fit_start(run)
    assert hook.run_id not in (None, "0" * 32)
    assert hook.state_dict()["run_id"] == hook.run_id
    hook.close()


@needs_mlflow
def test_tracker_hooks_only_on_rank_0_and_only_when_asked(tmp_path: Path) -> None:
    config = TrainingConfig(tracker="mlflow", output_dir=str(tmp_path))
    assert [type(h) for h in tracker_hooks(config, _ctx(0))] == [MLflowTracker]
    assert tracker_hooks(config, _ctx(1)) == []
    assert tracker_hooks(TrainingConfig(output_dir=str(tmp_path)), _ctx(0)) == []


def test_missing_mlflow_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` sees uninstalled
    config = TrainingConfig(tracker="mlflow", output_dir=str(tmp_path))
    for rank in (0, 1):  # every rank stops, not only the one that would log
        with pytest.raises(ConfigError) as info:
            tracker_hooks(config, _ctx(rank))
        assert str(info.value) == MISSING_MLFLOW
    assert tracker_hooks(TrainingConfig(output_dir=str(tmp_path)), _ctx(0)) == []

    rc = main(["train", *QUICK, "--epochs", "1", "--output_dir", str(tmp_path / "run")])
    assert rc == 2
    assert f"ddptrain: error: {MISSING_MLFLOW}" in capsys.readouterr().err


def test_flatten_params() -> None:
    params = flatten_params({
        "lr": 0.01, "num_classes": None, "dataset_args": {"root": "/d", "opts": {"n": 3}},
        "model_args": {}, "note": "x" * 7000, "odd{key}": 1,
    })
    assert params == {
        "lr": "0.01", "num_classes": "None", "dataset_args.root": "/d",
        "dataset_args.opts.n": "3", "model_args": "{}", "note": "x" * 5997 + "...",
        "odd_key_": "1",
    }


def test_row_metrics_keep_numbers_only() -> None:
    row = {
        "split": "val", "epoch": 2, "step": 58, "loss": 0.25, "accuracy": 1,
        "flag": True, "name": "x", "missing": None, "top@5": 0.5,
    }
    assert row_metrics(row) == {
        "val/epoch": 2.0, "val/loss": 0.25, "val/accuracy": 1.0, "val/top_5": 0.5,
    }


class _Stand:
    """The part of a hook's `RunView` that the tracker reads, for driving it by hand."""

    is_main = True

    def __init__(self, run_dir: Path) -> None:
        self.config = TrainingConfig(tracker="mlflow", output_dir=str(run_dir))


def _ctx(rank: int) -> DistributedContext:
    return DistributedContext(rank=rank, local_rank=rank, world_size=2, device=CPU)


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None
