"""Mixtures of experts: the built-in GPT's (`--model_args experts=E top_k=K`,
`ddptrain.models.moe`) and Hugging Face's Mixtral and Qwen3-MoE built from a config.

One process (fast tier): the layer equals the dense computation of each token's chosen
experts, in the grouped GEMM (no host read) and in the loop over experts; a run logs each
expert's token slots per layer, which sum to the tokens times top_k; the routers'
balancing loss trains (`--moe_aux_weight`) while the rows' loss stays the task's; a resume
goes on bit for bit; what does not combine is one line. 2 ranks (slow tier): fsdp,
`--ep` (under ddp and fsdp) and `--tp` end with ddp's weights, and an `--ep` DCP step
resumes on one process. Heavy: on 4 ranks `--ep` over groups of ranks (ddp, fsdp, and
fsdp x `--tp`) and HSDP end with ddp's weights; an `--ep` run SIGKILLed mid-epoch resumes
bit for bit. The balancing loss of the global micro-batch against one process:
`test_moe_global`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from ddptrain import fit
from ddptrain.config import TrainingConfig
from ddptrain.errors import ConfigError
from ddptrain.models.moe import MoE

GPT = dict(dataset="chars", model="gpt", model_args={"experts": 4, "top_k": 2}, width=32,
           block_size=16, batch_size=32, seed=3, optimizer="sgd", lr=0.2, momentum=0.9,
           max_grad_norm=1.0, tensorboard=False, curves=False, synthetic_size=256,
           log_interval=1)


@pytest.mark.parametrize(("width", "reads"), [(8, []), (6, ["tolist"])])
def test_the_layer_is_the_dense_sum_of_each_tokens_chosen_experts(
    width: int, reads: list[str],
) -> None:
    """Widths of 16 bytes in bf16 (8) take the grouped GEMM, which reads nothing on the
    host; others (6) the loop over experts, which reads the group sizes once."""
    from bench.host_reads import HostReads

    torch.manual_seed(0)
    moe = MoE(width=width, hidden=2 * width, experts=4, top_k=2)
    with torch.no_grad():
        moe.b_in.normal_()
        moe.b_out.normal_()
    x = torch.randn(3, 5, width)
    with HostReads() as counted:
        got = moe(x)
        got.sum().backward()  # every expert that got a token has a gradient
    assert [r.split(" at ")[0] for r in counted.reads[-1]] == reads
    aux, counts, prob_sums = moe.last  # type: ignore[misc]
    flat = x.reshape(-1, width)
    probs = F.softmax(moe.router(flat), dim=-1)
    want = torch.zeros_like(flat)
    chosen_all = []
    for i, token in enumerate(flat):
        p, chosen = probs[i].topk(2)
        chosen_all += chosen.tolist()
        for w, e in zip(p / p.sum(), chosen.tolist(), strict=True):
            want[i] += w * (F.gelu(token @ moe.w_in[e] + moe.b_in[e]) @ moe.w_out[e]
                            + moe.b_out[e])
    torch.testing.assert_close(got.reshape(-1, width), want, rtol=0, atol=1e-6)
    assert counts.tolist() == [chosen_all.count(e) for e in range(4)]
    assert int(counts.sum()) == 15 * 2
    share = counts.float() / 30
    torch.testing.assert_close(aux, 4 * (share * probs.mean(0)).sum())
    torch.testing.assert_close(prob_sums, probs.sum(0))  # the global loss's local part
    assert moe.w_in.grad is not None
    used = counts > 0
    assert (moe.w_in.grad[used].abs().sum((1, 2)) > 0).all()


def _as_ddp(runs: Path, ddp: dict[str, Any], others: dict[str, dict[str, Any]]) -> None:
    """Each of `others` (`fit_runs` results, their run directories under `runs` by name)
    ended within 1e-5 of `ddp`'s weights, its rows counting the same tokens per expert."""
    for name, got in others.items():
        assert got["weights"].keys() == ddp["weights"].keys()
        for key, value in ddp["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, rtol=0, atol=1e-5,
                                       msg=f"{name} {key}")
        assert [r["expert_tokens"] for r in _rows(runs / name)] == [
            r["expert_tokens"] for r in _rows(runs / "ddp")]


def _rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "train" and "expert_tokens" in r]


