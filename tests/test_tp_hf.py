"""Tensor parallelism for Hugging Face models built from a config (`--model hf:DIR --tp
2`): which models have a plan, heads that tp does not divide refused with one line, and
real gloo groups where Llama-style models (grouped-query attention; Qwen2's biased q, k,
v) and GPT-2 (fused Conv1D q, k, v; tied head) split over 2 ranks each end with the
weights of plain training on one process with the same global batch, with SGD momentum
and a clip that acts on some steps only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli
from dist_utils import run_ranks
from nd_workers import fit_runs, held_whole

from ddptrain.config import TrainingConfig
from ddptrain.data.sources import load_data
from ddptrain.errors import ConfigError
from ddptrain.launch.process_group import setup_distributed, teardown_distributed
from ddptrain.parallel.tp import tensor_parallel_plan
from ddptrain.parallel.tp_hf import check_hf_config, parallelize_gpt2
from ddptrain.train.plan import resolve
from ddptrain.train.trainer import Trainer

transformers = pytest.importorskip("transformers")


def _llama(cls: str = "LlamaConfig", **fields: Any) -> Any:
    # 4 query heads sharing 2 key-value heads: each of 2 tp ranks keeps 2 and 1.
    return getattr(transformers, cls)(**{
        "vocab_size": 20, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 32,
        "bos_token_id": 0, "eos_token_id": 0, **fields,
    })


def _gpt2(**fields: Any) -> Any:
    return transformers.GPT2Config(**{
        "vocab_size": 20, "n_positions": 32, "n_embd": 64, "n_layer": 2, "n_head": 4,
        "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0, **fields,
    })


def _tp(tp: int) -> TrainingConfig:
    return TrainingConfig(output_dir="/tmp/unused", tp=tp, strategy="fsdp").validate()


# ---------------------------------------------------------------- pure logic
def test_hf_gpt2_and_llama_have_plans_and_other_models_are_refused() -> None:
    gpt2 = transformers.GPT2LMHeadModel(_gpt2())
    assert tensor_parallel_plan(gpt2, _tp(2)) is parallelize_gpt2
    assert callable(tensor_parallel_plan(transformers.LlamaForCausalLM(_llama()), _tp(2)))
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=20, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    ))
    with pytest.raises(ConfigError, match="this model is a BertModel: give --tp_plan"):
        tensor_parallel_plan(bert, _tp(2))


@pytest.mark.parametrize(("config", "tp", "message"), [
    (_llama(), 4, "--tp 4 does not divide the attention heads of M (num_attention_heads 4, "
                  "num_key_value_heads 2): choose a tp that divides them"),
    (_llama(num_attention_heads=6, num_key_value_heads=6, hidden_size=60), 4,
     "--tp 4 does not divide the attention heads of M (num_attention_heads 6, "
     "num_key_value_heads 6)"),
    (_gpt2(), 3, "--tp 3 does not divide the attention heads of M (n_head 4)"),
    (_llama(base_model_tp_plan={"layers.*.mlp.gate_up_proj": "packed_colwise"}), 2,
     "--tp 2: M's tensor-parallel plan splits layers.*.mlp.gate_up_proj as 'packed_colwise', "
     "which ddptrain does not apply"),
])
def test_hf_layouts_the_plan_cannot_split_are_config_errors(
    config: Any, tp: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_hf_config(config, tp, "M")
    assert check_hf_config(_llama(), 2, "M") and check_hf_config(_gpt2(), 4, "M")


# ---------------------------------------------------------------- the command line
@pytest.mark.slow
@pytest.mark.heavy
def test_hf_heads_tp_does_not_divide_are_one_line_before_the_group(tmp_path: Path) -> None:
    """Rank 0 of 4 (no peer runs; the port is closed) reads the directory's config and
    refuses the layout before it tries to meet them; the run directory is not made."""
    transformers.LlamaForCausalLM(_llama()).save_pretrained(tmp_path / "llama")
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    model = f"hf:{tmp_path / 'llama'}"
    res = run_cli(["train", "--dataset", "hfplug:counting", "--model", model, "--tp", "4",
                   "--output_dir", str(tmp_path / "run")], tmp_path, env=env, timeout=180)
    assert res.returncode == 2, res.stderr
    errors = [text for text in res.stderr.splitlines() if text.strip()]
    assert errors == [
        f"ddptrain: error: --tp 4 does not divide the attention heads of --model {model} "
        "(num_attention_heads 4, num_key_value_heads 2): choose a tp that divides them"
    ], res.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- real process groups
# 76 counting sequences of 16 tokens, a global batch of 16: 5 optimizer steps. Under this
# clip the gradient norms (before it) are Llama 2.2, 3.3, 2.6, 6.7, 7.5; GPT-2 2.5, 3.5,
# 6.4, 4.8, 2.9; Qwen2 2.3, 3.1, 4.8, 4.1, 5.8: it acts on some steps of each only, so a
# wrong norm changes which, and a wrong gradient scale is not clipped away.
RUN = dict(dataset="hfplug:counting", epochs=1, optimizer="sgd", lr=0.5, momentum=0.9,
           max_grad_norm=3.0, log_interval=1, seed=3, tensorboard=False, batch_size=16)
MODELS = ("llama", "gpt2", "qwen2")


@pytest.mark.slow
@pytest.mark.heavy
def test_hf_llama_qwen2_and_gpt2_under_tp2_equal_plain_training(tmp_path: Path) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_llama()).save_pretrained(tmp_path / "llama")
    transformers.GPT2LMHeadModel(_gpt2()).save_pretrained(tmp_path / "gpt2")
    # Qwen2: Llama's layout with biases on q, k and v (split with their columns).
    transformers.Qwen2ForCausalLM(_llama("Qwen2Config")).save_pretrained(tmp_path / "qwen2")

    def runs(name: str, **fields: Any) -> list[dict[str, Any]]:
        return [{**RUN, "model": f"hf:{tmp_path / m}", "output_dir": str(tmp_path / name / m),
                 **fields} for m in MODELS]

    plain = fit_runs(0, runs("plain"))
    split = run_ranks(fit_runs, 2, tmp_path, runs("tp", tp=2))[0]
    for model, ref, got in zip(MODELS, plain, split, strict=True):
        assert got["summary"]["strategy"] == "tp"
        assert sorted(got["weights"]) == sorted(ref["weights"])  # the model's own names
        for name, value in ref["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, atol=1e-5, rtol=0,
                                       msg=f"{model} {name}")
        assert got["summary"]["samples"] == ref["summary"]["samples"]
        assert got["summary"]["val_loss"] == pytest.approx(ref["summary"]["val_loss"], abs=1e-5)
        # The exported directory is the whole model, and loads as it came.
        tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tp" / model / "hf")
        for name, value in tuned.state_dict().items():
            torch.testing.assert_close(value, ref["weights"][name], atol=1e-5, rtol=0, msg=name)
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tp" / "gpt2" / "hf")
    assert gpt2.lm_head.weight.data_ptr() == gpt2.transformer.wte.weight.data_ptr()


def _whole_parts_after_fit(rank: int, run: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's own copy of the parts every tp rank holds whole, after training."""
    config = TrainingConfig(**run).validate()
    ctx = setup_distributed(config)
    clean = False
    try:
        trainer = Trainer(resolve(config, load_data(config), ctx.world_size, ctx.device), ctx)
        trainer.fit()
        whole = held_whole(trainer.module)
        clean = True
        return whole
    finally:
        teardown_distributed(clean)


