"""Fine-tuning parts: `--freeze`, parameter groups (`--lr_scale`, no weight decay on biases
and norms, `--decay_all`), `--optimizer / --scheduler package.module:fn` and
`--activation_checkpointing`, under ddp, zero and fsdp.

The 2-rank proofs run several trainers in one process group (`_variants`), so a whole
strategy costs one spawn: the plain run, the same with activation checkpointing (equal
weights; every block ran its forward once more per training micro-batch) and a frozen run
(frozen tensors bitwise unchanged; under ddp the gradient bytes reduced per step are
exactly the trainable ones). The heavy tier adds the user's optimizer and scheduler
(zero equals ddp) and their bitwise resume after a SIGKILL under ddp and fsdp.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli, run_torchrun, write_npz
from dist_utils import run_ranks
from procs import assert_bitwise, assert_same_log, sigkill_then_resume, weights
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ddptrain.config import TrainingConfig
from ddptrain.config_cli import parse_config
from ddptrain.errors import ConfigError
from ddptrain.parallel.parts import checkpoint_activations, freeze
from ddptrain.train.optim import param_groups


# ---------------------------------------------------------------- pure logic
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)
        self.gain = nn.Parameter(torch.ones(4, 4))  # 2-D and no norm layer's: decays


def _groups(**kw: Any) -> list[tuple[float, bool, list[str]]]:
    return [(g.scale, g.decay, g.names) for g in param_groups(Tiny(), TrainingConfig(**kw))]


def test_groups_keep_decay_off_biases_and_norms_and_scale_by_the_first_pattern() -> None:
    assert _groups() == [
        (1.0, True, ["gain", "embed.weight", "body.0.weight", "body.2.weight", "head.weight"]),
        (1.0, False, ["body.0.bias", "body.1.weight", "body.1.bias", "body.2.bias",
                      "head.bias"]),
    ]
    assert _groups(decay_all=True) == [(1.0, True, [n for n, _ in Tiny().named_parameters()])]
    got = _groups(lr_scale={"body.*": 0.1, "body.2.*": 5.0, "head.bias": 2.0})
    assert got == [
        (1.0, True, ["gain", "embed.weight", "head.weight"]),
        (0.1, True, ["body.0.weight", "body.2.weight"]),  # body.* came first
        (0.1, False, ["body.0.bias", "body.1.weight", "body.1.bias", "body.2.bias"]),
        (2.0, False, ["head.bias"]),
    ]


def test_freeze_turns_gradients_off_and_a_pattern_matching_nothing_is_an_error() -> None:
    model = Tiny()
    assert freeze(model, ["embed.*", "body.1.*"]) == 40 + 8
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == [
        "embed.weight", "body.1.weight", "body.1.bias"]
    assert all(n not in g.names for g in param_groups(model, TrainingConfig())
               for n in ("embed.weight", "body.1.weight"))
    with pytest.raises(ConfigError, match=r"--freeze 'encoder\.\*' matches no parameter"):
        freeze(Tiny(), ["embed.*", "encoder.*"])
    with pytest.raises(ConfigError, match="--lr_scale 'x' matches no parameter"):
        param_groups(Tiny(), TrainingConfig(lr_scale={"x": 2.0}))
    with pytest.raises(ConfigError, match="finds no repeated blocks"):
        checkpoint_activations(nn.Linear(2, 2), None, "block")


def test_selective_recompute_keeps_the_matmuls_and_recomputes_the_cheap_ops() -> None:
    """One forward and backward of the built-in GPT under each mode, its ops counted:
    block runs every matmul of the blocks again in backward, selective none of them but
    the element-wise ops (GELU) again; the gradients are plain training's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ddptrain.models import GPT, GPTConfig

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = {}
    for mode in ("off", "block", "selective"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32))
        if mode != "off":
            checkpoint_activations(model, None, mode)
        with Count() as count:
            model(tokens).float().pow(2).mean().backward()
        runs[mode] = (count.ops, {n: p.grad for n, p in model.named_parameters()})
    off, block, selective = (runs[m][0] for m in ("off", "block", "selective"))
    matmuls = lambda ops: ops["addmm"] + ops["mm"]  # noqa: E731
    # Under block, each of 2 blocks runs 3 of its 4 linears again (the recompute stops
    # once backward has what it needs: the last one's output is not); under selective none
    assert matmuls(block) == matmuls(off) + 2 * 3
    assert matmuls(selective) == matmuls(off)
    assert selective["gelu"] == off["gelu"] + 2 == block["gelu"]
    for mode in ("block", "selective"):
        for name, grad in runs["off"][1].items():
            torch.testing.assert_close(runs[mode][1][name], grad, rtol=0, atol=1e-6)


