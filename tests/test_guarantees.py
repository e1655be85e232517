"""Guarantees that only show when something random or shuffled happens after a restart:
every rank's RNG state is restored, an iterable dataset is told its epoch, and
`--keep_last` never prunes the best DCP step directory.

Each test drives the CLI with the user code in `guardplug.py` and reads the results from
the run directory. A kill is the model SIGKILLing its own process at a given training
forward (GUARD_KILL_AT), so it lands at the same step however busy the machine is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import run_cli, run_torchrun
from procs import assert_bitwise, assert_same_log, rows, sigkill_then_resume, weights
from safetensors.torch import load_file

from ddptrain.checkpoint import list_checkpoints, load_checkpoint
from ddptrain.cli import main

CPU = torch.device("cpu")


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------- RNG state of every rank
# 192 training samples on 2 ranks x 8: 12 steps an epoch. At every step a dropout layer in
# the model draws from each rank's own torch generator, and the dataset's __getitem__ (in
# the training process: --num_workers 0) adds noise from its torch, numpy and Python ones.
RNG_JOB = ["train", "--dataset", "guardplug:augmented", "--model", "guardplug:dropout_net",
           "--batch_size", "8", "--epochs", "2", "--lr", "0.05", "--num_workers", "0",
           "--save_every_steps", "5", "--log_interval", "4"]


@pytest.mark.heavy
@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_restores_every_ranks_rng_state(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    _ok(run_torchrun(2, [*RNG_JOB, "--output_dir", str(reference)], cwd=tmp_path))
    run = tmp_path / "run"

    def killed_at_step_18() -> None:
        # rank 1 died at step 18's forward: the newest checkpoint is step 15, in epoch 2
        newest = load_checkpoint(list_checkpoints(run / "checkpoints")[0], CPU)
        assert (newest["step"], newest["epoch"], newest["samples_in_epoch"]) == (15, 1, 48)
        torch_states = [rank["torch"] for rank in newest["rng"]]
        assert len(torch_states) == 2 and not torch.equal(*torch_states)  # each rank its own

    resumed = sigkill_then_resume(2, RNG_JOB, run, tmp_path, 18, between=killed_at_step_18)
    assert "epoch 1 done, step 15" in resumed.stdout + resumed.stderr
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)


# ---------------------------------------------------------------- an iterable's epoch
# 64 samples in an order drawn from (seed, epoch), on 2 ranks x 8: 4 steps an epoch, each
# rank records the ids of its 4 batches per epoch.
STREAM_JOB = ["train", "--dataset", "guardplug:epoch_stream", "--model", "guardplug:recorder",
              "--batch_size", "8", "--epochs", "2", "--lr", "0.05", "--num_workers", "0",
              "--save_every_steps", "2", "--log_interval", "2"]
STEPS = 4


def _recorded(record: Path) -> list[list[list[int]]]:
    """Per rank, the ids of each training batch in the order trained on."""
    lines = [(record / f"rank{r}.txt").read_text().splitlines() for r in (0, 1)]
    return [[[int(v) for v in line.split()] for line in rank] for rank in lines]


def _epochs(seen: list[list[list[int]]]) -> list[list[list[int]]]:
    """Epoch by epoch, every rank's batches of that epoch."""
    count = len(seen[0]) // STEPS
    return [[rank[e * STEPS : (e + 1) * STEPS] for rank in seen] for e in range(count)]


def _ids(epoch: list[list[list[int]]]) -> list[int]:
    return sorted(i for rank in epoch for batch in rank for i in batch)


def _stream_run(base: Path, name: str, extra: list[str], env: dict[str, str]) -> Path:
    record = base / f"{name}-record"
    record.mkdir()
    proc = run_torchrun(2, [*STREAM_JOB, *extra], cwd=base,
                        env={"GUARD_RECORD": str(record), **env})
    if "GUARD_KILL_AT" in env:
        assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
    else:
        _ok(proc)
    return record


