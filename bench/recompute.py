"""Activation checkpointing: peak memory and step time of a deep GPT with and without
`--activation_checkpointing`, through `ddptrain train` as a user runs it (one process,
and 2 CPU ranks under ddp and fsdp, gloo, one thread each). `make bench` runs it:

    .venv/bin/python bench/recompute.py        # about 5 minutes on 2 cores

The model is ddptrain's GPT with 24 blocks (width 64, 4 heads, 256-token windows, 1.2M
parameters: small weights, many activations) on 64 random token windows, batch 16 per
rank, AdamW, one epoch (4 optimizer steps on one process, 2 on 2 ranks). Peak memory is
the largest `peak_rss_mb` of rank 0's train rows (the process's resident high-water
mark); glibc runs with a fixed mmap threshold, so a freed activation goes back to the
system at once and the high-water mark is what was held.
The report goes into docs/BENCHMARKS.md between `<!-- recompute:start -->` and
`<!-- recompute:end -->`.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.run import bench_env, machine  # noqa: E402
from bench.sharding import save_and_write, section_parser  # noqa: E402

DEPTH, WIDTH, BLOCK, VOCAB = 24, 64, 256, 64
JOB = ["train", "--dataset", "bench.recompute:tokens", "--model", "bench.recompute:deep_gpt",
       "--width", str(WIDTH), "--batch_size", "16", "--epochs", "1", "--optimizer", "adamw",
       "--lr", "0.001", "--log_interval", "1", "--no-tensorboard", "--save_every", "0"]
RUNS = [("1 process", 1, "ddp"), ("2 ranks, fsdp", 2, "fsdp")]
START, END = "<!-- recompute:start -->", "<!-- recompute:end -->"


def deep_gpt(config: Any, vocab_size: int, input_shape: tuple[int, ...]) -> torch.nn.Module:
    from ddptrain.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size, input_shape[0], DEPTH, 4, config.width))


def tokens(config: Any, n: int = 80) -> Any:
    """Random windows of BLOCK tokens (the task is `lm`): 64 to train, 16 to validate."""
    from torch.utils.data import TensorDataset

    class Windows(TensorDataset):
        vocab_size = VOCAB

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (n, BLOCK), generator=g)
    return Windows(data[:64], data[:64]), Windows(data[64:], data[64:])


def run(nproc: int, strategy: str, recompute: bool, out: Path) -> dict[str, Any]:
    flags = [*JOB, "--strategy", strategy, "--output_dir", str(out)]
    if recompute:
        flags.append("--activation_checkpointing")
    head = ([sys.executable, "-m"] if nproc == 1 else
            [str(Path(sys.executable).parent / "torchrun"), "--standalone",
             f"--nproc_per_node={nproc}", "-m"])
    env = {**bench_env(), "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    done = subprocess.run([*head, "ddptrain", *flags], env=env, capture_output=True, text=True,
                          timeout=900)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"][-1]
    return {
        "peak_rss_mb": max(r["peak_rss_mb"] for r in train),
        "step_s": statistics.median(r["step_time_s"] for r in train[1:]),
        "val_loss": val["loss"],
    }


def section(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "## Activation checkpointing (ddptrain, GPT of 24 blocks)", "",
        f"`bench/recompute.py`, {m['date_utc']}, {m['cpu']}, {m['cores']} cores, torch "
        f"{m['torch']}. ddptrain's GPT with {DEPTH} blocks (width {WIDTH}, 4 heads, "
        f"{BLOCK}-token windows), batch 16 per rank, AdamW, one epoch, with and "
        "without `--activation_checkpointing`. Peak RSS is rank 0's resident high-water "
        "mark in training (glibc with a fixed mmap threshold, so freed activations leave at "
        "once); the step time is the median of the train rows after the first"
        + (f" (1-minute load average at the end: {results['load_1min']:.1f} on "
           f"{m['cores']} cores, so the times are long; the memory does not depend on it)"
           if "load_1min" in results else "") + ".", "",
        "| run | peak RSS without (MB) | with (MB) | saved (MB) | step without (s) | with (s) "
        "| val loss without / with |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, figures in results["runs"].items():
        off, on = figures["off"], figures["on"]
        lines.append(
            f"| {name} | {off['peak_rss_mb']:.0f} | {on['peak_rss_mb']:.0f} | "
            f"{off['peak_rss_mb'] - on['peak_rss_mb']:.0f} | {off['step_s']:.2f} | "
            f"{on['step_s']:.2f} | {off['val_loss']:.6f} / {on['val_loss']:.6f} |"
        )
    lines += [
        "", "Without it every block keeps its activations from forward to backward; with "
        "it a block keeps only its input and recomputes the rest in backward, one block at "
        "a time: the memory saved grows with depth and batch, and each step pays about one "
        "more forward. The validation losses are the same: the recomputation restores the "
        "random state, and the weights are those of the run without it "
        "(`tests/test_finetune_parts.py`).", "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = section_parser(__doc__ or "", "recompute")
    args = parser.parse_args()
    results: dict[str, Any] | None = None
    if not args.report_only:
        results = {"machine": machine(), "runs": {}}
        with tempfile.TemporaryDirectory(prefix="bench-recompute-") as tmp:
            for name, nproc, strategy in RUNS:
                results["runs"][name] = {
                    key: run(nproc, strategy, on, Path(tmp) / f"{nproc}-{strategy}-{key}")
                    for key, on in (("off", False), ("on", True))
                }
                print(name, results["runs"][name], flush=True)
        results["load_1min"] = os.getloadavg()[0]  # the step times depend on it, memory not
    return save_and_write(args, results, section, "activation checkpointing", START, END)


if __name__ == "__main__":
    raise SystemExit(main())
