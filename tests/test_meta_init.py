"""fsdp starts a model larger than one rank may hold: built on the meta device, sharded,
then each rank allocates and fills only its shards, from rank 0's seeded template.

1. On real 2-rank gloo groups, a model whose whole parameters and buffers exceed a cap
   per rank: the module fsdp trains never holds more than the cap on any rank while it is
   set up (sampled after every tensor operation, see `metaplug.watch_setups`), where ddp's
   holds the whole model; and it starts from ddp's weights and buffers, bitwise. Built
   from `--model` and from a factory handed to the trainer (`fit(model=fn)`).
2. The plan states the largest model each strategy fits on one device.
3. `--compile` under fsdp compiles each block and trains like eager.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import write_npz
from dist_utils import run_ranks
from metaplug import Wide, watch_setups

from ddptrain.config import TrainingConfig
from ddptrain.launch.cluster import read_cluster_env
from ddptrain.parallel import FSDP, StrategyChoice, resolve_strategy
from ddptrain.parallel.memory import device_memory, largest_models

WIDTH = 512  # 4 blocks of 512 x 512: about 1.1M parameters, 4.2 MiB in fp32


def _whole_bytes() -> int:
    model = Wide(6, 3, WIDTH)
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


@pytest.mark.slow
def test_fsdp_starts_a_model_no_rank_could_hold_whole_with_the_eager_weights(
    tmp_path: Path,
) -> None:
    npz = write_npz(tmp_path / "d.npz", 64)
    job = dict(dataset=str(npz), model="metaplug:wide", width=WIDTH, epochs=1, seed=11,
               use_amp=False, tensorboard=False, batch_size=8)
    whole = _whole_bytes()
    cap = int(0.6 * whole)  # a rank's share of 2 is about half
    layouts = {
        "ddp": ({}, "flag"),
        "fsdp": ({"strategy": "fsdp"}, "flag"),
        "fsdp_factory": ({"strategy": "fsdp"}, "factory"),
    }
    jobs = [({**job, **kw, "output_dir": str(tmp_path / name)}, given)
            for name, (kw, given) in layouts.items()]
    ranks = run_ranks(watch_setups, 2, tmp_path, jobs)  # each rank: one report per job
    runs = {name: [r[i] for r in ranks] for i, name in enumerate(layouts)}

    # The cap binds: the eager path holds the whole model on every rank.
    assert all(r["peak"] >= whole > cap for r in runs["ddp"])
    reference = runs["ddp"][0]
    for name in ("fsdp", "fsdp_factory"):
        for rank, r in enumerate(runs[name]):
            assert r["samples"] > 20, r["samples"]  # the watch saw the set-up's operations
            assert 0 < r["peak"] <= cap, (name, rank, r["peak"], cap, whole)
            # Buffers are every rank's: the BatchNorm statistics and the one outside the
            # state dict are the eager model's on each rank.
            _bitwise(r["buffers"], reference["buffers"])
        # The gathered weights (parameters and persistent buffers) are ddp's, bitwise.
        _bitwise(runs[name][0]["state"], reference["state"])
    assert {"gain", "blocks.0.bn.running_mean"} <= set(reference["buffers"])
    assert "gain" not in reference["state"]


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------ the plan
def test_the_plan_says_the_largest_model_each_strategy_fits_per_device(tmp_path: Path) -> None:
    from ddptrain.data import load_data
    from ddptrain.train import format_plan, make_plan

    npz = write_npz(tmp_path / "d.npz", 40)
    config = TrainingConfig(dataset=str(npz), optimizer="adamw", output_dir=str(tmp_path))
    choice = StrategyChoice("fsdp", 4, "dcp", FSDP, device_bytes=16 * 2**30)
    # AdamW in fp32, per parameter: ddp 4 x 4 bytes, zero 4 + 4 + 8/4, fsdp 16/4
    assert choice.largest_models(2) == {
        "ddp": 16 * 2**30 // 16, "zero": 16 * 2**30 // 10, "fsdp": 16 * 2**30 // 4,
    }
    plan = make_plan(config, load_data(config), 4, "cuda:0", "nccl", "fp32", "classification",
                     1000, choice)
    line = next(x for x in format_plan(plan, config).splitlines() if x.startswith("largest"))
    assert line == ("largest model   per device of 16.0 GiB: ddp ~1.1B params, zero ~1.7B, "
                    "fsdp ~4.3B (AdamW, fp32; activations not counted)")
    # SGD without momentum keeps no state: only parameters and gradients
    assert largest_models(8 * 10**6, 2, 0) == {"ddp": 10**6, "zero": 10**6, "fsdp": 2 * 10**6}
    # On CPU a device is the host's memory shared by the ranks on it (torchrun says how many)
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert read_cluster_env(env).local_world_size == 2
    cpu = resolve_strategy(TrainingConfig(), 2, "cpu", local_ranks=2)
    assert cpu.device_bytes == device_memory("cpu", 2) and cpu.device_bytes is not None
    assert math.isclose(cpu.device_bytes, device_memory("cpu", 1) / 2, rel_tol=1e-9, abs_tol=1)


# ------------------------------------------------------------ --compile
def _fit_report(rank: int, overrides: dict[str, Any]) -> dict[str, Any]:
    from workers import _with_trainer

    def body(trainer: Any) -> dict[str, Any]:
        blocks = trainer.strategy._blocks
        compiled = [hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks]
        trainer.fit()
        return {"compiled": compiled, "model_is_module": trainer.model is trainer.module,
                "state": trainer.strategy.model_state(trainer.module)}

    return _with_trainer(overrides, body)


@pytest.mark.heavy
@pytest.mark.slow
def test_compile_under_fsdp_compiles_each_block_and_trains_like_eager(tmp_path: Path) -> None:
    npz = write_npz(tmp_path / "d.npz", 96)
    job = dict(dataset=str(npz), model="mlp", width=16, epochs=1, seed=3, use_amp=False,
               tensorboard=False, batch_size=16, strategy="fsdp", optimizer="sgd", lr=0.05,
               save_every=0)
    eager = run_ranks(_fit_report, 2, tmp_path, {**job, "output_dir": str(tmp_path / "e")})
    compiled = run_ranks(_fit_report, 2, tmp_path,
                         {**job, "compile": True, "output_dir": str(tmp_path / "c")})
    for r in compiled:
        # the MLP's three Linear layers, each compiled on its own; the root is not wrapped
        assert r["compiled"] == [True, True, True] and r["model_is_module"]
    assert eager[0]["compiled"] == [False, False, False]
    a, b = eager[0]["state"], compiled[0]["state"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k