def test_a_run_logs_each_experts_tokens_and_trains_the_routers_balance(tmp_path: Path) -> None:
    fit(TrainingConfig(output_dir=str(tmp_path / "moe"), epochs=1, **GPT))
    rows = _rows(tmp_path / "moe")
    assert len(rows) >= 30
    for row in rows:
        layers = row["expert_tokens"]
        assert len(layers) == 2 and all(len(layer) == 4 for layer in layers)
        # 2 blocks, each sending each of the interval's tokens to 2 experts
        assert [sum(layer) for layer in layers] == [row["tokens"] * 2] * 2, row
        assert row["expert_tokens_min"] == min(min(layer) for layer in layers)
        assert row["expert_tokens_max"] == max(max(layer) for layer in layers)
        assert 1.0 <= row["router_aux"] < 4.0  # 1: even; 4 (experts): one expert takes all
    # the balancing loss trains the routers, and only the rows' router_aux shows it
    fit(TrainingConfig(output_dir=str(tmp_path / "off"), epochs=1,
                       **{**GPT, "moe_aux_weight": 0.0}))
    off = _rows(tmp_path / "off")
    assert off[0]["loss"] == rows[0]["loss"]  # the first step's: the task's loss alone
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("moe", "off"))
    assert not torch.equal(a["blocks.0.mlp.router.weight"], b["blocks.0.mlp.router.weight"])


def test_a_resumed_run_goes_on_bit_for_bit(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    fit(TrainingConfig(output_dir=str(tmp_path / "whole"), epochs=2, **GPT))
    first = sorted((tmp_path / "whole" / "checkpoints").glob("step_*.pt"))[0]
    fit(TrainingConfig(output_dir=str(tmp_path / "cut"), epochs=2, resume_from=str(first),
                       **GPT))
    whole, cut = (load_file(str(tmp_path / r / "model.safetensors")) for r in ("whole", "cut"))
    assert whole.keys() == cut.keys() and any(".w_in" in k for k in whole)
    for name in whole:
        assert torch.equal(whole[name], cut[name]), name


@pytest.mark.parametrize(("fields", "message"), [
    ({"pp": 2}, "--model gpt with experts under --pp is not supported yet"),
    ({"tp": 2, "sequence_parallel": True}, "--sequence_parallel with the built-in GPT's experts"),
    ({"model_args": {"experts": 1}}, "a mixture needs at least 2 experts"),
    ({"model_args": {"experts": 4, "top_k": 5}}, "1 <= top_k <= experts"),
    ({"model_args": {"expert": 4}}, "--model gpt takes no --model_args but experts, top_k"),
    ({"model": "mlp", "dataset": "digits"}, "--model mlp takes no --model_args"),
])
def test_what_does_not_combine_is_one_line(
    fields: dict[str, Any], message: str, tmp_path: Path
) -> None:
    from ddptrain.data.sources import load_data
    from ddptrain.models import create_model

    config = TrainingConfig(output_dir=str(tmp_path), **{**GPT, **fields})
    data = load_data(config)
    with pytest.raises(ConfigError) as caught:
        create_model(config, data, data.facts.vocab_size or 10, torch.device("meta"))
    assert message in str(caught.value)


@pytest.mark.parametrize(("fields", "message"), [
    ({"ep": 2, "strategy": "zero"}, "--ep 2 runs under --strategy ddp or fsdp (with --tp"),
    ({"ep": 2, "pp": 2, "strategy": "fsdp"}, "drop --ep, or --pp, --dp_replicate and zero"),
    ({"ep": 2, "checkpoint_format": "file"}, "use --checkpoint_format dcp (or auto)"),
])
def test_expert_parallelism_that_does_not_combine_is_one_line(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        TrainingConfig(output_dir="unused", **{**GPT, **fields}).validate()
    assert message in str(caught.value)


@pytest.mark.slow
def test_fsdp_ends_with_ddps_weights_for_the_gpts_mixtrals_and_qwen3s_experts(
    tmp_path: Path,
) -> None:
    """2 ranks, SGD with momentum, clipping and 2-step accumulation: fsdp shards the
    experts' batched weights (dimension 0, the experts) and ends within 1e-5 of ddp. The
    Mixtral and the Qwen3-MoE are Hugging Face's, built from a config (their experts
    fused by transformers)."""
    transformers = pytest.importorskip("transformers")
    from dist_utils import run_ranks
    from nd_workers import fit_runs

    transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
    )).save_pretrained(tmp_path / "mixtral")
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0,
    )).save_pretrained(tmp_path / "qwen3moe")
    hf = dict(GPT, dataset="hfplug:counting_windows", model_args={}, batch_size=8)
    runs = {name: dict(cfg, epochs=1, grad_accum_steps=2, batch_size=8, synthetic_size=128)
            for name, cfg in (("gpt", GPT),
                              ("mixtral", dict(hf, model=f"hf:{tmp_path / 'mixtral'}")),
                              ("qwen3moe", dict(hf, model=f"hf:{tmp_path / 'qwen3moe'}")))}

    def layout(strategy: str) -> list[dict[str, Any]]:
        return [dict(cfg, strategy=strategy, output_dir=str(tmp_path / strategy / name))
                for name, cfg in runs.items()]

    ddp = run_ranks(fit_runs, 2, tmp_path, layout("ddp"))[0]
    fsdp = run_ranks(fit_runs, 2, tmp_path, layout("fsdp"))[0]
    for name, want, got in zip(runs, ddp, fsdp, strict=True):
        assert got["weights"].keys() == want["weights"].keys(), name
        for key, value in want["weights"].items():
            torch.testing.assert_close(got["weights"][key], value, rtol=0, atol=1e-5,
                                       msg=f"{name} {key}")


