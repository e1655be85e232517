"""ddptrain's three strategies side by side: ddp (replicas), zero (DDP with the optimizer
state sharded) and fsdp (FSDP2: parameters, gradients and optimizer state sharded), on 2
CPU ranks (torchrun, gloo, `OMP_NUM_THREADS=1`), each run through `ddptrain train` as a
user starts it. `make bench` runs it after bench/run.py:

    .venv/bin/python bench/sharding.py [--repeats N]

It measures
- step time: the median of the train rows' `step_time_s` after the first log interval,
  on the mlp, miniresnet and gpt workloads, and each strategy's ratio to ddp;
- memory on a 17M-parameter MLP trained with AdamW: peak RSS of every rank (VmHWM, read
  from /proc while the run lives, and rank 0's `peak_rss_mb` rows) and the bytes rank 0
  holds (summary.json `rank0_bytes`);
- checkpoints of that model: what each save costs the training loop (fsdp with
  synchronous DCP, fsdp with `--async_checkpoint`, ddp's single file), and the time a
  `--resume_from auto` start takes to its first step against a fresh start.

The report goes into docs/BENCHMARKS.md between the lines `<!-- sharding:start -->` and
`<!-- sharding:end -->` (appended when missing; bench/run.py rewrites the rest of the
file). Raw figures are kept in runs/bench/sharding.json, beside bench/run.py's.
`--report_only` rebuilds the section from them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.run import bench_env, machine  # noqa: E402

STRATEGIES = ("ddp", "zero", "fsdp")
# Step-time workloads, each sized to a run of a few seconds past start-up with enough
# train rows (every --log_interval optimizer steps) for a median after the first one.
WORKLOADS: dict[str, list[str]] = {
    "mlp": ["--dataset", "digits", "--model", "mlp", "--width", "256", "--batch_size", "16",
            "--epochs", "2", "--log_interval", "10"],
    "miniresnet": ["--dataset", "digits", "--model", "miniresnet", "--width", "16",
                   "--batch_size", "32", "--epochs", "2", "--log_interval", "5"],
    "gpt": ["--dataset", "chars", "--model", "gpt", "--block_size", "64", "--width", "64",
            "--batch_size", "16", "--epochs", "3", "--log_interval", "5"],
}
# The memory and checkpoint model: an MLP of 17,088,522 parameters (digits, width 4096)
# with AdamW, 23 optimizer steps in its one epoch, a train row after every step so that
# the steps after a checkpoint can be told from the others.
BIG_WIDTH = 4096
BIG = ["--dataset", "digits", "--model", "mlp", "--width", str(BIG_WIDTH), "--optimizer",
       "adamw", "--batch_size", "32", "--log_interval", "1"]
BIG_EPOCHS = 1
SAVE_EVERY_STEPS = 5  # steps 5, 10, 15, 20 of 23; the epoch's end saves in every run
# The checkpoint runs: (name, strategy, extra flags).
CHECKPOINT_RUNS: list[tuple[str, str, list[str]]] = [
    ("ddp file", "ddp", []),
    ("fsdp dcp sync", "fsdp", []),
    ("fsdp dcp async", "fsdp", ["--async_checkpoint"]),
]
RESUME_STRATEGIES = ("ddp", "fsdp")
RESUME_PAIRS = 3  # fresh and resumed starts per strategy and repeat, in alternating order
RUN_TIMEOUT_S = 300.0
POLL_S = 0.02
MAX_LOAD = 1.5  # wait for the 1-minute load average to drop below this before starting
START_MARK, END_MARK = "<!-- sharding:start -->", "<!-- sharding:end -->"


@dataclass
class Watch:
    """What a poller sees of a live run: every worker's VmHWM (peak RSS) by rank, and the
    wall time at which metrics.jsonl first grew a new train row."""

    metrics: Path
    skip_bytes: int = 0  # metrics.jsonl's size before the launch (a resume appends)
    hwm_mb: dict[int, float] = field(default_factory=dict)
    first_row_at: float | None = None
    workers: set[int] = field(default_factory=set)


def kill(proc: subprocess.Popen[str], watch: Watch) -> None:
    """Kill the run: torchrun's session and its workers, which run in sessions of their
    own and would otherwise go on without torchrun."""
    for pid in watch.workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for thread in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (thread / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return kids


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        return None
    return None


def _poll(proc: subprocess.Popen[str], watch: Watch, stop_at_first_row: bool) -> None:
    """Read the workers' (torchrun's children's) peak RSS and watch metrics.jsonl until the
    run ends; with `stop_at_first_row`, kill the run once its first train row is there."""
    ranks: dict[int, int] = {}
    while proc.poll() is None:
        for pid in _children(proc.pid):
            if pid not in ranks:
                rank = _rank_of(pid)
                if rank is None:
                    continue
                ranks[pid] = rank
                watch.workers.add(pid)
            hwm = _hwm_mb(pid)
            if hwm is not None:
                rank = ranks[pid]
                watch.hwm_mb[rank] = max(hwm, watch.hwm_mb.get(rank, 0.0))
        if watch.first_row_at is None and _new_train_row(watch):
            watch.first_row_at = time.time()
            if stop_at_first_row:
                kill(proc, watch)
                return
        time.sleep(POLL_S)


def _new_train_row(watch: Watch) -> bool:
    try:
        with watch.metrics.open("rb") as f:
            f.seek(watch.skip_bytes)
            return b'"split": "train"' in f.read()
    except OSError:
        return False


def cpu_seconds() -> dict[str, float]:
    """The machine's CPU time so far, from /proc/stat: busy (user, nice, system, irq,
    softirq), iowait and steal (time the hypervisor gave this machine's vCPUs to others)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, iowait, irq, softirq, steal = fields[:8]
    return {"busy": (user + nice + system + irq + softirq) / tick, "iowait": iowait / tick,
            "steal": steal / tick}


def own_cpu_seconds() -> float:
    """CPU time of this process (its poller) and of its finished children (torchrun and,
    through it, its workers)."""
    return sum(u.ru_utime + u.ru_stime for u in (
        resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    ))


def launch(
    out_dir: Path, tag: str, strategy: str, args: list[str], *,
    fresh: bool = True, stop_at_first_row: bool = False,
) -> dict[str, Any]:
    """One `ddptrain train` under torchrun; returns its figures (`error` on failure)."""
    run_dir = out_dir / tag
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "ddptrain", "train", *args, "--strategy", strategy, "--output_dir", str(run_dir),
    ]
    metrics = run_dir / "metrics.jsonl"
    watch = Watch(metrics, metrics.stat().st_size if metrics.exists() else 0)
    os.sync()  # the previous run's writes reach the disk before this one starts
    load = os.getloadavg()[0]
    cpu0, own0 = cpu_seconds(), own_cpu_seconds()
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=bench_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    poller = threading.Thread(target=_poll, args=(proc, watch, stop_at_first_row))
    poller.start()
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill(proc, watch)
        output, _ = proc.communicate()
        output += f"\n(killed after {RUN_TIMEOUT_S:.0f}s)\n"
    poller.join()
    wall = time.time() - t0
    cpu1, own1 = cpu_seconds(), own_cpu_seconds()
    row: dict[str, Any] = {
        "tag": tag, "strategy": strategy, "command": " ".join(cmd[1:]), "load_1min": load,
        "wall_s": wall, "killed": stop_at_first_row, "own_cpu_s": own1 - own0,
        "machine_cpu_s": {k: cpu1[k] - cpu0[k] for k in cpu1 if k in cpu0},
        "peak_rss_mb_by_rank": [watch.hwm_mb[r] for r in sorted(watch.hwm_mb)],
        "first_row_s": None if watch.first_row_at is None else watch.first_row_at - t0,
    }
    summary = run_dir / "summary.json"
    if stop_at_first_row:
        ok = watch.first_row_at is not None
    else:
        ok = proc.returncode == 0 and summary.exists()
    if not ok:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{tag}.log").write_text(output)
        errors = [ln for ln in output.splitlines() if "Error" in ln or "error" in ln]
        last = errors[-1:] or output.strip().splitlines()[-1:] or ["no output"]
        row["error"] = f"exit {proc.returncode}: {last[0].strip()}"
        row["log"] = str(out_dir / f"{tag}.log")
        print(f"  {tag}: FAILED ({row['error']})", flush=True)
        return row
    if not stop_at_first_row:
        row["summary"] = json.loads(summary.read_text())
        rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
        row["train_rows"] = [
            {k: r.get(k) for k in ("step", "step_time_s", "samples_per_sec", "peak_rss_mb")}
            for r in rows if r.get("split") == "train"
        ]
        row["checkpoint_mb"] = _checkpoint_mb(run_dir / "checkpoints")
    print(f"  {tag}: {_describe(row)}", flush=True)
    return row


