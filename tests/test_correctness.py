"""The data-parallel proofs, on real 2-rank gloo process groups.

1. N ranks x batch B == 1 rank x batch N*B: in test_tasks.py, for every task.
2. K micro-steps of b == one step of K*b, with one all-reduce round per optimizer step.
3. The sampler covers every training sample, each on one rank, in a seeded order that
   changes between epochs.
4. Validation metrics on 2 ranks equal those on 1 rank.
5. Train rows are global, though their all-reduces are batched (one per epoch end).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from safetensors.torch import load_file
from workers import count_allreduces, count_metric_collectives, epoch_indices, evaluate_fresh

from ddptrain.cli import train
from ddptrain.config import TrainingConfig

pytestmark = pytest.mark.slow


def _base(npz: Path, out: Path, **kw: Any) -> dict[str, Any]:
    cfg = dict(
        dataset=str(npz), model="mlp", epochs=2, lr=0.05, momentum=0.9, weight_decay=1e-4,
        warmup_epochs=0.5, use_amp=False, log_interval=5, seed=7, output_dir=str(out),
    )
    cfg.update(kw)
    return cfg


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), (k, (a[k] - b[k]).abs().max())


def _single(cfg: dict[str, Any]) -> dict[str, Any] | None:
    return train(TrainingConfig(**cfg).validate())


def test_accumulation_equals_big_batch_with_one_allreduce_per_step(
    tmp_path: Path, npz400: Path
) -> None:
    # Per rank: 160 samples = 10 micro-batches of 16; K=4 gives windows of 4, 4 and a
    # leftover 2, which must be stepped (as a batch of 32), not dropped.
    acc = run_ranks(
        count_allreduces, 2, tmp_path,
        _base(npz400, tmp_path / "acc", batch_size=16, grad_accum_steps=4),
    )
    big = run_ranks(
        count_allreduces, 2, tmp_path, _base(npz400, tmp_path / "big", batch_size=64)
    )
    _assert_close(_weights(tmp_path / "acc"), _weights(tmp_path / "big"), atol=1e-5)
    for rank in (0, 1):
        a, b = acc[rank], big[rank]
        assert a["steps"] == b["steps"] == 2 * 3  # 2 epochs x (4 + 4 + 2 micro-batches)
        assert a["calls"] > 0 and a["calls"] % a["steps"] == 0
        assert a["calls"] / a["steps"] == b["calls"] / b["steps"]  # rounds per step
        # The counter sees every all-reduce: without no_sync, K backward passes make K.
        rounds = a["calls"] // a["steps"]
        assert a["seed_style_calls"] == 4 * rounds


def _ids(n: int, npz: Path, out: Path, tmp: Path, world: int) -> list[dict[int, list[int]]]:
    cfg = _base(npz, out, batch_size=16)
    return run_ranks(epoch_indices, world, tmp, cfg, n)


def test_train_rows_are_global_though_reduced_in_batches(tmp_path: Path, npz400: Path) -> None:
    """A row every step, yet one metric all-reduce per epoch end (and the first batch):
    each row still holds every rank's samples of its own interval, as one process with
    the same global batch logs them."""
    two_dir, one_dir = tmp_path / "two", tmp_path / "one"
    two = run_ranks(
        count_metric_collectives, 2, tmp_path,
        _base(npz400, two_dir, batch_size=16, log_interval=1),
    )
    _single(_base(npz400, one_dir, batch_size=32, log_interval=1))
    epochs, steps = 2, 2 * 10
    for rank in (0, 1):
        # the first batch (after step 1), then per epoch: its train totals and validation
        assert two[rank] == {"calls": 1 + 2 * epochs, "steps": steps}
    rows = {}
    for name, run_dir in (("two", two_dir), ("one", one_dir)):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        rows[name] = [r for r in map(json.loads, lines) if r["split"] == "train"]
    assert [r["step"] for r in rows["two"]] == list(range(1, steps + 1))
    for a, b in zip(rows["two"], rows["one"], strict=True):
        assert (a["step"], a["samples"]) == (b["step"], b["samples"]) == (a["step"], 32)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["accuracy"] == b["accuracy"]


def test_sampler_covers_every_sample_once_per_epoch(tmp_path: Path, npz400: Path) -> None:
    from ddptrain.data.sources import split_indices

    train_idx, _ = split_indices(400, 0.2, seed=7)
    expected = sorted(train_idx.tolist())
    seen = _ids(400, npz400, tmp_path / "s", tmp_path, world=2)
    for epoch in (1, 2, 3):
        r0, r1 = seen[0][epoch], seen[1][epoch]
        assert len(r0) == len(r1) == 160
        assert not set(r0) & set(r1), "a sample was given to both ranks"
        assert len(set(r0)) == len(r0) and len(set(r1)) == len(r1)
        assert sorted(r0 + r1) == expected
    assert seen[0][1] != seen[0][2] != seen[0][3], "order must change between epochs"
    again = _ids(400, npz400, tmp_path / "s2", tmp_path, world=2)
    assert again[0] == seen[0] and again[1] == seen[1], "same seed, same order"


def test_validation_metrics_match_across_world_sizes(tmp_path: Path) -> None:
    from conftest import write_npz

    npz = write_npz(tmp_path / "odd.npz", 405)  # 81 val samples: shards of 41 and 40
    cfg = _base(npz, tmp_path / "v", batch_size=16)
    two = run_ranks(evaluate_fresh, 2, tmp_path, cfg)
    one = run_ranks(evaluate_fresh, 1, tmp_path, cfg)
    assert two[0] == two[1]
    assert two[0]["samples"] == one[0]["samples"] == 81
    assert two[0]["accuracy"] == one[0]["accuracy"]
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-6, abs=0)
