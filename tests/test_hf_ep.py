"""`--ep` on Hugging Face mixtures (`ddptrain.models.hf_moe`): a Mixtral's and a
Qwen3-MoE's experts (transformers' batched weights) are found by their structure as the
model is built, and keep transformers' forward until spread; a layout the pass does not
compute is refused naming it. 2 ranks (slow tier): `--ep 2` under ddp and fsdp ends
within 1e-5 of ddp, the export holds each expert tensor whole under its HF name, and a
DCP step of the ep run resumes on one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError

transformers = pytest.importorskip("transformers")

RUN = dict(dataset="hfplug:counting_windows", model_args={}, block_size=16, batch_size=8,
           seed=3, optimizer="sgd", lr=0.2, momentum=0.9, max_grad_norm=1.0,
           tensorboard=False, curves=False, synthetic_size=128, log_interval=1, epochs=1,
           grad_accum_steps=2, checkpoint_format="dcp")


def _mixtral_config() -> Any:
    return transformers.MixtralConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
    )


def _mixtral(out: Path) -> Path:
    transformers.MixtralForCausalLM(_mixtral_config()).save_pretrained(out)
    return out


def _qwen3moe(out: Path) -> Path:
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0,
    )).save_pretrained(out)
    return out


@pytest.mark.parametrize("make", [_mixtral, _qwen3moe])
def test_a_hf_mixtures_experts_are_found_and_keep_transformers_forward(
    make: Any, tmp_path: Path,
) -> None:
    from ddptrain.models.hf import build_hf
    from ddptrain.parallel.ep import expert_layers, expert_params

    directory = make(tmp_path / "model")
    model = build_hf(f"hf:{directory}", {}, "lm", None, torch.device("cpu"))
    names = [name for name, _ in expert_layers(model)]
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    params = expert_params(model)
    assert set(params) == {f"{n}.{leaf}" for n in names for leaf in ("gate_up_proj", "down_proj")}
    # not spread: transformers' own forward, bit for bit
    experts = model.get_submodule(names[0])
    hidden = torch.randn(10, 32)
    index = torch.randint(0, 4, (10, 2))
    weights = torch.rand(10, 2)
    torch.testing.assert_close(experts(hidden, index, weights),
                               type(experts).forward(experts, hidden, index, weights),
                               rtol=0, atol=0)


def test_experts_laid_out_otherwise_are_refused_naming_the_layout() -> None:
    """A layout the pass does not compute (here biases) is one ConfigError naming the
    module and what differs, before any mesh is made."""
    from ddptrain.models.hf_moe import adopt_experts
    from ddptrain.parallel.ep import expert_parallel

    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(_mixtral_config())
    model.model.layers[1].mlp.experts.has_bias = True
    assert adopt_experts(model) == 1
    ctx = DistributedContext(rank=0, local_rank=0, world_size=2, device=torch.device("cpu"),
                             backend="gloo")
    with pytest.raises(ConfigError) as caught:
        expert_parallel(model, ctx, 2)
    assert "MixtralExperts (has_bias=True)" in str(caught.value)
    assert "--strategy fsdp" in str(caught.value)


@pytest.mark.slow
def test_ep_on_two_ranks_trains_a_mixtral_and_a_qwen3_as_ddp_and_exports_whole_experts(
    tmp_path: Path,
) -> None:
    """2 ranks, SGD with momentum, clipping and 2-step accumulation: `--ep 2` (2 of the 4
    experts a rank, the tokens' rows exchanged with all-to-all) under ddp and under fsdp
    ends within 1e-5 of ddp for Hugging Face's Mixtral and Qwen3-MoE; the ep run's
    `model.safetensors` holds each expert tensor whole under its HF name, its `hf/` loads
    with transformers, and its DCP step of mid-epoch resumes on one process (every expert
    whole there) and ends as it does."""
    from dist_utils import run_ranks
    from nd_workers import fit_runs
    from safetensors.torch import load_file

    models = {"mixtral": _mixtral(tmp_path / "mixtral"),
              "qwen3moe": _qwen3moe(tmp_path / "qwen3moe")}
    layouts = {"ddp": {}, "ep": {"ep": 2, "save_every_steps": 2},
               "ep_fsdp": {"ep": 2, "strategy": "fsdp"}}
    runs = [dict(RUN, model=f"hf:{directory}", output_dir=str(tmp_path / layout / name),
                 **fields)
            for layout, fields in layouts.items() for name, directory in models.items()]
    results = run_ranks(fit_runs, 2, tmp_path, runs)[0]
    at = {(layout, name): results[i * len(models) + j]
          for i, layout in enumerate(layouts) for j, name in enumerate(models)}
    got = {run: result["weights"] for run, result in at.items()}
    worst = 0.0
    for name in models:
        want = got["ddp", name]
        # each ep rank held half of the experts (2 layers x 2 experts fewer)
        held = {layout: at[layout, name]["bytes"]["params"] for layout in ("ddp", "ep")}
        inner = 64 if name == "mixtral" else 32
        assert held["ddp"] - held["ep"] == 2 * 2 * 3 * inner * 32 * 4
        for layout in ("ep", "ep_fsdp"):
            assert got[layout, name].keys() == want.keys()
            for key, value in want.items():
                torch.testing.assert_close(got[layout, name][key], value, rtol=0, atol=1e-5,
                                           msg=f"{layout} {name} {key}")
                worst = max(worst, float((got[layout, name][key] - value).abs().max()))
        key = "model.layers.0.mlp.experts.gate_up_proj"
        # training moved the experts: the comparison is not of untouched weights
        start = transformers.AutoModelForCausalLM.from_pretrained(models[name])
        assert not torch.equal(start.get_parameter(key).detach(), want[key])
        exported = load_file(str(tmp_path / "ep" / name / "model.safetensors"))
        assert exported[key].shape == (4, 2 * inner, 32)
        torch.testing.assert_close(exported[key], got["ep", name][key], rtol=0, atol=0)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ep" / name / "hf")
        torch.testing.assert_close(back.get_parameter(key).detach(), got["ep", name][key],
                                   rtol=0, atol=0)
    print(f"ep vs ddp: max weight difference {worst:.3g}")
    # the ep run's DCP step of mid-epoch resumes on one process, every expert whole there
    first = sorted((tmp_path / "ep" / "mixtral" / "checkpoints").glob("step_*"))[0]
    assert first.name.endswith("2")  # of 4 steps
    (one,) = run_ranks(fit_runs, 1, tmp_path, [dict(
        RUN, model=f"hf:{models['mixtral']}", output_dir=str(tmp_path / "one"),
        resume_from=str(first), batch_size=16)])
    for key, value in got["ep", "mixtral"].items():
        torch.testing.assert_close(one[0]["weights"][key], value, rtol=0, atol=1e-5, msg=key)


def test_ep_without_experts_is_refused_before_the_process_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--ep on a model without a mixture (a dense Llama, the GPT without experts) or with
    experts ep does not divide: one line from the config.json or the flags, before any
    process group or model is built (a plain `resolve_run` on one process here; the
    check does not depend on the world)."""
    from ddptrain.models.factory import ModelShape
    from ddptrain.parallel.resolve import check_experts

    dense = tmp_path / "dense"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(dense)
    mixtral = _mixtral(tmp_path / "mixtral")
    cases = [
        (3, "gpt", None, {}, "--ep 3 needs a mixture of experts and --model gpt has none"),
        (3, "gpt", None, {"experts": 4}, "--ep 3 does not divide the 4 experts of --model gpt"),
        (2, f"hf:{dense}", dense, {}, "(llama) has none"),
        (3, f"hf:{mixtral}", mixtral, {}, "does not divide the 4 experts of --model hf:"),
    ]
    for ep, name, directory, args, message in cases:
        config = TrainingConfig(output_dir="unused", model=name, model_args=args, ep=ep)
        with pytest.raises(ConfigError) as caught:
            check_experts(config, ModelShape(name, 4, 2, directory))
        assert message in str(caught.value), caught.value
    config = TrainingConfig(output_dir="unused", model=f"hf:{mixtral}", ep=2)
    check_experts(config, ModelShape(f"hf:{mixtral}", 4, 2, mixtral))  # 2 of 4 a rank
    # the command checks the layout as it resolves the run, before anything is built: one
    # process has no expert group of 2
    from ddptrain.cli import main

    run = tmp_path / "run"
    assert main(["train", "--model", f"hf:{mixtral}", "--dataset", "hfplug:counting_windows",
                 "--ep", "2", "--checkpoint_format", "dcp", "--output_dir", str(run)]) == 2
    assert "--ep 2 does not divide the 1 data-parallel ranks of 1" in capsys.readouterr().err
    assert not run.exists()
