"""Pipeline parallelism (--pp): the flags checked before any process group, and real gloo
groups where the built-in GPT cut into stages ends with the weights of plain training on
the same global batch, under each schedule, with accumulation, clipping and SGD with
momentum (a wrong gradient, scale or norm would show), and resumes from a DCP directory
written by another layout."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli, run_torchrun
from dist_utils import run_ranks
from metaplug import held_bytes
from nd_workers import GLOBAL_BATCH, GPT, fit_runs
from procs import (  # noqa: F401  (reap: an autouse fixture)
    assert_bitwise,
    assert_same_log,
    rank_of,
    reap,
    torchrun,
    weights,
    worker_pids,
)
from test_parallel_nd import _assert_same_weights, _reference
from test_tp_compose import watched_ranks

from ddptrain.config import TrainingConfig
from ddptrain.data.sources import load_data
from ddptrain.errors import EXIT_PREEMPTED, ConfigError
from ddptrain.models.gpt import build_gpt
from ddptrain.parallel import resolve_strategy
from ddptrain.parallel.mesh import plan_mesh


def _config(**fields: Any) -> TrainingConfig:
    return TrainingConfig(**{"dataset": "chars", **fields}).validate()


@pytest.mark.parametrize(("fields", "world", "message"), [
    ({"pp": 2, "tp": 2, "sequence_parallel": True}, 4, "--sequence_parallel with --pp 2"),
    ({"pp": 2, "batch_size": 30, "pp_microbatches": 4}, 2, "does not divide --batch_size 30"),
    ({"pp": 4, "pp_microbatches": 2}, 4, "at least as many micro-batches as stages"),
    ({"pp": 2}, 4, "--strategy ddp does not compose"),
    ({"pp": 2, "strategy": "zero"}, 2, "--strategy zero is unsupported"),
    ({"pp_microbatches": 2}, 2, "--pp is 1"),
    ({"pp": 2, "checkpoint_format": "file"}, 2, "each writes its stage"),
])
def test_bad_pipeline_flags_are_refused_before_the_group(
    fields: dict[str, Any], world: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_strategy(_config(**fields), world, "cpu")


def test_pipeline_stages_are_the_outermost_dimension() -> None:
    layout = plan_mesh(_config(pp=2, strategy="fsdp"), 8)
    assert layout.mesh_shape == (2, 1, 4, 1, 1)
    choice = resolve_strategy(_config(pp=2, strategy="fsdp"), 8, "cpu")
    assert choice.cls.__name__ == "Pipeline" and choice.checkpoint_kind == "dcp"


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "line"), [
    (["--pp", "2"], "--pp 2: ddptrain splits the built-in GPT and Llama-style Hugging Face "
     "models, and this run's model is 'mlp': give --pp_split package.module:fn, "
     "fn(model, stage, stages) returning the stage's module"),
    (["--pp", "3", "--dataset", "chars", "--pp_schedule", "interleaved1f1b",
      "--batch_size", "48"],
     "the GPT has 2 blocks, 4 units with its embeddings and head, and --pp asks for 6 "
     "stages: use at most 4 stages"),
])
def test_a_model_ddptrain_cannot_split_is_one_line_before_the_group(
    tmp_path: Path, flags: list[str], line: str
) -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": flags[1], "LOCAL_WORLD_SIZE": flags[1],
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    res = run_cli(["train", *flags, "--output_dir", str(tmp_path / "run")], tmp_path, env=env,
                  timeout=180)
    assert res.returncode == 2, res.stderr
    assert [t for t in res.stderr.splitlines() if t.strip()] == [f"ddptrain: error: {line}"]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.heavy
def test_pp2_equals_plain_under_every_schedule_and_resumes(
    tmp_path: Path, plain: dict[str, Any], plain_gpt: Callable[..., dict[str, Any]]
) -> None:
    """--pp 2 on 2 ranks, each the whole batch of 128: 1F1B (2 micro-batches), GPipe with
    2 accumulation steps of 64, interleaved 1F1B (4 stages, 4 micro-batches); the epoch's
    last batch (18 samples) is padded. Each ends with plain training's weights; a DCP
    step directory written mid-epoch resumes to the uninterrupted run's weights, as 2
    stages and on one process. A user's split of an MLP equals its plain training, and
    bf16 autocast rounds as plain bf16 training does."""
    pp = {**GPT, "pp": 2, "batch_size": GLOBAL_BATCH}
    runs = [
        {**pp, "output_dir": str(tmp_path / "1f1b"), "save_every_steps": 2},
        {**pp, "pp_schedule": "gpipe", "batch_size": GLOBAL_BATCH // 2,
         "grad_accum_steps": 2, "output_dir": str(tmp_path / "gpipe")},
        {**pp, "pp_schedule": "interleaved1f1b", "pp_microbatches": 4,
         "output_dir": str(tmp_path / "interleaved")},
        {**pp, "output_dir": str(tmp_path / "resumed"),
         "resume_from": str(tmp_path / "1f1b" / "checkpoints" / "step_000000002")},
    ]
    # A user's model and split (an MLP of 4 layers over 2 stages), and mixed precision.
    mlp = {"model": "ppplug:mlp", "width": 32, "epochs": 2, "batch_size": 64, "lr": 0.1,
           "optimizer": "sgd", "momentum": 0.9, "max_grad_norm": 1.0, "seed": 3}
    bf16 = {**GPT, "batch_size": GLOBAL_BATCH, "amp_dtype": "bfloat16"}
    runs += [
        {**mlp, "pp": 2, "pp_split": "ppplug:split", "output_dir": str(tmp_path / "mlp")},
        {**bf16, "pp": 2, "output_dir": str(tmp_path / "bf16")},
    ]
    ranks = run_ranks(fit_runs, 2, tmp_path, runs)
    one_f_one_b, gpipe, interleaved, resumed, user, low = ranks[0]
    for run in (one_f_one_b, gpipe, interleaved):
        _assert_same_weights(run, plain)
    _assert_same_weights(user, fit_runs(0, [{**mlp, "output_dir": str(tmp_path / "m1")}])[0])
    # bf16 rounds differently when the batch is cut into micro-batches: as close to plain
    # bf16 training as that is to fp32 (2e-3), and not fp32 (the autocast is on).
    ref16 = plain_gpt(amp_dtype="bfloat16")
    for name, value in ref16["weights"].items():
        torch.testing.assert_close(low["weights"][name], value, atol=3e-3, rtol=0, msg=name)
    off = max(float((low["weights"][k] - v).abs().max()) for k, v in plain["weights"].items())
    assert off > 1e-4, off
    assert resumed["resumed_from"].endswith("step_000000002")
    for name, value in one_f_one_b["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, atol=0, rtol=0, msg=name)
    # The stages' DCP directory resumes on one process (plain training) too.
    on_one = _reference(tmp_path, "one", resume_from=resumed["resumed_from"])
    assert on_one["resumed_from"] == resumed["resumed_from"]
    _assert_same_weights(on_one, plain)
    # Each rank holds its stage: about half of the parameters (the tied embedding twice).
    held = [sum(r[0]["bytes"].values()) for r in ranks]
    whole = sum(plain["bytes"].values())
    assert all(0.3 < h / whole < 0.75 for h in held), (held, whole)


# The built-in GPT as 2 stages: 4 epochs of 34 steps, a DCP step directory every 10.
PP_JOB = ["train", "--dataset", "chars", "--block_size", "64", "--width", "64", "--batch_size",
          "16", "--epochs", "4", "--pp", "2", "--log_interval", "10", "--save_every_steps",
          "10", "--seed", "3"]


@pytest.mark.slow
@pytest.mark.heavy
def test_sigterm_to_one_stage_stops_both_and_the_resume_is_bitwise_exact(
    tmp_path: Path,
) -> None:
    """SIGTERM to the last stage's rank only: both stages stop at the same step with a
    checkpoint and exit 75; `--resume_from auto` ends with the uninterrupted run's weights
    and log, bit for bit."""
    reference = tmp_path / "reference"
    done = run_torchrun(2, [*PP_JOB, "--output_dir", str(reference)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    agent = torchrun([*PP_JOB, "--output_dir", str(run)], tmp_path, [])
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step_000000020").is_dir():
        assert agent.poll() is None and time.monotonic() < deadline, "no step 20 checkpoint"
        time.sleep(0.2)
    os.kill(next(p for p in worker_pids(agent.pid) if rank_of(p) == 1), signal.SIGTERM)
    _, err = agent.communicate(timeout=120)
    steps = {int(x.split()[0]) for x in err.split("stopped by SIGTERM at step ")[1:]}
    assert len(steps) == 1 and err.count("stopped by SIGTERM at step") == 2, err[-3000:]
    assert f"exitcode  : {EXIT_PREEMPTED}" in err, err[-3000:]
    assert steps.pop() < 136, "the run ended before the signal"
    resumed = run_torchrun(
        2, [*PP_JOB, "--output_dir", str(run), "--resume_from", "auto"], cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)


@pytest.mark.slow
@pytest.mark.heavy
def test_pp_starts_on_the_meta_device_and_no_rank_holds_more_than_its_stage(
    tmp_path: Path,
) -> None:
    """The module the strategy sets up is built on the meta device and left plain (no
    FSDP over one rank); while the trainer is built, no rank holds more than its stage
    (about half of the GPT; the tied embedding on both), and the gathered initial weights
    are a seeded whole-model start's."""
    watched = {**GPT, "pp": 2, "batch_size": 8, "output_dir": str(tmp_path / "watched")}
    ranks = [r["setup"] for r in run_ranks(watched_ranks, 2, tmp_path, watched, [])]
    config = TrainingConfig(**watched).validate()
    torch.manual_seed(config.seed)
    whole = build_gpt(load_data(config).facts.vocab_size or 0, config.block_size, config.width)
    whole_bytes = held_bytes(whole)
    for rank, r in enumerate(ranks):
        assert r["on_meta"] and r["same"], rank
        assert r["samples"] > 50, r["samples"]
        assert 0 < r["held"] <= r["peak"] <= 0.75 * whole_bytes, (rank, r["peak"], whole_bytes)
        # pp takes every rank: nothing to shard, so no FSDP wrapper and no DTensor
        assert r["fsdp"] == 0 and r["dtensors"] == 0, r
    for name, value in whole.state_dict().items():
        assert torch.equal(ranks[0]["state"][name], value), name
