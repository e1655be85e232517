"""Bitwise-exact resume on more than 2 ranks.

On 2 ranks an all-reduce sums a + b, whatever the bucket layout. On 4, gloo's ring sums
each element in an order set by its offset in the bucket, so a resumed run must reduce
its first step in the layout the uninterrupted run had then: DDP's rebuilt one, not the
first one a freshly built DDP starts with (`ddptrain.parallel.ddp`).

The kill is the model SIGKILLing its own process at a given training forward
(`guardplug`, GUARD_KILL_AT), so it lands at the same step however busy the machine is.
"""

from __future__ import annotations

import gc
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import run_torchrun
from dist_utils import run_ranks
from procs import assert_bitwise, assert_same_log, sigkill_then_resume, weights

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.models.nets import MLP
from ddptrain.parallel.ddp import DDP

pytestmark = pytest.mark.slow

# breast_cancer on 4 ranks x 8: 15 steps an epoch; the built-in MLP with a kill switch.
JOB = ["train", "--dataset", "breast_cancer", "--model", "guardplug:killable_mlp",
       "--batch_size", "8", "--epochs", "2", "--lr", "0.05", "--save_every_steps", "5",
       "--log_interval", "5"]


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.heavy
# ddp's kill and resume: tests/test_faults.py (one process) and the EMA, Ray, Slurm and
# pod proofs (2 ranks); the sharded states here, at 4 ranks
@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_sigkill_then_resume_on_four_ranks_is_bitwise_exact(
    tmp_path: Path, strategy: str
) -> None:
    job = [*JOB, "--strategy", strategy]
    reference = tmp_path / "reference"
    _ok(run_torchrun(4, [*job, "--output_dir", str(reference)], cwd=tmp_path))
    run = tmp_path / "run"
    # rank 1 dies at step 8's forward: the newest checkpoint is step 5's
    resumed = sigkill_then_resume(4, job, run, tmp_path, kill_at=8)
    assert "epoch 0 done, step 5" in resumed.stdout + resumed.stderr
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)


# ---------------------------------------------------------------- the layout itself
def _layout(model: torch.nn.Module) -> list[list[tuple[str, int]]]:
    """DDP's buckets as its gradients sit in them (gradient_as_bucket_view): per bucket,
    (parameter name, offset), in offset order."""
    buckets: dict[int, list[tuple[int, str]]] = {}
    for name, p in model.module.named_parameters():
        grad = p.grad
        buckets.setdefault(grad.untyped_storage().data_ptr(), []).append(
            (grad.storage_offset(), name)
        )
    return sorted([[(n, o) for o, n in sorted(b)] for b in buckets.values()])


def _layouts(rank: int) -> dict[str, object]:
    dist.init_process_group("gloo")
    try:
        ctx = DistributedContext(rank, rank, dist.get_world_size(), torch.device("cpu"), "gloo")
        strategy = DDP(ctx, TrainingConfig())
        torch.manual_seed(0)
        # two hidden layers of 600: more than DDP's 1 MiB first bucket, so several buckets
        module = MLP(30, 2, hidden=600)
        model = strategy.setup_module(module)
        x = torch.randn(8, 30)

        def step() -> list[list[tuple[str, int]]]:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            return _layout(model)

        with model.no_sync():  # a backward that reduces nothing records nothing
            model(x).sum().backward()
        first = step()  # DDP's first layout: one bucket, in parameter order
        rebuilt = step()  # rebuilt in the order the gradients became ready
        saved = strategy.layout_state()
        # a resume: DDP built again from what the checkpoint saved, its first step; the
        # loaded weights are alike on every rank already, so the new wrapper broadcasts
        # nothing (a weight only rank 1 changed stays changed)
        first_weight = next(module.parameters())
        with torch.no_grad():
            first_weight.add_(float(dist.get_rank()))
        before = first_weight.sum().item()
        model = strategy.resume_module(model, module, saved)
        kept = first_weight.sum().item() == before
        started = step()
        # gloo's teardown trap: no DDP wrapper may outlive the group
        model = None
        del module, strategy, step, first_weight
        gc.collect()
        dist.barrier()
        return {"first": first, "rebuilt": rebuilt, "started": started, "saved": saved,
                "kept": kept}
    finally:
        dist.destroy_process_group()


def test_a_resumed_ddp_starts_in_the_layout_the_run_had_rebuilt(tmp_path: Path) -> None:
    results = run_ranks(_layouts, 2, tmp_path)
    got = results[0]
    names = [n for n, _ in MLP(30, 2, hidden=600).named_parameters()]
    assert got["saved"] == {"grad_ready_order": names[::-1]}  # the last layer's first
    assert len(got["first"]) == 1 and len(got["rebuilt"]) > 1
    assert got["started"] == got["rebuilt"] != got["first"]
    assert results[1]["started"] == got["started"]
    assert got["kept"] and results[1]["kept"]  # no second broadcast of the model
