"""What one optimizer step costs around its arithmetic, per layout: the collectives it
makes (the layout's own and ddptrain's), the host reads of device values it makes, and
the resident memory of a rank at its first step against a plain torch process doing
the same. `make bench` runs it:

    .venv/bin/python bench/step_costs.py          # about 2 minutes on 2 cores

Each layout of bench/layouts.py (and zero) trains the built-in GPT (2 blocks, width 256,
64-token windows) under torchrun on 2 or 4 ranks, with AdamW and ddptrain's defaults
(`--max_bad_steps` 5: every step's gradients are checked for non-finite values; no
clipping), through `ddptrain.fit` with a hook that watches steps 2 to the last:

- **collectives** from torch's flight recorder (on in every ddptrain run), each filed
  under the step whose window (from the end of the step before to its own end) it was
  issued in, and by who issued it: the first caller outside torch's c10d API is ddptrain
  (its own all-reduces) or torch (DDP's bucket all-reduces, FSDP's all-gathers and
  reduce-scatters, DTensor's redistributions, the pipeline's sends and receives);
- **host reads** counted by dispatch (`bench/host_reads.py`) and filed the same way; the
  read at `settle` is the verdict of the step before, read after this step's forward and
  backward are queued (on a GPU from a pinned copy whose event has passed: it does not
  wait for the device);
- **resident memory** (`VmRSS`) at the end of the first step, the largest over the ranks.
  The plain process is a hand-written DDP loop of a GPT of the same shape built from
  `torch.nn` alone, with AdamW, on 2 ranks (`bench/contestants/plain_gpt.py`).

No metric row falls inside the watched steps (`--log_interval` above the epoch's steps),
so what is counted is the hot path alone; the epoch's one metric sync comes after it.

The report goes into docs/BENCHMARKS.md between `<!-- step-costs:start -->` and
`<!-- step-costs:end -->`; raw figures are kept in runs/bench/step_costs.json, and
`--report_only` rebuilds the section from them.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.contestants.plain_gpt import rss_mb  # noqa: E402
from bench.layouts import (  # noqa: E402
    BLOCK,
    GLOBAL_BATCH,
    LAYOUTS,
    WIDTH,
    Layout,
    run_each,
)
from bench.run import bench_env, machine  # noqa: E402
from bench.sharding import save_and_write, section_parser  # noqa: E402

START, END = "<!-- step-costs:start -->", "<!-- step-costs:end -->"
STEP_LAYOUTS: list[Layout] = [LAYOUTS[0], Layout("zero", 2, {"strategy": "zero"}), *LAYOUTS[1:]]
PLAIN = ROOT / "bench" / "contestants" / "plain_gpt.py"
C10D = ("torch/distributed/distributed_c10d.py", "torch/distributed/c10d_logger.py")
RUN_TIMEOUT_S = 600


def _short(path: str) -> str:
    for marker in ("/src/ddptrain/", "/site-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _collective(entry: dict[str, Any]) -> tuple[str, str]:
    """(who issued it, the op): ddptrain's `file:function` or `torch`, and the c10d
    function called (`all_reduce`, `reduce_scatter_single`, ...)."""
    frames = entry.get("frames") or []
    op = str(entry.get("profiling_name", "?")).split(":")[-1]
    api = next((i for i, f in enumerate(frames) if f["filename"].endswith(C10D[0])), 0)
    if frames and frames[api]["filename"].endswith(C10D[0]):
        op = frames[api]["name"]
    caller = next((f for f in frames[api:] if not f["filename"].endswith(C10D)), None)
    if caller is None:
        return "unrecorded", op  # the recorder kept no stack for it
    if "/src/ddptrain/" in caller["filename"]:
        return f"ddptrain {_short(caller['filename'])}:{caller['name']}", op
    return "torch", op


def child(fields: dict[str, Any], out: Path) -> None:
    """One layout's run on this rank (under torchrun): writes `rank<R>.json`."""
    import torch

    from bench.host_reads import HostReads
    from ddptrain import fit
    from ddptrain.observe import Hook

    rank = int(os.environ["RANK"])

    class Probe(Hook):
        def __init__(self) -> None:
            self.reads = HostReads()
            self.ends: list[tuple[int, int]] = []  # (step, time.time_ns()) at each step's end
            self.rss_mb = 0.0
            self.p2p: list[tuple[int, str]] = []  # (time.time_ns(), kind) of each send, receive

        def on_epoch_start(self, run: Any, epoch: int) -> None:
            self.reads.step = run.step
            self.reads.__enter__()
            schedules = sys.modules.get("torch.distributed.pipelining.schedules")
            if schedules is not None:  # gloo's sends and receives are not recorded
                batch = schedules._batch_p2p

                def counted(ops: list[Any], *args: Any, **kwargs: Any) -> Any:
                    now = time.time_ns()
                    self.p2p += [(now, f"torch | {op.op.__name__}") for op in ops]
                    return batch(ops, *args, **kwargs)

                schedules._batch_p2p = counted

        def on_step_end(self, run: Any) -> None:
            step = run.step
            self.ends.append((step, time.time_ns()))
            self.reads.step = step
            if len(self.ends) == 1:
                self.rss_mb = rss_mb()

        def on_row(self, run: Any, row: dict[str, Any]) -> None:
            if self.reads.active:
                self.reads.__exit__(None, None, None)

        def on_fit_end(self, run: Any, summary: dict[str, Any]) -> None:
            if self.reads.active:
                self.reads.__exit__(None, None, None)
            recorder = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
            per_step: dict[int, Counter[str]] = {}
            reads: dict[int, Counter[str]] = {}
            windows = zip(self.ends, self.ends[1:], strict=False)
            for (before, start), (step, end) in windows:
                issued = [(entry["time_created_ns"], " | ".join(_collective(entry)))
                          for entry in recorder.get("entries", [])] + self.p2p
                per_step[step] = Counter(kind for t, kind in issued if start < t <= end)
                # a read filed under step k was made after step k's end: in step k+1
                reads[step] = Counter(r.split(" at ")[1] for r in self.reads.reads[before])
            (out / f"rank{rank}.json").write_text(json.dumps({
                "rss_mb": self.rss_mb, "collectives": per_step, "reads": reads,
                "steps": run.step,
                "recorder_entries": len(recorder.get("entries", [])),
            }))

    fit(output_dir=str(out / "run"), dataset="bench.layouts:windows", model="gpt",
        width=WIDTH, block_size=BLOCK, epochs=1, optimizer="adamw", lr=0.001,
        log_interval=1000, tensorboard=False, curves=False, save_every=0, seed=0,
        hooks=[Probe()], **fields)


