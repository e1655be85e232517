"""`train.probe`: one training step of each layout on fake ranks, its peak memory and its
collectives, against the same step on real gloo ranks (`probe_real.py` under torchrun:
the flight recorder's collectives, the same memory trackers)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import BIN, REPO, child_env

from ddptrain.config import TrainingConfig
from ddptrain.models.gpt import build_gpt
from ddptrain.train import probe
from ddptrain.train.collectives import _recorded, traffic

VOCAB, SEQ, BATCH, WIDTH = 512, 64, 4, 128


def build(device: torch.device) -> torch.nn.Module:
    with torch.device(device):
        return build_gpt(VOCAB, SEQ, WIDTH)


def parameter_bytes() -> int:
    return sum(p.numel() * 4 for p in build(torch.device("meta")).parameters())


def fake(world: int, rank: int = 0, **flags: Any) -> probe.StepFigures:
    config = TrainingConfig(optimizer="adamw", batch_size=BATCH, **flags)
    return probe.fake_step(config, world, rank, world, build, BATCH, SEQ, VOCAB)


def test_ddp_and_zero_count_the_collectives_of_their_step() -> None:
    """DDP's reducer all-reduces every gradient in its first bucket layout (one bucket);
    zero's step then broadcasts each rank's parameters (one bucket a rank). The figures
    stay a dict of bytes by kind (what `ddptrain plan` reads)."""
    whole = parameter_bytes()
    ddp = fake(2, strategy="ddp")
    assert ddp.collectives == {"all_reduce": {"calls": 1, "bytes": whole}}
    assert ddp["total"] >= ddp["params"] + ddp["optimizer"] > 0
    zero = fake(2, strategy="zero")
    assert zero.collectives == {"all_reduce": {"calls": 1, "bytes": whole},
                                "broadcast": {"calls": 2, "bytes": whole}}
    assert zero["optimizer"] < 0.6 * ddp["optimizer"]


def test_a_pipeline_rank_holds_its_stage_and_passes_activations() -> None:
    """pp 2 over 2 ranks, 2 micro-batches: each rank holds its stage alone (the tied
    embedding on both), sends and receives one activation (or its gradient) a
    micro-batch, and the two copies of the tied embedding sum their gradients."""
    config = TrainingConfig(optimizer="adamw", batch_size=BATCH, pp=2)
    first, last = probe.fake_stages(config, 2, 2, build, BATCH, SEQ, VOCAB)
    assert (first.stage, last.stage) == (0, 1)
    whole, embedding = parameter_bytes(), VOCAB * WIDTH * 4
    assert first["params"] + last["params"] == whole + embedding  # the tie: one a stage
    activation = BATCH // 2 * SEQ * WIDTH * 4
    for stage in (first, last):
        assert stage.collectives == {
            "all_reduce": {"calls": 1, "bytes": embedding},
            "recv": {"calls": 2, "bytes": 2 * activation},
            "send": {"calls": 2, "bytes": 2 * activation},
        }
    assert last["activations"] > first["activations"]  # the logits are the last stage's


def test_the_recorders_names_are_the_dispatchers() -> None:
    """gloo runs a reduce-scatter as an all-reduce of the whole input, which its flight
    recorder names so: the Python frames that called it tell them apart."""
    entry = {"profiling_name": "gloo:all_reduce", "input_sizes": [[4, 8]],
             "input_dtypes": ["BFloat16"],
             "frames": [{"name": "reduce_scatter_single"}, {"name": "wrapper"}]}
    assert _recorded(entry) == ("reduce_scatter", 64)
    assert _recorded({**entry, "frames": [{"name": "backward"}]}) == ("all_reduce", 64)
    assert _recorded({"profiling_name": "gloo:all_gather", "input_sizes": [[10]],
                      "input_dtypes": ["Float"]}) == ("all_gather", 40)
    assert traffic([("send", 8), ("all_gather", 4), ("send", 8)]) == {
        "all_gather": {"calls": 1, "bytes": 4}, "send": {"calls": 2, "bytes": 16}}


def run_real(tmp_path: Path, ranks: int, *layouts: str) -> list[dict[str, Any]]:
    """Each rank's real and fake figures of `layouts` (`probe_real.py`), rank by rank."""
    out = tmp_path / "figures"
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={ranks}",
         str(REPO / "tests" / "probe_real.py"), str(out), *layouts],
        env=child_env(), text=True, capture_output=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(ranks)]


