"""`--tracker wandb`: what a real training run leaves in Weights & Biases' offline files.

The run trains in this process with `WANDB_MODE=offline`; its `<run_dir>/wandb/offline-run-*/
run-<id>.wandb` file is read back record by record (W&B's log format: a 7-byte header, then
32 KiB blocks of checksummed chunks, each record a `wandb_internal_pb2.Record`).
"""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddptrain.cli import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="needs wandb (pip install wandb)"
)
QUICK = ["--dataset", "afterplug:pair", "--model", "afterplug:net", "--batch_size", "16",
         "--log_interval", "2", "--tracker", "wandb", "--no-tensorboard"]
_BLOCK, _HEAD = 32768, 7


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_PROJECT", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = _HEAD, []
    while pos + _HEAD <= len(data):
        left = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEAD])
        if left < _HEAD or (kind == 0 and length == 0):  # the rest of a block is padding
            pos += left
            continue
        chunks.append(data[pos + _HEAD : pos + _HEAD + length])
        pos += _HEAD + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def read_run(path: Path) -> dict[str, Any]:
    """The run id, config, history rows by step and artifact files of one offline run."""
    out: dict[str, Any] = {"history": {}, "artifacts": {}}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
            out["config"] = {i.key: json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            out["history"].setdefault(record.history.step.num, {}).update(row)
        elif kind == "artifact":
            names = [entry.path for entry in record.artifact.manifest.contents]
            out["artifacts"][record.artifact.type] = sorted(names)
    return out


def offline_runs(run: Path) -> list[Path]:
    return sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.heavy
@pytest.mark.slow  # two runs, each starting W&B's service process
def test_the_run_files_hold_the_config_the_rows_and_the_artifacts(tmp_path: Path) -> None:
    run = tmp_path / "w"
    assert main(["train", *QUICK, "--epochs", "2", "--output_dir", str(run)]) == 0
    config = yaml.safe_load((run / "config.yaml").read_text())
    (first,) = offline_runs(run)
    logged = read_run(first)
    assert logged["id"] == config["run_id"]
    assert {k: v for k, v in logged["config"].items() if k in config} == config
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in rows} == {"train", "val"}
    for row in rows:
        at = logged["history"][row["step"]]
        assert at[f"{row['split']}/loss"] == pytest.approx(row["loss"], rel=1e-12)
        assert at[f"{row['split']}/epoch"] == row["epoch"]
    expected = ["config.yaml", "model.safetensors", "summary.json"]
    assert logged["artifacts"] == {"run-files": expected}

    # a resume continues the same W&B run, with the rows of the epochs it adds
    assert main(["train", *QUICK, "--epochs", "3", "--output_dir", str(run),
                 "--resume_from", "auto"]) == 0
    runs = offline_runs(run)
    assert len(runs) == 2
    resumed = read_run(next(p for p in runs if p != first))
    assert resumed["id"] == logged["id"]
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["epoch"] == 3
    assert resumed["history"][last["step"]]["val/loss"] == pytest.approx(last["loss"], rel=1e-12)
    assert min(resumed["history"]) > max(r["step"] for r in rows)