def _checkpoint_mb(directory: Path) -> dict[str, float]:
    """Size on disk of each checkpoint (a file or a step directory)."""
    sizes: dict[str, float] = {}
    if not directory.is_dir():
        return sizes
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink() or entry.name.startswith("."):
            continue
        if entry.is_dir():
            sizes[entry.name] = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        elif entry.suffix == ".pt":
            sizes[entry.name] = entry.stat().st_size
    return {k: v / 2**20 for k, v in sizes.items()}


def _describe(row: dict[str, Any]) -> str:
    if "summary" not in row:
        return f"first train row {row['first_row_s']:.2f} s after launch"
    return (f"{step_ms(row):.2f} ms/step, peak RSS {max(row['peak_rss_mb_by_rank']):.0f} MB, "
            f"{row['wall_s']:.1f} s")


def step_ms(row: dict[str, Any]) -> float:
    """Median ms per optimizer step over the train rows after the first log interval."""
    times = [r["step_time_s"] for r in row["train_rows"][1:]]
    return statistics.median(times) * 1e3


def rotated(names: tuple[str, ...], r: int) -> list[str]:
    shift = r % len(names)
    return list(names[shift:] + names[:shift])


def wait_for_quiet(max_wait_s: float) -> float:
    """Wait (at most `max_wait_s`) for the 1-minute load average to drop below MAX_LOAD;
    returns the seconds waited."""
    t0 = time.time()
    while os.getloadavg()[0] > MAX_LOAD and time.time() - t0 < max_wait_s:
        print(f"load {os.getloadavg()[0]:.2f} > {MAX_LOAD}: waiting", flush=True)
        time.sleep(10)
    return time.time() - t0


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    load_before_wait = os.getloadavg()
    waited = wait_for_quiet(args.max_wait_s)
    started = time.time()
    results: dict[str, Any] = {
        "repeats": args.repeats, "workloads": WORKLOADS, "big": BIG, "big_epochs": BIG_EPOCHS,
        "save_every_steps": SAVE_EVERY_STEPS, "steps": [], "memory": [], "checkpoints": [],
        "resume": [], "load_before_wait": load_before_wait, "waited_s": waited,
        "load_at_start": os.getloadavg(),
    }
    for workload, flags in WORKLOADS.items():
        for r in range(args.repeats):
            print(f"{workload}: repeat {r + 1}/{args.repeats}", flush=True)
            for strategy in rotated(STRATEGIES, r):
                row = launch(out_dir, f"{workload}-{strategy}-{r}", strategy, flags)
                results["steps"].append({**row, "workload": workload, "repeat": r})
    big = [*BIG, "--epochs", str(BIG_EPOCHS), "--save_every", "0"]
    for r in range(args.repeats):
        print(f"memory and checkpoints (width {BIG_WIDTH}): repeat {r + 1}/{args.repeats}",
              flush=True)
        for strategy in rotated(STRATEGIES, r):
            row = launch(out_dir, f"big-{strategy}-{r}", strategy, big)
            results["memory"].append({**row, "repeat": r})
            # Each strategy's checkpoint runs follow its run without step saves, which
            # they are compared with.
            for name, _strategy, extra in (c for c in CHECKPOINT_RUNS if c[1] == strategy):
                tag = f"big-{name.replace(' ', '-')}-{r}"
                saves = ["--save_every_steps", str(SAVE_EVERY_STEPS), *extra]
                row = launch(out_dir, tag, strategy, [*big, *saves])
                results["checkpoints"].append({**row, "name": name, "repeat": r})
                # Their sizes are recorded; the checkpoints themselves are not needed.
                shutil.rmtree(out_dir / tag / "checkpoints", ignore_errors=True)
        # Resume: the run directory of the run just made continues for one more epoch
        # (`--resume_from auto`), against a fresh start of the same command; each is
        # stopped once its first train row (after optimizer step 1) is written.
        more = [*BIG, "--epochs", str(BIG_EPOCHS + 1), "--save_every", "0"]
        for strategy in RESUME_STRATEGIES:
            for pair in range(RESUME_PAIRS):
                order = ("fresh", "resume") if (r + pair) % 2 == 0 else ("resume", "fresh")
                for kind in order:
                    if kind == "fresh":
                        row = launch(out_dir, f"start-{strategy}-{r}-{pair}", strategy, more,
                                     stop_at_first_row=True)
                    else:  # killed at its first row, it leaves the checkpoint as it was
                        row = launch(out_dir, f"big-{strategy}-{r}", strategy,
                                     [*more, "--resume_from", "auto"], fresh=False,
                                     stop_at_first_row=True)
                    results["resume"].append({**row, "kind": kind, "repeat": r})
    results["suite_seconds"] = time.time() - started
    results["load_at_end"] = os.getloadavg()
    results["machine"] = machine()
    return results


