"""n-D layouts on one device mesh (--dp_replicate, --tp, --pp): the layout checks before
any process group, and real gloo groups where tensor parallelism (2 ranks), HSDP 2x2,
FSDP x TP 2x2 and FSDP x PP 2x2 (4 ranks) each end with the weights of plain training on the
global batch, with clipping and SGD with momentum (a wrong gradient norm would show)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli
from dist_utils import run_ranks
from nd_workers import GLOBAL_BATCH, GPT, fit_runs

from ddptrain.config import TrainingConfig
from ddptrain.errors import ConfigError
from ddptrain.layout import Layout
from ddptrain.parallel import resolve_strategy
from ddptrain.parallel.mesh import plan_mesh


def _config(**fields: Any) -> TrainingConfig:
    return TrainingConfig(**{"output_dir": "/tmp/unused", **fields}).validate()


# ---------------------------------------------------------------- the layout, pure logic
def test_mesh_layout_keeps_tp_innermost_and_derives_the_shards() -> None:
    layout = plan_mesh(_config(strategy="fsdp", dp_replicate=2, tp=2), 16, 8)
    assert layout == Layout(pp=1, dp_replicate=2, dp_shard=4, tp=2)
    assert layout.mesh_shape == (1, 2, 4, 1, 2)  # tp last: neighbouring ranks, one node
    assert (layout.world_size, layout.data_parallel) == (16, 8)
    choice = resolve_strategy(_config(strategy="fsdp", tp=2), 4, "cpu")
    assert choice.label == "fsdp; dp_shard 2 x tp 2" and choice.checkpoint_kind == "dcp"
    # A tp run's bytes per rank: its layers split over tp ranks, sharded over dp_shard.
    assert choice.rank_bytes(1000, 1)["params"] == 4 * 250
    assert resolve_strategy(_config(), 4, "cpu").layout.plain  # plain ddp: no mesh


@pytest.mark.parametrize(("fields", "world", "message"), [
    ({"tp": 3}, 4,
     "world size 4 is not dp_replicate 1 x data-parallel shards x cp 1 x tp 3 x pp 1"),
    ({"cp": 3}, 4, "cp 3 x tp 1 x pp 1: 1 x 3 x 1 x 1 = 3 does not divide 4 ranks"),
    ({"cp": 2, "block_size": 33}, 4, "--cp 2 does not divide --block_size 33"),
    ({"cp": 2, "tp": 2}, 4, "--cp 2 with --tp 2 --pp 1 needs --strategy fsdp"),
    ({"cp": 2, "tp": 2, "strategy": "fsdp", "sequence_parallel": True}, 4,
     "--cp 2 with --sequence_parallel: both split the sequence"),
    ({"cp": 2, "ep": 3}, 4, "--ep 3 does not divide the 4 data-parallel x cp ranks of 4"),
    ({"strategy": "fsdp", "dp_replicate": 3, "tp": 2}, 8, "6 does not divide 8 ranks"),
    ({"pp": 3}, 4, "tp 1 x pp 3: 1 x 1 x 1 x 3 = 3 does not divide 4 ranks"),
    ({"dp_replicate": 2}, 4, "--dp_replicate 2 is HSDP"),
    ({"tp": 2}, 4, "--strategy ddp does not compose with it"),
    ({"strategy": "zero", "tp": 2}, 2, "--tp 2 with --strategy zero is unsupported"),
    ({"tp_plan": "mypkg.plans:tp"}, 2, "--tp_plan 'mypkg.plans:tp' is a tensor-parallel plan"),
])
def test_bad_layouts_are_refused_before_the_group(
    fields: dict[str, Any], world: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve_strategy(_config(**fields), world, "cpu")


WORLD_3 = (
    "world size 3 is not dp_replicate 1 x data-parallel shards x cp 1 x tp 2 x pp 1: 1 x 1 "
    "x 2 x 1 = 2 does not divide 3 ranks; choose degrees whose product divides the world size"
)
HEADS = "--tp 8 does not divide the GPT's 4 attention heads: choose a tp that does"


@pytest.mark.slow
@pytest.mark.parametrize(("world", "flags", "line"), [
    (3, ["--tp", "2"], WORLD_3),
    (8, ["--tp", "8", "--strategy", "fsdp"], HEADS),
])
def test_bad_layout_is_one_line_and_exit_2(
    tmp_path: Path, world: int, flags: list[str], line: str
) -> None:
    """Rank 0 of a job whose layout does not fit: refused before it tries to meet its
    peers (none runs here; the port is closed), the directory untouched."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    res = run_cli(["train", "--dataset", "chars", *flags, "--output_dir",
                   str(tmp_path / "run")], tmp_path, env=env, timeout=180)
    assert res.returncode == 2, res.stderr
    errors = [text for text in res.stderr.splitlines() if text.strip()]
    assert errors == [f"ddptrain: error: {line}"], res.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- real process groups
