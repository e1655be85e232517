"""`ddptrain plan`: the layouts a model fits on a cluster, their memory measured on fake
ranks (`train.probe`), ranked by a stated cost model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, REPO, child_env

from ddptrain.launch.planner import Model, build_parser, candidates, main, plan

TINY = ["--model", "gpt", "--width", "128", "--block_size", "64", "--vocab_size", "4096",
        "--nodes", "1", "--gpus_per_node", "4", "--global_batch_size", "8"]


@pytest.mark.slow
def test_fake_ranks_hold_what_real_ranks_hold(tmp_path: Path) -> None:
    """One training step of each layout on 2 real gloo ranks and on 2 fake ones: the peak
    a rank holds within 10 %, and the optimizer's state (what a layout shards) within 2 %.
    (The kinds at the moment of the peak move with the gathers' timing on real ranks:
    fsdp's unsharded weights may or may not be held then.)"""
    out = tmp_path / "peaks.json"
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2",
         str(REPO / "tests" / "probe_real.py"), str(out), "ddp", "zero", "fsdp", "tp2"],
        env=child_env(), text=True, capture_output=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = json.loads(out.read_text())
    for name, real in peaks["real"].items():
        fake = peaks["fake"][name]
        assert abs(fake["total"] - real["total"]) <= 0.1 * real["total"], (name, real, fake)
        assert fake["optimizer"] == pytest.approx(real["optimizer"], rel=0.02), name
    # the layouts differ as they should: zero keeps half of ddp's optimizer state
    assert peaks["real"]["zero"]["optimizer"] == pytest.approx(
        peaks["real"]["ddp"]["optimizer"] / 2, rel=0.02)


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

    budget = 18.0e6 / 0.9 / 2**30
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
