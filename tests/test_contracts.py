"""The numerical contracts of the layouts, each guarded in `make test` by a fast 2-rank run:
a tiny GPT (width 16, tied embedding and head) on 150 token windows of 16, 2 epochs of 5
steps of 32 (the fifth batch holds 22: a pipeline pads it), SGD with momentum and a clip
that acts on some steps only, all runs in one gloo group of 2 ranks (about 25 s). The
heavy tier keeps the end-to-end proofs (tests/test_pipeline.py, test_tp_compose.py,
test_tp_hf.py, test_steer.py); these fail first when a contract breaks:

- pipeline (`--pp 2`, 1F1B, 4 micro-batches of 8: the padded batch's third is part
  padding, its fourth all padding): equals plain training, so the tied weight's gradients
  summed between the stages, the loss scale, the padding left out and the tied weight
  counted once in the clipped norm each show when wrong;
- tensor parallel (`--tp 2` with 2 accumulation steps): equals plain training;
- seeding per data-parallel rank: with dropout under `--tp 2`, the parts both tp ranks
  hold whole stay bitwise alike (their dropout masks are the same draws);
- EMA: a resume from a mid-run checkpoint (`.pt` under ddp, DCP under fsdp) ends with the
  uninterrupted run's averages, bitwise.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from nd_workers import fit_runs
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ddptrain.checkpoint.manager import EMA_FILE_KEY
from ddptrain.train.ema import EMA
from ddptrain.train.resume import _restore_ema

# Plain training's gradient norms over the 10 steps: 0.65 0.38 0.54 1.19 0.67 0.52 0.57 0.82
# 0.90 1.00. The clip at 0.6 acts on 6 of them: a norm counted wrong changes which.
TINY = dict(
    dataset="contractplug:tokens", block_size=16, width=16, epochs=2, batch_size=32,
    optimizer="sgd", lr=0.5, momentum=0.9, max_grad_norm=0.6, log_interval=1, seed=3,
    tensorboard=False, curves=False,
)
EMA_RUN = {**TINY, "batch_size": 16, "ema_decay": 0.8, "save_every_steps": 3}
RUNS = ("pp", "tp_accum", "tp_dropout", "ema_ddp", "ema_ddp_resumed", "ema_fsdp",
        "ema_fsdp_resumed")


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every contract's run, in one 2-rank group; and plain training on one process."""
    tmp = tmp_path_factory.mktemp("contracts")
    out = {name: str(tmp / name) for name in RUNS}
    runs = [
        {**TINY, "pp": 2, "pp_microbatches": 4, "output_dir": out["pp"]},
        {**TINY, "tp": 2, "batch_size": 16, "grad_accum_steps": 2, "output_dir": out["tp_accum"]},
        {**TINY, "tp": 2, "model": "contractplug:gpt", "model_args": {"dropout": 0.1},
         "output_dir": out["tp_dropout"]},
        {**EMA_RUN, "output_dir": out["ema_ddp"]},
        {**EMA_RUN, "output_dir": out["ema_ddp_resumed"],
         "resume_from": f"{out['ema_ddp']}/checkpoints/step_000000003.pt"},
        {**EMA_RUN, "strategy": "fsdp", "output_dir": out["ema_fsdp"]},
        {**EMA_RUN, "strategy": "fsdp", "output_dir": out["ema_fsdp_resumed"],
         "resume_from": f"{out['ema_fsdp']}/checkpoints/step_000000003"},
    ]
    ranks = run_ranks(fit_runs, 2, tmp, runs)
    plain = fit_runs(0, [{**TINY, "output_dir": str(tmp / "plain")}])[0]
    return {"plain": plain, "ranks": [dict(zip(RUNS, r, strict=True)) for r in ranks],
            "dirs": {name: Path(d) for name, d in out.items()}}


