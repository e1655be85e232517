"""Checkpoints of a large state: what a save and a resume cost each rank, per strategy.

A 20-layer MLP of 4096 x 4096 linear layers (336M parameters) trained one AdamW step holds
1.0B floats of state (parameters and two moments: 4.0 GB). On 2 CPU ranks (torchrun,
gloo, `OMP_NUM_THREADS=1`) every strategy and checkpoint kind saves it once through
`ddptrain.checkpoint.Checkpointer` (what the trainer calls), then resumes it:

    .venv/bin/python bench/checkpoints.py [--layers 20] [--cases ddp-file,fsdp-dcp]
        [--label raw | --tree DIR --label before]

Per rank it records the save's wall time (for `--async_checkpoint` also the time it held
training up), the bytes the process wrote (`wchar`), and for the resume (page cache
dropped first, so the reads are real) the wall time to locate, check and load the
checkpoint, the bytes it read from storage (`read_bytes`, which counts memory-mapped
reads) and its peak RSS growth. `--tree DIR` runs another checkout's `src` (e.g. the
code before a change) under the same harness and files its rows under `--label`;
`--label raw` saves and loads the same state with plain torch instead (`Raw`), the floor
the other rows are divided by. Each `--layers` is a table of its own. Single runs vary
much on shared cores: run the rows in rounds, each into its own `--results` file, and
`--median_of R1 R2 R3` writes their medians (each round's figures kept beside them).

The report goes into docs/BENCHMARKS.md between `<!-- checkpoints:start -->` and
`<!-- checkpoints:end -->`; raw figures in runs/bench/checkpoints.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START_MARK, END_MARK = "<!-- checkpoints:start -->", "<!-- checkpoints:end -->"
# strategy, --checkpoint_format, async
CASES = [
    ("ddp", "file", False), ("ddp", "dcp", False), ("ddp", "dcp", True),
    ("zero", "dcp", False), ("zero", "dcp", True), ("fsdp", "dcp", False), ("fsdp", "dcp", True),
]


def _io() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {k: int(v) for k, v in fields.items()}


def _rss_peak_kb() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith("VmHWM"))
    return int(line.split()[1])


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddptrain.checkpoint import Checkpointer
    from ddptrain.config import TrainingConfig
    from ddptrain.context import DistributedContext
    from ddptrain.parallel import resolve_strategy
    from ddptrain.train.optim import optimizer_spec

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ctx = DistributedContext(rank, rank, world, torch.device("cpu"), "gloo")
    config = TrainingConfig(
        strategy=args.strategy, optimizer="adamw", checkpoint_format=args.format,
        async_checkpoint=args.use_async, output_dir=str(args.dir),
        checkpoint_dir=str(args.dir / "checkpoints"),
    )
    torch.manual_seed(0)

    def build(device: Any = None) -> nn.Module:
        with torch.device(device or "cpu"):
            return nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])

    choice = resolve_strategy(config, world, ctx.device)
    strategy = choice.build(ctx, config, None)
    building = getattr(strategy, "build_module", None)
    module = building(build) if building else build()
    strategy.setup_module(module)
    optimizer = strategy.build_optimizer(module, optimizer_spec(config, 1e-4))
    module(torch.randn(8, args.width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    checkpoints = Checkpointer(config, ctx, strategy, args.format)
    meta = {"epoch": 0, "step": 1, "samples_in_epoch": 0, "bad_steps": 0, "bad_streak": 0}
    raw = Raw(args, module, optimizer) if args.raw else None

    dist.barrier()
    io0, t0 = _io(), time.perf_counter()
    if raw is not None:
        raw.save()
    else:
        checkpoints.save(1, meta, module, optimizer, best=True)  # an epoch end, the best
    blocking = time.perf_counter() - t0
    checkpoints.wait()
    save_s = time.perf_counter() - t0
    written = _io()["wchar"] - io0["wchar"]
    dist.barrier()

    if rank == 0:  # the resume reads from storage, not from the page cache the save filled
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5\n")  # VmHWM starts over
    rss0 = _rss_peak_kb()
    io0, t0 = _io(), time.perf_counter()
    if raw is not None:
        raw.load()
    else:
        # as a resume does: a step directory's entries checked as the load reads them
        # (a tree from before that, `--tree`, checks them first)
        one_pass = "checked_in_load" in inspect.signature(checkpoints.locate).parameters
        found = (checkpoints.locate("auto", checked_in_load=True) if one_pass
                 else checkpoints.locate("auto"))
        assert found is not None
        checkpoints.load(found[0], found[1], module, optimizer)
        del found
    resume_s = time.perf_counter() - t0
    io1 = _io()
    row = {
        "rank": rank, "save_s": save_s, "blocking_s": blocking, "written": written,
        "resume_s": resume_s, "read": io1["read_bytes"] - io0["read_bytes"],
        "rss_growth": (_rss_peak_kb() - rss0) * 1024,
    }
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        args.out.write_text(json.dumps(rows))
    del checkpoints, optimizer, module
    dist.barrier()
    dist.destroy_process_group()


class Raw:
    """The same state saved and loaded by hand with plain torch, the floor a checkpoint
    is held to: `.pt` (ddp) through `torch.save`/`torch.load`, a step directory (fsdp,
    zero) through `dcp.save`/`dcp.load` of `get_state_dict`; no checksums, no atomic
    rename, no progress, no pointer files."""

    def __init__(self, args: argparse.Namespace, module: Any, optimizer: Any) -> None:
        import torch.distributed as dist

        self.args, self.module, self.optimizer = args, module, optimizer
        self.rank = dist.get_rank()
        self.path = args.dir / ("raw.pt" if args.format == "file" else "raw-dcp")

    def save(self) -> None:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.args.format == "file":
            if self.rank == 0:
                state = {"model": self.module.state_dict(), "optim": self.optimizer.state_dict()}
                with self.path.open("wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
            dist.barrier()
        else:
            model, optim = get_state_dict(self.module, self.optimizer)
            dcp.save({"model": model, "optim": optim}, checkpoint_id=self.path)

    def load(self) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if self.args.format == "file":
            # torch.load as plain as it comes: the whole file read (mmap=True would leave
            # the optimizer's moments unread until the first step after the resume)
            state = torch.load(self.path, map_location="cpu", weights_only=True)
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
        else:
            model, optim = get_state_dict(self.module, self.optimizer)
            state = {"model": model, "optim": optim}
            dcp.load(state, checkpoint_id=self.path)
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])


def run_case(
    strategy: str, fmt: str, use_async: bool, args: argparse.Namespace, work: Path
) -> list[dict[str, Any]]:
    run_dir = work / f"{strategy}-{fmt}-{'async' if use_async else 'sync'}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    out = run_dir / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{args.tree / 'src'}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(Path(__file__).resolve()), "--worker", "--strategy", strategy,
           "--format", fmt, "--dir", str(run_dir), "--out", str(out),
           "--layers", str(args.layers), "--width", str(args.width)]
    if use_async:
        cmd.append("--use_async")
    if args.label == "raw":
        cmd.append("--raw")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{strategy} {fmt} failed")
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    subprocess.run(["rm", "-rf", str(run_dir / "checkpoints")], check=True)
    return rows


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Results of several rounds of the same rows (`--median_of`) as one: every figure the
    median over the rounds, each row's per-round save and resume times kept (`rounds`)."""
    import statistics

    out: dict[str, Any] = {**rounds[0], "sizes": {}}
    for layers, size in rounds[0]["sizes"].items():
        merged: dict[str, Any] = {"runs": {}, "rounds": len(rounds)}
        for label, cases in size["runs"].items():
            for key, ranks in cases.items():
                each = [r["sizes"][layers]["runs"][label][key] for r in rounds]
                row = [{field: statistics.median(e[rank][field] for e in each)
                        for field, value in ranks[rank].items()
                        if isinstance(value, (int, float))} for rank in range(len(ranks))]
                row[0]["each"] = {"save_s": [e[0]["save_s"] for e in each],
                                  "resume_s": [max(x["resume_s"] for x in e) for e in each]}
                merged["runs"].setdefault(label, {})[key] = row
        out["sizes"][layers] = merged
    return out


