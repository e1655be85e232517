"""What ddptrain's split layouts cost over a hand-written loop with the same plan: `--pp 2`
against torch's pipeline schedule driven by hand, `--tp 2` against the same tensor-parallel
plan and a plain optimizer loop, on 2 CPU ranks (gloo, `OMP_NUM_THREADS=1`).

    .venv/bin/python bench/layouts_raw.py [--rounds N]

Both sides train the built-in GPT (2 blocks, width 256, 4 heads, 64-token windows) on the
same random windows, every rank the whole batch of 16, AdamW, no clipping, fp32, in one
torchrun job: each round runs ddptrain (`ddptrain.fit`, adopting the job's process group)
then the hand-written loop, for each layout, so both see the same machine state. The
figure is the median step time over the rounds (ddptrain: its train rows' `step_time_s`
after the first log interval; the loop: 5-step windows, timed the same way, after the
first), and their ratio.

The hand-written pipeline cuts the model with ddptrain's own `GPTStage` (the same units)
and sums the tied embedding's gradient between the two stages as ddptrain does; the
tensor-parallel loop applies ddptrain's `parallelize_gpt`. What the ratio shows is the
rest: the strategy's wrapping, the loss scaling, the metric sums, the finite checks.

The report goes into docs/BENCHMARKS.md between `<!-- layouts-raw:start -->` and
`<!-- layouts-raw:end -->`; raw figures are kept in runs/bench/layouts_raw.json, and
`--report_only` rebuilds the section from them.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.run import bench_env, machine  # noqa: E402
from bench.sharding import save_and_write, section_parser  # noqa: E402

WIDTH, BLOCK, VOCAB, BATCH, STEPS, WINDOW = 256, 64, 64, 16, 25, 5
LAYOUTS = {"pp 2": {"pp": 2}, "tp 2": {"tp": 2}}
START, END = "<!-- layouts-raw:start -->", "<!-- layouts-raw:end -->"


def windows(config: Any, n: int = BATCH * STEPS + 16) -> Any:
    """Random token windows (next-token targets): BATCH x STEPS to train, 16 to validate."""
    from torch.utils.data import TensorDataset

    class Windows(TensorDataset):
        vocab_size = VOCAB

    x, y = _tokens(n)
    cut = BATCH * STEPS
    return Windows(x[:cut], y[:cut]), Windows(x[cut:], y[cut:])


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (n, BLOCK + 1), generator=g)
    return data[:, :-1], data[:, 1:]


# ---------------------------------------------------------------- one rank of the job
def ddptrain_step_s(layout: dict[str, int], out: Path) -> float:
    from ddptrain.api import fit

    fit(dataset="bench.layouts_raw:windows", model="gpt", width=WIDTH, block_size=BLOCK,
        epochs=1, optimizer="adamw", lr=1e-3, batch_size=BATCH, log_interval=WINDOW,
        tensorboard=False, save_every=0, seed=0, output_dir=str(out), **layout)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r["step_time_s"] for r in rows if r["split"] == "train"]
    return statistics.median(train[1:])


def raw_step_s(layout: dict[str, int]) -> float:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from ddptrain.models.gpt import build_gpt

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_gpt(VOCAB, BLOCK, WIDTH)
    x, y = _tokens(BATCH * STEPS)
    if "tp" in layout:
        from ddptrain.parallel.tp import parallelize_gpt

        parallelize_gpt(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        params = list(model.parameters())

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            F.cross_entropy(model(xb).flatten(0, 1), yb.flatten()).backward()
    else:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import Schedule1F1B

        from ddptrain.parallel.pp import GPTStage

        stage = GPTStage(model, rank, 2)
        tied = stage.wte.weight if rank == 0 else stage.lm_head.weight
        params = list(stage.parameters())
        schedule = Schedule1F1B(
            PipelineStage(stage, rank, 2, torch.device("cpu")), 2,
            loss_fn=lambda out, target: F.cross_entropy(out.flatten(0, 1), target.flatten()),
        )

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            if rank == 0:
                schedule.step(xb)
            else:
                schedule.step(target=yb)
            assert tied.grad is not None
            dist.all_reduce(tied.grad)  # the tied embedding and head take one step

    optimizer = torch.optim.AdamW(params, lr=1e-3)
    times = []
    t0 = time.perf_counter()
    for i in range(STEPS):
        sl = slice(i * BATCH, (i + 1) * BATCH)
        step(x[sl], y[sl])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (i + 1) % WINDOW == 0:
            dist.all_reduce(torch.zeros(1))  # as ddptrain's log point meets the ranks
            now = time.perf_counter()
            times.append((now - t0) / WINDOW)
            t0 = now
    return statistics.median(times[1:])


def child(rounds: int, out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results: dict[str, dict[str, list[float]]] = {
        name: {"ddptrain": [], "raw": []} for name in LAYOUTS
    }
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)  # every rank writes one run directory
        for r in range(rounds):
            for name, layout in LAYOUTS.items():
                run = Path(shared[0]) / f"{name.replace(' ', '')}-{r}"
                results[name]["ddptrain"].append(ddptrain_step_s(layout, run))
                results[name]["raw"].append(raw_step_s(layout))
                dist.barrier()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the report
def section(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "",
        "## Layouts against hand-written loops with the same plan",
        "",
        f"`bench/layouts_raw.py`, {m['date_utc']}, {m['cpu']}, {m['cores']} cores, torch "
        f"{m['torch']}, {results['rounds']} rounds alternating ddptrain and the loop in one "
        f"2-rank torchrun job ({results['suite_s']:.0f} s in all). The built-in GPT (2 blocks, "
        f"width {WIDTH}, 4 heads, {BLOCK}-token windows), every rank the whole batch of "
        f"{BATCH}, AdamW, fp32, {STEPS} steps a run; the step time is the median over the "
        "rounds of each run's median (after its first 5-step window).",
        "",
        "| layout | ddptrain (ms) | hand-written (ms) | ratio | rounds (ddptrain / loop, ms) |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in results["runs"].items():
        ours, raw = statistics.median(r["ddptrain"]), statistics.median(r["raw"])
        each = ", ".join(f"{a * 1e3:.0f}/{b * 1e3:.0f}" for a, b in zip(r["ddptrain"], r["raw"],
                                                                         strict=True))
        lines.append(f"| {name} | {ours * 1e3:.1f} | {raw * 1e3:.1f} | {ours / raw:.2f} | "
                     f"{each} |")
    lines += [
        "",
        "The hand-written pipeline cuts the model with ddptrain's `GPTStage` and sums the tied "
        "embedding's gradient between the stages; the tensor-parallel loop applies "
        "ddptrain's `parallelize_gpt`. Neither layout wraps anything around the model when it "
        "takes every rank (no FSDP over a one-rank data-parallel mesh); the ratio is what "
        "ddptrain adds: the loss scaling, the metric sums, the finite check of every step, "
        "and the optimizer's groups split by kind of tensor (tp's DTensors apart from the "
        "plain ones, as torch's foreach steps need).",
        "",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    if os.environ.get("LAYOUTS_RAW_CHILD"):
        child(int(sys.argv[1]), Path(sys.argv[2]))
        return 0
    parser = section_parser(__doc__ or "", "layouts_raw")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, Any] | None = None
    if not args.report_only:
        with tempfile.TemporaryDirectory(prefix="bench-layouts-raw-") as tmp:
            ranks = Path(tmp) / "ranks.json"
            env = {**bench_env(), "LAYOUTS_RAW_CHILD": "1"}
            t0 = time.perf_counter()
            subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone",
                            "--nproc_per_node=2", __file__, str(args.rounds), str(ranks)],
                           env=env, check=True, cwd=tmp)
            results = {"machine": machine(), "rounds": args.rounds,
                       "runs": json.loads(ranks.read_text()),
                       "suite_s": time.perf_counter() - t0}
    return save_and_write(args, results, section, "layouts-raw", START, END)


if __name__ == "__main__":
    raise SystemExit(main())