def _reference(tmp_path: Path, name: str, **fields: Any) -> dict[str, Any]:
    """One process, the whole global batch: plain training."""
    runs = [{**GPT, "batch_size": GLOBAL_BATCH, "output_dir": str(tmp_path / name), **fields}]
    return fit_runs(0, runs)[0]


def _assert_same_weights(got: dict[str, Any], ref: dict[str, Any], atol: float = 1e-5) -> None:
    assert sorted(got["weights"]) == sorted(ref["weights"])  # the module's own names
    for name, value in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, atol=atol, rtol=0, msg=name)
    # Every sample counted once: the tp peers of a batch do not count it twice.
    assert got["summary"]["samples"] == ref["summary"]["samples"]
    assert got["summary"]["val_loss"] == pytest.approx(ref["summary"]["val_loss"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.heavy
def test_tp2_equals_ddp_halves_the_bytes_and_resumes_from_dcp(
    tmp_path: Path, plain: dict[str, Any]
) -> None:
    """--tp 2 on 2 ranks (each rank the whole batch): ddp's weights and figures; its
    parameters, gradients and optimizer state about half of ddp's; a DCP step directory
    written mid-epoch resumes (same layout) to the uninterrupted run's weights."""
    tp = {**GPT, "batch_size": GLOBAL_BATCH, "tp": 2}
    runs = [
        {**tp, "output_dir": str(tmp_path / "tp"), "save_every_steps": 2},
        {**tp, "output_dir": str(tmp_path / "resumed"),
         "resume_from": str(tmp_path / "tp" / "checkpoints" / "step_000000002")},
    ]
    ranks = run_ranks(fit_runs, 2, tmp_path, runs)
    ref = plain
    full, resumed = ranks[0]
    _assert_same_weights(full, ref)
    assert full["summary"]["strategy"] == "tp"
    assert resumed["resumed_from"].endswith("step_000000002")
    for name, value in full["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, atol=0, rtol=0, msg=name)
    held = sum(ranks[1][0]["bytes"].values()) / sum(ref["bytes"].values())
    # The blocks are split in two; the embeddings, norms and row-split biases are whole.
    assert 0.45 < held < 0.6, held


@pytest.mark.slow
@pytest.mark.heavy
def test_hsdp_fsdp_x_tp_and_fsdp_x_pp_on_4_ranks_equal_ddp_and_resume_elsewhere(
    tmp_path: Path, plain: dict[str, Any]
) -> None:
    """HSDP 2x2 (2 replicas, each sharded over 2 ranks; batch 32 on each of 4 ranks),
    FSDP x TP 2x2 (2 data-parallel ranks of batch 64, each split over 2 tp ranks) and
    FSDP x PP 2x2 (2 data-parallel ranks of batch 64, each cut into 2 stages); the FSDP x
    TP DCP directory written mid-epoch resumes on one process (plain training, batch 128)
    and on 2 ranks as 2 pipeline stages, each to the same weights."""
    runs = [
        {**GPT, "strategy": "fsdp", "dp_replicate": 2, "batch_size": GLOBAL_BATCH // 4,
         "output_dir": str(tmp_path / "hsdp")},
        {**GPT, "strategy": "fsdp", "tp": 2, "batch_size": GLOBAL_BATCH // 2,
         "output_dir": str(tmp_path / "fsdp_tp"), "save_every_steps": 2},
        {**GPT, "strategy": "fsdp", "pp": 2, "batch_size": GLOBAL_BATCH // 2,
         "output_dir": str(tmp_path / "fsdp_pp")},
    ]
    hsdp, fsdp_tp, fsdp_pp = run_ranks(fit_runs, 4, tmp_path, runs)[0]
    ref = plain
    for run in (hsdp, fsdp_tp, fsdp_pp):
        _assert_same_weights(run, ref)
    _resumes_on_one_process_and_as_stages(tmp_path, "fsdp_tp", ref)


@pytest.mark.slow
@pytest.mark.heavy
def test_pp2_x_tp2_on_4_ranks_equals_plain_with_accumulation_and_resumes_elsewhere(
    tmp_path: Path, plain: dict[str, Any]
) -> None:
    """--pp 2 --tp 2 on 4 ranks: each stage's layers split over 2 ranks, every rank the
    whole global batch, as 2 accumulation steps of 64 (each cut into 2 micro-batches). It
    ends with plain training's weights (the tied embedding's gradient summed once, the
    clip's global norm over stages and tp shards), and its DCP step directory written
    mid-epoch resumes on one process (plain training) and on 2 ranks as 2 stages without
    tp, each to the same weights."""
    job = {**GPT, "pp": 2, "tp": 2, "batch_size": GLOBAL_BATCH // 2, "grad_accum_steps": 2,
           "output_dir": str(tmp_path / "pp_tp"), "save_every_steps": 2}
    ranks = run_ranks(fit_runs, 4, tmp_path, [job])
    composed = ranks[0][0]
    _assert_same_weights(composed, plain)
    assert composed["summary"]["strategy"] == "pp"
    # each rank holds half a stage: about a quarter of the model, the whole tensors aside
    held = [sum(r[0]["bytes"].values()) / sum(plain["bytes"].values()) for r in ranks]
    assert all(0.2 < h < 0.45 for h in held), held
    _resumes_on_one_process_and_as_stages(tmp_path, "pp_tp", plain)


def _resumes_on_one_process_and_as_stages(tmp_path: Path, run: str, ref: dict[str, Any]) -> None:
    """`run`'s DCP step directory of step 2 resumes on one process (plain training) and on
    2 ranks as 2 pipeline stages, each to `ref`'s weights."""
    step = tmp_path / run / "checkpoints" / "step_000000002"
    on_one = _reference(tmp_path, "one", resume_from=str(step))
    as_stages = run_ranks(fit_runs, 2, tmp_path, [{
        **GPT, "pp": 2, "batch_size": GLOBAL_BATCH, "output_dir": str(tmp_path / "pp"),
        "resume_from": str(step),
    }])[0][0]
    for resumed in (on_one, as_stages):
        assert resumed["resumed_from"] == str(step)
        for name, value in ref["weights"].items():
            torch.testing.assert_close(
                resumed["weights"][name], value, atol=1e-5, rtol=0, msg=name
            )


@pytest.mark.slow
@pytest.mark.heavy
def test_fsdp_and_hsdp_x_pp2_x_tp2_on_8_ranks_equal_plain(
    tmp_path: Path, plain: dict[str, Any]
) -> None:
    """3-D layouts on 8 ranks: 2 stages, each split over 2 tp ranks, each of those sharded
    by FSDP over 2 data-parallel ranks (batch 64 each); and the same with the 2
    data-parallel ranks as HSDP replicas (`--dp_replicate 2`). Both end with plain
    training's weights."""
    job = {**GPT, "strategy": "fsdp", "pp": 2, "tp": 2, "batch_size": GLOBAL_BATCH // 2}
    runs = [{**job, "output_dir": str(tmp_path / "fsdp")},
            {**job, "dp_replicate": 2, "output_dir": str(tmp_path / "hsdp")}]
    fsdp, hsdp = run_ranks(fit_runs, 8, tmp_path, runs)[0]
    for run in (fsdp, hsdp):
        _assert_same_weights(run, plain)