def report(results: dict[str, Any]) -> str:
    lines = [
        "## Checkpoints of large states against plain torch", "",
        f"`bench/checkpoints.py`, {results['date']}: MLPs of {results['width']} x "
        f"{results['width']} linear layers, one AdamW step, on 2 CPU ranks (gloo, one "
        "thread each); one save and one resume per row, through `Checkpointer` as the "
        "trainer calls it. Per rank: the save's wall time (async: the time it held "
        "training up, then the whole save), the bytes the process wrote, and after the "
        "page cache is dropped the resume's wall time (locate, checksums, load), the bytes "
        "it read from storage and its peak RSS growth. *raw* is the same state through "
        "plain `torch.save`/`torch.load` (ddp's `.pt`) or `dcp.save`/`dcp.load` (a step "
        "directory), with no checksums, atomic rename or progress; *x raw* divides by "
        "it. *before* is the tree before one-pass checksums (a save read each file back "
        "to checksum it, a resume read every file whole before the load); *after* is this "
        "tree.",
    ]
    for layers, size in sorted(results["sizes"].items(), key=lambda kv: int(kv[0])):
        floats = 3 * int(layers) * (results["width"] ** 2 + results["width"])
        rounds = size.get("rounds", 1)
        lines += [
            "", f"### {layers} layers: {floats / 1e9:.2f}B floats ({4 * floats / 1e9:.1f} GB "
            "of parameters and AdamW moments)", "",
            *([f"Medians of {rounds} rounds, the rows run in turn in each round; the last "
               "column gives each round's save and resume.", ""] if rounds > 1 else []),
            "| code | strategy | format | save s (rank 0 / 1) | x raw | held training s | "
            "GB written (rank 0 / 1) | resume s | x raw | GB read (rank 0 / 1) | "
            "peak RSS growth GB (rank 0 / 1) |" + (" rounds: save s; resume s |"
                                                    if rounds > 1 else ""),
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
            + (" --- |" if rounds > 1 else ""),
        ]
        raw = size["runs"].get("raw", {})
        for label, cases in size["runs"].items():
            for key, rows in cases.items():
                strategy, fmt, mode = key.split("-")
                r0, r1 = rows
                held = f"{r0['blocking_s']:.1f}" if mode == "async" else "="
                resume = max(r0["resume_s"], r1["resume_s"])
                base = raw.get(f"{strategy}-{fmt}-sync")
                save_x = resume_x = "="
                if base is not None and label != "raw":
                    save_x = f"{r0['save_s'] / base[0]['save_s']:.2f}"
                    resume_x = f"{resume / max(b['resume_s'] for b in base):.2f}"
                lines.append(
                    f"| {label} | {strategy} | {fmt}{' async' if mode == 'async' else ''} | "
                    f"{r0['save_s']:.1f} / {r1['save_s']:.1f} | {save_x} | {held} | "
                    f"{_gb(r0['written'])} / {_gb(r1['written'])} | {resume:.1f} | {resume_x} | "
                    f"{_gb(r0['read'])} / {_gb(r1['read'])} | "
                    f"{_gb(r0['rss_growth'])} / {_gb(r1['rss_growth'])} |"
                    + (f" {', '.join(f'{x:.1f}' for x in r0['each']['save_s'])}; "
                       f"{', '.join(f'{x:.1f}' for x in r0['each']['resume_s'])} |"
                       if "each" in r0 else "")
                )
    lines += ["", "Reading the tables: a ddp `.pt` is written by rank 0 alone and read whole "
              "by every rank (each rank needs the whole state); a DCP directory is written "
              "in parts by every rank (replicated tensors once, spread over the ranks) and "
              "each rank reads what it holds. The save is an epoch end that is the best so "
              "far (`latest.pt` and `best.pt` are hard links to the step file). A DCP save "
              "takes its checksums from the bytes as they are written and a resume checks "
              "each entry's bytes as DCP reads them to deserialise it, before the entry is "
              "loaded; a large write is summed on a helper thread while it is written "
              "(zlib and the write both let go of the GIL). A `.pt` save sums its tensors "
              "in 32 MB chunks on a few threads before torch writes them, and tells "
              "torch's zip writer not to sum every record again with its own CRC-32 "
              "(slower than zlib's, and as long as the write itself: *raw* pays it, which "
              "is why the 20-layer save is 0.71x raw); a `.pt` resume maps the file and "
              "checks each tensor from the page cache the read filled. *before* checked a step "
              "directory with a sequential read of every file, then loaded it: here the load "
              "found those bytes in the page cache (GB read is storage reads), which a state "
              "of 10-100 GB a node does not fit in. *raw* `.pt` is `torch.load` as it "
              "comes, the whole file read into each rank's memory (with `mmap=True` it would "
              "leave the optimizer's moments unread until the first step after the resume: "
              "the cost moved, not saved); ddptrain maps the file, so a rank's RSS counts "
              "the pages it touched. The RSS column counts mapped file pages "
              "too. Single runs on these 2 shared cores vary by up to a factor of two (raw fsdp "
              "save at 20 layers: 4.2 to 8.4 s), so each table is the median of 3 rounds, "
              "the rows in turn within a round (each round's figures in the last column); "
              "the *raw* and *after* rows are one later set of rounds than the *before* "
              "rows, on a busier machine (raw fsdp save at 6 layers 2.1 s against 1.6 s "
              "then), so *before* divided by today's *raw* reads low; bytes are exact.", ""]
    return "\n".join(lines)