# ---------------------------------------------------------------------- report
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _f(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _ok(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if "error" not in r and all(r.get(k) == v for k, v in match.items())]


def _errors(results: dict[str, Any]) -> list[str]:
    out = []
    for section in ("steps", "memory", "checkpoints", "resume"):
        for r in results[section]:
            if "error" in r:
                out.append(f"- `{r['tag']}` failed ({r['error']}): `{r['command']}`")
    return out


def save_costs(row: dict[str, Any]) -> dict[str, Any]:
    """What a run's step checkpoints cost its training loop, from its own train rows (one
    after every step), so that the run-to-run spread of whole runs does not enter.

    `held_s`: for each step save, the row of the step after it (which holds the save: the
    saving step's row is written before it) less the median of the rows that follow no
    save; median over the saves. `excess_s`: every row after the first less that median,
    summed and divided by the number of saves: it also holds what a background write
    takes from the later steps it overlaps."""
    rows = row["train_rows"]
    after = {s + 1 for s in range(SAVE_EVERY_STEPS, rows[-1]["step"], SAVE_EVERY_STEPS)}
    normal = [r["step_time_s"] for r in rows[1:] if r["step"] not in after]
    typical = statistics.median(normal)
    held = [r["step_time_s"] - typical for r in rows if r["step"] in after]
    excess = sum(r["step_time_s"] - typical for r in rows[1:])
    return {
        "saves": len(after), "held_s": _median(held), "excess_s": excess / len(after),
        "typical_step_s": typical,
        "reported_s": row["summary"].get("checkpoint_blocking_s_median"),
        "size_mb": _median(list(row["checkpoint_mb"].values())),
        "peak_rss_mb": max(row["peak_rss_mb_by_rank"], default=None),
    }


WRAP = 88  # the report's prose width, as bench/report.py writes it


def para(text: str) -> list[str]:
    return textwrap.wrap(text, WRAP, break_long_words=False, break_on_hyphens=False)


def bullet(text: str) -> list[str]:
    return textwrap.wrap(text, WRAP, initial_indent="- ", subsequent_indent="  ",
                         break_long_words=False, break_on_hyphens=False)


def section(results: dict[str, Any]) -> str:
    m = results["machine"]
    load = results["load_at_start"]
    during = [r["load_1min"] for s in ("steps", "memory", "checkpoints", "resume")
              for r in results[s]]
    cores = m["cores"] or 2
    # Over the runs that ran to their end (a killed run's workers are not this process's
    # to account for): what the machine did besides them.
    whole = [r for s in ("steps", "memory", "checkpoints") for r in results[s]
             if r.get("machine_cpu_s")]
    span = sum(r["wall_s"] for r in whole) * cores
    cpu = {k: sum(r["machine_cpu_s"][k] for r in whole) for k in ("busy", "iowait", "steal")}
    others = cpu["busy"] - sum(r["own_cpu_s"] for r in whole)
    waited = (f" (after waiting {results['waited_s']:.0f} s for it to drop from "
              f"{results['load_before_wait'][0]:.2f})" if results["waited_s"] >= 1 else "")
    lines = [
        "## Sharding: ddp, zero, fsdp",
        "",
        *para("Generated by `bench/sharding.py` (`make bench` runs it after `bench/run.py`); "
              "every number in this section comes from one run of it."),
        "",
        *bullet(f"**date**: {m['date_utc']}"),
        *bullet(f"**machine**: {m['cpu']}, {m['cores']} cores, {m.get('memory_gib', '?')} "
                f"GiB; Python {m['python']}, torch {m['torch']}"),
        *bullet(f"**load** (1/5/15-minute averages) at the start: {load[0]:.2f} / "
                f"{load[1]:.2f} / {load[2]:.2f}{waited}; the 1-minute average at the launches "
                f"{min(during):.2f}..{max(during):.2f} (median "
                f"{statistics.median(during):.2f}), {results['load_at_end'][0]:.2f} at the "
                "end (the 2 ranks alone make 2)"),
        *(bullet(f"**other work**: over the runs that went to their end, processes other than "
                f"the benchmark's (and the kernel's own work, such as writing dirty pages "
                f"back) kept {others / span:.1%} of the {cores} cores busy, and the hypervisor "
                f"took {cpu['steal'] / span:.1%} of them (steal); the runs themselves used "
                f"{(cpu['busy'] - others) / span:.1%} (from /proc/stat and the runs' "
                "rusage)") if span else []),
        *bullet("**set-up**: 2 ranks (torchrun, gloo, CPU), `OMP_NUM_THREADS=1`, every run "
                f"`ddptrain train` as a user starts it; {results['repeats']} repeat(s), "
                "strategies in an order rotated each repeat; medians over the repeats, "
                "ratios of the medians; whole section "
                f"{results['suite_seconds'] / 60:.1f} min"),
        "",
        "### Step time",
        "",
        "| workload | flags | ddp ms/step | zero ms/step | fsdp ms/step | zero / ddp "
        "| fsdp / ddp |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for workload, flags in results["workloads"].items():
        med = {s: _median([step_ms(r) for r in _ok(results["steps"], workload=workload,
                                                     strategy=s)]) for s in STRATEGIES}
        ddp = med["ddp"]
        ratios = [None if med[s] is None or not ddp else med[s] / ddp for s in ("zero", "fsdp")]
        lines.append(
            f"| {workload} | `{' '.join(flags)}` | {_f(med['ddp'])} | {_f(med['zero'])} | "
            f"{_f(med['fsdp'])} | {_f(ratios[0], 3)} | {_f(ratios[1], 3)} |"
        )
    lines += ["", *para(
        "ms/step is the median of the train rows' `step_time_s` (metrics.jsonl, one row every "
        "`--log_interval` optimizer steps) after the first row, which holds the first step; "
        "it holds every row's all-reduce of the metric sums, alike for the three strategies."
    )]
    lines += _memory(results)
    lines += _checkpoints(results)
    lines += _resume(results)
    lines += [
        "",
        "### What 2 CPU cores cannot show",
        "",
        *para(
            "On CPU gloo, communication and computation share the same 2 cores: fsdp's "
            "all-gathers (before each block's forward and backward) and reduce-scatters, and "
            "zero's broadcast of the updated parameters, find no idle core or copy engine to "
            "overlap with, so the ratios above are their full price on a saturated machine. "
            "On a GPU cluster with NCCL they overlap with compute (fsdp prefetches the next "
            "block's parameters), and what fsdp buys is memory: each of N ranks holds 1/N of "
            "parameters, gradients and optimizer state, so models that do not fit one GPU "
            "train; with 2 ranks here the sharded part halves, beside the ~0.4 GB every "
            "process holds anyway. Likewise `--async_checkpoint` hides the write behind the "
            "steps only where a core (or a GPU's host side) is idle; and one local disk "
            "cannot show a parallel file system taking every rank's DCP shard at once."
        ),
    ]
    errors = _errors(results)
    if errors:
        lines += ["", "Runs that failed (the command and its last error line; the whole log "
                  "is kept beside the results):", "", *errors]
    return "\n".join(lines) + "\n"


def _memory(results: dict[str, Any]) -> list[str]:
    ddp_rows = _ok(results["memory"], strategy="ddp")
    params = ddp_rows[0]["summary"]["rank0_bytes"]["params"] / 4 if ddp_rows else None
    title = f"MLP of {params / 1e6:.1f}M parameters" if params else "a large MLP"
    lines = [
        "",
        f"### Memory per rank: {title}, AdamW",
        "",
        f"`ddptrain train {' '.join(results['big'])} --epochs {results['big_epochs']} "
        "--save_every 0 --strategy S`",
        "",
        "| strategy | params (MiB) | grads (MiB) | optimizer (MiB) | sum (MiB) | peak RSS "
        "rank 0 in training (MB) | peak RSS rank 0 / rank 1, whole run (MB) | ms/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    held_by: dict[str, dict[str, float]] = {}
    for strategy in STRATEGIES:
        rows = _ok(results["memory"], strategy=strategy)
        if not rows:
            lines.append(f"| {strategy} | failed | | | | | | |")
            continue
        held = held_by[strategy] = {k: v / 2**20 for k, v in
                                    rows[0]["summary"]["rank0_bytes"].items()}
        train_rss = _median([max(t["peak_rss_mb"] for t in r["train_rows"]) for r in rows])
        per_rank = [_median([r["peak_rss_mb_by_rank"][i] for r in rows])
                    for i in range(len(rows[0]["peak_rss_mb_by_rank"]))]
        lines.append(
            f"| {strategy} | {_f(held['params'], 1)} | {_f(held['grads'], 1)} | "
            f"{_f(held['optimizer'], 1)} | {_f(sum(held.values()), 1)} | {_f(train_rss, 0)} | "
            f"{' / '.join(_f(v, 0) for v in per_rank)} | "
            f"{_f(_median([step_ms(r) for r in rows]))} |"
        )
    lines += ["", *para(
        "Params, grads and optimizer are summary.json's `rank0_bytes`: what rank 0 holds "
        "after training. Peak RSS in training is the largest `peak_rss_mb` of rank 0's "
        "train rows; whole run is each worker's VmHWM, read from /proc every 20 ms while it "
        "lives, so it also holds the final checkpoint and the export of model.safetensors. "
        "Every process also holds about 0.4 GB of interpreter, torch and data, alike under "
        "every strategy; ms/step here has a train row (and its all-reduce) after every step."
    )]
    if "ddp" in held_by and "zero" in held_by and held_by["ddp"]["optimizer"]:
        share = held_by["zero"]["optimizer"] / held_by["ddp"]["optimizer"]
        lines += ["", *para(
            f"Under zero rank 0 holds {share * 100:.0f} % of the optimizer state that ddp holds on "
            "every rank (an even split over 2 ranks would be 50 %): ZeroRedundancyOptimizer "
            "hands each parameter whole to one rank, so the split follows the sizes of the "
            "model's parameters, and the other rank's RSS shows the rest."
        )]
    return lines


def _checkpoints(results: dict[str, Any]) -> list[str]:
    every = results["save_every_steps"]
    lines = [
        "",
        "### Checkpoints of that model",
        "",
        *para(f"The same runs with `--save_every_steps {every}`; every run, with or without "
              "step saves, also saves at the end of its epoch."),
        "",
        "| checkpoint | saves | one checkpoint on disk (MB) | ms/step without a save | "
        "step held up per save (s) | all steps' excess per save (s) | ddptrain's "
        "`checkpoint_blocking_s_median` (s) | peak RSS, max of ranks (MB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_name: dict[str, dict[str, float | None]] = {}
    for name, _strategy, _extra in CHECKPOINT_RUNS:
        figs = [save_costs(row) for row in _ok(results["checkpoints"], name=name)]
        if figs:
            by_name[name] = {k: _median([f[k] for f in figs if f.get(k) is not None])
                             for k in ("held_s", "reported_s", "excess_s")}
        else:
            lines.append(f"| {name} | failed | | | | | | |")
            continue

        def med(key: str, figs: list[dict[str, Any]] = figs) -> float | None:
            return _median([f[key] for f in figs if f.get(key) is not None])

        typical = med("typical_step_s")
        lines.append(
            f"| {name} | {figs[0]['saves']} | {_f(med('size_mb'), 0)} | "
            f"{_f(None if typical is None else typical * 1e3)} | {_f(med('held_s'), 3)} | "
            f"{_f(med('excess_s'), 3)} | {_f(med('reported_s'), 3)} | "
            f"{_f(med('peak_rss_mb'), 0)} |"
        )
    lines += ["", *para(
        "Both cost figures come from the run's own train rows, one after every step. Step "
        "held up per save: the row of the step after a save holds that save (the saving "
        "step's row is written before it); the figure is that row less the median row that "
        "follows no save (ms/step without a save), median over the saves. All steps' excess "
        "per save: every row after the first less that median, summed, over the number of "
        "saves; it also holds what a background write takes from the later steps it shares "
        "the cores with. ddptrain's own figure times the `dcp.save` / "
        "`dcp.async_save` call alone: not the barrier before it, the metadata and the rename "
        "after it, or the wait for the previous background save. A file checkpoint is "
        "written by rank 0 and then copied to latest.pt (and best.pt), so each save writes "
        "it at least twice; a DCP checkpoint is one step directory with each rank's shard, "
        "and latest is a one-line pointer."
    )]
    sync, bg = by_name.get("fsdp dcp sync"), by_name.get("fsdp dcp async")
    if sync and bg and bg["reported_s"] is not None and None not in (bg["held_s"], sync["held_s"]):
        lines += ["", *para(
            f"With `--async_checkpoint` the save call returns after {bg['reported_s']:.3f} s "
            f"(synchronous: {sync['reported_s']:.3f} s), yet the step after the save is held "
            f"up {bg['held_s']:.3f} s (synchronous: {sync['held_s']:.3f} s). "
            + ("The background write runs in a thread of each training process, which "
               "shares the interpreter and the 2 cores with the training step; with both "
               "cores busy training there is no idle core for it to hide on, so the work "
               "moves to the next step rather than disappearing."
               if bg["held_s"] > sync["held_s"] / 2 else
               "The background write hides most of the save behind the steps that follow.")
        )]
    return lines


def _resume(results: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "### Resume",
        "",
        "| strategy | fresh start to first step (s) | `--resume_from auto` start to first "
        "step (s) | resume cost (s) | starts of each kind |",
        "| --- | --- | --- | --- | --- |",
    ]
    verdicts: list[str] = []
    for strategy in RESUME_STRATEGIES:
        got = {k: [r["first_row_s"] for r in _ok(results["resume"], strategy=strategy, kind=k)]
               for k in ("fresh", "resume")}
        t = {k: _median(v) for k, v in got.items()}
        cost = None if t["fresh"] is None or t["resume"] is None else t["resume"] - t["fresh"]
        spread = "; ".join(f"{k} {min(v):.2f}..{max(v):.2f}" for k, v in got.items() if v)
        lines.append(f"| {strategy} | {_f(t['fresh'])} | {_f(t['resume'])} | {_f(cost)} | "
                     f"{len(got['fresh'])} + {len(got['resume'])} ({spread}) |")
        if got["fresh"] and got["resume"]:
            apart = min(got["resume"]) > max(got["fresh"]) or min(got["fresh"]) > max(
                got["resume"])
            verdicts.append(f"{strategy}: the two kinds' ranges " + (
                "do not overlap" if apart else
                "overlap, so the difference is within the spread between launches"))
    lines += ["", *para(
        f"Both starts are the memory runs' command with `--epochs {results['big_epochs'] + 1}`: "
        "the fresh one in an empty directory, the resumed one with `--resume_from auto` in "
        "the directory of the memory run, whose newest checkpoint is the end of epoch "
        f"{results['big_epochs']} (ddp: a .pt file; fsdp: a DCP step directory). Time runs "
        "from the launch of torchrun to the first train row in metrics.jsonl (written after "
        "optimizer step 1), when the run is killed, so no checkpoint is added; fresh and "
        "resumed starts alternate. The difference is what resuming adds: finding the "
        "checkpoint and checking it, reading it, loading weights, optimizer state, RNG states "
        "and the schedule. The rest of the start (interpreter, imports, process group, data, "
        "model) is the same in both, but varies from launch to launch: "
        + "; ".join(verdicts) + "."
    )]
    return lines


def section_parser(doc: str, name: str) -> argparse.ArgumentParser:
    """The flags every benchmark that writes a docs section takes: where the section and
    the raw figures (`runs/bench/<name>.json`) go, and `--report_only`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "BENCHMARKS.md",
                        help="the report the section goes into")
    parser.add_argument("--results", type=Path, default=ROOT / "runs" / "bench" /
                        f"{name}.json", help=f"raw figures (default: runs/bench/{name}.json)")
    parser.add_argument("--report_only", action="store_true",
                        help="rebuild the section from the saved figures")
    return parser


def save_and_write(
    args: Any, fresh: dict[str, Any] | None, section: Callable[[dict[str, Any]], str],
    what: str, start: str = START_MARK, end: str = END_MARK,
) -> int:
    """Save `fresh` figures (None: `--report_only`, nothing measured) to `args.results`,
    then write the docs section from the saved ones; the exit code."""
    if fresh is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(fresh, indent=1) + "\n")
    results = json.loads(args.results.read_text())
    write_section(args.docs, section(results), start, end)
    print(f"wrote the {what} section of {args.docs}")
    return 0


def write_section(md: Path, text: str, start: str = START_MARK, end: str = END_MARK) -> None:
    """Put `text` between the markers `start` and `end` of `md` (the sharding ones unless
    told; appended when they are missing)."""
    block = f"{start}\n{text}{end}\n"
    current = md.read_text() if md.exists() else ""
    if start in current and end in current:
        head, rest = current.split(start, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        md.write_text(head + block + tail)
    else:
        sep = "" if not current or current.endswith("\n\n") else (
            "\n" if current.endswith("\n") else "\n\n")
        md.write_text(current + sep + block)


def main() -> int:
    parser = section_parser(__doc__ or "", "sharding")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out_dir", type=Path, default=ROOT / "runs" / "bench-sharding",
                        help="run directories (default: runs/bench-sharding)")
    parser.add_argument("--max_wait_s", type=float, default=180.0,
                        help=f"wait at most this long for the load to drop below {MAX_LOAD}")
    args = parser.parse_args()
    results = None
    if not args.report_only:
        results = run_suite(args)
        print(f"whole suite {results['suite_seconds']:.0f} s")
    return save_and_write(args, results, section, "sharding")


if __name__ == "__main__":
    raise SystemExit(main())