def assert_fake_holds_what_real_holds(ranks: list[dict[str, Any]], name: str) -> None:
    """Each rank's peak within 10 %, its optimizer state (what a layout shards) within
    2 %. (The kinds at the moment of the peak move with the gathers' timing on real
    ranks: fsdp's unsharded weights may or may not be held then.)"""
    for rank, figures in enumerate(ranks):
        real, fake = figures["real"][name]["peak"], figures["fake"][name]["peak"]
        assert abs(fake["total"] - real["total"]) <= 0.1 * real["total"], (name, rank,
                                                                           real, fake)
        assert fake["optimizer"] == pytest.approx(real["optimizer"], rel=0.02), (name, rank)


@pytest.mark.slow
def test_two_fake_ranks_hold_and_call_what_two_real_ranks_do(tmp_path: Path) -> None:
    """ddp, zero, fsdp, tp 2 and pp 2 on 2 gloo ranks and on 2 fake ones: each rank's
    peak, and the same collectives (op, calls, bytes) as the flight recorder's."""
    layouts = ("ddp", "zero", "fsdp", "tp2", "pp2")
    ranks = run_real(tmp_path, 2, *layouts)
    for name in layouts:
        assert_fake_holds_what_real_holds(ranks, name)
        for rank, figures in enumerate(ranks):
            real, fake = figures["real"][name], figures["fake"][name]
            assert fake["collectives"] == real["collectives"], (name, rank)
    # the layouts differ as they should: zero keeps half of ddp's optimizer state, and a
    # pipeline's ranks hold different stages
    real = ranks[0]["real"]
    assert real["zero"]["peak"]["optimizer"] == pytest.approx(
        real["ddp"]["peak"]["optimizer"] / 2, rel=0.02)
    assert [r["fake"]["pp2"]["stage"] for r in ranks] == [0, 1]
    assert ranks[0]["real"]["pp2"]["peak"] != ranks[1]["real"]["pp2"]["peak"]
    assert {"send", "recv", "all_reduce"} == set(real["pp2"]["collectives"])


@pytest.mark.slow
def test_four_fake_ranks_hold_and_call_what_four_real_ranks_do(tmp_path: Path) -> None:
    """HSDP 2 x 2, fsdp x tp (dp_shard 2 x tp 2), ep 2 (fsdp, the GPT with 4 experts)
    and fsdp x pp (dp_shard 2 x pp 2) on 4 gloo ranks and on 4 fake ones. A fake rank's
    router spreads its tokens evenly, a real one's as its weights say: ep's all-to-alls
    are the same calls, and their bytes the same over the ranks together."""
    layouts = ("hsdp", "fsdp_tp", "ep2", "fsdp_pp")
    ranks = run_real(tmp_path, 4, *layouts)
    for name in layouts:
        assert_fake_holds_what_real_holds(ranks, name)
        for rank, figures in enumerate(ranks):
            real, fake = figures["real"][name]["collectives"], figures["fake"][name][
                "collectives"]
            assert set(fake) == set(real), (name, rank)
            for op in real:
                assert fake[op]["calls"] == real[op]["calls"], (name, rank, op)
                if not (name == "ep2" and op == "all_to_all"):
                    assert fake[op]["bytes"] == real[op]["bytes"], (name, rank, op)
    sent = [sum(r[kind]["ep2"]["collectives"]["all_to_all"]["bytes"] for r in ranks)
            for kind in ("real", "fake")]
    assert sent[0] == sent[1]
    # HSDP all-reduces over the replicas what fsdp reduce-scatters in each
    hsdp = ranks[0]["real"]["hsdp"]["collectives"]
    assert hsdp["all_reduce"]["calls"] == hsdp["reduce_scatter"]["calls"] > 0
    # pp is the mesh's outermost dimension: ranks 0, 1 hold the first stage
    assert [r["fake"]["fsdp_pp"]["stage"] for r in ranks] == [0, 0, 1, 1]
    assert probe.pipeline_ranks(TrainingConfig(pp=2), 4) == [0, 2]
