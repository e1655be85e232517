"""Sharding the model: `--strategy zero | fsdp` and DCP step directories, on real 2-rank
gloo groups and real torchrun.

1. zero and fsdp end with ddp's weights, with and without accumulation; fsdp reduces
   gradients once per optimizer step however many micro-steps make it.
2. Per rank, fsdp holds about 1/N of ddp's parameters, gradients and optimizer state,
   zero 1/N of its optimizer state; peak RSS on a 17M-parameter model is clearly lower.
3. A worker SIGKILLed under torchrun (during a DCP write) resumes bitwise exactly.
4. A DCP directory from 2 ranks resumes on 1 and the reverse, and across strategies.
5. The exported model loads into the user's model and predicts as the run evaluated.
6. Evaluation under fsdp (ranks with unequal batch counts) equals evaluation under ddp.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import write_npz
from dist_utils import run_ranks
from procs import (  # noqa: F401  (reap: an autouse fixture)
    assert_bitwise,
    assert_same_log,
    rank_of,
    reap,
    rows,
    torchrun,
    weights,
    worker_pids,
)
from workers import fit_and_measure, run_training

from ddptrain.checkpoint.dcp import list_step_dirs
from ddptrain.checkpoint.export import export_safetensors
from ddptrain.checkpoint.manager import load_checkpoint
from ddptrain.models.nets import MLP

pytestmark = pytest.mark.slow


def _job(npz: Path, out: Path, **kw: Any) -> dict[str, Any]:
    cfg = dict(
        # SGD: its step scales with the gradient, so clipping by a wrong norm shows
        dataset=str(npz), model="mlp", epochs=2, optimizer="sgd", lr=0.05, momentum=0.9,
        max_grad_norm=0.2, use_amp=False, seed=7, tensorboard=False, log_interval=5,
        output_dir=str(out), batch_size=32,
    )
    cfg.update(kw)
    return cfg


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), (k, (a[k] - b[k]).abs().max())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job under each strategy on 2 ranks. 405 samples: 81 for validation, so
    with batch 8 one rank evaluates 6 batches and the other 5."""
    tmp = tmp_path_factory.mktemp("strategies")
    npz = write_npz(tmp / "d.npz", 405)
    layouts = {
        "ddp": {}, "zero": {"strategy": "zero"}, "fsdp": {"strategy": "fsdp"},
        "fsdp_acc": {"strategy": "fsdp", "batch_size": 8, "grad_accum_steps": 4},
        "zero_acc": {"strategy": "zero", "batch_size": 8, "grad_accum_steps": 4},
    }
    out: dict[str, Any] = {"npz": npz}
    for name, kw in layouts.items():
        run = tmp / name
        out[name] = (run, run_ranks(fit_and_measure, 2, tmp, _job(npz, run, **kw)))
    return out


def test_zero_and_fsdp_end_with_the_weights_of_ddp(runs: dict[str, Any]) -> None:
    reference = weights(runs["ddp"][0])
    for name in ("zero", "fsdp", "fsdp_acc", "zero_acc"):
        _close(weights(runs[name][0]), reference)


def test_fsdp_reduces_gradients_once_per_optimizer_step_when_accumulating(
    runs: dict[str, Any],
) -> None:
    for plain, acc in zip(runs["fsdp"][1], runs["fsdp_acc"][1], strict=True):
        assert plain["steps"] == acc["steps"] > 0
        # 3 sharded units (two blocks and the root): one reduce-scatter each per step
        assert plain["reduce_scatters"] == acc["reduce_scatters"] == 3 * plain["steps"]
    assert all(r["reduce_scatters"] == 0 for r in runs["ddp"][1])


