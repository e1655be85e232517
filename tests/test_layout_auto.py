"""`--layout auto` and `--batch_size auto`: `ddptrain plan`'s first choice for this world
and device, chosen at launch, recorded in config.yaml and kept by a resume."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml
from conftest import one_error_line, run_torchrun
from procs import assert_bitwise, sigkill_after_checkpoint, weights

from ddptrain.launch.autolayout import choose

GPT = ["train", "--dataset", "chars", "--model", "gpt", "--width", "64", "--block_size", "32"]


def _chars_vocab() -> int:
    from ddptrain.config import TrainingConfig
    from ddptrain.data import load_data

    return int(load_data(TrainingConfig(dataset="chars", block_size=32), None).facts.vocab_size)


def _peaks(vocab: int, world: int) -> dict[str, float]:
    """GiB a rank holds at a micro-batch of 1, as the plan measures: under ddp at its
    least (block recompute), under fsdp without recompute."""
    from ddptrain.launch.planner import Candidate, lm_model, measure
    from ddptrain.observe.flops import count_flops

    args = argparse.Namespace(nodes=1, gpus_per_node=world, block_size=32, optimizer="sgd",
                              use_amp=False, amp_dtype="auto")
    model = lm_model("gpt", {}, vocab, 32, 64, count_flops)
    return {s: measure(args, model, world, Candidate(s, 1, 1, 1, 1, 4, mode))["total"] / 2**30
            for s, mode in (("ddp", "block"), ("fsdp", "off"))}


@pytest.mark.heavy
def test_layout_auto_on_four_ranks_drops_what_does_not_fit_and_resumes_bitwise(
    tmp_path: Path,
) -> None:
    """A budget between fsdp's and ddp's peak at one sequence: ddp fits no micro-batch and
    is not chosen, the run trains with what was, config.yaml names it, and a run SIGKILLed
    mid-epoch resumes (keeping the choice from config.yaml) to the uninterrupted run's
    weights, bitwise."""
    peaks = _peaks(_chars_vocab(), 4)
    budget = (peaks["ddp"] + peaks["fsdp"]) / 2 / 0.9
    job = [*GPT, "--layout", "auto", "--batch_size", "auto", "--global_batch_size", "16",
           "--device_memory", f"{budget:.9f}", "--epochs", "2", "--optimizer", "sgd",
           "--momentum", "0.9", "--max_grad_norm", "1", "--save_every_steps", "10",
           "--log_interval", "10"]
    reference = tmp_path / "reference"
    done = run_torchrun(4, [*job, "--output_dir", str(reference)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layout auto: " in done.stdout + done.stderr, done.stdout[-2000:]
    saved = yaml.safe_load((reference / "config.yaml").read_text())
    chosen = {k: saved[k] for k in ("strategy", "tp", "batch_size", "grad_accum_steps")}
    assert saved["layout"] == "auto" and chosen["strategy"] != "ddp", chosen
    assert saved["oom_backoff"] is True
    # the same global batch of 16 over the data-parallel ranks (4 / tp)
    assert chosen["batch_size"] * chosen["grad_accum_steps"] * 4 // chosen["tp"] == 16

    run = tmp_path / "run"
    sigkill_after_checkpoint(4, job, run, tmp_path, 20)
    resumed = run_torchrun(4, [*job, "--output_dir", str(run), "--resume_from", "auto"],
                           cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "layout auto: kept from the run's config.yaml" in resumed.stdout + resumed.stderr
    assert_bitwise(weights(run), weights(reference))


@pytest.mark.parametrize(("extra", "message"), [
    (["--model", "mlp", "--dataset", "digits", "--layout", "auto"],
     "--layout auto plans a language model"),
    ([*GPT[1:], "--layout", "auto", "--tp", "2"],
     "--layout auto chooses the layout, and --tp 2 names one"),
    ([*GPT[1:], "--layout", "auto", "--pp", "2"],
     "--layout auto chooses the layout, and --pp 2 names one"),
    ([*GPT[1:], "--batch_size", "auto", "--global_batch_size", "8", "--pp", "2"],
     "--batch_size auto does not plan --pp"),
    ([*GPT[1:], "--batch_size", "auto"], "--batch_size auto keeps a global batch"),
    ([*GPT[1:], "--layout", "auto", "--device_memory", "0.001"],
     "--layout auto: no layout fits: nothing fits 0.001 GiB a rank"),
])
def test_what_cannot_be_planned_is_one_line_and_exit_2(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    err = one_error_line(capsys, ["train", *extra, "--output_dir", str(tmp_path / "r")])
    assert message in err, err


def test_batch_size_auto_keeps_the_flags_layout_and_chooses_its_largest_micro_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One process: `--batch_size auto` under the flags' fsdp (here, one rank's) picks
    the largest micro-batch the budget holds, keeps the global batch, arms the backoff."""
    import torch

    from ddptrain.config_cli import parse_config

    config = parse_config([*GPT[1:], "--batch_size", "auto", "--global_batch_size", "16",
                           "--output_dir", "/nonexistent/run"])
    chosen = choose(config, 65, 1, 1, torch.device("cpu"), own_model=False)
    assert (chosen.strategy, chosen.tp) == ("ddp", 1)
    assert chosen.batch_size == 16 and chosen.grad_accum_steps == 1 and chosen.oom_backoff
    assert config.layout == "flags"
    small = parse_config([*GPT[1:], "--batch_size", "auto", "--global_batch_size", "16",
                          "--device_memory", f"{_one_sequence_budget()}",
                          "--output_dir", "/nonexistent/run"])
    fewer = choose(small, 65, 1, 1, torch.device("cpu"), own_model=False)
    assert fewer.batch_size * fewer.grad_accum_steps == 16 and fewer.batch_size < 16


