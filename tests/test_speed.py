"""Speed levers and the run's plan: `--dry_run` states the seeds' arithmetic, `--compile`
trains like eager without recompiling per step, `--channels_last` runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import child_env, run_cli, run_torchrun

from ddptrain.checkpoint.manager import load_checkpoint

pytestmark = pytest.mark.slow


def test_dry_run_prints_the_seeds_arithmetic_and_trains_nothing(tmp_path: Path) -> None:
    proc = run_torchrun(2, ["train", "--dataset", "breast_cancer", "--batch_size", "8",
                            "--drop_last", "--dry_run", "--output_dir", str(tmp_path / "run")],
                        cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "455 samples; per epoch 448 trained, 7 dropped (--drop_last" in out
    assert "28 batches per rank, 56 in all, 28 optimizer steps" in out
    assert "8 per rank x 1 accumulation step(s) x 2 rank(s) = 16 samples" in out
    # CPU: the host's memory, shared by the 2 ranks on it
    assert re.search(r"largest model   per device of [\d.]+ GiB: ddp ~[\d.]+[MB] params, "
                     r"zero ~[\d.]+[MB], fsdp ~[\d.]+[MB] \(SGD with momentum, fp32", out), out
    assert out.count("# resolved config") == 1  # rank 0 only
    assert not (tmp_path / "run").exists()


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.heavy
def test_compile_matches_eager_on_two_ranks_without_recompiling_per_step(
    tmp_path: Path,
) -> None:
    # 455 samples on 2 x 16: every epoch ends with a short batch (7 samples, 4 and 3 per rank)
    job = ["train", "--dataset", "breast_cancer", "--batch_size", "16", "--epochs", "3",
           "--log_interval", "5", "--model", "mlp", "--width", "16"]
    eager = run_torchrun(2, [*job, "--output_dir", str(tmp_path / "eager")], cwd=tmp_path)
    assert eager.returncode == 0, eager.stderr[-2000:]
    compiled = run_torchrun(2, [*job, "--compile", "--output_dir", str(tmp_path / "compiled")],
                            cwd=tmp_path, env={"TORCH_LOGS": "recompiles"}, timeout=600)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    a, b = _rows(tmp_path / "eager"), _rows(tmp_path / "compiled")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-5)
    # Shapes seen: the full batch, the short last one, validation's; each compiles once,
    # in epoch 1: epochs 2 and 3 add nothing.
    recompiles = compiled.stderr.count("Recompiling function")
    assert recompiles <= 2 * 3, compiled.stderr[-3000:]
    payload = load_checkpoint(tmp_path / "compiled" / "checkpoints" / "latest.pt",
                              torch.device("cpu"))
    assert not any("_orig_mod" in k or k.startswith("module.") for k in payload["model_state_dict"])
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["first_step_s"] > 0


def test_channels_last_runs_on_images(tmp_path: Path) -> None:
    proc = run_cli(["train", "--dataset", "digits", "--model", "miniresnet", "--width", "8",
                    "--epochs", "1", "--channels_last", "--output_dir", str(tmp_path / "cl")],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused = run_cli(["train", "--channels_last", "--output_dir", str(tmp_path / "x")],
                      cwd=tmp_path, env=child_env())
    assert refused.returncode == 2 and "needs image data" in refused.stderr