def test_each_rank_holds_its_share_of_the_state(runs: dict[str, Any]) -> None:
    ddp, zero, fsdp = (runs[k][1] for k in ("ddp", "zero", "fsdp"))
    full = ddp[0]["bytes"]
    assert full == ddp[1]["bytes"] and full["optimizer"] == full["params"]  # SGD momentum
    for rank in (0, 1):
        # FSDP shards every tensor on dim 0 (the odd rows padded): about half each
        for kind in ("params", "grads", "optimizer"):
            assert 0.4 * full[kind] < fsdp[rank]["bytes"][kind] < 0.6 * full[kind]
        assert zero[rank]["bytes"]["params"] == full["params"]
        assert zero[rank]["bytes"]["optimizer"] < full["optimizer"]
    # ZeRO gives each parameter's state to one rank: the shares add up to the whole
    assert zero[0]["bytes"]["optimizer"] + zero[1]["bytes"]["optimizer"] == full["optimizer"]
    assert sum(r["bytes"]["optimizer"] for r in fsdp) >= full["optimizer"]


def test_fsdp_evaluation_equals_ddp_on_an_uneven_validation_split(
    runs: dict[str, Any],
) -> None:
    ddp = runs["ddp"][1][0]["summary"]
    for name in ("fsdp", "fsdp_acc"):
        got = runs[name][1][0]["summary"]
        for key in ("val_loss", "val_accuracy"):
            assert got[key] == pytest.approx(ddp[key], rel=1e-5)
    # every val sample counted once, on both ranks' rows
    assert [r["samples"] for r in rows(runs["fsdp_acc"][0]) if r["split"] == "val"] == [81, 81]
    # the rank with 5 batches forwards in step with the one with 6 without asking it per
    # batch: an evaluation's collectives are ddp's (the metric sums)
    reduces = {name: [r["eval_all_reduces"] for r in runs[name][1]] for name in runs
               if name != "npz"}
    assert reduces["fsdp"] == reduces["fsdp_acc"] == reduces["ddp"] == [1, 1], reduces