def test_flags_parse_and_bad_values_are_refused() -> None:
    cfg = parse_config(["--freeze", "embed.*", "body.0.*", "--lr_scale", "layers.*.bias=0.5",
                        "--optimizer", "optimplug:grouped", "--optimizer_args", "head=net.5"])
    assert cfg.freeze == ["embed.*", "body.0.*"]
    assert cfg.lr_scale == {"layers.*.bias": 0.5}
    assert cfg.optimizer_args == {"head": "net.5"}
    # --activation_checkpointing alone is block; a mode may follow; yes/no of older
    # run directories and True in Python read as block / off
    assert cfg.activation_checkpointing == "off"
    assert parse_config(["--activation_checkpointing"]).activation_checkpointing == "block"
    assert parse_config(["--activation_checkpointing", "selective"]).activation_checkpointing \
        == "selective"
    assert TrainingConfig(activation_checkpointing=True).validate().activation_checkpointing \
        == "block"
    from ddptrain.config_cli import _coerce

    assert _coerce("activation_checkpointing", False) == "off"
    for argv, fix in [
        (["--lr_scale", "head.*=0"], "positive factor"),
        (["--optimizer", "adam"], "sgd, adamw or package.module:fn"),
        (["--scheduler", "linear"], "cosine or package.module:fn"),
    ]:
        with pytest.raises(ConfigError, match=fix):
            parse_config(argv)