def _torchrun(ranks: int, args: list[str], out: Path, name: str,
              script: str = __file__) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
           f"--nproc_per_node={ranks}", script, *args, "--out", str(out)]
    done = subprocess.run(cmd, env=bench_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def _per_step(ranks: list[dict[str, Any]], key: str) -> dict[str, float]:
    """What rank 0 made per watched step, as the median over the steps, by kind."""
    steps = ranks[0][key]
    kinds = {k for count in steps.values() for k in count}
    medians = {k: statistics.median(count.get(k, 0) for count in steps.values())
               for k in sorted(kinds)}
    return {k: n for k, n in medians.items() if n}  # not those of a step or two


def measure(layout: Layout, out: Path) -> dict[str, Any]:
    batch = GLOBAL_BATCH // layout.data_parallel
    fields = {**layout.fields, "batch_size": batch}
    ranks = _torchrun(layout.ranks, ["--child", json.dumps(fields)], out, layout.name)
    return {
        "ranks": layout.ranks, "flags": layout.flags, "steps": ranks[0]["steps"],
        "watched": len(ranks[0]["collectives"]),
        "collectives": _per_step(ranks, "collectives"), "reads": _per_step(ranks, "reads"),
        "rss_mb": max(r["rss_mb"] for r in ranks),
        "recorder_entries": ranks[0]["recorder_entries"],
    }


def _ops(counts: dict[str, float], who: str) -> str:
    by_op = Counter[str]()
    for kind, n in counts.items():
        owner, op = kind.split(" | ")
        if owner.split(" ")[0] == who:
            by_op[op] += n  # type: ignore[assignment]
    return ", ".join(f"{n:g} {op}" for op, n in sorted(by_op.items())) or "none"


def _sites(counts: dict[str, float]) -> str:
    """`n at function (file)` for each site: a collective's `ddptrain file:function | op`
    or a read's `file:line function`."""
    by_site = Counter[str]()
    for kind, n in counts.items():
        site = kind.split(" | ")[0].removeprefix("ddptrain ")
        if ":" in site and " " in site:  # file:line function
            where, function = site.split(" ")
            site = f"{where.split(':')[0]}:{function}"
        path, function = site.rsplit(":", 1)
        by_site[f"`{function}` ({path.rsplit('/', 1)[-1]})"] += n  # type: ignore[assignment]
    return ", ".join(f"{n:g} at {site}" for site, n in by_site.items()) or "none"


def section(results: dict[str, Any]) -> str:
    m, runs, plain = results["machine"], results["runs"], results["plain_rss_mb"]
    lines = [
        "## What a step costs around its arithmetic: collectives, host reads, memory", "",
        f"`bench/step_costs.py`, {m['date_utc']}, {m['cpu']}, {m['cores']} cores, torch "
        f"{m['torch']} ({results['suite_s']:.0f} s in all). Each layout trains the built-in "
        f"GPT (2 blocks, width {WIDTH}, {BLOCK}-token windows) with a global batch of "
        f"{GLOBAL_BATCH}, AdamW and ddptrain's defaults (every step checked for non-finite "
        "gradients, no clipping); the figures are rank 0's per step, the median over the "
        "steps after the first (no metric row among them), counted as they happen: "
        "collectives from torch's flight recorder, host reads of device values by dispatch.",
        "",
        "| layout | ranks | collectives per step: the layout's (torch) | ddptrain's own "
        "| host reads per step | resident at the first step (MB) |",
        "| --- | ---: | --- | --- | --- | ---: |",
    ]
    for name, r in runs.items():
        own = _sites({k: v for k, v in r["collectives"].items() if k.startswith("ddptrain")})
        lines.append(
            f"| {name} (`{' '.join(r['flags'])}`) | {r['ranks']} | "
            f"{_ops(r['collectives'], 'torch')} | {own} | "
            f"{_sites(r['reads'])} | {r['rss_mb']:.0f} |"
        )
    base = runs["ddp"]["rss_mb"]
    lines += [
        f"| plain torch: a hand-written DDP loop, same shape, AdamW | 2 | | | | {plain:.0f} |",
        "",
        f"- **Resident memory at the first step**: ddp {base:.0f} MB against {plain:.0f} MB "
        f"for the hand-written loop (**{base - plain:+.0f} MB**, target within 50 MB). "
        "The first `torch.optim` optimizer a process builds imports `torch._dynamo`, and "
        "with it DTensor and FSDP, in the plain loop too; what ddptrain adds is its own "
        "modules, DCP's and the pipeline's (about 10 MB and 0.1 s of imports), the flight "
        "recorder's ring and its metric buffers.",
        "- **Collectives.** The layout's own are what the layout is: DDP's bucket "
        "all-reduces, zero's one broadcast per rank of the parameters it stepped (one flat "
        "bucket each), FSDP's all-gathers and reduce-scatters (HSDP adds the replicas' "
        "all-reduce of each reduce-scattered shard), DTensor's all-reduces of "
        "tensor-parallel activations, the pipeline's sends and receives of activations and "
        "their gradients, each named by the c10d function called. ddptrain's own is one "
        "per step: the window's token count and, where ranks hold different gradients "
        "(fsdp, tp, pp), this rank's non-finite flag in the same all-reduce "
        "(`rescale_to_global_count`). A pipeline adds the sum of the tied embedding's "
        "gradient between its first and last stage (`finish_gradients`): part of its "
        "gradient reduction, issued by ddptrain.",
        "- **Host reads.** One per step in every layout: `settle` reads the verdict of the "
        "step before, after this step's forward and backward are queued, from a pinned "
        "copy whose event has passed, so on a GPU it waits for nothing. The step itself is "
        "skipped on the device where it is not finite (the fused AdamW takes the flag; "
        "zero's local one too). A user's own optimizer, or SGD over DTensor shards (torch "
        "has no fused SGD for DTensor), still reads its verdict before its step.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = section_parser(__doc__ or "", "step_costs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--layouts", nargs="*", help="only these layouts (names as reported)")
    args = parser.parse_args()
    if args.child is not None:
        child(json.loads(args.child), args.out)
        return 0
    results: dict[str, Any] | None = None
    if not args.report_only:
        results = {"machine": machine(), "runs": {}}
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="bench-steps-") as tmp:
            results["runs"] = run_each(STEP_LAYOUTS, measure, Path(tmp), args.layouts or ())
            plain = _torchrun(2, [], Path(tmp) / "plain", "plain", str(PLAIN))
            results["plain_rss_mb"] = max(r["rss_mb"] for r in plain)
        results["suite_s"] = time.perf_counter() - t0
    return save_and_write(args, results, section, "step costs", START, END)


if __name__ == "__main__":
    raise SystemExit(main())
