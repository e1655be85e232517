"""A mixture of experts over 2 ranks: what a step costs and what a rank holds when the
built-in GPT's MLPs are 4 experts (top 2) under ddp, fsdp, expert parallelism (`--ep 2`,
under ddp and under fsdp) and tensor parallelism (`--tp 2`), against the dense GPT under
ddp, each run through `ddptrain train` under torchrun (gloo, one thread per rank).
`make bench` runs it:

    .venv/bin/python bench/moe.py          # about 2 minutes on 2 cores

The model and data are bench/layouts.py's (2 blocks, width 256, 64-token windows, a
global batch of 16, AdamW, one epoch of 6 steps). For each layout: the median step time
of the train rows after the first, the bytes rank 0 holds (summary.json `rank0_bytes`),
and under `--ep` the bytes each rank's all-to-alls send in a step's forward (the tokens'
rows to their experts' ranks and back; backward sends as many again), counted at
`ddptrain.models.moe.all_to_all_single` in each rank.

The report goes into docs/BENCHMARKS.md between `<!-- moe:start -->` and
`<!-- moe:end -->`; raw figures are kept in runs/bench/moe.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.layouts import BLOCK, GLOBAL_BATCH, JOB, RUN_TIMEOUT_S, WIDTH, Layout  # noqa: E402
from bench.run import bench_env, machine  # noqa: E402
from bench.sharding import save_and_write, section_parser  # noqa: E402

START, END = "<!-- moe:start -->", "<!-- moe:end -->"
EXPERTS = ["--model_args", "experts=4", "top_k=2"]
LAYOUTS = [
    (Layout("dense GPT, ddp", 2, {"strategy": "ddp"}), False),
    (Layout("4 experts, ddp", 2, {"strategy": "ddp"}), True),
    (Layout("4 experts, fsdp", 2, {"strategy": "fsdp"}), True),
    (Layout("4 experts, --ep 2", 2, {"strategy": "ddp", "ep": 2}), True),
    (Layout("4 experts, fsdp --ep 2", 2, {"strategy": "fsdp", "ep": 2}), True),
    (Layout("4 experts, --tp 2", 2, {"strategy": "ddp", "tp": 2}), True),
]
BASELINE = "4 experts, ddp"


def _counted(argv: list[str]) -> int:
    """Rank side: ddptrain's CLI, with the bytes its all-to-alls send counted into
    $MOE_A2A_OUT.<rank>.json."""
    import ddptrain.models.moe as moe
    from ddptrain.cli import main

    sent = [0]
    real = moe.all_to_all_single

    def counting(input: Any, *args: Any, **kwargs: Any) -> Any:
        sent[0] += input.numel() * input.element_size()
        return real(input, *args, **kwargs)

    moe.all_to_all_single = counting
    try:
        return main(argv)
    finally:
        rank = os.environ.get("RANK", "0")
        Path(f"{os.environ['MOE_A2A_OUT']}.{rank}.json").write_text(json.dumps(sent[0]))


def run(layout: Layout, moe: bool, out: Path) -> dict[str, Any]:
    batch = GLOBAL_BATCH // layout.data_parallel
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
           f"--nproc_per_node={layout.ranks}", str(Path(__file__).resolve()), "--rank_run",
           *JOB, *(EXPERTS if moe else []), *layout.flags, "--batch_size", str(batch),
           "--output_dir", str(out)]
    env = {**bench_env(), "MOE_A2A_OUT": str(out.parent / f"{out.name}-a2a")}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"{layout.name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    sent = [json.loads(Path(f"{env['MOE_A2A_OUT']}.{r}.json").read_text())
            for r in range(layout.ranks)]
    return {
        "flags": layout.flags + (EXPERTS if moe else []), "bytes": summary["rank0_bytes"],
        "step_s": statistics.median(r["step_time_s"] for r in train[1:]),
        "steps": summary["steps"], "val_loss": summary["val_loss"],
        "a2a_per_step": [s / summary["steps"] for s in sent],
        "balance": [train[-1].get("expert_tokens_min"), train[-1].get("expert_tokens_max")],
        "wall_s": time.perf_counter() - t0,
    }


def section(results: dict[str, Any]) -> str:
    m, runs = results["machine"], results["runs"]
    base = runs[BASELINE]
    lines = [
        "## Mixture of experts: ddp, fsdp and expert parallelism", "",
        f"`bench/moe.py`, {m['date_utc']}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}"
        f", one run per layout ({results['suite_s']:.0f} s in all), 2 ranks each. ddptrain's "
        f"GPT (2 blocks, width {WIDTH}, {BLOCK}-token windows, a global batch of "
        f"{GLOBAL_BATCH}, AdamW, one epoch) with each block's MLP as 4 experts, each token "
        "routed to 2 (`--model_args experts=4 top_k=2`), against the dense GPT. Bytes are "
        "rank 0's parameters, gradients and optimizer state at the end; the step time is "
        "the median of the train rows after the first; the all-to-all column is the bytes "
        "each rank's forward all-to-alls take in a step under `--ep 2` (the tokens' rows out "
        "and the results back, those for its own experts included; backward moves as many "
        "again).", "",
        "| layout | params (MB) | total state (MB) | step (ms) | vs ddp | all-to-all a step, "
        "rank 0 / 1 (KB) | val loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in runs.items():
        b = r["bytes"]
        a2a = " / ".join(f"{s / 1024:.0f}" for s in r["a2a_per_step"])
        lines.append(
            f"| {name} (`{' '.join(r['flags'])}`) | {b['params'] / 2**20:.2f} | "
            f"{sum(b.values()) / 2**20:.2f} | {r['step_s'] * 1e3:.0f} | "
            f"{r['step_s'] / base['step_s']:.2f} | {a2a} | {r['val_loss']:.4f} |"
        )
    lines += [
        "",
        "Four experts of top 2 hold about four times the dense MLP's weights and compute "
        "twice its MLP work per token; fsdp halves every tensor on each rank, and `--ep 2` "
        "keeps 2 of the 4 experts a rank whole (the attention, embeddings and routers "
        "replicated), so rank 0 holds about what fsdp holds of the experts and all of the "
        "rest; fsdp with `--ep 2` on 2 ranks holds what fsdp holds (one expert group: "
        "fsdp has no other rank to shard the experts over, and shards the rest), and `--tp 2` "
        "splits every expert's hidden width and the attention in two. What `--ep` pays "
        "instead of fsdp's all-gathers and reduce-scatters of the expert weights is the "
        "tokens' rows: each token's rows for an expert on the other rank go there and back, "
        "in forward and in backward, a volume set by the batch and the width, not by the "
        "number or size of the experts; `--tp` pays an all-reduce of the experts' outputs "
        "per layer instead. On 2 CPU cores gloo's collectives weigh on every parallel "
        "layout; on GPUs the point of `--ep` is experts too many or too large for each "
        "device to hold, with the all-to-all on NVLink or the network. ddp, fsdp and `--ep` "
        "reach the same validation loss to 1e-6. `--tp` sums each expert's products in "
        "another order, and routing is discrete: a last-bit difference in a router's "
        "score sends a token to another expert, which AdamW's normalised steps carry on, "
        "so its loss differs in the fourth digit; with SGD it ends within 1e-5 of ddp "
        "(tests/test_moe.py, as fsdp and `--ep` do).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank_run":
        return _counted(sys.argv[2:])
    args = section_parser(__doc__ or "", "moe").parse_args()
    if args.report_only:
        return save_and_write(args, None, section, "moe", START, END)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ddptrain-moe-") as tmp:
        runs = {layout.name: run(layout, moe, Path(tmp) / str(i))
                for i, (layout, moe) in enumerate(LAYOUTS)}
    for name, r in runs.items():
        print(name, json.dumps(r), flush=True)
    load = os.getloadavg()[0]
    fresh = {"machine": machine(), "suite_s": time.perf_counter() - t0, "load_1min": load,
             "runs": runs}
    return save_and_write(args, fresh, section, "moe", START, END)


if __name__ == "__main__":
    raise SystemExit(main())
