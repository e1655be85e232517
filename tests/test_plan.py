"""`ddptrain plan`: the layouts a model fits on a cluster, their memory measured on fake
ranks (`train.probe`), ranked by a stated cost model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO

from ddptrain.launch.planner import Model, build_parser, candidates, main, plan

TINY = ["--model", "gpt", "--width", "128", "--block_size", "64", "--vocab_size", "4096",
        "--nodes", "1", "--gpus_per_node", "4", "--global_batch_size", "8"]


def test_the_layouts_follow_each_dimensions_rules() -> None:
    model = Model(None, heads=4, kv_heads=2, experts=0, parameters=10**6,
                  flops_per_sequence=1.0, width=128, layers=2)
    found = candidates(model, nodes=2, per_node=4, batch=16)
    layouts = {(c.strategy, c.dp_replicate, c.tp) for c in found}
    # tp inside a node and dividing the key/value heads (2): 1 or 2, never 4
    assert {t for _, _, t in layouts} == {1, 2}
    assert ("fsdp", 2, 1) in layouts and ("fsdp", 2, 2) in layouts  # HSDP: a replica a node
    assert ("ddp", 1, 2) not in layouts  # ddp does not compose with tp's data-parallel ranks
    for c in found:  # every candidate keeps the global batch
        assert c.micro * c.accum * (8 // c.tp) == 16
    experts = Model(None, 4, 4, 8, 10**6, 1.0, 128, 2)
    spread = {(c.strategy, c.ep) for c in candidates(experts, 1, 4, 16)}
    assert {e for s, e in spread if s == "fsdp"} == {1, 2, 4}  # dividing the 8 experts
    assert {e for s, e in spread if s != "fsdp"} == {1}


def test_long_sequences_are_also_planned_split_over_cp_ranks_of_a_node() -> None:
    """From `LONG_CONTEXT` tokens: cp 2 and 4 inside a node of 4, with tp where cp x tp
    divides the 4 heads and the node; ddp and zero only where nothing splits the model;
    the launch line names --cp. Below it: no cp candidate."""
    from ddptrain.launch.planner import LONG_CONTEXT

    model = Model(None, heads=4, kv_heads=4, experts=0, parameters=10**6,
                  flops_per_sequence=1.0, width=128, layers=2)
    assert {c.cp for c in candidates(model, 2, 4, 16, LONG_CONTEXT // 2)} == {1}
    found = candidates(model, nodes=2, per_node=4, batch=16, block_size=LONG_CONTEXT)
    layouts = {(c.strategy, c.tp, c.cp) for c in found}
    assert {(t, p) for _, t, p in layouts} == {(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)}
    assert ("ddp", 1, 4) in layouts and ("zero", 1, 2) in layouts
    assert ("ddp", 2, 2) not in layouts and ("fsdp", 2, 2) in layouts
    for c in found:  # the global batch kept over the data-parallel ranks
        assert c.micro * c.accum * c.layout(8).data_parallel == 16
    assert "--cp" in next(c for c in found if c.cp == 4).flags()


def test_a_budget_ddp_does_not_fit_drops_it_and_the_first_choice_is_a_launch_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ddptrain.launch.planner import _card, _model

    args = build_parser().parse_args([*TINY, "--gpu_memory", "1"])
    model = _model(args)
    everything, _ = plan(args, model, 4, 8, _card(args))
    peaks = {p.name: p.memory["total"] for p in everything}
    assert peaks["fsdp"] < peaks["ddp"]
    budget = (peaks["fsdp"] + peaks["ddp"]) / 2 / 0.9 / 2**30  # between them
    assert main([*TINY, "--gpu_memory", f"{budget}"]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "#" not in line]
    assert rows and not any("| ddp |" in row for row in rows)
    assert any("| fsdp |" in row for row in rows)
    launch = printed.split("first choice (add your --dataset):\n")[1].splitlines()[0].strip()
    assert launch.startswith("torchrun --nnodes 1 --nproc_per_node 4 -m ddptrain train ")
    # the line runs: its flags are train's own
    from ddptrain.config_cli import parse_config

    parse_config(launch.split(" train ", 1)[1].split())


@pytest.mark.parametrize(("extra", "message"), [
    (["--gpu", "B300"], "--gpu 'B300' is not in ddptrain's table"),
    (["--gpu_memory", "0.001"], "nothing fits 0.001 GiB a rank: the closest is"),
    (["--gpus_per_node", "3", "--global_batch_size", "2"], "no layout divides this world"),
])
def test_bad_input_is_one_line_and_exit_2(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str],
) -> None:
    from ddptrain.cli import main as cli

    assert cli(["plan", *TINY, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptrain: error: ") and message in err[0], err


def test_recompute_is_planned_where_a_micro_batch_fits_only_with_it() -> None:
    """fsdp on 4 ranks, 2 sequences a rank: without recompute only a micro-batch of 1
    fits the budget; block recompute fits 2 (selective saves too little here). Both are
    planned, each with its own flags; a mode is not tried where no recompute fits."""
    from ddptrain.launch.planner import _card, _model

    budget = 18.5e6 / 0.9 / 2**30
    args = build_parser().parse_args([
        "--model", "gpt", "--width", "256", "--block_size", "256", "--vocab_size", "512",
        "--nodes", "1", "--gpus_per_node", "4", "--global_batch_size", "8",
        "--gpu_memory", f"{budget}"])
    fits, over = plan(args, _model(args), 4, 8, _card(args))
    fsdp = {(p.candidate.recompute, p.candidate.micro) for p in fits
            if p.candidate.strategy == "fsdp" and p.candidate.tp == 1}
    assert fsdp == {("off", 1), ("block", 2)}
    tried = {(p.candidate.recompute, p.candidate.micro) for p in over
             if p.candidate.strategy == "fsdp" and p.candidate.tp == 1}
    assert tried == {("off", 2), ("selective", 2)}
    block = next(p for p in fits if p.candidate.recompute == "block")
    assert block.name == "fsdp, block recompute"
    assert block.candidate.flags()[-6:] == [
        "--activation_checkpointing", "block", "--batch_size", "2", "--grad_accum_steps", "1"]


def _llama(directory: Path, **fields: int) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 12,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
              "max_position_embeddings": 256, "tie_word_embeddings": False, **fields}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.slow
def test_a_deep_models_memory_extrapolated_from_two_depths_equals_it_measured_whole(
    tmp_path: Path,
) -> None:
    """A deep Llama's peak per rank, measured at 3 and 4 blocks and extrapolated (what
    makes a 70B plan take minutes), within 8 % of a step of all its blocks, for fsdp,
    fsdp x tp and block recompute on 8 fake ranks: a 12-block one, and a 24-block one
    whose peak moves with depth (at 3 blocks the logits' temporaries make it, at 24 the
    saved activations). The plan's first choice is measured at full depth."""
    import dataclasses

    from ddptrain.launch.planner import Candidate, lm_model, measure
    from ddptrain.observe.flops import count_flops

    args = build_parser().parse_args(["--block_size", "128", "--gpus_per_node", "8",
                                      "--global_batch_size", "16", "--gpu_memory", "1"])
    shallow = lm_model(f"hf:{_llama(tmp_path / 'a')}", {}, 512, 128, 0, count_flops)
    moving = lm_model(f"hf:{_llama(tmp_path / 'b', num_hidden_layers=24, vocab_size=4096)}",
                      {}, 4096, 128, 0, count_flops)
    assert shallow.deep and moving.deep
    for model in (shallow, moving):
        whole = dataclasses.replace(model, deep=False)
        for c in (Candidate("fsdp", 1, 1, 1, 2, 1), Candidate("fsdp", 1, 2, 1, 2, 1),
                  Candidate("fsdp", 2, 1, 1, 4, 1, "block")):
            guess, measured = measure(args, model, 8, c), measure(args, whole, 8, c)
            assert guess["total"] == pytest.approx(measured["total"], rel=0.08), c
    two = build_parser().parse_args(["--block_size", "128", "--gpus_per_node", "2",
                                     "--global_batch_size", "4", "--gpu_memory", "1"])
    fits, _ = plan(two, moving, 2, 4, (1.0, 989e12, 450.0, 50.0))
    first = fits[0]
    assert first.whole and not all(p.whole for p in fits[1:])
    assert first.memory == measure(two, dataclasses.replace(moving, deep=False), 2,
                                   first.candidate)