def write_section(md: Path, text: str) -> None:
    block = f"{START_MARK}\n{text}{END_MARK}\n"
    current = md.read_text() if md.exists() else ""
    if START_MARK in current and END_MARK in current:
        head, rest = current.split(START_MARK, 1)
        md.write_text(head + block + rest.split(END_MARK, 1)[1].lstrip("\n"))
    else:
        md.write_text(current.rstrip("\n") + "\n\n" + block)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--format", default="file", help=argparse.SUPPRESS)
    parser.add_argument("--use_async", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--raw", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cases", default="",
                        help="comma-separated strategy-format[-async] cases (default: all)")
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--tree", type=Path, default=ROOT,
                        help="the checkout whose src/ is measured (default: this one)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-checkpoints")
    parser.add_argument("--results", type=Path,
                        default=ROOT / "runs" / "bench" / "checkpoints.json")
    parser.add_argument("--report_only", action="store_true")
    parser.add_argument("--median_of", type=Path, nargs="+",
                        help="results files of rounds of the same rows: write their medians "
                        "to --results (and the report)")
    args = parser.parse_args()
    if args.median_of:  # their sizes replace those of --results
        fresh = median_of([json.loads(p.read_text()) for p in args.median_of])
        kept = json.loads(args.results.read_text()) if args.results.exists() else {"sizes": {}}
        kept["sizes"].update(fresh["sizes"])
        kept.update(date=fresh["date"], width=fresh["width"])
        args.results.write_text(json.dumps(kept, indent=1))
        args.report_only = True
    if args.worker:
        worker(args)
        return 0
    results: dict[str, Any] = (
        json.loads(args.results.read_text()) if args.results.exists() else {"sizes": {}}
    )
    if not args.report_only:
        runs: dict[str, Any] = {}
        chosen = {c if c.count("-") == 2 else f"{c}-sync" for c in args.cases.split(",") if c}
        for strategy, fmt, use_async in CASES:
            key = f"{strategy}-{fmt}-{'async' if use_async else 'sync'}"
            if (chosen and key not in chosen) or (args.label == "raw" and use_async):
                continue
            print(f"{args.label}: {key}", flush=True)
            runs[key] = run_case(strategy, fmt, use_async, args, args.work)
        size = results.setdefault("sizes", {}).setdefault(str(args.layers), {"runs": {}})
        size["runs"].setdefault(args.label, {}).update(runs)
        results.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       width=args.width)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1))
    write_section(ROOT / "docs" / "BENCHMARKS.md", report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