def test_an_fsdp_export_loads_into_the_users_model_and_predicts_the_same(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    run, ranks = runs["fsdp_acc"]
    model = MLP(6, 3, 64)
    model.load_state_dict(load_file(str(run / "model.safetensors")))  # strict, own names
    data = np.load(runs["npz"])
    from ddptrain.data.sources import split_indices

    _, val = split_indices(len(data["y"]), 0.2, 7)
    x, y = torch.from_numpy(data["x"][val]), torch.from_numpy(data["y"][val])
    with torch.no_grad():
        logits = model(x)
    summary = ranks[0]["summary"]
    accuracy = (logits.argmax(1) == y).float().mean().item()
    loss = torch.nn.functional.cross_entropy(logits, y).item()
    assert accuracy == pytest.approx(summary["val_accuracy"], abs=1e-6)
    assert loss == pytest.approx(summary["val_loss"], rel=1e-5)
    # the last DCP step directory, exported in one process, is the same model
    newest = list_step_dirs(run / "checkpoints")[0]
    export_safetensors(newest, tmp_path / "from_dcp.safetensors")
    assert_bitwise(load_file(str(tmp_path / "from_dcp.safetensors")), weights(run))


@pytest.mark.heavy
def test_peak_memory_per_rank_is_clearly_lower_under_fsdp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four blocks of width 2896 (metaplug:wide): 33.6M parameters, 128 MiB in fp32, which
    # AdamW quadruples with its gradients and moments. FSDP shards them block by block, so
    # only a block or two is ever whole on a rank; few samples, so the time goes to memory.
    # A fixed mmap threshold makes glibc hand every freed tensor back at once (its default
    # threshold grows, keeping freed blocks in the heap), so the peak RSS is the peak of
    # what was held, not of what the allocator kept.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    npz = write_npz(tmp_path / "d.npz", 200)
    base = dict(dataset=str(npz), model="metaplug:wide", width=2896, epochs=1,
                optimizer="adamw", batch_size=32, use_amp=False, tensorboard=False,
                save_every=0)
    ddp = run_ranks(fit_and_measure, 2, tmp_path, {**base, "output_dir": str(tmp_path / "d")})
    fsdp = run_ranks(fit_and_measure, 2, tmp_path,
                     {**base, "output_dir": str(tmp_path / "f"), "strategy": "fsdp"})
    for d, f in zip(ddp, fsdp, strict=True):
        held = sum(d["bytes"].values()) / 2**20
        assert held > 480 and sum(f["bytes"].values()) / 2**20 < 0.55 * held
        assert f["peak_rss_mb"] < d["peak_rss_mb"] - 128, (f["peak_rss_mb"], d["peak_rss_mb"])


# ------------------------------------------------------------ DCP checkpoints
def _global_batch_job(npz: Path, out: Path, **kw: Any) -> dict[str, Any]:
    cfg = dict(dataset=str(npz), model="mlp", epochs=2, lr=0.05, warmup_epochs=0.5,
               use_amp=False, log_interval=2, seed=7, output_dir=str(out), tensorboard=False,
               batch_size=8, global_batch_size=32, save_every_steps=3, optimizer="adamw",
               strategy="fsdp")
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize(("before", "after"), [
    ((2, "fsdp", "dcp"), (1, "fsdp")),
    ((1, "fsdp", "dcp"), (2, "fsdp")),
    ((2, "ddp", "file"), (2, "fsdp")),
    ((2, "zero", "dcp"), (2, "ddp")),
], ids=["dcp-2-to-1", "dcp-1-to-2", "ddp-file-to-fsdp", "zero-dcp-to-ddp"])
def test_a_checkpoint_resumes_on_another_world_size_and_strategy(
    tmp_path: Path, before: tuple[int, str, str], after: tuple[int, str]
) -> None:
    npz = write_npz(tmp_path / "d.npz", 401)  # 321 training samples: nothing divides
    reference = tmp_path / "reference"
    run_ranks(run_training, before[0], tmp_path, _global_batch_job(
        npz, reference, strategy=before[1], checkpoint_format=before[2]))
    suffix = ".pt" if before[2] == "file" else ""
    mid = reference / "checkpoints" / f"step_000000006{suffix}"  # epoch 1 has 11 steps
    assert load_checkpoint(mid, torch.device("cpu"))["samples_in_epoch"] == 6 * 32
    resumed = tmp_path / "resumed"
    ckpts = resumed / "checkpoints"
    ckpts.mkdir(parents=True)
    copy = shutil.copytree if mid.is_dir() else shutil.copy
    copy(mid, ckpts / mid.name)
    if mid.is_dir():
        # a save killed mid-write, and a directory without DCP's metadata: both ignored
        shutil.copytree(mid, ckpts / ".step_000000009.partial")
        (ckpts / ".step_000000009.partial" / "meta.pt").unlink()
        shutil.copytree(mid, ckpts / "step_000000012")
        (ckpts / "step_000000012" / ".metadata").unlink()
    run_ranks(run_training, after[0], tmp_path, _global_batch_job(
        npz, resumed, strategy=after[1], resume_from="auto", checkpoint_format="auto"))
    _close(weights(reference), weights(resumed))
    ref_lr = {r["step"]: r["lr"] for r in rows(reference) if r["split"] == "train"}
    resumed_rows = [r for r in rows(resumed) if r["split"] == "train"]
    assert resumed_rows[0]["step"] == 8  # went on from step 6, not from the planted 9 or 12
    for r in resumed_rows:
        assert r["lr"] == pytest.approx(ref_lr[r["step"]], rel=1e-9)
    if after[1] != "ddp":  # the resumed run writes DCP directories: its saves sweep it
        assert not (ckpts / ".step_000000009.partial").exists()


# MiniResNet (BatchNorm: statistics FSDP leaves per rank) at width 4 on digits: 36 steps.
TORCHRUN_JOB = ["train", "--dataset", "digits", "--model", "miniresnet", "--width", "4",
                "--batch_size", "16", "--epochs", "1", "--lr", "0.05", "--log_interval", "3",
                "--save_every_steps", "3", "--strategy", "fsdp", "--async_checkpoint"]


def _kill_during_a_write(ckpts: Path, agent: Any, after_step: int, limit: float = 120) -> int:
    """SIGKILL rank 1 as soon as a save past `after_step` is being written."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        for partial in ckpts.glob(".step_*.partial") if ckpts.is_dir() else []:
            step = int(partial.name.split("_")[1].split(".")[0])
            if step > after_step:
                (victim,) = [p for p in worker_pids(agent.pid) if rank_of(p) == 1]
                os.kill(victim, signal.SIGKILL)
                return step
        assert agent.poll() is None, agent.stderr.read()[-2000:]
        time.sleep(0.001)
    raise AssertionError(f"no save past step {after_step} within {limit}s")


@pytest.mark.heavy
def test_a_worker_killed_during_a_dcp_write_resumes_bitwise_exactly(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    ref = torchrun([*TORCHRUN_JOB, "--output_dir", str(reference)], tmp_path, [])
    _, err = ref.communicate(timeout=240)
    assert ref.returncode == 0, err[-3000:]
    run = tmp_path / "run"
    agent = torchrun([*TORCHRUN_JOB, "--output_dir", str(run)], tmp_path, ["--max_restarts=1"])
    killed_at = _kill_during_a_write(run / "checkpoints", agent, after_step=12)
    time.sleep(0.3)
    # still partial: rank 1 died before its shard was written, so this save never counts
    torn = (run / "checkpoints" / f".step_{killed_at:09d}.partial").exists()
    out, err = agent.communicate(timeout=240)
    assert agent.returncode == 0, err[-3000:]
    resumed = [line for line in (out + err).splitlines() if "resumed from" in line]
    assert resumed, (out + err)[-3000:]
    resumed_step = int(resumed[-1].split("step ")[-1])
    assert 12 <= resumed_step <= killed_at and (resumed_step < killed_at or not torn)
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)
    summary = (run / "summary.json").read_text()
    assert '"strategy": "fsdp"' in summary and "checkpoint_blocking_s_median" in summary


# ------------------------------------------------------------ what fsdp shards, and bad input
def test_fsdp_shards_the_repeated_blocks_of_each_builtin_model() -> None:
    from ddptrain.models.gpt import GPT, GPTConfig
    from ddptrain.models.nets import MiniResNet
    from ddptrain.parallel.fsdp import fsdp_blocks

    assert [type(b).__name__ for b in fsdp_blocks(MLP(6, 3, 64), None)] == ["Linear"] * 3
    gpt = fsdp_blocks(GPT(GPTConfig(32, 16, n_layer=3, n_head=2, n_embd=32)), None)
    assert len(gpt) == 3 and len({type(b) for b in gpt}) == 1
    assert [type(b).__name__ for b in fsdp_blocks(MiniResNet(1, 10, 8), None)] == [
        "BasicBlock"] * 6
    assert len(fsdp_blocks(MiniResNet(1, 10, 8), "BasicBlock")) == 6


def test_bad_sharding_settings_are_one_line_each(tmp_path: Path) -> None:
    from conftest import run_cli

    from ddptrain.errors import ConfigError
    from ddptrain.parallel.fsdp import fsdp_blocks

    with pytest.raises(ConfigError, match=r"--fsdp_wrap 'Nope' matches no module.*Linear"):
        fsdp_blocks(MLP(6, 3, 64), "Nope")
    proc = run_cli(["train", "--async_checkpoint", "--output_dir", str(tmp_path / "r")],
                   cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ddptrain: error: --async_checkpoint True is invalid: background saves write DCP "
        "step directories: add --checkpoint_format dcp (or use --strategy zero / fsdp)"
    ]


@pytest.mark.parametrize(("flags", "message"), [
    ({"fsdp_wrap": "Block"}, "--fsdp_wrap 'Block' is an fsdp setting and --strategy is 'ddp'"),
    ({"reshard_after_forward": False, "strategy": "zero"},
     "--no-reshard_after_forward is an fsdp setting and --strategy is 'zero'"),
    ({"fsdp_cpu_offload": True}, "--fsdp_cpu_offload is an fsdp setting"),
    ({"fsdp_cpu_offload": True, "strategy": "fsdp"}, "--fsdp_cpu_offload is invalid on CPU"),
])
def test_a_flag_of_another_strategy_is_refused_not_ignored(
    flags: dict[str, Any], message: str
) -> None:
    from ddptrain.config import TrainingConfig
    from ddptrain.errors import ConfigError
    from ddptrain.parallel import resolve_strategy

    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve_strategy(TrainingConfig(**flags), 2, "cpu")


def test_the_strategy_is_decided_once_with_what_it_implies() -> None:
    from ddptrain.config import TrainingConfig
    from ddptrain.parallel import FSDP, Strategy, resolve_strategy

    one = resolve_strategy(TrainingConfig(strategy="fsdp"), 1, "cpu")
    assert (one.name, one.cls, one.checkpoint_kind) == ("single process", Strategy, "dcp")
    with pytest.raises(Exception, match="fsdp_cpu_offload is invalid on one process"):
        resolve_strategy(TrainingConfig(strategy="fsdp", fsdp_cpu_offload=True), 1, "cuda")
    four = resolve_strategy(TrainingConfig(strategy="fsdp", optimizer="adamw"), 4, "cpu")
    assert (four.name, four.cls, four.checkpoint_kind) == ("fsdp", FSDP, "dcp")
    assert four.rank_bytes(1000, 2) == {"params": 1000, "grads": 1000, "optimizer": 2000}
    ddp = resolve_strategy(TrainingConfig(), 4, "cpu")
    assert ddp.checkpoint_kind == "file"
    assert ddp.rank_bytes(1000, 1) == {"params": 4000, "grads": 4000, "optimizer": 4000}
    # frozen parameters (--freeze, a LoRA run's model) have no gradients, no state
    assert ddp.rank_bytes(1000, 1, 100) == {"params": 4000, "grads": 400, "optimizer": 400}
    assert four.rank_bytes(1000, 2, 100) == {"params": 1000, "grads": 100, "optimizer": 200}


def test_an_ignored_strategy_flag_stops_the_run_before_anything_is_written(
    tmp_path: Path,
) -> None:
    from conftest import run_cli

    run = tmp_path / "r"
    proc = run_cli(["train", "--fsdp_wrap", "Linear", "--output_dir", str(run)], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ddptrain: error: --fsdp_wrap 'Linear' is an fsdp setting and --strategy is 'ddp': "
        "add --strategy fsdp, or drop the flag"
    ]
    assert not run.exists()


@pytest.mark.heavy
@pytest.mark.slow
def test_gpu_train_rows_under_ddp_and_fsdp_with_a_cuda_stand_in(tmp_path: Path) -> None:
    """The MFU path a GPU takes, on the real 2-rank run: FLOPs counted once, without
    copying the wrapped (or sharded) model, the same per sample under every strategy."""
    from conftest import BIN, REPO, child_env

    per_sample = {}
    for strategy in ("ddp", "fsdp"):
        run = tmp_path / strategy
        proc = subprocess.run(
            [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2",
             str(REPO / "tests" / "cuda_standin.py"), "train", "--dataset", "digits",
             "--model", "mlp", "--optimizer", "adamw", "--epochs", "1", "--log_interval", "5",
             "--strategy", strategy, "--output_dir", str(run)],
            cwd=tmp_path, env=child_env(), text=True, capture_output=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        train = [r for r in rows(run) if r["split"] == "train"]
        assert train and all(r["peak_cuda_mb"] == 64 for r in train)
        assert all(r["tflops_per_sec"] > 0 and 0 < r["mfu"] < 1 for r in train)
        counted = {round(1e12 * r["tflops_per_sec"] / r["samples_per_sec"]) for r in train}
        assert len(counted) == 1, counted  # counted once, reused by every row
        per_sample[strategy] = counted.pop()
    assert per_sample["ddp"] == per_sample["fsdp"] > 0