@pytest.mark.parametrize(("fields", "world", "label", "params"), [
    # 1,000 parameters, 600 of them experts; fp32 bytes of parameters on rank 0
    ({"ep": 2}, 2, "ddp; ep 2 over dp", 4 * (400 + 300)),  # half the experts
    ({"ep": 2, "strategy": "fsdp"}, 4, "fsdp; ep 2 over dp", 4 * 1000 // 4),  # a 4th of all
    # the tp ranks of an expert group hold the same experts: 1,600 over 4 ranks
    ({"ep": 2, "strategy": "fsdp", "tp": 2}, 4, "fsdp; dp_shard 2 x tp 2; ep 2 over dp",
     4 * 1600 // 4),
    ({}, 2, "ddp", 4 * 1000),
])
def test_the_plan_names_where_the_experts_live_and_counts_their_share(
    fields: dict[str, Any], world: int, label: str, params: int
) -> None:
    """The layout the plan (and the dry run) prints and summary.json's "layout" say
    --ep, and the bytes per rank count each rank's share of the experts (the slow ep test
    reads the layout in summary.json, the 2-rank dry run the bytes)."""
    from ddptrain.parallel import resolve_strategy
    from ddptrain.train.plan import format_plan, make_plan

    config = TrainingConfig(output_dir="unused", **{**GPT, **fields})
    choice = resolve_strategy(config, world, "cpu")
    assert choice.label == label
    data = type("Data", (), {"train": range(64), "facts": type("F", (), {
        "num_classes": None})()})()
    plan = make_plan(config, data, world, "cpu", "gloo", "float32", "lm", 1000, choice,
                     experts=(600, 0))
    assert f"world size      {world} ({label})" in format_plan(plan, config)
    assert plan.rank_bytes is not None and plan.rank_bytes["params"] == params


@pytest.mark.slow
def test_a_dry_run_on_two_ranks_plans_half_the_experts_a_rank(tmp_path: Path) -> None:
    """`--dry_run --ep 2` under torchrun: the plan names the layout and holds half the
    experts' bytes on rank 0, against ddp's whole."""
    from conftest import run_torchrun

    flags = ["train", "--dataset", "chars", "--model", "gpt", "--model_args", "experts=4",
             "top_k=2", "--width", "32", "--block_size", "16", "--dry_run",
             "--checkpoint_format", "dcp"]
    said = {}
    for name, extra in (("ep", ["--ep", "2"]), ("ddp", [])):
        done = run_torchrun(2, [*flags, *extra, "--output_dir", str(tmp_path / name)],
                            tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        said[name] = done.stdout
    assert "world size      2 (ddp; ep 2 over dp)" in said["ep"]
    experts = [line for line in said["ep"].splitlines() if line.startswith("experts ")]
    assert experts and "of them on rank 0" in experts[0]

    def params(text: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith("memory "))
        value, unit = line.split("params ")[1].split(",")[0].split()
        return float(value) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]

    # the GPT's experts are most of its weights: ep's rank holds well under ddp's
    assert params(said["ep"]) < 0.75 * params(said["ddp"])


@pytest.mark.slow
def test_experts_spread_over_two_ranks_train_as_ddp_and_resume_on_one(tmp_path: Path) -> None:
    """`--ep 2` on 2 ranks (2 of the 4 experts a rank, tokens exchanged with all-to-all;
    SGD with momentum, clipping, 2-step accumulation) ends within 1e-5 of ddp, where every
    rank holds every expert, and so do `--ep 2` under fsdp (one expert group: the experts'
    own FSDP unit has no other rank) and `--tp 2` (each expert's hidden width split); the
    rows count the same tokens per expert. The ep run's DCP step of mid-epoch resumes on
    one process (every expert whole there) and ends as the ep run does (the balancing
    loss is the global micro-batch's: one process of 16 takes the one 2 ranks of 8 do),
    and `model.safetensors` holds each expert tensor whole."""
    from dist_utils import run_ranks
    from nd_workers import fit_runs
    from safetensors.torch import load_file

    # the default balancing loss, of the global micro-batch (`--moe_aux_scope global`):
    # the tp run's one data-parallel rank of 16 takes the one ddp's 2 ranks of 8 take
    run = dict(GPT, epochs=1, grad_accum_steps=2, batch_size=8, synthetic_size=128,
               checkpoint_format="dcp")
    ddp, ep, *others = run_ranks(fit_runs, 2, tmp_path, [
        dict(run, output_dir=str(tmp_path / "ddp")),
        dict(run, output_dir=str(tmp_path / "ep"), ep=2, save_every_steps=2),
        dict(run, output_dir=str(tmp_path / "fsdp"), ep=2, strategy="fsdp"),
        dict(run, output_dir=str(tmp_path / "tp"), tp=2, batch_size=16),
    ])[0]
    _as_ddp(tmp_path, ddp, dict(zip(("ep", "fsdp", "tp"), [ep, *others], strict=True)))
    assert ep["summary"]["layout"] == "ddp; ep 2 over dp"
    assert others[0]["summary"]["layout"] == "fsdp; ep 2 over dp"
    exported = load_file(str(tmp_path / "ep" / "model.safetensors"))
    assert exported["blocks.0.mlp.w_in"].shape == (4, 32, 128)
    torch.testing.assert_close(exported["blocks.0.mlp.w_in"], ep["weights"]["blocks.0.mlp.w_in"],
                               rtol=0, atol=0)
    first = sorted((tmp_path / "ep" / "checkpoints").glob("step_*"))[0]
    assert first.name.endswith("2")  # of 4 steps
    (one,) = run_ranks(fit_runs, 1, tmp_path, [dict(
        run, output_dir=str(tmp_path / "one"), resume_from=str(first), batch_size=16)])
    for key, value in ep["weights"].items():
        torch.testing.assert_close(one[0]["weights"][key], value, rtol=0, atol=1e-5, msg=key)


@pytest.mark.slow
@pytest.mark.heavy
def test_experts_over_part_of_the_ranks_or_split_by_tp_train_as_ddp(
    tmp_path: Path,
) -> None:
    """4 ranks as 2 expert groups of 2 (`dp_mod_ep 2 x ep 2`): `--ep 2` under ddp (the
    groups' expert gradients all-reduced once a window) and under fsdp (each expert's
    shard further split over the 2 ranks that hold it, the rest over all 4) and fsdp x
    `--tp 2` x `--ep 2` (the experts whole on the 2 data-parallel ranks of each tp index,
    the attention split over the tp ranks), and HSDP (2 replicas x 2 shards, no `--ep`)
    end within 1e-5 of ddp (SGD with momentum, clipping, 2-step accumulation), the rows
    counting the same tokens per expert. The balancing loss is the global micro-batch's
    in each: its counts summed over the data-parallel ranks (all 4; the 2 of a tp index;
    replicas and shards together), not over tp peers."""
    from dist_utils import run_ranks
    from nd_workers import fit_runs

    run = dict(GPT, epochs=1, grad_accum_steps=2, batch_size=8, synthetic_size=128)
    ddp, ep, fsdp, eptp, hsdp = run_ranks(fit_runs, 4, tmp_path, [
        dict(run, output_dir=str(tmp_path / "ddp")),
        dict(run, output_dir=str(tmp_path / "ep"), ep=2),
        dict(run, output_dir=str(tmp_path / "fsdp"), ep=2, strategy="fsdp"),
        dict(run, output_dir=str(tmp_path / "eptp"), tp=2, ep=2, strategy="fsdp",
             batch_size=16),
        dict(run, output_dir=str(tmp_path / "hsdp"), strategy="fsdp", dp_replicate=2),
    ])[0]
    _as_ddp(tmp_path, ddp, {"ep": ep, "fsdp": fsdp, "eptp": eptp, "hsdp": hsdp})


@pytest.mark.slow
@pytest.mark.heavy
def test_an_ep_run_killed_mid_epoch_resumes_bit_for_bit(tmp_path: Path) -> None:
    """`--ep 2` under torchrun: rank 1 SIGKILLs itself at its 7th training forward, the
    newest DCP step is the 5th (each rank wrote its experts); `--resume_from auto` ends
    with the uninterrupted run's weights and log, bit for bit."""
    from conftest import run_torchrun
    from procs import assert_bitwise, assert_same_log, sigkill_then_resume, weights

    job = ["train", "--dataset", "chars", "--model", "guardplug:killable_moe_gpt", "--width",
           "32", "--block_size", "16", "--batch_size", "32", "--epochs", "1", "--optimizer",
           "sgd", "--lr", "0.2", "--momentum", "0.9", "--max_grad_norm", "1.0", "--ep", "2",
           "--save_every_steps", "5", "--log_interval", "2", "--no-tensorboard", "--no-curves"]
    reference = tmp_path / "reference"
    done = run_torchrun(2, [*job, "--output_dir", str(reference)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    resumed = sigkill_then_resume(2, job, run, tmp_path, kill_at=7)
    assert "step 5" in resumed.stdout + resumed.stderr
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)
