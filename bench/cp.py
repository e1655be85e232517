"""Context parallelism: what a rank holds and what a step costs when each sequence is split
over the cp ranks (`--cp`), against data parallelism on the same global batch. `make bench`
runs it:

    .venv/bin/python bench/cp.py          # about 3 minutes on 2 cores

Two parts. The memory a rank holds in one training step, measured as `ddptrain plan`
measures it (`train.probe.fake_step`: the real passes and step on 4 fake ranks and
tensors without data; torch's MemTracker by kind): the built-in GPT (width 256, 4 heads,
4,096-token sequences, vocabulary 256), 2 sequences a micro-step, under ddp and under cp
2 and 4. Then real runs through `ddptrain train` under torchrun (2 CPU ranks, gloo, one
thread each): the GPT (width 64) on the chars corpus in 1,024-token windows, a global
batch of 8, SGD, one epoch, as ddp (4 sequences a rank) and as cp 2 (8 sequences, each
rank 512 tokens of each): rank 0's peak RSS, the median step time and the validation
loss (the same model trained: equal to the fp32 floor).
The report goes into docs/BENCHMARKS.md between `<!-- cp:start -->` and `<!-- cp:end -->`;
raw figures are kept in runs/bench/cp.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.run import bench_env, machine  # noqa: E402
from bench.sharding import save_and_write, section_parser  # noqa: E402

START, END = "<!-- cp:start -->", "<!-- cp:end -->"
MIB = 2**20
FAKE = dict(width=256, block=4096, vocab=256, micro=2, world=4)
JOB = ["train", "--dataset", "chars", "--model", "gpt", "--width", "64", "--block_size",
       "1024", "--epochs", "1", "--optimizer", "sgd", "--lr", "0.05", "--seed", "3",
       "--log_interval", "1", "--no-tensorboard", "--no-curves", "--save_every", "0",
       "--no-use_amp"]
RUNS = {"ddp, 2 ranks": ["--batch_size", "4"], "cp 2": ["--batch_size", "8", "--cp", "2"]}


def held(cp: int) -> dict[str, float]:
    """MiB a rank holds at its step's peak, by kind, under cp (1: ddp over every rank)."""
    from ddptrain.config import TrainingConfig
    from ddptrain.models.gpt import build_gpt
    from ddptrain.train.probe import fake_step

    config = TrainingConfig(output_dir="/tmp/unused", cp=cp, block_size=FAKE["block"],
                            use_amp=False).validate()
    figures = fake_step(config, FAKE["world"], 0, FAKE["world"],
                        lambda device: build_gpt(FAKE["vocab"], FAKE["block"], FAKE["width"]),
                        FAKE["micro"], FAKE["block"], FAKE["vocab"])
    return {k: figures[k] / MIB for k in ("params", "activations", "total")}


def run(flags: list[str], out: Path) -> dict[str, Any]:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=2", "-m", "ddptrain", *JOB, *flags,
         "--output_dir", str(out)], env=bench_env(), capture_output=True, text=True,
        timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    return {"peak_rss_mb": max(r["peak_rss_mb"] for r in train),
            "step_s": statistics.median(r["step_time_s"] for r in train[1:]),
            "val_loss": [r for r in rows if r["split"] == "val"][-1]["loss"]}


def section(results: dict[str, Any]) -> str:
    m, fake = results["machine"], results["held"]
    lines = [
        "## Context parallelism: a sequence over several ranks", "",
        f"`bench/cp.py`, {m['date_utc']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}. "
        f"What a rank holds at its step's peak, measured on {FAKE['world']} fake ranks as "
        f"`ddptrain plan` measures (the GPT at width {FAKE['width']}, 4 heads, "
        f"{FAKE['block']:,}-token sequences, {FAKE['micro']} a micro-step):", "",
        "| layout | weights (MiB) | activations (MiB) | a rank's peak (MiB) | activations "
        "against ddp |", "| --- | ---: | ---: | ---: | ---: |",
    ]
    base = fake["1"]["activations"]
    for cp, f in fake.items():
        name = "ddp" if cp == "1" else f"cp {cp}"
        lines.append(f"| {name} | {f['params']:.1f} | {f['activations']:.1f} | "
                     f"{f['total']:.1f} | {f['activations'] / base:.2f} |")
    lines += [
        "", "Trained on 2 CPU ranks (the GPT at width 64 on the chars corpus, 1,024-token "
        "windows, a global batch of 8, SGD, one epoch): ddp gives each rank 4 whole "
        "sequences, cp 2 each rank half of each of 8.", "",
        "| run | rank 0's peak RSS (MB) | step (s) | validation loss |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, f in results["runs"].items():
        lines.append(f"| {name} | {f['peak_rss_mb']:.0f} | {f['step_s']:.3f} | "
                     f"{f['val_loss']:.6f} |")
    lines += [
        "", "Both runs train the same model to the same loss (to the fp32 floor). A rank "
        "holds as many tokens in either (4 whole sequences, or half of each of 8), so their "
        "memory is alike; what cp changes is the longest sequence that fits: at the same "
        "sequences a micro-step (the first table) a rank's activations fall with its share "
        "of each, its weights do not (shard them with `--strategy fsdp`, over the "
        "data-parallel and cp ranks together). Each layer adds four all-to-alls forward and "
        "four backward (q, k, v and the output), inside a node; on 2 CPU cores they cost "
        "the step a quarter more.", "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = section_parser(__doc__ or "", "cp")
    args = parser.parse_args()
    results: dict[str, Any] | None = None
    if not args.report_only:
        results = {"machine": machine(), "held": {str(cp): held(cp) for cp in (1, 2, 4)},
                   "runs": {}}
        print(results["held"], flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp:
            for name, flags in RUNS.items():
                results["runs"][name] = run(flags, Path(tmp) / name.replace(" ", "-"))
                print(name, results["runs"][name], flush=True)
        results["load_1min"] = os.getloadavg()[0]
    return save_and_write(args, results, section, "context parallelism", START, END)


if __name__ == "__main__":
    raise SystemExit(main())
