"""Epoch-level resume continues at the right epoch with the right learning rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ddptrain.checkpoint.pt import list_checkpoints
from ddptrain.cli import main


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _strip_timing(row: dict) -> dict:
    # timing, and the run id: a resume into a new directory is a new run of the same job
    timing = {"samples_per_sec", "step_time_s", "data_wait_frac", "peak_rss_mb", "epoch_time_s",
              "run_id"}
    return {k: v for k, v in row.items() if k not in timing}


def test_resume_from_epoch_checkpoint_matches_uninterrupted_run(tmp_path: Path) -> None:
    common = ["train", "--epochs", "3", "--batch_size", "16", "--log_interval", "4",
              "--warmup_epochs", "1"]
    full = tmp_path / "full"
    assert main([*common, "--output_dir", str(full)]) == 0
    ckpts = list_checkpoints(full / "checkpoints")
    assert len(ckpts) == 3
    after_two = ckpts[1]
    assert torch.load(after_two, weights_only=True)["epoch"] == 2

    resumed = tmp_path / "resumed"
    assert main([*common, "--output_dir", str(resumed), "--resume_from", str(after_two)]) == 0

    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bitwise: same data order, LR and momentum
    full_rows = [_strip_timing(r) for r in _rows(full) if r["epoch"] == 3]
    resumed_rows = [_strip_timing(r) for r in _rows(resumed)]
    assert [r["epoch"] for r in resumed_rows] == [3] * len(resumed_rows)
    assert resumed_rows == full_rows  # same steps, same losses, same learning rates
    lrs = [r["lr"] for r in resumed_rows if r["split"] == "train"]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] < 0.01  # cosine, past warm-up


def test_resume_auto_in_place_keeps_log_without_gaps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["train", "--batch_size", "16", "--log_interval", "5", "--output_dir", str(run)]
    assert main([*args, "--epochs", "2"]) == 0
    before = _rows(run)
    # Continue the same run to 4 epochs: the log keeps epochs 1-2 and appends 3-4.
    assert main([*args, "--epochs", "4", "--resume_from", "auto"]) == 0
    rows = _rows(run)
    assert rows[: len(before)] == before
    steps = [r["step"] for r in rows if r["split"] == "train"]
    assert steps == sorted(set(steps)) and len(steps) > len(
        [r for r in before if r["split"] == "train"]
    )
    assert [r["epoch"] for r in rows if r["split"] == "val"] == [1, 2, 3, 4]


def test_resume_auto_without_checkpoint_starts_fresh(tmp_path: Path) -> None:
    run = tmp_path / "fresh"
    rc = main(["train", "--epochs", "1", "--resume_from", "auto", "--output_dir", str(run)])
    assert rc == 0
    assert [r["epoch"] for r in _rows(run) if r["split"] == "val"] == [1]


def _made_by_a_step(optimizer: torch.optim.Optimizer) -> dict:
    """The state torch's own way makes: one step of zero gradients at a learning rate of 0."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)
    return optimizer.state_dict()["state"]


@pytest.mark.parametrize(("cls", "kwargs"), [
    (torch.optim.SGD, {"momentum": 0.9}), (torch.optim.AdamW, {}),
    (torch.optim.Adam, {"amsgrad": True}),
])
def test_an_optimizer_state_to_load_into_is_made_without_a_step(
    cls: type[torch.optim.Optimizer], kwargs: dict
) -> None:
    """Resume loads into the optimizer's state; torch's built-in optimizers get it as the
    zeros their first step makes, without the step or a gradient per parameter."""
    from ddptrain.parallel.base import init_optimizer_state

    def fresh() -> torch.optim.Optimizer:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        return cls([{"params": net[0].parameters()}, {"params": net[1].parameters(),
                    "lr": 0.5}], lr=0.1, **kwargs)

    want = _made_by_a_step(fresh())
    optimizer = fresh()
    steps = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    init_optimizer_state(optimizer)
    got = optimizer.state_dict()["state"]
    assert not steps and all(p.grad is None for g in optimizer.param_groups for p in g["params"])
    assert got.keys() == want.keys()
    for i in want:
        assert got[i].keys() == want[i].keys()
        for name, tensor in want[i].items():
            mine = got[i][name]
            assert (mine.shape, mine.dtype, mine.device) == (tensor.shape, tensor.dtype,
                                                              tensor.device), (i, name)
            if name != "step":  # a step was taken there: 1; none here: 0
                assert torch.equal(mine, tensor), (i, name)
    optimizer.load_state_dict(fresh().state_dict() | {"state": want})  # loads as it would


def test_any_other_optimizer_gets_its_state_from_a_step_of_zero_gradients() -> None:
    from ddptrain.parallel.base import init_optimizer_state

    net = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in net.parameters()]
    optimizer = torch.optim.RMSprop(net.parameters(), lr=0.1, weight_decay=0.1)
    init_optimizer_state(optimizer)
    after = list(net.parameters())
    assert optimizer.state and all(map(torch.equal, before, after))
    assert optimizer.param_groups[0]["lr"] == 0.1
