"""`--lora_rank`: adapters through peft on a frozen model (`parallel.lora`).

Single-process runs (fast tier): the frozen base stays bit for bit, the adapters train,
the merge equals peft's own, the adapter directory loads with `PeftModel.from_pretrained`
and gives the run's outputs, a resume goes on bit for bit, and what cannot combine is one
line. 2 ranks (slow tier): ddp and fsdp train the same adapters, and tp and pp those of
one process.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ddptrain import fit
from ddptrain.checkpoint.export import checkpoint_model_state
from ddptrain.config import TrainingConfig
from ddptrain.errors import ConfigError
from ddptrain.models.gpt import build_gpt
from ddptrain.parallel.lora import LoraSpec, add_lora, is_adapter, merged, transposed
from tests.dist_utils import run_ranks
from tests.workers import train_and_report

GPT = dict(dataset="chars", model="gpt", width=32, block_size=16, batch_size=64, seed=3,
           optimizer="sgd", lr=0.2, max_grad_norm=1.0, tensorboard=False, curves=False,
           synthetic_size=256, lora_rank=4, lora_alpha=8.0)


def _gpt(vocab: int, block: int = 16, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(3)
    return build_gpt(vocab, block, width)


def _state(run: Path) -> dict[str, torch.Tensor]:
    (ckpt,) = sorted((run / "checkpoints").glob("step_*.pt"))[-1:]
    return checkpoint_model_state(ckpt)


def test_the_base_stays_frozen_the_adapters_train_and_the_merge_is_pefts(tmp_path: Path) -> None:
    import peft

    fit(TrainingConfig(output_dir=str(tmp_path / "run"), epochs=1, **GPT))
    state = _state(tmp_path / "run")
    adapters = {k: v for k, v in state.items() if is_adapter(k)}
    assert adapters and all(".blocks." in f".{k}" for k in adapters)
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0
               for k, v in adapters.items()), "the adapters did not train (B is still 0)"
    # the base: the seeded model's own weights, bit for bit, under the wrapped names
    vocab = state["wte.weight"].shape[0]
    fresh = _gpt(vocab).state_dict()
    for name, value in state.items():
        if not is_adapter(name):
            assert torch.equal(value, fresh[name.replace(".base_layer.", ".")]), name
    # model.safetensors is the merge, equal to peft's merge_and_unload of the same layers
    spec = LoraSpec(names=tuple(sorted({k.split(".lora_")[0] for k in adapters})), rank=4,
                    alpha=8.0)
    model = _gpt(vocab)
    add_lora(model, spec)
    model.load_state_dict(state)
    for module in model.modules():  # merged by peft, layer by layer
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()
    reference = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()
                 if not is_adapter(k)}
    ours = merged(state, spec)
    exported = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6)
        if name in exported:  # tied weights are stored once
            assert torch.equal(exported[name], ours[name]), name


def test_the_adapter_directory_loads_with_peft_and_gives_the_runs_outputs(
    tmp_path: Path,
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    base_dir = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=20, n_positions=32, n_embd=32, n_layer=2,
                               n_head=2)).save_pretrained(base_dir)
    run = tmp_path / "run"
    fit(TrainingConfig(
        output_dir=str(run), dataset="tests.hfplug:counting", model=f"hf:{base_dir}",
        epochs=2, batch_size=16, optimizer="adamw", lr=0.01, tensorboard=False,
        curves=False, lora_rank=2,
    ))
    ids = torch.arange(12).reshape(2, 6) % 20
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                      run / "adapter").eval()
    exported = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        want = exported(ids).logits
        torch.testing.assert_close(tuned(ids).logits, want, rtol=0, atol=1e-5)
        assert not torch.allclose(base(ids).logits, want, atol=1e-3)  # it did train
    # GPT-2's Conv1D stores its weight (in, out): the merge transposes B @ A for it
    assert transposed(base) >= {"transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"}
    _exports_as_the_run(run, tmp_path / "out")  # export of its checkpoint merges them alike


def _exports_as_the_run(run: Path, out: Path) -> None:
    """`ddptrain export` of the run's final checkpoint is the run's merged
    `model.safetensors` (names and tensors), and with --adapter_only its `adapter/`."""
    import json

    from ddptrain.cli import main

    final = str(next(p for p in (run / "checkpoints" / n for n in ("latest.pt", "latest"))
                     if p.exists()))  # a .pt file, or the pointer to a step directory
    assert main(["export", final, str(out / "model.safetensors")]) == 0
    exported = load_file(str(out / "model.safetensors"))
    own = load_file(str(run / "model.safetensors"))
    with safe_open(str(run / "model.safetensors"), "pt") as f:  # {alias: kept name}
        ties = {k[len("tied:"):]: v for k, v in (f.metadata() or {}).items()
                if k.startswith("tied:")}
    # a step directory keeps no tie: its copy of the tied head is written too, equal
    twice = {a: k for a, k in ties.items() if a in exported}
    assert exported.keys() - twice.keys() == own.keys() and not any(map(is_adapter, exported))
    for name, value in {**own, **{a: own[k] for a, k in twice.items()}}.items():
        assert torch.equal(exported[name], value), name
    assert main(["export", final, str(out / "adapter"), "--adapter_only"]) == 0
    exported, own = (load_file(str(d / "adapter_model.safetensors"))
                     for d in (out / "adapter", run / "adapter"))
    assert exported.keys() == own.keys() and own
    assert all(torch.equal(exported[k], own[k]) for k in own)
    configs = [json.loads((d / "adapter_config.json").read_text())
               for d in (out / "adapter", run / "adapter")]
    for config in configs:  # peft keeps the targets as a set: written in any order
        config["target_modules"] = sorted(config["target_modules"])
    assert configs[0] == configs[1]


@pytest.mark.parametrize("kind", ["file", "dcp"])
def test_export_of_a_lora_checkpoint_is_the_runs_merged_model_and_adapter(
    tmp_path: Path, kind: str,
) -> None:
    fit(TrainingConfig(output_dir=str(tmp_path / "run"), epochs=1, checkpoint_format=kind, **GPT))
    _exports_as_the_run(tmp_path / "run", tmp_path / "out")


def _resumed_bit_for_bit(tmp_path: Path, fields: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A 2-epoch run, and its own first-epoch checkpoint resumed in another directory:
    both end with the same state, bit for bit, which is returned."""
    fit(TrainingConfig(output_dir=str(tmp_path / "whole"), epochs=2, **fields))
    first = sorted((tmp_path / "whole" / "checkpoints").glob("step_*.pt"))[0]
    fit(TrainingConfig(output_dir=str(tmp_path / "cut"), epochs=2, resume_from=str(first),
                       **fields))
    whole, cut = _state(tmp_path / "whole"), _state(tmp_path / "cut")
    assert whole.keys() == cut.keys()
    for name in whole:
        assert torch.equal(whole[name], cut[name]), name
    return whole


