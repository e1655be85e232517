"""A model whose steps leave some parameters out of the loss (tests/unusedplug.py), on
real 2-rank gloo groups: without `--find_unused_parameters` one line per rank names the
flag; with it (also inside accumulation windows, where the branch is taken on the
micro-steps that skip the gradient sync) 2 ranks equal 1 rank with the same global batch;
`--static_graph` trains a model with a branch it never takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_torchrun
from dist_utils import run_ranks
from safetensors.torch import load_file
from workers import run_training

from ddptrain.errors import EXIT_USAGE

pytestmark = pytest.mark.slow

BRANCHY = ["train", "--model", "unusedplug:branchy", "--epochs", "1", "--batch_size", "16",
           "--log_interval", "4", "--no-tensorboard"]


def _cfg(out: Path, **kw: Any) -> dict[str, Any]:
    cfg = dict(
        dataset="breast_cancer", model="unusedplug:branchy", epochs=2, lr=0.05, momentum=0.9,
        warmup_epochs=0.5, use_amp=False, log_interval=3, seed=7, output_dir=str(out),
        tensorboard=False,
    )
    cfg.update(kw)
    return cfg


def _max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert x.keys() == y.keys() and any(k.startswith("branch.") for k in x)
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def test_a_branch_left_out_on_some_steps_is_one_line_per_rank_naming_the_flag(
    tmp_path: Path,
) -> None:
    proc = run_torchrun(2, [*BRANCHY, "--output_dir", str(tmp_path / "run")], cwd=tmp_path)
    assert proc.returncode != 0
    errors = [x for x in proc.stderr.splitlines() if "ddptrain: " in x]
    assert len(errors) == 2, proc.stderr[-3000:]
    for line in errors:
        assert "ddptrain: error: " in line and "--find_unused_parameters" in line, line
    assert "Expected to have finished reduction" not in proc.stderr
    assert f"exitcode  : {EXIT_USAGE}" in proc.stderr or f"exitcode: {EXIT_USAGE}" in proc.stderr


@pytest.mark.parametrize("accum", [pytest.param(1, marks=pytest.mark.heavy), 2])
def test_with_find_unused_parameters_two_ranks_equal_one_rank(
    tmp_path: Path, accum: int
) -> None:
    # every=2: the branch is taken on every other forward; with 2 micro-steps a window,
    # always on the one inside no_sync and never on the one that reduces.
    two, one = tmp_path / "two", tmp_path / "one"
    run_ranks(run_training, 2, tmp_path, _cfg(two, batch_size=16, grad_accum_steps=accum,
                                              find_unused_parameters=True))
    run_ranks(run_training, 1, tmp_path, _cfg(one, batch_size=32, grad_accum_steps=accum))
    assert _max_diff(two, one) < 1e-5


def test_static_graph_trains_a_model_with_a_branch_never_taken(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_ranks(run_training, 2, tmp_path, _cfg(run, batch_size=16, static_graph=True,
                                              model_args={"every": 0}))
    weights = load_file(str(run / "model.safetensors"))
    assert torch.isfinite(weights["body.weight"]).all()