@pytest.mark.slow
def test_a_70b_llama_on_64_ranks_holds_between_steps_what_the_doctor_counts() -> None:
    """`examples/llama-70b` (its config.json alone: built on fake tensors, no weights)
    under fsdp on 8 x 8 ranks: the parameters, gradients and AdamW state a rank holds
    between steps, measured on fake ranks at 3 and 4 blocks and extrapolated to 80, agree
    with `ddptrain doctor`'s arithmetic within 15 %."""
    import torch

    from ddptrain.config import TrainingConfig
    from ddptrain.launch.planner import Candidate, _model, measure
    from ddptrain.parallel import resolve_strategy
    from ddptrain.parallel.memory import optimizer_slots

    args = build_parser().parse_args([
        "--model", f"hf:{REPO / 'examples' / 'llama-70b'}", "--nodes", "8",
        "--gpus_per_node", "8", "--block_size", "4096"])
    model = _model(args)
    assert model.deep and model.layers == 80 and 70e9 < model.parameters < 71e9
    held = measure(args, model, 64, Candidate("fsdp", 1, 1, 1, 1, 8, "block"))
    config = TrainingConfig(strategy="fsdp", optimizer="adamw")
    doctor = resolve_strategy(config, 64, torch.device("cpu")).rank_bytes(
        model.parameters, optimizer_slots(config))
    for kind in ("params", "grads", "optimizer"):
        assert held[f"held_{kind}"] == pytest.approx(doctor[kind], rel=0.15), (kind, held)
