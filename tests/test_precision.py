"""Mixed precision: bf16 autocast on CPU here; fp16 + GradScaler and bf16 where CUDA is."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from ddptrain.cli import main
from ddptrain.config import TrainingConfig
from ddptrain.train.precision import resolve_precision


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_precision_choice_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_precision(TrainingConfig(), cpu).dtype is None  # auto: fp32 on CPU
    bf16 = resolve_precision(TrainingConfig(amp_dtype="bfloat16"), cpu)
    assert bf16.dtype == torch.bfloat16 and not bf16.scaler
    # The GPU's compute capability decides auto (a stand-in: no CUDA here).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    fp16 = resolve_precision(TrainingConfig(), cuda)  # auto on a V100: fp16 + scaler
    assert fp16.dtype == torch.float16 and fp16.scaler
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    auto = resolve_precision(TrainingConfig(), cuda)  # auto on an H100: bf16, no scaler
    assert auto.dtype == torch.bfloat16 and not auto.scaler
    forced = resolve_precision(TrainingConfig(amp_dtype="float16"), cuda)
    assert forced.dtype == torch.float16 and forced.scaler
    assert not resolve_precision(TrainingConfig(amp_dtype="bfloat16"), cuda).scaler
    assert resolve_precision(TrainingConfig(use_amp=False), cuda).dtype is None


def test_tf32_where_the_gpu_has_it_and_off_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """TF32 float32 matmuls: on by default on Ampere and later, off with --tf32 off, never
    on a V100 or the CPU, where --tf32 on is one line; the plan says which runs."""
    from ddptrain.errors import ConfigError

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    auto = resolve_precision(TrainingConfig(use_amp=False), cuda)
    assert auto.tf32 and auto.describe() == "float32 (matmuls TF32)"
    off = resolve_precision(TrainingConfig(tf32="off"), cuda)
    assert not off.tf32 and off.describe() == "bfloat16 autocast (float32 matmuls IEEE)"
    assert not resolve_precision(TrainingConfig(), cpu).tf32
    assert resolve_precision(TrainingConfig(), cpu).describe() == "float32"
    with pytest.raises(ConfigError, match="--tf32 on is invalid on CPU"):
        resolve_precision(TrainingConfig(tf32="on"), cpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert not resolve_precision(TrainingConfig(), cuda).tf32
    with pytest.raises(ConfigError, match="before Ampere"):
        resolve_precision(TrainingConfig(tf32="on"), cuda)
    # Applied: the process's float32 matmul precision follows (CUDA only; CPU untouched).
    before = (torch.backends.cuda.matmul.fp32_precision,
              torch.backends.cudnn.conv.fp32_precision)
    try:
        auto.apply()
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
        off.apply()
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        torch.backends.cuda.matmul.fp32_precision = "none"
        resolve_precision(TrainingConfig(), cpu).apply()
        assert torch.backends.cuda.matmul.fp32_precision == "none"
    finally:
        (torch.backends.cuda.matmul.fp32_precision,
         torch.backends.cudnn.conv.fp32_precision) = before


def test_float8_is_refused_in_one_line_where_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """--float8 needs compute capability 8.9 (an A100 stand-in is refused before the
    process group), composes with ddp/zero/fsdp only, and needs torchao; the CPU emulates
    it (tests); the plan says it runs."""
    import importlib.util

    from ddptrain.errors import ConfigError

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    f8 = TrainingConfig(float8="tensorwise")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8\.0\): float8 matmuls need 8\.9"):
        resolve_precision(f8, cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        assert resolve_precision(f8, cuda).describe().endswith(", float8 tensorwise linears")
        resolve_precision(dataclasses.replace(f8, compile=True), cuda)
        resolve_precision(f8, cpu)
    # eager float8 on a GPU is slower than bf16 (measured), and the CPU's is emulated:
    # each said once, with the way out, and the plan says so too
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "--float8 tensorwise without --compile",
        "--float8 tensorwise on the CPU is emulated (no float8 matmuls)"]
    assert resolve_precision(f8, cpu).describe().endswith(
        ", float8 tensorwise linears (emulated: slower, not faster)")
    assert resolve_precision(f8, cpu).float8 == "tensorwise"
    with pytest.raises(ConfigError, match="--float8 with --tp/--pp is not supported"):
        resolve_precision(TrainingConfig(float8="rowwise", tp=2), cpu)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match="needs torchao: pip install torchao"):
        resolve_precision(f8, cpu)
    # Evaluating a float8 run swaps nothing: it asks for no torchao and no float8 GPU.
    from ddptrain.train.inference import Source, source_config

    stored = Source({"float8": "tensorwise", "activation_checkpointing": "block"}, Path("w"))
    after = source_config(stored)
    assert (after.float8, after.activation_checkpointing) == ("off", "off")
    resolve_precision(after, cpu)


def test_float8_converts_the_block_linears_and_keeps_the_tied_head() -> None:
    """The GPT's block linears become Float8Linear under the same state-dict names; the
    head, tied to the embedding, stays as it is."""
    from ddptrain.models import GPT, GPTConfig
    from ddptrain.parallel.parts import to_float8

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    names = list(model.state_dict())
    chosen = to_float8(model, "tensorwise", fsdp=False)
    assert chosen == [f"blocks.{b}.{n}" for b in range(2)
                      for n in ("attn.qkv", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert type(model.blocks[0].attn.qkv).__name__ == "Float8Linear"
    assert type(model.lm_head).__name__ == "Linear" and model.lm_head.weight is model.wte.weight
    assert list(model.state_dict()) == names
    model(torch.randint(0, 64, (2, 16))).sum().backward()


def test_bf16_autocast_trains_on_cpu(tmp_path: Path) -> None:
    run = tmp_path / "bf16"
    args = ["train", "--amp_dtype", "bfloat16", "--epochs", "3", "--batch_size", "16"]
    assert main([*args, "--output_dir", str(run)]) == 0
    assert _summary(run)["val_accuracy"] >= 0.9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_amp_trains_on_cuda(tmp_path: Path, dtype: str) -> None:
    run = tmp_path / dtype
    args = ["train", "--dataset", "digits", "--model", "miniresnet", "--width", "16",
            "--epochs", "3", "--batch_size", "64", "--lr", "0.05", "--amp_dtype", dtype]
    assert main([*args, "--output_dir", str(run)]) == 0
    assert _summary(run)["val_accuracy"] >= 0.9
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("peak_cuda_mb" in r for r in rows if r["split"] == "train")
    scaler = torch.load(run / "checkpoints" / "latest.pt", weights_only=True)["scaler_state_dict"]
    assert bool(scaler) == (dtype == "float16")  # a GradScaler only for float16


def test_fp16_steps_skipped_by_the_grad_scaler_leave_sgd_momentum_at_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float16 autocast with a GradScaler, as on a GPU (here on the CPU, which runs both):
    the scaler skips the first steps (their gradients overflow), the fused SGD is handed
    its found_inf, and its momentum must be the zeros a first step starts from, not the
    uninitialised memory the fused step allocates (poisoned here with NaN: `make
    gpu-check`'s fp16 run ended NaN before)."""
    import ddptrain.train as train
    import ddptrain.train.plan as plan
    from ddptrain import fit
    from ddptrain.train.precision import Precision

    def fp16(config: TrainingConfig, device: torch.device) -> Precision:
        return Precision(torch.float16, True, "cpu")

    monkeypatch.setattr(plan, "resolve_precision", fp16)
    monkeypatch.setattr(train, "resolve_precision", fp16)
    empty_like = torch.empty_like

    def poisoned(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = empty_like(t, *args, **kwargs)  # type: ignore[arg-type]
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty_like", poisoned)
    scaler_init = torch.amp.GradScaler.__init__

    def overflowing(self: torch.amp.GradScaler, *args: object, **kwargs: object) -> None:
        scaler_init(self, *args, init_scale=2.0**20, **kwargs)  # type: ignore[arg-type, misc]

    monkeypatch.setattr(torch.amp.GradScaler, "__init__", overflowing)
    run = tmp_path / "fp16"
    config = TrainingConfig(output_dir=str(run), epochs=1, save_every=0, tensorboard=False,
                            dataset="digits", model="mlp", batch_size=32, width=16,
                            optimizer="sgd", momentum=0.9, max_grad_norm=1.0, lr=0.05)
    result = fit(config)
    scale = torch.load(run / "checkpoints" / "latest.pt", weights_only=True)[
        "scaler_state_dict"]["scale"]
    assert scale < 2.0**20  # some steps were skipped
    assert torch.isfinite(torch.tensor(result["val_loss"]))
