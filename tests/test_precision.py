"""Mixed precision: bf16 autocast on CPU here; fp16 + GradScaler and bf16 where CUDA is."""

from __future__ import annotations

import json
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
