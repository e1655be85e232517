"""Hugging Face models on 2 ranks through `--model module:fn` with dict batches: a
sequence classifier returning a `ModelOutput` with its own loss, and a GPT-2 language
model with tied weights whose exported file loads into a fresh `GPT2LMHeadModel`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_torchrun

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_sequence_classifier_with_model_output_loss_on_two_ranks(tmp_path: Path) -> None:
    run = tmp_path / "bert"
    proc = run_torchrun(2, [
        "train", "--dataset", "hfplug:sentiment", "--model", "hfplug:bert_classifier",
        "--epochs", "6", "--batch_size", "8", "--optimizer", "adamw", "--lr", "0.003",
        "--output_dir", str(run),
    ], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "classification" and summary["world_size"] == 2
    assert summary["val_accuracy"] > 0.7


def test_gpt2_with_tied_weights_trains_and_exports_loadable_weights(tmp_path: Path) -> None:
    import hfplug
    from safetensors import safe_open
    from safetensors.torch import load_model
    from transformers import GPT2LMHeadModel

    run = tmp_path / "gpt2"
    proc = run_torchrun(2, [
        "train", "--dataset", "hfplug:counting", "--model", "hfplug:gpt2", "--epochs", "5",
        "--batch_size", "8", "--optimizer", "adamw", "--lr", "0.01", "--output_dir", str(run),
        "--strategy", "fsdp",  # sharded per GPT2Block; the tie survives the export
    ], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "lm" and summary["val_perplexity"] < 5  # 20 tokens: 20 at chance

    fresh = hfplug.gpt2(None, vocab_size=20)
    assert isinstance(fresh, GPT2LMHeadModel)
    missing, unexpected = load_model(fresh, str(run / "model.safetensors"))
    assert not missing and not unexpected
    with safe_open(str(run / "model.safetensors"), "pt") as f:
        ties = {k: v for k, v in f.metadata().items() if k.startswith("tied:")}
    assert ties in ({"tied:lm_head.weight": "transformer.wte.weight"},
                    {"tied:transformer.wte.weight": "lm_head.weight"})  # stored once
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()
    # The loaded model predicts what the trained one did: the same validation loss.
    _, val = hfplug.counting(None)
    fresh.eval()
    with torch.no_grad():
        batch = {k: torch.stack([item[k] for item in val.items]) for k in val.items[0]}
        loss = fresh(**batch).loss
    assert float(loss) == pytest.approx(summary["val_loss"], rel=1e-4)


def test_a_hugging_face_model_is_built_without_torchaos_or_pytrees_lines(tmp_path: Path) -> None:
    """transformers imports torchao as it builds a model: its lines about kernels built for
    other machines and torch's pytree deprecations are held back (a fresh interpreter, as a
    first run has)."""
    pytest.importorskip("transformers")
    import subprocess
    import sys

    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=30, n_positions=16,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path / "m")
    code = ("import torch\nfrom ddptrain.models.hf import build_hf\n"
            f"build_hf('hf:{tmp_path / 'm'}', {{'auto_class': 'AutoModelForCausalLM'}}, None, None,"
            " torch.device('cpu'))\n"
            "import sys\nprint('torchao' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Failed to load" not in done.stderr and "_pytree" not in done.stderr, done.stderr