def test_a_freeze_matching_nothing_stops_the_run_with_one_line_and_writes_nothing(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    out = run_cli(["train", "--dataset", "digits", "--model", "mlp", "--epochs", "1",
                   "--freeze", "net.1.*", "encoder.*", "--output_dir", str(run)], cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [x for x in out.stderr.splitlines() if x.startswith("ddptrain: error:")]
    assert errors == [
        "ddptrain: error: --freeze 'encoder.*' matches no parameter of this model: the names "
        "look like net.1.weight, net.1.bias, net.3.weight, net.3.bias, net.5.weight, "
        "net.5.bias"
    ], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not run.exists() or not [p for p in run.rglob("*") if p.is_file()]


def test_a_checkpoint_of_one_group_resumes_into_the_new_groups(tmp_path: Path) -> None:
    """A checkpoint whose optimizer has one group (every parameter with weight decay, as
    before the groups) resumes: each parameter's state continues by name in its new
    group, which gets this run's settings."""
    from ddptrain import fit

    npz = write_npz(tmp_path / "d.npz", 160, features=8)
    base = dict(dataset=str(npz), model="mlp", width=16, batch_size=16, lr=0.05,
                use_amp=False, tensorboard=False, output_dir=str(tmp_path / "run"))
    fit(TrainingConfig(**base, epochs=1, decay_all=True))
    saved = torch.load(tmp_path / "run/checkpoints/latest.pt", weights_only=True)
    assert len(saved["optimizer_state_dict"]["param_groups"]) == 1
    fit(TrainingConfig(**base, epochs=2, resume_from="auto"))
    latest = torch.load(tmp_path / "run/checkpoints/latest.pt", weights_only=True)
    groups = latest["optimizer_state_dict"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [1e-4, 0.0]
    assert sorted(p for g in groups for p in g["params"]) == sorted(latest["model_state_dict"])
    assert latest["step"] == 2 * saved["step"]


# ---------------------------------------------------------------- 2 ranks, one spawn each
def _variants(rank: int, base: dict[str, Any], variants: dict[str, dict[str, Any]]) -> Any:
    """Train each variant of `base` in turn on this rank; rank 0 returns, per variant, the
    initial and final weights, the blocks' forward counts, the steps, the gradient bytes
    all-reduced (ddp, zero) and the optimizer's class and learning rates."""
    from torch.nn.parallel import DistributedDataParallel

    from ddptrain.data.sources import load_data
    from ddptrain.launch.process_group import setup_distributed, teardown_distributed
    from ddptrain.train.plan import resolve
    from ddptrain.train.trainer import Trainer

    ctx = setup_distributed(TrainingConfig(**base).validate())
    clean, out, reduced = False, {}, [0]

    def count(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        reduced[0] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    try:
        for name, extra in variants.items():
            run = Path(extra.get("output_dir") or Path(base["output_dir"]) / name)
            run.mkdir(parents=True, exist_ok=True)
            cfg = TrainingConfig(**{**base, **extra, "output_dir": str(run)}).validate()
            trainer = Trainer(resolve(cfg, load_data(cfg), ctx.world_size, ctx.device), ctx)
            before = {k: v.clone() for k, v in trainer.strategy.model_state(trainer.module).items()}
            reduced[0] = 0
            if isinstance(trainer.model, DistributedDataParallel):
                trainer.model.register_comm_hook(None, count)
            trainer.fit()
            out[name] = {
                "before": before, "after": trainer.strategy.model_state(trainer.module),
                "calls": [b.calls for b in trainer.module.blocks],
                "steps": trainer.progress.step, "bytes": reduced[0],
                "trainable": sum(p.numel() for p in trainer.params),
                "lrs": [g["lr"] for g in trainer.optimizer.param_groups],
                "optimizer": type(trainer.optimizer).__name__,
            }
            del trainer
        clean = True
    finally:
        teardown_distributed(clean)
    return out if rank == 0 else None


def _base(tmp_path: Path, strategy: str) -> dict[str, Any]:
    npz = write_npz(tmp_path / "data.npz", 320, features=8)  # 256 train: 8 steps an epoch
    return dict(
        dataset=str(npz), model="optimplug:stack", batch_size=16, epochs=1, lr=0.01,
        optimizer="adamw", strategy=strategy, use_amp=False, tensorboard=False,
        log_interval=4, output_dir=str(tmp_path / "runs"),
    )


FROZEN = ["stem.*", "blocks.1.fc.weight"]  # a whole layer, and half of an fsdp block


def _float8_variants(tmp_path: Path, strategy: str) -> dict[str, dict[str, Any]]:
    """Two epochs in fp32 and with float8 linears, and the float8 run again from its
    first epoch's checkpoint (8 steps; a file under ddp, a DCP directory under fsdp)."""
    f8 = {"float8": "tensorwise", "epochs": 2}
    epoch1 = tmp_path / "runs" / "float8" / "checkpoints" / "step_000000008"
    return {"plain2": {"epochs": 2}, "float8": f8, "float8_resumed": {
        **f8, "resume_from": str(epoch1) + (".pt" if strategy == "ddp" else "")}}


def _check_float8(got: dict[str, Any], tmp_path: Path) -> None:
    """float8 really ran (its weights are not fp32's), ended within 2 % of fp32's
    validation loss, and its resume is bitwise the uninterrupted run."""
    plain, f8 = got["plain2"]["after"], got["float8"]["after"]
    assert max(float((f8[k] - v).abs().max()) for k, v in plain.items()) > 1e-4
    loss = {n: json.loads((tmp_path / "runs" / n / "summary.json").read_text())["val_loss"]
            for n in ("plain2", "float8")}
    assert abs(loss["float8"] - loss["plain2"]) <= 0.02 * loss["plain2"], loss
    assert_bitwise(got["float8_resumed"]["after"], f8)


def _check_ac_and_freeze(got: dict[str, Any]) -> None:
    plain, ac, frozen = got["plain"], got["ac"], got["frozen"]
    for k, v in plain["after"].items():
        torch.testing.assert_close(ac["after"][k], v, rtol=0, atol=1e-5, msg=k)
        torch.testing.assert_close(got["selective"]["after"][k], v, rtol=0, atol=1e-5, msg=k)
    # Each block's forward ran once more per training micro-batch: recomputed in backward.
    assert [a - p for a, p in zip(ac["calls"], plain["calls"], strict=True)] == [
        plain["steps"]] * 4
    names = frozen["before"].keys()
    still = {k for k in names if torch.equal(frozen["before"][k], frozen["after"][k])}
    assert still == {"stem.weight", "stem.bias", "blocks.1.fc.weight"}
    assert frozen["trainable"] == plain["trainable"] - (8 * 32 + 32) - 32 * 32


@pytest.mark.slow
def test_ddp_freeze_reduces_only_trained_bytes_and_recompute_changes_nothing(
    tmp_path: Path,
) -> None:
    variants = {
        "plain": {}, "ac": {"activation_checkpointing": True}, "frozen": {"freeze": FROZEN},
        "selective": {"activation_checkpointing": "selective"},
        **_float8_variants(tmp_path, "ddp"),
    }
    got = run_ranks(_variants, 2, tmp_path, _base(tmp_path, "ddp"), variants)[0]
    _check_ac_and_freeze(got)
    _check_float8(got, tmp_path)
    plain, frozen = got["plain"], got["frozen"]
    # Every step reduces each trainable gradient once, 4 bytes an element; frozen: none.
    assert plain["bytes"] == 4 * plain["trainable"] * plain["steps"]
    assert frozen["bytes"] == 4 * frozen["trainable"] * frozen["steps"]
    assert frozen["bytes"] < plain["bytes"]


@pytest.mark.slow
@pytest.mark.heavy
def test_a_user_optimizer_and_scheduler_under_zero_end_with_ddps_weights(
    tmp_path: Path,
) -> None:
    """zero builds the user's optimizer again as a ZeroRedundancyOptimizer over its groups."""
    user = {"optimizer": "optimplug:grouped", "scheduler": "optimplug:halving",
            "freeze": ["blocks.3.*"]}
    variants = {"user": user, "user_zero": {**user, "strategy": "zero"}}
    got = run_ranks(_variants, 2, tmp_path, _base(tmp_path, "ddp"), variants)[0]
    user_ddp, user_zero = got["user"], got["user_zero"]
    assert user_zero["optimizer"] == "ZeroRedundancyOptimizer"
    assert_bitwise(user_zero["after"], user_ddp["after"])
    # grouped's four groups (backbone at 0.1 x --lr), halved every 4 of the 8 steps
    assert user_ddp["lrs"] == pytest.approx([0.001 / 4, 0.001 / 4, 0.01 / 4, 0.01 / 4])


@pytest.mark.slow
def test_fsdp_freeze_inside_a_block_and_recompute_changes_nothing(tmp_path: Path) -> None:
    variants = {"plain": {}, "ac": {"activation_checkpointing": True},
                "frozen": {"freeze": FROZEN},
                "selective": {"activation_checkpointing": "selective"},
                **_float8_variants(tmp_path, "fsdp")}
    got = run_ranks(_variants, 2, tmp_path, _base(tmp_path, "fsdp"), variants)[0]
    _check_ac_and_freeze(got)
    _check_float8(got, tmp_path)


# ---------------------------------------------------------------- exact resume, torchrun
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("strategy", ["fsdp"])  # a sharded state: the harder of the two
def test_user_optimizer_and_scheduler_resume_bitwise_after_sigkill(
    tmp_path: Path, strategy: str
) -> None:


    npz = write_npz(tmp_path / "data.npz", 320, features=8)
    job = ["train", "--dataset", str(npz), "--model", "optimplug:stack", "--batch_size", "16",
           "--epochs", "2", "--lr", "0.01", "--strategy", strategy, "--optimizer",
           "optimplug:grouped", "--optimizer_args", "backbone_scale=0.2",
           "--scheduler", "optimplug:halving", "--scheduler_args", "every=3",
           "--save_every_steps", "5", "--log_interval", "2", "--no-tensorboard"]
    reference = tmp_path / "reference"
    done = run_torchrun(2, [*job, "--output_dir", str(reference)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    # rank 1 dies at step 7's forward (mid-epoch 1): the newest checkpoint is step 5's
    resumed = sigkill_then_resume(2, job, run, tmp_path, kill_at=7)
    assert "epoch 0 done, step 5" in resumed.stdout + resumed.stderr
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)
    lrs = [r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if r["split"] == "train"]
    # group 0, the backbone's weights at 0.2 x --lr, halved every 3 steps
    assert lrs[0] == pytest.approx(0.002) and lrs[-1] == pytest.approx(0.002 * 0.5**5)