@pytest.fixture(scope="module")
def stream_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run, in `run/`; its records are in `reference-record/`."""
    base = tmp_path_factory.mktemp("stream")
    _stream_run(base, "reference", ["--output_dir", str(base / "run")], {})
    return base


@pytest.mark.slow
def test_an_iterable_dataset_is_told_the_epoch_also_after_a_resume(
    stream_reference: Path, tmp_path: Path
) -> None:
    first, second = _epochs(_recorded(stream_reference / "reference-record"))
    assert _ids(first) == _ids(second) == list(range(64))  # every sample once an epoch
    assert second != first, "epoch 2 trained on epoch 1's order: set_epoch never arrived"
    # Resume into epoch 2 from the checkpoint at the end of epoch 1.
    epoch_end = stream_reference / "run" / "checkpoints" / "step_000000004.pt"
    payload = load_checkpoint(epoch_end, CPU)
    assert (payload["epoch"], payload["samples_in_epoch"]) == (1, 0)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(epoch_end, run / "checkpoints" / epoch_end.name)
    record = _stream_run(tmp_path, "resumed", [
        "--output_dir", str(run), "--resume_from", str(run / "checkpoints" / epoch_end.name)
    ], {})
    (resumed,) = _epochs(_recorded(record))
    assert resumed == second, "the resumed epoch 2 trained on another order"
    assert_bitwise(weights(run), weights(stream_reference / "run"))


@pytest.mark.slow
def test_a_stateful_stream_resumed_mid_epoch_keeps_its_epochs_order(
    stream_reference: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    # rank 1 dies at step 7's forward: the newest checkpoint is step 6, half-way into
    # epoch 2, with the stream's position in it
    killed = _stream_run(tmp_path, "killed", [
        "--dataset_args", "stateful=true", "--output_dir", str(run)
    ], {"GUARD_KILL_AT": "7"})
    newest = load_checkpoint(list_checkpoints(run / "checkpoints")[0], CPU)
    assert (newest["step"], newest["epoch"]) == (6, 1)
    record = _stream_run(tmp_path, "resumed", [
        "--dataset_args", "stateful=true", "--output_dir", str(run), "--resume_from", "auto"
    ], {})
    before = [rank[STEPS : STEPS + 2] for rank in _recorded(killed)]  # steps 5 and 6
    after = _recorded(record)  # steps 7 and 8
    assert _ids([[*b, *a] for b, a in zip(before, after, strict=True)]) == list(range(64))
    # the uninterrupted run's epoch 2 order (the same stream but for its state_dict; its
    # weights cannot be compared: see test_reading_the_datas_facts_does_not_consume...)
    _, second = _epochs(_recorded(stream_reference / "reference-record"))
    assert after == [rank[2:] for rank in second]


@pytest.mark.slow
def test_a_stateful_stream_in_two_loader_workers_resumes_mid_epoch_exactly(
    tmp_path: Path,
) -> None:
    """--num_workers 2: each worker's position in the stream is saved (torchdata's
    StatefulDataLoader). Rank 1 dies at step 7's forward; the resume from step 6 trains
    steps 7 and 8 on the uninterrupted run's samples and ends with its weights."""
    workers = ["--dataset_args", "stateful=true", "--num_workers", "2"]
    reference, run = tmp_path / "reference", tmp_path / "run"
    whole = _stream_run(tmp_path, "reference", [*workers, "--output_dir", str(reference)], {})
    _stream_run(tmp_path, "killed", [*workers, "--output_dir", str(run)], {"GUARD_KILL_AT": "7"})
    newest = load_checkpoint(list_checkpoints(run / "checkpoints")[0], CPU)
    assert (newest["step"], newest["epoch"]) == (6, 1)
    resumed = _stream_run(tmp_path, "resumed", [
        *workers, "--output_dir", str(run), "--resume_from", "auto"], {})
    assert _recorded(resumed) == [rank[6:] for rank in _recorded(whole)]
    assert_bitwise(weights(run), weights(reference))


@pytest.mark.slow
def test_an_iterable_dataset_in_loader_workers_is_told_the_epoch(tmp_path: Path) -> None:
    record = _stream_run(tmp_path, "workers", [
        "--num_workers", "2", "--output_dir", str(tmp_path / "run")
    ], {})
    first, second = _epochs(_recorded(record))
    assert _ids(first) == _ids(second) == list(range(64))
    assert second != first, "epoch 2 trained on epoch 1's order: set_epoch never arrived"


def test_reading_the_datas_facts_does_not_consume_a_stateful_stream(tmp_path: Path) -> None:
    record = tmp_path / "record"
    record.mkdir()
    _ok(run_cli([*STREAM_JOB, "--dataset_args", "stateful=true", "--epochs", "1",
                 "--output_dir", str(tmp_path / "run")], cwd=tmp_path,
                env={"GUARD_RECORD": str(record)}))
    seen = [int(v) for v in (record / "rank0.txt").read_text().split()]  # one process
    assert sorted(seen) == list(range(64)), "epoch 1 did not see every sample once"


# ---------------------------------------------------------------- the best DCP checkpoint
def test_keep_last_never_prunes_the_best_dcp_step_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # Validation labels are the opposite of the training rule: epoch 1 is the best.
    # 240 training samples in batches of 16: 15 steps an epoch, a step directory each.
    _ok(run_cli(["train", "--dataset", "guardplug:flipped", "--model", "mlp", "--batch_size",
                 "16", "--epochs", "3", "--lr", "0.05", "--checkpoint_format", "dcp",
                 "--keep_last", "1", "--output_dir", str(run)], cwd=tmp_path))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_epoch"] == 1, [r for r in rows(run) if r["split"] == "val"]
    ckpt = run / "checkpoints"
    best = ckpt / (ckpt / "best").read_text().strip()
    latest = ckpt / (ckpt / "latest").read_text().strip()
    assert (best.name, latest.name) == ("step_000000015", "step_000000045")
    # --keep_last 1 pruned epoch 2; the best epoch's directory is whole and loads
    assert sorted(p.name for p in ckpt.glob("step_*")) == [best.name, latest.name]
    meta = load_checkpoint(best, CPU)
    assert (meta["epoch"], meta["step"]) == (1, 15)
    out = tmp_path / "best.safetensors"
    assert main(["export", str(best), str(out)]) == 0
    exported, final = load_file(str(out)), weights(run)
    assert exported.keys() == final.keys()
    assert any(not torch.equal(exported[k], final[k]) for k in final)  # epoch 1's, not 3's


@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_export_best_writes_the_best_epochs_weights(tmp_path: Path, fmt: str) -> None:
    """`--export best` (as after early stopping): model.safetensors holds the best epoch's
    checkpoint's weights, not the last step's; the summary names the checkpoint."""
    run = tmp_path / "run"
    assert main(["train", "--dataset", "guardplug:flipped", "--model", "mlp", "--batch_size",
                 "16", "--epochs", "3", "--lr", "0.05", "--checkpoint_format", fmt,
                 "--ema_decay", "0.5", "--export", "best", "--no-tensorboard",
                 "--output_dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_epoch"] == 1
    best = run / "checkpoints" / ("best.pt" if fmt == "file" else "best")
    assert main(["export", str(best), str(tmp_path / "best.safetensors")]) == 0
    expected, got = load_file(str(tmp_path / "best.safetensors")), weights(run)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert "step_000000015" in summary["exported"] or summary["exported"].endswith("best.pt")