def test_a_resumed_lora_run_goes_on_bit_for_bit(tmp_path: Path) -> None:
    _resumed_bit_for_bit(tmp_path, GPT)


def test_qlora_trains_on_a_4_bit_base_resumes_bit_for_bit_and_exports_its_merge(
    tmp_path: Path
) -> None:
    """`--lora_quantize nf4`: the adapted layers' frozen weights are the seeded model's
    in 4-bit NormalFloat (a checkpoint holds them dequantized: not the fp32 weights, the
    4-bit ones); a resume from the first epoch's checkpoint makes the same 4-bit base
    again and ends bit for bit like the run; `model.safetensors` is the dequantized base
    plus the adapters."""
    import math

    from torchao.quantization import to_nf4

    whole = _resumed_bit_for_bit(tmp_path, {**GPT, "lora_quantize": "nf4"})
    fresh = _gpt(whole["wte.weight"].shape[0]).state_dict()
    bases = [k for k in whole if k.endswith(".base_layer.weight")]
    assert bases
    for name in bases:
        plain = fresh[name.replace(".base_layer.", ".")]
        four_bit = to_nf4(plain, 64, math.gcd(plain.numel() // 64, 256)).get_original_weight()
        assert torch.equal(whole[name], four_bit) and not torch.equal(four_bit, plain), name
    spec = LoraSpec(names=tuple(k.removesuffix(".base_layer.weight") for k in bases), rank=4,
                    alpha=8.0)
    exported, merge = load_file(str(tmp_path / "whole" / "model.safetensors")), merged(whole, spec)
    assert {n.replace(".base_layer.", ".") for n in bases} <= exported.keys()
    for name, value in exported.items():  # the tied head is stored once, as wte
        torch.testing.assert_close(value, merge[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("fields", [
    {"lora_rank": 4}, {"lora_rank": 4, "lora_quantize": "nf4"},
    {"lora_rank": 0, "lora_alpha": None, "freeze": ["blocks.0.*"]},
], ids=["lora", "qlora", "freeze"])
def test_the_dry_runs_bytes_per_rank_are_what_the_run_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any]
) -> None:
    """`--dry_run`'s memory line counts the run as it trains: gradients and AdamW state of
    the adapters (or what `--freeze` leaves) alone, the base as it is held (nf4: its 4-bit
    bytes), equal to the real run's strategy's own figures (`rank_bytes`)."""
    import ddptrain.train

    plans: list[Any] = []
    plain = ddptrain.train.format_plan
    monkeypatch.setattr(ddptrain.train, "format_plan",
                        lambda plan, config: plans.append(plan) or plain(plan, config))
    job = {**GPT, "optimizer": "adamw", "epochs": 1, "batch_size": 512, **fields}
    assert fit(TrainingConfig(output_dir=str(tmp_path / "dry"), dry_run=True, **job)) == {
        "dry_run": True}
    (plan,) = plans
    held = fit(TrainingConfig(output_dir=str(tmp_path / "run"), **job))["rank0_bytes"]
    assert plan.rank_bytes == held
    assert held["grads"] < held["params"] and held["optimizer"] == 2 * held["grads"]


def test_init_from_a_plain_model_fills_the_wrapped_layers(tmp_path: Path) -> None:
    plain = {k: v for k, v in GPT.items() if not k.startswith("lora_")}
    fit(TrainingConfig(output_dir=str(tmp_path / "plain"), epochs=1, **plain))
    source = load_file(str(tmp_path / "plain" / "model.safetensors"))
    fit(TrainingConfig(output_dir=str(tmp_path / "tuned"), epochs=1,
                       init_from=str(tmp_path / "plain"), **{**GPT, "lr": 0.0}))
    state = _state(tmp_path / "tuned")
    wrapped = [k for k in state if ".base_layer." in k]
    assert wrapped
    for name in wrapped:
        assert torch.equal(state[name], source[name.replace(".base_layer.", ".")]), name


@pytest.mark.parametrize(("fields", "message"), [
    ({"lora_rank": 4, "float8": "tensorwise"}, "--lora_rank with --float8 is unsupported"),
    ({"lora_alpha": 16.0}, "--lora_alpha 16.0 is invalid: it shapes the adapters of --lora_rank"),
    ({"lora_rank": 4, "lora_dropout": 1.0}, "use a probability in [0, 1)"),
    ({"lora_quantize": "nf4"}, "--lora_quantize 'nf4' is invalid: it shapes the adapters"),
    ({"lora_rank": 4, "lora_quantize": "nf4", "strategy": "fsdp"},
     "--lora_quantize nf4 with --strategy fsdp is unsupported"),
    ({"lora_rank": 4, "lora_quantize": "nf4", "tp": 2}, "--lora_quantize nf4 with --tp is"),
])
def test_what_does_not_combine_is_one_line(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        TrainingConfig(output_dir="unused", **fields).validate()
    assert message in str(caught.value)


def test_a_target_that_is_not_a_linear_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        fit(TrainingConfig(output_dir=str(tmp_path / "run"), epochs=1,
                           lora_targets=["blocks.*.ln_1"], **GPT))
    assert "matches 'blocks.0.ln_1', a LayerNorm: LoRA adapts linear layers" in str(
        caught.value)


@pytest.mark.slow
def test_ddp_and_fsdp_train_the_same_adapters(tmp_path: Path) -> None:
    ends = {}
    for strategy in ("ddp", "fsdp"):
        cfg = dict(GPT, output_dir=str(tmp_path / strategy), epochs=1, strategy=strategy,
                   batch_size=16)
        ranks = run_ranks(train_and_report, 2, tmp_path, cfg)
        ends[strategy] = ranks[0]["weights"]
    ddp, fsdp = ends["ddp"], ends["fsdp"]
    assert ddp.keys() == fsdp.keys() and any(is_adapter(k) for k in ddp)
    for name in ddp:
        torch.testing.assert_close(fsdp[name], ddp[name], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_tp_trains_the_adapters_one_process_trains(tmp_path: Path) -> None:
    """Under --tp 2 each adapted layer's base and its lora_B (column splits) or lora_A (row
    splits) are split like the layer, the other adapter whole: the run ends with the
    weights of one process with the same batch, the base untouched."""
    # 8 steps: the split layers sum their products in another order, which LoRA's
    # dynamics amplify past 1e-5 over an epoch of small batches (6e-6 by step 21 of 127)
    one = dict(GPT, output_dir=str(tmp_path / "one"), epochs=1, batch_size=256)
    fit(TrainingConfig(**one))
    reference = _state(tmp_path / "one")
    ranks = run_ranks(train_and_report, 2, tmp_path,
                      dict(one, output_dir=str(tmp_path / "tp"), tp=2))
    got = ranks[0]["weights"]
    assert got.keys() == reference.keys() and any(is_adapter(k) for k in got)
    for name, value in reference.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)
    assert any(not torch.equal(got[k], 0 * got[k]) for k in got if ".lora_B." in k)


@pytest.mark.slow
def test_pp_trains_the_adapters_one_process_trains(tmp_path: Path) -> None:
    """Under --pp 2 each stage holds its blocks' adapters: the exported adapters and the
    merged weights are those of one process with the same batch."""
    from tests.conftest import run_torchrun

    job = ["train", "--dataset", "chars", "--model", "gpt", "--width", "32",
           "--block_size", "16", "--batch_size", "256", "--optimizer", "sgd", "--lr", "0.2",
           "--max_grad_norm", "1.0", "--lora_rank", "4", "--lora_alpha", "8", "--epochs", "1",
           "--seed", "3", "--no-tensorboard", "--no-curves"]
    fit(TrainingConfig(**{**GPT, "batch_size": 256, "epochs": 1,
                          "output_dir": str(tmp_path / "one")}))
    done = run_torchrun(2, [*job, "--pp", "2", "--output_dir", str(tmp_path / "pp")],
                        cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # the plan: the adapters' bytes rank 0 holds (its stage's half)
    held = re.search(r"trained +([\d,]+) parameters \(([\d.]+) (B|KiB) of them on rank 0\)",
                     done.stdout + done.stderr)
    assert held is not None, done.stdout[-3000:]
    on_rank0 = float(held[2]) * (1024 if held[3] == "KiB" else 1)
    assert 0 < on_rank0 < 0.75 * 4 * int(held[1].replace(",", "")), held[0]
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(str(tmp_path / "one" / name)), load_file(str(tmp_path / "pp" / name))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.slow
def test_qlora_on_two_ddp_ranks_trains_the_adapters_one_process_trains(tmp_path: Path) -> None:
    """`--lora_quantize nf4` under ddp: each rank quantizes the same base (after DDP's
    broadcast of the plain weights), and the adapters end as one process's with the
    same global batch in the same micro-batches (to 1e-9 measured). Against one process
    at batch 32 the NF4 run ends up to 5e-3 apart (1.6e-6 without NF4), and so does one
    process at 16 x 2 steps of accumulation: the gap is the batch's, not the ranks'. NF4's
    linear gives a batch's rows bit for bit whole or split; what differs is float32's
    rounding of a sum in another order, which this NF4 run amplifies: the same run with
    its learning rate x (1 + 1e-6) ends 2.2e-2 apart, where the plain base's ends 3.1e-4
    apart (64 steps)."""
    qlora = dict(GPT, epochs=1, lora_quantize="nf4", batch_size=16)
    (two,) = run_ranks(train_and_report, 2, tmp_path,
                       dict(qlora, output_dir=str(tmp_path / "ddp")))[:1]
    (one,) = run_ranks(train_and_report, 1, tmp_path,
                       dict(qlora, output_dir=str(tmp_path / "one"), grad_accum_steps=2))
    assert two["weights"].keys() == one["weights"].keys()
    for name, value in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], value, rtol=0, atol=1e-5, msg=name)