def _assert_equals_plain(got: dict[str, Any], plain: dict[str, Any]) -> None:
    assert sorted(got["weights"]) == sorted(plain["weights"])  # the model's own names
    for name, value in plain["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, atol=1e-5, rtol=0, msg=name)
    assert got["summary"]["samples"] == plain["summary"]["samples"] == 300
    assert got["summary"]["val_loss"] == pytest.approx(plain["summary"]["val_loss"], abs=1e-5)


@pytest.mark.slow
def test_pp2_with_a_tied_head_a_padded_batch_and_a_clip_equals_plain(
    group: dict[str, Any],
) -> None:
    _assert_equals_plain(group["ranks"][0]["pp"], group["plain"])
    # The tied head exported once, as plain training exports it: not a copy per stage.
    pp, plain = (group["dirs"]["pp"], group["dirs"]["pp"].with_name("plain"))
    exported = [safe_open(str(d / "model.safetensors"), "pt") for d in (pp, plain)]
    keys, ties = ([sorted(f.keys()) for f in exported],
                  [{k: v for k, v in (f.metadata() or {}).items() if k.startswith("tied:")}
                   for f in exported])
    assert keys[0] == keys[1] and ties[0] == ties[1] and ties[0], (keys, ties)


@pytest.mark.slow
def test_tp2_with_accumulation_equals_plain(group: dict[str, Any]) -> None:
    _assert_equals_plain(group["ranks"][0]["tp_accum"], group["plain"])


@pytest.mark.slow
def test_tp_peers_draw_the_same_dropout_masks(group: dict[str, Any]) -> None:
    """Dropout acts on activations both tp ranks hold whole: seeded per data-parallel rank,
    their whole copies (embeddings, norms, the tied head) stay bitwise alike."""
    first, second = (r["tp_dropout"]["held_whole"] for r in group["ranks"])
    assert {"wte.weight", "ln_f.weight"} <= first.keys()
    for name, value in first.items():
        assert torch.equal(second[name], value), name
    # ...and dropout did act: the run is not plain training's.
    trained, plain = group["ranks"][0]["tp_dropout"]["weights"], group["plain"]["weights"]
    assert not torch.allclose(trained["wte.weight"], plain["wte.weight"], atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_resume_carries_the_ema_bitwise(group: dict[str, Any], strategy: str) -> None:
    """From step 3 of 10 (`.pt` under ddp, a DCP directory under fsdp)."""
    dirs = group["dirs"]
    resumed = group["ranks"][0][f"ema_{strategy}_resumed"]
    assert resumed["resumed_from"].split("/")[-1].startswith("step_000000003")
    whole = load_file(str(dirs[f"ema_{strategy}"] / "model_ema.safetensors"))
    again = load_file(str(dirs[f"ema_{strategy}_resumed"] / "model_ema.safetensors"))
    weights = load_file(str(dirs[f"ema_{strategy}"] / "model.safetensors"))
    assert whole.keys() == again.keys()
    for name, value in whole.items():
        assert torch.equal(again[name], value), name
    # The averages, not the weights.
    assert any(not torch.equal(weights[n], v) for n, v in whole.items() if n in weights)


def test_an_average_the_checkpoint_lacks_starts_from_the_resumed_weights(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Linear(3, 2)
    ema = EMA(model, 0.9)  # the averages start as the fresh weights
    with torch.no_grad():  # then the resume loads other weights
        model.weight.add_(1.0)
        model.bias.add_(1.0)
    saved = {"weight": torch.full((2, 3), 7.0)}  # a checkpoint with one average of two
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        _restore_ema(ema, {EMA_FILE_KEY: saved}, "ckpt.pt")
    state = ema.state()
    assert torch.equal(state["weight"], saved["weight"])
    assert torch.equal(state["bias"], model.bias)  # the resumed weight, not the fresh one
    assert "ckpt.pt holds no EMA weights for 1 parameter(s)" in caplog.text
    _restore_ema(ema, {}, "old.pt")  # none at all: every average from the resumed weights
    assert torch.equal(ema.state()["weight"], model.weight)
