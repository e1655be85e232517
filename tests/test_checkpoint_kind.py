"""The checkpoint kind: decided for a run from its config, world size and model size
(`ddptrain.checkpoint_kind`), and read from a path already on disk
(`ddptrain.checkpoint.kind.resolve_checkpoint`). Pure logic on tmp_path: no process group."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from ddptrain.checkpoint.kind import (
    DCP_INDEX,
    META,
    Checkpoint,
    CheckpointKind,
    resolve_checkpoint,
)
from ddptrain.checkpoint_kind import DCP_ABOVE_BYTES, checkpoint_kind
from ddptrain.config import TrainingConfig

SMALL, LARGE = 10_000_000, 200_000_000  # AdamW (2 slots): 120 MB, 2.4 GB of fp32 state


def test_the_kind_is_a_string_that_round_trips() -> None:
    assert CheckpointKind.FILE == "file" and CheckpointKind.DCP == "dcp"
    assert CheckpointKind("dcp") is CheckpointKind.DCP
    assert f"{CheckpointKind.DCP}" == "dcp" and str(CheckpointKind.FILE) == "file"
    assert json.loads(json.dumps({"kind": CheckpointKind.DCP})) == {"kind": "dcp"}
    assert yaml.safe_load(yaml.safe_dump({"kind": str(CheckpointKind.FILE)})) == {"kind": "file"}


@pytest.mark.parametrize(("fields", "world", "kind"), [
    ({}, None, "file"),  # ddp: rank 0 writes the whole state
    ({}, 8, "file"),
    ({"strategy": "zero"}, 8, "dcp"),  # each rank holds a share
    ({"strategy": "fsdp"}, 1, "dcp"),
    ({"tp": 2}, 2, "dcp"),
    ({"pp": 2}, 2, "dcp"),
    ({"ep": 2}, 2, "dcp"),
    ({"checkpoint_format": "file", "strategy": "fsdp"}, 4, "file"),  # named: kept
    ({"checkpoint_format": "dcp"}, 1, "dcp"),
])
def test_the_kind_a_config_asks(fields: dict[str, object], world: int | None, kind: str) -> None:
    config = TrainingConfig(**fields)  # type: ignore[arg-type]
    assert checkpoint_kind(config, world) is CheckpointKind(kind)
    if world is None:
        assert config.checkpoint_kind is CheckpointKind(kind)


def test_a_large_ddp_state_turns_auto_into_dcp_on_several_ranks() -> None:
    auto, named = TrainingConfig(), TrainingConfig(checkpoint_format="file")
    assert 4 * LARGE * 3 > DCP_ABOVE_BYTES > 4 * SMALL * 3
    assert checkpoint_kind(auto, 8, SMALL, 2) is CheckpointKind.FILE
    assert checkpoint_kind(auto, 8, LARGE, 2) is CheckpointKind.DCP
    assert checkpoint_kind(named, 8, LARGE, 2) is CheckpointKind.FILE
    assert checkpoint_kind(auto, 1, LARGE, 2) is CheckpointKind.FILE  # one process: one writer
    assert checkpoint_kind(auto, None, LARGE, 2) is CheckpointKind.FILE


def _step_dir(root: Path, whole: bool = True) -> Path:
    path = root / "checkpoints" / "step_000000010"
    path.mkdir(parents=True)
    (path / DCP_INDEX).write_bytes(b"index")
    if whole:
        (path / META).write_bytes(b"meta")
    return path


def test_a_step_file(tmp_path: Path) -> None:
    path = tmp_path / "step_000000010.pt"
    path.write_bytes(b"pt")
    found = resolve_checkpoint(path)
    assert found == Checkpoint(path, exists=True, link=False, directory=False)
    assert found.kind is CheckpointKind.FILE
    assert not (found.step_dir or found.whole or found.run_dir or found.safetensors)


def test_a_dcp_step_directory(tmp_path: Path) -> None:
    found = resolve_checkpoint(_step_dir(tmp_path))
    assert found.kind is CheckpointKind.DCP and found.directory and found.own_directory
    assert found.step_dir and found.whole and not found.run_dir


def test_a_torn_step_directory_is_still_read_as_one(tmp_path: Path) -> None:
    found = resolve_checkpoint(_step_dir(tmp_path, whole=False))
    assert found.kind is CheckpointKind.DCP and found.step_dir and not found.whole


def test_a_run_directory(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("epochs: 1\n")
    _step_dir(tmp_path)
    found = resolve_checkpoint(tmp_path)
    assert found.run_dir and found.holds_config and found.directory
    assert not found.step_dir and not found.whole


def test_an_exported_model(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("epochs: 1\n")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"st")
    file = resolve_checkpoint(weights)
    assert file.safetensors and file.kind is CheckpointKind.FILE and not file.directory
    folder = resolve_checkpoint(tmp_path)  # the export's folder: read for its weights
    assert folder.directory and not folder.step_dir


def test_a_missing_path(tmp_path: Path) -> None:
    found = resolve_checkpoint(tmp_path / "step_000000099.pt")
    assert not (found.exists or found.link or found.directory)
    assert found.kind is CheckpointKind.FILE  # refused by the file reader, as before
    assert not (found.step_dir or found.whole or found.holds_config or found.run_dir)


def test_a_link_is_reported_and_not_a_directory_of_its_own(tmp_path: Path) -> None:
    target = _step_dir(tmp_path)
    link = tmp_path / "planted"
    os.symlink(target, link)
    found = resolve_checkpoint(link)
    assert found.link and found.directory and found.kind is CheckpointKind.DCP
    assert not found.own_directory  # a planted link is not read through (finished's stamps)
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "gone", dangling)
    gone = resolve_checkpoint(dangling)
    assert gone.link and not gone.exists and not gone.directory
