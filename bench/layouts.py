"""The layouts of one model over its ranks side by side: what each rank holds and what a
step costs under ddp, fsdp, tensor parallelism (`--tp 2`) on 2 ranks, and HSDP 2x2
(`--dp_replicate 2`) and FSDP x TP 2x2 on 4, each run through `ddptrain train` under
torchrun (gloo, one thread per rank) as a user starts it. `make bench` runs it:

    .venv/bin/python bench/layouts.py          # about 2 minutes on 2 cores

Every layout trains the built-in GPT (2 blocks, width 256, 4 heads, 64-token windows:
1.6M parameters) on the same random token windows with the same global batch of 16 and
AdamW, one epoch of 6 optimizer steps. For each it reads
- the bytes rank 0 holds of parameters, gradients and optimizer state (summary.json
  `rank0_bytes`: the strategy's own count of the tensors it keeps on that rank);
- the step time: the median of the train rows' `step_time_s` after the first.

A further layout is one more entry of LAYOUTS: the config fields that pick it and its
number of ranks; the per-rank batch follows from the layout's data-parallel ranks.

The report goes into docs/BENCHMARKS.md between `<!-- layouts:start -->` and
`<!-- layouts:end -->`; raw figures are kept in runs/bench/layouts.json, and
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
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.run import bench_env, machine  # noqa: E402
from bench.sharding import save_and_write, section_parser  # noqa: E402

WIDTH, BLOCK, VOCAB, TRAIN_WINDOWS, GLOBAL_BATCH = 256, 64, 64, 96, 16
JOB = ["train", "--dataset", "bench.layouts:windows", "--model", "gpt", "--width", str(WIDTH),
       "--block_size", str(BLOCK), "--epochs", "1", "--optimizer", "adamw", "--lr", "0.001",
       "--log_interval", "1", "--no-tensorboard", "--save_every", "0", "--seed", "0"]
START, END = "<!-- layouts:start -->", "<!-- layouts:end -->"
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Layout:
    """One way to spread the model: its name in the report, its ranks, and the config
    fields (`ddptrain train --<field> <value>`) that pick it."""

    name: str
    ranks: int
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def flags(self) -> list[str]:
        return [arg for key, value in self.fields.items() for arg in (f"--{key}", str(value))]

    @property
    def data_parallel(self) -> int:
        """Ranks that read different samples (the mesh's replicas x shards)."""
        from ddptrain.config import TrainingConfig
        from ddptrain.parallel.mesh import plan_mesh

        config = TrainingConfig(**self.fields, output_dir="unused").validate()
        return plan_mesh(config, self.ranks).data_parallel


LAYOUTS: list[Layout] = [
    Layout("ddp", 2, {"strategy": "ddp"}),
    Layout("fsdp", 2, {"strategy": "fsdp"}),
    Layout("tp 2", 2, {"tp": 2}),
    Layout("hsdp 2x2", 4, {"strategy": "fsdp", "dp_replicate": 2}),
    Layout("fsdp x tp 2x2", 4, {"strategy": "fsdp", "tp": 2}),
    Layout("pp 2", 2, {"pp": 2}),
    Layout("fsdp x pp 2x2", 4, {"strategy": "fsdp", "pp": 2}),
]
BASELINE = "ddp"


def windows(config: Any, n: int = TRAIN_WINDOWS + 16) -> Any:
    """Random token windows of --block_size (next-token targets): TRAIN_WINDOWS to train,
    the rest to validate."""
    from torch.utils.data import TensorDataset

    class Windows(TensorDataset):
        vocab_size = VOCAB

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (n, config.block_size + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    return (Windows(x[:TRAIN_WINDOWS], y[:TRAIN_WINDOWS]),
            Windows(x[TRAIN_WINDOWS:], y[TRAIN_WINDOWS:]))


def run(layout: Layout, out: Path) -> dict[str, Any]:
    """One layout's run; its bytes on rank 0 and its median step time."""
    batch = GLOBAL_BATCH // layout.data_parallel
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
           f"--nproc_per_node={layout.ranks}", "-m", "ddptrain", *JOB, *layout.flags,
           "--batch_size", str(batch), "--output_dir", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=bench_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"{layout.name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    return {
        "ranks": layout.ranks, "flags": layout.flags, "batch_per_rank": batch,
        "label": summary["strategy"], "bytes": summary["rank0_bytes"],
        "step_s": statistics.median(r["step_time_s"] for r in train[1:]),
        "steps": summary["steps"], "val_loss": summary["val_loss"],
        "wall_s": time.perf_counter() - t0,
    }


def run_each(layouts: list[Layout], measure: Callable[[Layout, Path], dict[str, Any]],
             tmp: Path, only: Collection[str] = ()) -> dict[str, Any]:
    """Each layout's figures by its name, measured in turn in a directory of its own under
    `tmp` (`only`: those names alone)."""
    runs: dict[str, Any] = {}
    for i, layout in enumerate(layouts):
        if not only or layout.name in only:
            runs[layout.name] = measure(layout, tmp / str(i))
            print(layout.name, json.dumps(runs[layout.name]), flush=True)
    return runs


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def section(results: dict[str, Any]) -> str:
    m, runs = results["machine"], results["runs"]
    base = runs[BASELINE]
    base_total = sum(base["bytes"].values())
    lines = [
        "## Layouts: ddp, fsdp, tp, hsdp, pp", "",
        f"`bench/layouts.py`, {m['date_utc']}, {m['cpu']}, {m['cores']} cores, torch "
        f"{m['torch']}, one run per layout ({results['suite_s']:.0f} s in all). ddptrain's "
        f"GPT (2 blocks, width {WIDTH}, 4 heads, {BLOCK}-token windows) on "
        f"{TRAIN_WINDOWS} random token windows, a global batch of {GLOBAL_BATCH} in every "
        "layout, AdamW, one epoch. Bytes are what rank 0 holds at the end of training "
        "(summary.json `rank0_bytes`: parameters, gradients as materialised, optimizer "
        "state; the other ranks hold the same, give or take a padded shard). The step time "
        "is the median of the train rows after the first"
        + (f" (1-minute load average at the end: {results['load_1min']:.1f} on "
           f"{m['cores']} cores: other work shared the machine, so the step times are long "
           "and vary from run to run; the bytes do not depend on it)"
           if results.get("load_1min", 0) > m["cores"] else "") + ".", "",
        "| layout | ranks | batch per rank | params (MB) | grads (MB) | optimizer (MB) "
        "| total vs ddp | step (ms) | vs ddp | val loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in runs.items():
        b = r["bytes"]
        lines.append(
            f"| {name} (`{' '.join(r['flags'])}`) | {r['ranks']} | {r['batch_per_rank']} | "
            f"{_mb(b['params'])} | {_mb(b['grads'])} | {_mb(b['optimizer'])} | "
            f"{sum(b.values()) / base_total:.2f} | {r['step_s'] * 1e3:.0f} | "
            f"{r['step_s'] / base['step_s']:.2f} | {r['val_loss']:.6f} |"
        )
    lines += [
        "",
        "fsdp shards every tensor over its ranks; tp 2 splits each block's attention heads and MLP"
        " over 2 ranks, while the embeddings, the norms and the biases added after a row-wise "
        "split stay whole on both, so it holds a little more than half. HSDP 2x2 shards over the 2"
        " ranks of a replica (as fsdp on 2 ranks) and keeps 2 replicas; FSDP x TP 2x2 shards tp's "
        "halves over 2 data-parallel ranks, a quarter of the split blocks per rank. The validation"
        " losses agree to the float rounding of a different order of sums: every layout trains the"
        " same model. The figures are tensors only: the ~0.4 GB each process holds anyway "
        "(interpreter, torch, gloo buffers) and the activations come on top. "
        "pp 2 gives rank 0 the first stage (the embeddings and block 0) and rank 1 the last "
        "(block 1, the final norm and the head, whose weight is the embedding's: both stages "
        "hold it), about half each; FSDP x PP 2x2 shards each stage over 2 ranks. "
        "tests/test_parallel_nd.py and tests/test_pipeline.py check that tp, pp, HSDP, FSDP x TP "
        "and FSDP x PP end with ddp's weights, and tp's and pp's bytes at about half of ddp's.",
        "",
        "### What 2 CPU cores cannot show",
        "",
        "The 4-rank layouts run 4 processes on 2 cores, each with half the samples or half the "
        "layers' work of a 2-rank process, so their step times hold the waits for a core as much "
        "as the work: they say that the layouts run, not what they would cost on 4 devices. Tensor"
        " parallelism pays collectives of activations in every block (an all-gather of the q, k, v"
        " projection and two all-reduces in forward, as many in backward), here over gloo on the "
        "cores that compute, for matrices too small to gain from being split; on GPUs in one node "
        "(NVLink) those all-reduces are fast and the split is what lets a layer too large for one "
        "device, or too slow on one, run at all. HSDP's point, the FSDP all-gathers and reduce-"
        "scatters staying on a node's fast links and only the replicas' all-reduce of the already "
        "reduce-scattered gradient shards crossing the slower network between nodes, needs two "
        "nodes and a network slower than a node's links: one machine's loopback has neither "
        "(tests/test_hsdp_hosts.py proves the layout across two network namespaces, not its "
        "speed). A pipeline's stages wait for each other: with 2 micro-batches over 2 stages "
        "each rank idles for a third of a step (the bubble, (P - 1) / (M + P - 1)), which more "
        "micro-batches or --pp_schedule interleaved1f1b shrink; its gain, one activation per "
        "micro-batch sent between stages instead of a collective per layer, shows between nodes,"
        " not on one machine's cores. And the memory saved matters where the model, not the "
        "~0.4 GB of each process, fills the device.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = section_parser(__doc__ or "", "layouts")
    args = parser.parse_args()
    results: dict[str, Any] | None = None
    if not args.report_only:
        results = {"machine": machine(), "runs": {}}
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="bench-layouts-") as tmp:
            results["runs"] = run_each(LAYOUTS, run, Path(tmp))
        results["suite_s"] = time.perf_counter() - t0
        results["load_1min"] = os.getloadavg()[0]
    return save_and_write(args, results, section, "layouts", START, END)


if __name__ == "__main__":
    raise SystemExit(main())