def _one_sequence_budget() -> float:
    """GiB between a micro-batch of 2 sequences and one of 16, for the tiny GPT."""
    from ddptrain.launch.planner import Candidate, lm_model, measure
    from ddptrain.observe.flops import count_flops

    model = lm_model("gpt", {}, 65, 32, 64, count_flops)
    args = argparse.Namespace(nodes=1, gpus_per_node=1, block_size=32, optimizer="sgd",
                              use_amp=False, amp_dtype="auto")
    two, sixteen = (measure(args, model, 1, Candidate("ddp", 1, 1, 1, m, 16 // m))["total"]
                    for m in (2, 16))
    return (two + sixteen) / 2 / 0.9 / 2**30


@pytest.mark.heavy
def test_the_plans_first_choice_is_not_slower_than_its_second_side_by_side(
    tmp_path: Path,
) -> None:
    """On 4 CPU ranks with ddp over the budget: the plan's first and second layouts
    (by the cost model, with a CPU's figures) run in turn, A B A B; the first's median
    step is not slower than the second's by more than the runs' own spread (at least
    10 %)."""
    import statistics

    from ddptrain.launch.autolayout import CPU_CARD, CPU_LATENCY_S
    from ddptrain.launch.planner import lm_model, plan
    from ddptrain.observe.flops import count_flops

    vocab = _chars_vocab()
    peaks = _peaks(vocab, 4)
    budget = (peaks["ddp"] + peaks["fsdp"]) / 2 / 0.9
    args = argparse.Namespace(nodes=1, gpus_per_node=4, block_size=32, optimizer="sgd",
                              margin=0.1, mfu=0.4, use_amp=False, amp_dtype="auto",
                              latency_s=CPU_LATENCY_S)
    fits, _ = plan(args, lm_model("gpt", {}, vocab, 32, 64, count_flops), 4, 16,
                   (budget, *CPU_CARD))
    # (tp over all 4 ranks runs under --strategy ddp too: plain ddp is what does not fit)
    assert len(fits) >= 2 and not any(p.name.startswith("ddp") for p in fits), fits
    first, second = fits[0], fits[1]
    times: dict[str, list[float]] = {first.name: [], second.name: []}
    for i, planned in enumerate([first, second, first, second]):
        run = tmp_path / f"run{i}"
        job = [*GPT, *planned.candidate.flags(), "--epochs", "1", "--optimizer", "sgd",
               "--log_interval", "10", "--output_dir", str(run)]
        done = run_torchrun(4, job, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if r["split"] == "train"][1:]  # the first interval holds the warm-up
        times[planned.name].append(statistics.median(r["step_time_s"] for r in rows))
    a, b = times[first.name], times[second.name]
    spread = max(0.1, *(abs(x - y) / min(x, y) for x, y in (a, b)))
    assert statistics.mean(a) <= statistics.mean(b) * (1 + spread), (times, spread)