@pytest.mark.slow
@pytest.mark.heavy
def test_hf_gpt2_with_dropout_keeps_its_whole_parts_alike_on_the_tp_ranks(
    tmp_path: Path
) -> None:
    """GPT-2's default dropout acts on activations each tp rank holds whole: the peers
    draw the same masks, so the embeddings, norms and tied head they keep stay equal."""
    transformers.GPT2LMHeadModel(_gpt2(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
                                 ).save_pretrained(tmp_path / "gpt2")
    run = {**RUN, "model": f"hf:{tmp_path / 'gpt2'}", "output_dir": str(tmp_path / "run"),
           "tp": 2}
    first, second = run_ranks(_whole_parts_after_fit, 2, tmp_path, run)
    assert {"transformer.wte.weight", "transformer.ln_f.weight"} <= set(first)
    for name, value in first.items():
        torch.testing.assert_close(second[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.heavy
def test_hf_llama_and_qwen2_as_pipeline_stages_alone_and_with_tp_equal_plain(
    tmp_path: Path
) -> None:
    """Llama (grouped-query attention) and Qwen2 (biased q, k, v; here its head tied to
    the embedding) cut into 2 stages on 2 ranks (`--pp 2`), and 2 stages each split over 2
    tp ranks on 4 (`--pp 2 --tp 2`): each ends with plain training's weights, and the
    exported directory of the 3-D run loads as the whole model."""
    transformers.LlamaForCausalLM(_llama()).save_pretrained(tmp_path / "llama")
    transformers.Qwen2ForCausalLM(_llama("Qwen2Config", tie_word_embeddings=True)
                                  ).save_pretrained(tmp_path / "qwen2")
    models = ("llama", "qwen2")

    def runs(name: str, **fields: Any) -> list[dict[str, Any]]:
        return [{**RUN, "dataset": "hfplug:counting_windows", "model": f"hf:{tmp_path / m}",
                 "output_dir": str(tmp_path / name / m), **fields} for m in models]

    plain = fit_runs(0, runs("plain"))
    stages = run_ranks(fit_runs, 2, tmp_path, runs("pp", pp=2))[0]
    split = run_ranks(fit_runs, 4, tmp_path, runs("pp_tp", pp=2, tp=2))[0]
    for layout, results in (("pp", stages), ("pp x tp", split)):
        for model, ref, got in zip(models, plain, results, strict=True):
            assert sorted(got["weights"]) == sorted(ref["weights"]), (layout, model)
            for name, value in ref["weights"].items():
                torch.testing.assert_close(got["weights"][name], value, atol=1e-5, rtol=0,
                                           msg=f"{layout} {model} {name}")
            assert got["summary"]["samples"] == ref["summary"]["samples"]
    for model, ref in zip(models, plain, strict=True):
        tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pp_tp" / model / "hf")
        for name, value in tuned.state_dict().items():
            torch.testing.assert_close(value, ref["weights"][name], atol=1e-5, rtol=0, msg=name)
