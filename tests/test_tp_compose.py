"""Tensor parallelism composed with the rest of a run, on real gloo groups of 2 ranks:

1. `--tp 2` with gradient accumulation (half the batch, 2 micro-steps: the same global
   batch) ends with the weights of plain training on one process; under bf16 autocast it
   ends close to plain bf16 training.
2. Its start-up is fsdp's meta-device one: the module is built on the meta device, and
   while it is split, sharded and filled no rank's module ever holds the whole model; it
   starts from the whole-model seeded weights, bitwise.
3. `ddptrain doctor --parameters N --tp T --dp_replicate R --world_size W` prints the
   layout's bytes per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from metaplug import _Watch, held_bytes
from nd_workers import fit_runs
from torch import nn

from ddptrain.config import TrainingConfig
from ddptrain.data.sources import load_data
from ddptrain.launch.process_group import setup_distributed, teardown_distributed
from ddptrain.models.gpt import build_gpt
from ddptrain.train.trainer import Trainer

# As tests/test_parallel_nd.py: the built-in GPT on 530 windows of 64 characters, a global
# batch of 128 (5 steps), SGD with momentum and a clip at 1.9 that acts on some steps only.
GPT = dict(
    dataset="chars", block_size=64, width=64, epochs=1, optimizer="sgd", lr=0.5,
    momentum=0.9, max_grad_norm=1.9, log_interval=1, seed=3,
)
GLOBAL_BATCH = 128


def _max_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(ref)  # the module's own names
    return max(float((got[k].float() - v.float()).abs().max()) for k, v in ref.items())


@pytest.mark.slow
@pytest.mark.heavy
def test_tp2_with_accumulation_equals_plain_and_under_bf16_stays_close(tmp_path: Path) -> None:
    plain = {**GPT, "batch_size": GLOBAL_BATCH}
    bf16 = {"amp_dtype": "bfloat16"}
    ref, ref_bf16 = fit_runs(0, [
        {**plain, "output_dir": str(tmp_path / "plain")},
        {**plain, **bf16, "output_dir": str(tmp_path / "plain_bf16")},
    ])
    runs = [
        {**GPT, "tp": 2, "batch_size": GLOBAL_BATCH // 2, "grad_accum_steps": 2,
         "output_dir": str(tmp_path / "tp_accum")},
        {**plain, **bf16, "tp": 2, "output_dir": str(tmp_path / "tp_bf16")},
    ]
    accum, tp_bf16 = run_ranks(fit_runs, 2, tmp_path, runs)[0]

    assert _max_diff(accum["weights"], ref["weights"]) <= 1e-5
    assert accum["summary"]["samples"] == ref["summary"]["samples"]
    assert accum["summary"]["val_loss"] == pytest.approx(ref["summary"]["val_loss"], abs=1e-5)

    # bf16 is not bitwise across layouts: a split layer adds its partial products in
    # another order, so a rounding may differ by one bf16 ulp (2^-8 relative). Measured
    # over these 5 steps: weights 1.4e-3 and loss 1.1e-3 apart. 1e-2 leaves 7x margin and
    # is below what bf16 copies of the weights (fsdp's policy) already move: 4.8e-2.
    assert tp_bf16["summary"]["samples"] == ref_bf16["summary"]["samples"]
    gap = abs(tp_bf16["summary"]["val_loss"] - ref_bf16["summary"]["val_loss"])
    assert gap <= 1e-2, gap
    near = _max_diff(tp_bf16["weights"], ref_bf16["weights"])
    assert near <= 1e-2, near
    # ...and it did train in bf16: nearer plain bf16 than plain fp32.
    assert near < _max_diff(tp_bf16["weights"], ref["weights"])


# ---------------------------------------------------------------- meta-device start
def watch_tp_setup(rank: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """Build a `--tp` trainer from a factory of the built-in GPT (as `fit(model=fn)`) and
    report: whether the training module the factory first built (the one the strategy
    sets up) was on the meta device, the peak bytes it held while the trainer was built
    (sampled after every tensor operation), and the gathered initial weights."""
    config = TrainingConfig(**overrides).validate()
    ctx = setup_distributed(config)
    data = load_data(config)
    watch = _Watch()
    built: list[nn.Module] = []
    on_meta: list[bool] = []

    def factory() -> nn.Module:
        model = build_gpt(data.facts.vocab_size or 0, config.block_size, config.width)
        if not built:  # the training module; rank 0 builds its template after it
            built.append(model)
            on_meta.append(all(t.is_meta for t in [*model.parameters(), *model.buffers()]))
            watch.module = model
        return model

    clean = False
    try:
        with watch:
            trainer = Trainer(config, ctx, data, module=factory)
        watch.sample()
        state = trainer.strategy.model_state(trainer.module)  # collective
        result = {
            "on_meta": on_meta[0], "peak": watch.peak, "samples": watch.samples,
            "held": held_bytes(trainer.module), "same": built[0] is trainer.module,
            "state": {k: v.detach().clone() for k, v in state.items()},
        }
        del trainer
        clean = True
    finally:
        teardown_distributed(clean)
    return result


@pytest.mark.slow
def test_tp_starts_on_the_meta_device_and_no_rank_ever_holds_the_whole_model(
    tmp_path: Path,
) -> None:
    job = {**GPT, "tp": 2, "batch_size": 8, "output_dir": str(tmp_path / "run")}
    ranks = run_ranks(watch_tp_setup, 2, tmp_path, job)

    config = TrainingConfig(**job).validate()
    torch.manual_seed(config.seed)  # the seeded whole-model start of every other layout
    whole = build_gpt(load_data(config).facts.vocab_size or 0, config.block_size, config.width)
    whole_bytes = held_bytes(whole)
    for rank, r in enumerate(ranks):
        assert r["on_meta"] and r["same"], rank
        assert r["samples"] > 50, r["samples"]  # the watch saw the set-up's operations
        # Each rank's blocks are split in two; embeddings and norms stay whole (~55%).
        assert 0 < r["held"] <= r["peak"] <= 0.65 * whole_bytes, (rank, r["peak"], whole_bytes)
    expected = whole.state_dict()
    got = ranks[0]["state"]
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
