"""Turns the suite's results into docs/BENCHMARKS.md and docs/benchmarks.png.

Every figure in the report is computed here from runs/bench/results.json; the only
numbers written in this file are the targets the figures are judged against. A result
file from a partial run (`bench/run.py --only ...`) gives a report of the sections it has.
"""

from __future__ import annotations

import inspect
import statistics
from pathlib import Path
from typing import Any

from bench.common import ALL_WORKLOADS, DDPTRAIN_ONLY, TIMED_EPOCHS, USER_DATASET, WORKLOADS
from bench.userdata import tabular

TARGET_VS_RAW = 1.01  # ddptrain step time / raw loop step time, at most
TARGET_VS_LIBS = 1.0  # ddptrain / Fabric and ddptrain / Accelerate, below
TARGET_WEAK = 0.95  # weak-scaling efficiency 1 -> 2 ranks, at least
TARGET_WAIT = 0.02  # data-wait fraction, below
TARGET_PROCESS = 1.02  # ddptrain train / hand-written script, launch to exit, at most
ORDER = ("raw", "ddptrain", "fabric", "accelerate")
# The start-up phases the ddptrain contestant reports, in the order they happen.
PHASES = {
    "launcher_s": "launcher",
    "interpreter_s": "interpreter",
    "imports_s": "imports",
    "dynamo_import_s": "torch._dynamo",
    "data_s": "data",
    "process_group_s": "process group",
    "trainer_s": "Trainer",
    "writer_start_s": "logging start",
    "first_step_s": "first step",
}


def _ok(rows: list[dict[str, Any]], contestant: str, workload: str, nproc: int = 2) -> list[dict]:
    return [
        r for r in rows
        if r["contestant"] == contestant and r["workload"] == workload and r["nproc"] == nproc
        and "error" not in r
    ]


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}


def timed_epochs(results: dict[str, Any]) -> dict[str, int]:
    """The timed epochs each workload ran with (older result files: the defaults)."""
    return {**TIMED_EPOCHS, **results.get("timed_epochs", {})}


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    rows = results["rows"]
    out: dict[str, Any] = {}
    for workload in WORKLOADS:
        per: dict[str, Any] = {}
        for name in ORDER:
            ok = _ok(rows, name, workload)
            if not ok:
                continue
            times = [r["step_time_s"] for r in ok]
            per[name] = {
                "n": len(ok),
                "step_ms": statistics.median(times) * 1e3,
                "min_ms": min(times) * 1e3,
                "max_ms": max(times) * 1e3,
                "first_step_s": _median(ok, "first_step_s"),
                "rss_mb": statistics.median(max(r["peak_rss_mb"]) for r in ok),
                "steps": ok[0]["timed_steps"],
            }
        if not per:
            continue  # not run (a partial run)
        single = _ok(rows, "ddptrain", workload, nproc=1)
        ddp = _ok(rows, "ddptrain", workload)
        weak = None
        if single and ddp:
            weak = _median(single, "step_time_s") / _median(ddp, "step_time_s")
        out[workload] = {
            "contestants": per,
            "weak_scaling": weak,
            "single_rank_ms": _median(single, "step_time_s") * 1e3 if single else None,
            "data_wait_frac": _median(ddp, "data_wait_frac"),
            "checkpoint_save_s": _median(ddp, "checkpoint_save_s"),
            "resume_s": _median(ddp, "resume_s"),
            "bare_allreduce_ms": _median(ddp, "bare_allreduce_ms"),
            "startup": _startup(ddp),
        }
    return out


def _startup(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Median of each start-up phase over the runs that reported it (rank 0's clock)."""
    split = [r["startup"] for r in rows if r.get("startup")]
    if not split:
        return None
    medians = {}
    for key in PHASES:
        values = [s[key] for s in split if s.get(key) is not None]
        if values:
            medians[key] = statistics.median(values)
    return medians


def _ratio(per: dict[str, Any], a: str, b: str) -> float | None:
    if a in per and b in per:
        return per[a]["step_ms"] / per[b]["step_ms"]
    return None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _verdict(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "**missed**")


def write_report(results: dict[str, Any], docs: Path) -> tuple[Path, Path]:
    docs.mkdir(parents=True, exist_ok=True)
    figures = summarize(results)
    png = docs / "benchmarks.png"
    _chart(figures, png)
    md = docs / "BENCHMARKS.md"
    md.write_text(_markdown(results, figures, png.name))
    return md, png


def describe(name: str) -> str:
    """The model and data of a workload, in words, from its settings."""
    w = ALL_WORKLOADS[name]
    if w.get("model") == "gpt":
        return f"GPT (width {w['width']}, context {w['block_size']}), {w['dataset']}"
    model = "MiniResNet" if w["dataset"] == "synthetic" else "MLP"
    if w["dataset"] == USER_DATASET:
        defaults = {k: p.default for k, p in inspect.signature(tabular).parameters.items()}
        n_val = round(defaults["n"] * defaults["val_fraction"])
        data = (
            f"a user's TensorDataset from `{USER_DATASET}` ({defaults['n'] - n_val:,} train "
            f"+ {n_val:,} val samples, {defaults['features']} features, "
            f"{defaults['classes']} classes)"
        )
    else:
        data = w["dataset"] + (
            f" ({w['synthetic_size']} samples)" if "synthetic_size" in w else ""
        )
    return f"{model} (width {w['width']}), {data}"


def _epochs(n: int) -> str:
    return f"{n} epoch" + ("" if n == 1 else "s")


def _loader(name: str) -> str:
    workers = ALL_WORKLOADS[name].get("num_workers", 0)
    return f"{workers} workers per rank" if workers else "in the training process"


def _markdown(results: dict[str, Any], figures: dict[str, Any], chart: str) -> str:
    m = results["machine"]
    epochs = timed_epochs(results)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`bench/run.py`); every number below comes from one run of",
        "it. Do not edit by hand: run `make bench` again.",
        "",
        f"- **date**: {m['date_utc']}",
        f"- **machine**: {m['cpu']}, {m['cores']} cores, {m.get('memory_gib', '?')} GiB, "
        f"{m['os']}",
        f"- **software**: Python {m['python']}, torch {m['torch']}, lightning "
        f"{m.get('lightning')}, accelerate {m.get('accelerate')}",
        f"- **set-up**: 2 ranks (torchrun, gloo, CPU), `OMP_NUM_THREADS=1`; "
        f"{results['repeats']} repeats, contestants alternating in an order rotated each "
        f"repeat; medians over the repeats, ratios of the medians; whole suite "
        f"{results['suite_seconds'] / 60:.1f} min"
        + (f"; 1-minute load average {m['load_1min'][0]:.1f} at the start, "
           f"{m['load_1min'][1]:.1f} at the end (2 ranks alone make 2)"
           if "load_1min" in m else ""),
    ]
    if results.get("quick"):
        lines.append(
            "- **`--quick` run**: 1 timed epoch per workload, a pipeline check; its figures "
            "are not measurements to quote."
        )
    sections = results.get("sections")
    if sections:
        lines.append(f"- **sections run**: {', '.join(sections)}")
    lines += [
        "",
        "| workload | model, data | per-rank batch | loading | timed |",
        "| --- | --- | --- | --- | --- |",
    ]
    ran = {*figures, *(r["workload"] for r in results.get("compile") or [])}
    if results.get("variants"):
        ran.add("resnet")
    for name in (n for n in ALL_WORKLOADS if n in ran):
        lines.append(
            f"| {name} | {describe(name)} | {ALL_WORKLOADS[name]['batch_size']} | "
            f"{_loader(name)} | {_epochs(epochs[name])} after 1 warm-up epoch"
            + (" (ddptrain alone, torch.compile against eager)" if name in DDPTRAIN_ONLY
               else "")
            + " |"
        )
    lines += [
        "",
        "Contestants: **raw** is a minimal hand-written DDP loop (`bench/loops.py`, the seed's",
        "`train_one_epoch` with `no_sync` done right), the physical reference; **ddptrain** is",
        "`ddptrain.train.trainer.Trainer` with its defaults (metric rows every 10 steps into",
        "metrics.jsonl and TensorBoard); **fabric** and **accelerate** are the same loop written",
        "for Lightning Fabric and HF Accelerate as their docs show. All build the same seeded",
        "model and dataset with ddptrain's builders and use SGD with the same schedule.",
        "Each keeps its loss and accuracy sums on the device and all-reduces them once at",
        "the end of every epoch, as the seed's loop reports its epoch loss; ddptrain's train",
        "rows (every 10 steps) ride on that same collective unless an epoch lasts longer",
        "than about 2 s.",
        "",
        "On **dataset** and **workers** the data is a user's own map-style `TensorDataset`",
        f"(`bench/userdata.py`), given to ddptrain as `--dataset {USER_DATASET}`, so it takes",
        "its user-dataset path; raw, Fabric and Accelerate read the same `TensorDataset`",
        "through a plain `DataLoader` (default collate; on **workers** `num_workers=2` and",
        "`persistent_workers=True`, as ddptrain keeps its workers across epochs).",
    ]
    if figures:
        lines += _step_sections(figures, chart, epochs)
    lines += _rounds_section(results.get("rounds") or {})
    if figures:
        lines += _ddptrain_section(figures)
        lines += _startup_section(figures)
    lines += _process_section(results, figures)
    lines += _channels_last_section(results, figures)
    lines += _compile_section(results, epochs)
    if figures:
        lines += ["", "## Reading the results", ""]
        lines += _analysis(figures, m["cores"], epochs)
    lines += _limits_section(m["cores"])
    lines += _gpu_section()
    return "\n".join(lines) + "\n"


def _step_sections(figures: dict[str, Any], chart: str, epochs: dict[str, int]) -> list[str]:
    lines = [
        "",
        "## Step time",
        "",
        f"![step time relative to the raw loop]({chart})",
        "",
        "| workload | contestant | median ms/step | min..max | samples/s (2 ranks) | repeats |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, f in figures.items():
        batch = WORKLOADS[name]["batch_size"]
        for c, v in f["contestants"].items():
            lines.append(
                f"| {name} | {c} | {v['step_ms']:.3f} | {v['min_ms']:.3f}..{v['max_ms']:.3f} | "
                f"{2 * batch / v['step_ms'] * 1e3:,.0f} | {v['n']} |"
            )
    lines += [
        "",
        "| workload | ddptrain / raw (target ≤ 1.01) | ddptrain / Fabric (target < 1) | "
        "ddptrain / Accelerate (target < 1) |",
        "| --- | --- | --- | --- |",
    ]
    for name, f in figures.items():
        per = f["contestants"]
        cells = []
        for other, target, strict in (
            ("raw", TARGET_VS_RAW, False),
            ("fabric", TARGET_VS_LIBS, True),
            ("accelerate", TARGET_VS_LIBS, True),
        ):
            r = _ratio(per, "ddptrain", other)
            met = None if r is None else (r < target if strict else r <= target)
            cells.append(f"{_fmt(r, '.3f')} ({_verdict(met)})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _rounds_section(rounds: dict[str, Any]) -> list[str]:
    if not rounds:
        return []
    ddp_rounds = rounds["ddptrain"].get("allreduce_rounds_per_step")
    seed_rounds = rounds["seed_loop"].get("allreduce_rounds_per_step")
    met = None if ddp_rounds is None else ddp_rounds == 1
    return [
        "",
        "## All-reduce rounds per optimizer step, `--grad_accum_steps 4`",
        "",
        "Counted with a DDP communication hook (`bench/allreduce.py`) on the mlp workload: one",
        "round is one backward pass whose gradients were all-reduced.",
        "",
        "| loop | rounds per optimizer step | target |",
        "| --- | --- | --- |",
        f"| ddptrain | {_fmt(ddp_rounds, '.2f')} | 1 ({_verdict(met)}) |",
        f"| seed-style loop (no `no_sync`) | {_fmt(seed_rounds, '.2f')} | 4 |",
        "",
        "The seed-style loop all-reduces on every micro-batch. Its figure can sit a little above",
        "4: it drops the epoch's last, short accumulation window without stepping, yet the",
        "backward passes of that window still all-reduced.",
    ]


def _ms(seconds: float | None) -> str:
    return _fmt(None if seconds is None else 1e3 * seconds, ".1f")


def _ddptrain_section(figures: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Scaling, data loading, start-up, memory, checkpoints (ddptrain)",
        "",
        "| workload | weak scaling 1→2 ranks (target ≥ 95 %) | 1-rank ms/step | "
        "data-wait fraction (target < 2 %) | checkpoint save | resume |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, f in figures.items():
        weak, wait = f["weak_scaling"], f["data_wait_frac"]
        wm = None if weak is None else weak >= TARGET_WEAK
        am = None if wait is None else wait < TARGET_WAIT
        weak_text = "not run" if weak is None else f"{100 * weak:.1f} % ({_verdict(wm)})"
        lines.append(
            f"| {name} | {weak_text} | {_fmt(f['single_rank_ms'], '.3f')} | "
            f"{_fmt(None if wait is None else 100 * wait, '.2f')} % ({_verdict(am)}) | "
            f"{_ms(f['checkpoint_save_s'])} ms | {_ms(f['resume_s'])} ms |"
        )
    lines += [
        "",
        "Weak scaling is the 1-rank step time over the 2-rank step time at the same per-rank",
        "batch (1.0 = perfect); it is measured on mlp and resnet only (the user-dataset",
        "workloads would repeat mlp's figure). The data-wait fraction is the median over the",
        "timed train rows of metrics.jsonl (rank 0's time blocked on the loader / wall time).",
        "Checkpoint save is `Trainer.save()` (gather RNG states, write, fsync, rename,",
        "barrier); resume is building a `Trainer` with `--resume_from` (model, loaders,",
        "checkpoint load).",
        "",
        "| workload | contestant | time to first step (s) | peak RSS per rank (MB) |",
        "| --- | --- | --- | --- |",
    ]
    for name, f in figures.items():
        for c, v in f["contestants"].items():
            lines.append(
                f"| {name} | {c} | {_fmt(v['first_step_s'], '.2f')} | {v['rss_mb']:.0f} |"
            )
    lines += [
        "",
        "Time to first step runs from the launch of torchrun to the end of the first optimizer",
        "step (interpreter and library imports, process group, data, model, one step). Peak RSS",
        "is the larger of the two ranks' `ru_maxrss`.",
    ]
    return lines


def _startup_section(figures: dict[str, Any]) -> list[str]:
    have = {n: f["startup"] for n, f in figures.items() if f.get("startup")}
    if not have:
        return []
    lines = [
        "",
        "## Start-up split (ddptrain)",
        "",
        "Where ddptrain's time to first step goes, in seconds: medians over the 2-rank runs of",
        "each workload, on rank 0's clock (`time.perf_counter` marks in",
        "`bench/contestants/ddptrain_api.py`, which runs the phases in `ddptrain train`'s",
        "order).",
        "",
        "| workload | " + " | ".join(PHASES.values()) + " | sum | time to first step |",
        "| --- " * (len(PHASES) + 3) + "|",
    ]
    for name, phases in have.items():
        cells = [_fmt(phases.get(k), ".3f") for k in PHASES]
        total = sum(phases.values())
        first = figures[name]["contestants"]["ddptrain"]["first_step_s"]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {total:.2f} | {_fmt(first, '.2f')} |"
        )
    lines += [
        "",
        "- **launcher**: from the orchestrator starting torchrun to rank 0's worker process",
        "  existing (torchrun imports torch itself, starts its store and forks the workers);",
        "  read from `/proc/self/stat`, 10 ms resolution.",
        "- **interpreter**: from the worker's start to the contestant's first line.",
        "- **imports**: torch, ddptrain (`ddptrain.train.trainer` and what it pulls in) and the",
        "  bench's helpers.",
        "- **torch._dynamo**: its import. The first `torch.optim` optimizer a process builds",
        "  imports it (the optimizer's methods are wrapped to keep dynamo out), in every",
        "  contestant alike; the contestant imports it up front so that it is not counted",
        "  as Trainer work.",
        "- **data**: the config and `load_data` (the workload's dataset, both splits).",
        "- **process group**: `setup_distributed` and one barrier, so it ends when every rank",
        "  has joined: a rank that imported more slowly is waited for here.",
        "- **Trainer**: `Trainer(...)`: model, loaders, optimizer, schedule, hooks, the DDP",
        "  wrapper (which broadcasts the initial weights).",
        "- **logging start**: opening metrics.jsonl and the TensorBoard writer.",
        "- **first step**: epoch 1 up to the end of its first optimizer step.",
        "",
        "The sum differs from the time to first step by what lies between the marks (argument",
        "parsing) and by the clocks: the launch time is the orchestrator's wall clock.",
    ]
    return lines


def _process_summary(rows: list[dict[str, Any]], contestant: str) -> dict[str, Any] | None:
    ok = [r for r in rows if r["contestant"] == contestant and "error" not in r]
    if not ok:
        return None
    walls = _spread([r["wall_s"] for r in ok])
    train = statistics.median(r["train_time_s"] for r in ok)
    files = ok[0]["files"]
    return {**walls, "train_s": train, "steps": ok[0]["steps"], "files": files}


def _files_text(files: list[str]) -> str:
    """The files a run left, with checkpoints and TensorBoard events counted, not listed."""
    checkpoints = [f for f in files if f.endswith(".pt")]
    events = [f for f in files if "tfevents" in f]
    rest = [f for f in files if f not in checkpoints and f not in events
            and not Path(f).name.startswith(".")]
    parts = [f"`{f}`" for f in rest]
    if checkpoints:
        parts.append(f"{len(checkpoints)} checkpoint file(s)")
    if events:
        parts.append(f"{len(events)} TensorBoard event file(s)")
    return ", ".join(parts)


def _process_section(results: dict[str, Any], figures: dict[str, Any]) -> list[str]:
    rows = results.get("process") or []
    if not rows:
        return []
    raw, ddp = _process_summary(rows, "raw"), _process_summary(rows, "ddptrain")
    epochs = results.get("process_epochs")
    w = WORKLOADS["dataset"]
    lines = [
        "",
        "## Whole process: `ddptrain train` against a hand-written script",
        "",
        f"The **dataset** workload as a whole run of {epochs} epochs, each contestant as the",
        "process a user starts: start-up, training, validation after every epoch, the files",
        "at the end. The orchestrator times each from launch to exit; the two alternate, in an",
        "order rotated each repeat. ddptrain runs with its defaults as installed here with its",
        "`viz` extra: metric rows, TensorBoard events, a checkpoint after every epoch and",
        "`curves.png` at the end.",
        "",
        "```bash",
        "torchrun --standalone --nproc_per_node=2 -m ddptrain train \\",
        f"    --dataset {USER_DATASET} --num_classes {w['num_classes']} "
        f"--batch_size {w['batch_size']} --width {w['width']} \\",
        f"    --epochs {epochs} --output_dir RUN_DIR          # PYTHONPATH holds the repo root",
        "torchrun --standalone --nproc_per_node=2 bench/contestants/raw_script.py \\",
        f"    --epochs {epochs} --out_dir RUN_DIR",
        "```",
        "",
        "| contestant | median launch to exit (s) | min..max | in the epochs (s) | "
        "outside them (s) | runs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in (("raw", raw), ("ddptrain", ddp)):
        if s is None:
            lines.append(f"| {name} | failed | | | | |")
            continue
        lines.append(
            f"| {name} | {s['median']:.2f} | {s['min']:.2f}..{s['max']:.2f} | "
            f"{s['train_s']:.2f} | {s['median'] - s['train_s']:.2f} | {s['n']} |"
        )
    whole = ddp["median"] / raw["median"] if ddp and raw else None
    per = figures.get("dataset", {}).get("contestants", {})
    step = _ratio(per, "ddptrain", "raw")
    lines += [
        "",
        "| ratio ddptrain / raw | value | target |",
        "| --- | --- | --- |",
        f"| whole process, launch to exit | {_fmt(whole, '.3f')} | ≤ {TARGET_PROCESS} "
        f"({_verdict(None if whole is None else whole <= TARGET_PROCESS)}) |",
        f"| step time (the **dataset** workload above) | {_fmt(step, '.3f')} | "
        f"≤ {TARGET_VS_RAW} ({_verdict(None if step is None else step <= TARGET_VS_RAW)}) |",
        "",
        "\"In the epochs\" is each run's own `train_time_s` (training, validation and, for",
        "ddptrain, the checkpoints written after each epoch); \"outside them\" is the rest of",
        "launch to exit: torchrun, interpreters, imports, process group, data, model, the",
        "final files and the teardown.",
        "",
    ]
    if raw:
        lines.append(f"- the script wrote: {_files_text(raw['files'])}")
    if ddp:
        lines.append(f"- ddptrain wrote: {_files_text(ddp['files'])}")
    if raw and ddp:
        gap = ddp["median"] - raw["median"]
        inside = ddp["train_s"] - raw["train_s"]
        lines += [
            "",
            f"ddptrain's run takes {gap:+.2f} s against the script's: {inside:+.2f} s in the "
            f"epochs and {gap - inside:+.2f} s outside them.",
            "",
            "Outside the epochs ddptrain does what the script leaves out: it imports its "
            "own modules and",
            "PyYAML, writes `config.yaml`, opens the TensorBoard writer, exports "
            "`model.safetensors`, and",
            "draws `curves.png`. The drawing (matplotlib's imports and the rendering, "
            "about a second of",
            "one core) runs in a child process beside the ranks' teardown, and the job "
            "waits for it",
            "before it releases its directory, so that the directory is whole when the "
            "job ends. What",
            "the teardown does not hide stays on the job's time: the price of a run "
            "directory that holds",
            "everything the log says it does.",
        ]
    return lines


def _channels_last_section(results: dict[str, Any], figures: dict[str, Any]) -> list[str]:
    rows = [r for r in results.get("variants") or [] if r.get("variant") == "channels_last"]
    if not rows:
        return []
    cl = [r["step_time_s"] * 1e3 for r in rows if "error" not in r]
    base = figures.get("resnet", {}).get("contestants", {}).get("ddptrain")
    lines = [
        "",
        "## channels_last (ddptrain, MiniResNet)",
        "",
        "The resnet workload with `--channels_last` (model and input batches in NHWC memory",
        "format), run in the same repeats as the contest's ddptrain resnet runs (NCHW).",
        "",
        "| memory format | median ms/step | min..max | repeats |",
        "| --- | --- | --- | --- |",
    ]
    if base:
        lines.append(f"| contiguous (NCHW) | {base['step_ms']:.3f} | "
                     f"{base['min_ms']:.3f}..{base['max_ms']:.3f} | {base['n']} |")
    if cl:
        s = _spread(cl)
        lines.append(f"| channels_last (NHWC) | {s['median']:.3f} | "
                     f"{s['min']:.3f}..{s['max']:.3f} | {s['n']} |")
    else:
        lines.append("| channels_last (NHWC) | failed | | |")
    if base and cl:
        ratio = statistics.median(cl) / base["step_ms"]
        verdict = "faster" if ratio < 1 else "slower" if ratio > 1 else "the same"
        lines += [
            "",
            f"channels_last / contiguous: **{ratio:.3f}** ({verdict}). On a CPU this compares",
            "oneDNN's convolution kernels in the two layouts at one thread per rank; the format",
            "exists for GPU tensor cores, where NHWC spares cuDNN a transpose around every",
            "convolution under mixed precision (see below).",
        ]
    return lines


def _compile_section(results: dict[str, Any], epochs: dict[str, int]) -> list[str]:
    lines = ["", "## torch.compile against eager (ddptrain)", ""]
    rows = results.get("compile") or []
    if not rows:
        lines.append(
            "Not run in this report (`bench/run.py --no-compile`, or a partial run); "
            "`make bench` runs it."
        )
        return lines
    lines += [
        "ddptrain with `--compile` (the DDP-wrapped model through `torch.compile`, inductor)",
        "against the same run in eager mode, 2 ranks. **One run each, not repeated**:",
        "compilation is slow on a small CPU (the first-step columns), so these figures are",
        "single measurements with no spread, not medians over repeats.",
        "",
        "| workload | eager ms/step | compiled ms/step | compiled / eager | first step eager (s) "
        "| first step compiled (s) | warm-up epoch eager (s) | warm-up epoch compiled (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    costs = []
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    for workload in workloads:
        by = {r["variant"]: r for r in rows if r["workload"] == workload}
        eager, comp = by.get("eager", {}), by.get("compile", {})
        if "error" in eager or "error" in comp or not eager or not comp:
            failed = ", ".join(v for v, r in by.items() if "error" in r) or "missing"
            lines.append(f"| {workload} | {failed} | | | | | | |")
            continue
        e_ms, c_ms = eager["step_time_s"] * 1e3, comp["step_time_s"] * 1e3
        lines.append(
            f"| {workload} | {e_ms:.3f} | {c_ms:.3f} | {c_ms / e_ms:.3f} | "
            f"{_fmt(eager.get('trainer_first_step_s'), '.2f')} | "
            f"{_fmt(comp.get('trainer_first_step_s'), '.2f')} | "
            f"{_fmt(eager.get('warmup_epoch_s'), '.2f')} | "
            f"{_fmt(comp.get('warmup_epoch_s'), '.2f')} |"
        )
        if eager.get("warmup_epoch_s") is not None and comp.get("warmup_epoch_s") is not None:
            costs.append((workload, comp["warmup_epoch_s"] - eager["warmup_epoch_s"],
                          (comp.get("trainer_first_step_s") or 0.0)
                          - (eager.get("trainer_first_step_s") or 0.0)))
    lines += [
        "",
        "Step time is the timed window after the warm-up epoch, when every graph is",
        "compiled (timed epochs: "
        + ", ".join(f"{w} {epochs[w]}" for w in workloads) + "). First step is",
        "`Trainer.first_step_s` (epoch 1 up to the end of its first optimizer step), which",
        "holds the first compilation; the warm-up epoch also holds any recompilation (an",
        "epoch's shorter last batch is a new shape).",
        "",
    ]
    for workload, epoch_cost, first_cost in costs:
        lines.append(
            f"- **{workload}**: the first step takes {first_cost:.1f} s longer compiled than "
            f"eager, the warm-up epoch {epoch_cost:.1f} s longer"
            + (" (the rest: recompilation later in the epoch)."
               if epoch_cost > 1.2 * first_cost else ".")
        )
    return lines


def _analysis(figures: dict[str, Any], cores: int, epochs: dict[str, int]) -> list[str]:
    """What each met or missed target means, worded from the measured figures."""
    text: list[str] = []
    missed_raw = []
    for name, f in figures.items():
        per = f["contestants"]
        if "raw" not in per or "ddptrain" not in per:
            continue
        if per["ddptrain"]["step_ms"] / per["raw"]["step_ms"] > TARGET_VS_RAW:
            missed_raw.append(name)
        gap_ms = per["ddptrain"]["step_ms"] - per["raw"]["step_ms"]
        gap = 100 * gap_ms / per["raw"]["step_ms"]
        spread = 100 * (per["raw"]["max_ms"] / per["raw"]["min_ms"] - 1)
        overlap = (
            per["ddptrain"]["min_ms"] <= per["raw"]["max_ms"]
            and per["raw"]["min_ms"] <= per["ddptrain"]["max_ms"]
        )
        line = (
            f"- **{name}, ddptrain vs raw**: {gap:+.1f} % step time ({gap_ms:+.3f} ms); the raw "
            f"loop's own spread over the repeats (max/min) is {spread:.1f} %, and the two "
            + ("contestants' ranges overlap, so the ordering is within the noise."
               if overlap else "contestants' ranges do not overlap.")
        )
        text.append(line)
    if missed_raw:
        text.append(
            f"- **where ddptrain is slower than raw** ({', '.join(missed_raw)}), the extra "
            "work is what the raw loop leaves out: per step, a loss weight per micro-batch, "
            "the sums of the task's metrics and the non-finite gradient check (a few µs "
            "each); every 10 steps a snapshot of the sums, and where the rows' all-reduce "
            "comes (the epoch end here) a JSON line, a TensorBoard event and a log line per "
            "row, on rank 0 while rank 1 waits for it."
        )
    for name, f in figures.items():
        per = f["contestants"]
        for other in ("fabric", "accelerate"):
            r = _ratio(per, "ddptrain", other)
            if r is None:
                continue
            lo = per[other]["min_ms"] / per["ddptrain"]["max_ms"]
            hi = per[other]["max_ms"] / per["ddptrain"]["min_ms"]
            overlap = lo <= 1 <= hi
            text.append(
                f"- **{name}, ddptrain vs {other}**: ratio {r:.3f}"
                + ("; the two contestants' ranges over the repeats overlap, so this ordering "
                   "is within the noise." if overlap else
                   "; the two contestants' ranges over the repeats do not overlap.")
            )
    weak_missed = False
    for name, f in figures.items():
        weak_f, ar = f["weak_scaling"], f["bare_allreduce_ms"]
        ddp = f["contestants"].get("ddptrain")
        if weak_f is None or ar is None or ddp is None:
            continue
        weak_missed |= weak_f < TARGET_WEAK
        text.append(
            f"- **{name}, weak scaling {100 * weak_f:.1f} %**: one rank takes "
            f"{f['single_rank_ms']:.3f} ms a step, two take {ddp['step_ms']:.3f} ms; a bare "
            f"all-reduce of the gradients alone, with no training around it, takes {ar:.3f} ms "
            f"({100 * ar / ddp['step_ms']:.0f} % of the 2-rank step)."
        )
    if weak_missed:
        text.append(
            f"  The machine has {cores} cores, and 2 ranks with one thread each"
            + (" use all of them" if cores <= 2 else "")
            + ": gloo's all-reduce (over loopback TCP, with its own threads) finds no idle "
            "core and cannot overlap with the backward pass, both ranks share one memory "
            "bus and cache, and any other process on the box delays whichever rank it "
            "lands on while the other waits in the collective. Where a step is shorter than "
            "an all-reduce, communication dominates. The target presumes spare cores or one "
            "device per rank; a box this small cannot meet it."
        )
    waits = {n: f["data_wait_frac"] for n, f in figures.items()
             if f["data_wait_frac"] is not None}
    over = [n for n, w in waits.items() if w >= TARGET_WAIT]
    if over:
        text.append(
            f"- **data wait** at or above 2 % on {', '.join(over)}: "
            + "; ".join(
                f"{n} {100 * waits[n]:.1f} % "
                + ("(2 loader workers per rank, which share the 2 cores with the ranks "
                   "themselves)" if ALL_WORKLOADS[n].get("num_workers")
                   else "(batches built in the training process: the steps are so short "
                   "that building a batch is a visible share of them)")
                for n in over
            )
            + "."
        )
    elif waits:
        text.append("- **data wait**: below 2 % on every workload.")
    return text


def _limits_section(cores: int) -> list[str]:
    return [
        "",
        f"## What {cores} CPU cores cannot show",
        "",
        f"- **Overlap.** 2 ranks with one thread each occupy {cores} cores; gloo's threads, the",
        "  loader workers and everything else on the box take turns with them. Communication",
        "  cannot hide behind the backward pass, so weak scaling and all-reduce costs are",
        "  those of a saturated machine, not of one device per rank.",
        "- **Loader workers.** On **workers**, 2 ranks x (1 + 2 workers) = 6 busy processes",
        "  share the cores: workers cannot take batch building off the training processes'",
        "  critical path as they do where cores are spare or a GPU does the arithmetic. The",
        "  workload shows what the setting costs and that it works, not what it gains.",
        "- **torch.compile.** On a CPU inductor emits C++ kernels; a GPU gains from fused",
        "  Triton kernels and fewer kernel launches, neither of which a one-thread CPU rank",
        "  pays for. The compile time here is also two ranks compiling at once on these cores.",
        "- **channels_last.** Its purpose is tensor-core convolutions under mixed precision;",
        "  the CPU figure is oneDNN's layout preference at one thread.",
        "- **Mixed precision and MFU** need a GPU (float16 with a GradScaler, bfloat16,",
        "  FLOP/s against the device's peak).",
        "",
        "GPU runs: `make gpu-check` and the commands of the next section.",
    ]


def _gpu_section() -> list[str]:
    return [
        "",
        "## GPU runs",
        "",
        "This report's runs are CPU runs: float16 and bfloat16 autocast, torch.compile and",
        "channels_last on a GPU, and MFU are measured on one GPU by `make gpu-check` (the GPU",
        "section below). On a machine of several GPUs these commands run them; the train rows",
        "of each run's metrics.jsonl then carry `step_time_s`, `peak_cuda_mb`, `tflops_per_sec`",
        "and `mfu` (FLOPs counted with `FlopCounterMode`, peak by GPU name), and summary.json",
        "`first_step_s` (with `--compile`: the compilation):",
        "",
        "```bash",
        "gpus=$(nvidia-smi -L | wc -l)",
        "for flags in '--amp_dtype float16' '--amp_dtype bfloat16' '--no-use_amp' \\",
        "             '--amp_dtype bfloat16 --channels_last' '--amp_dtype bfloat16 --compile'; do",
        "  ddprun --standalone --nproc_per_node=$gpus -m ddptrain train \\",
        "    --dataset synthetic --synthetic_size 50000 --batch_size 256 --epochs 2 $flags \\",
        "    --output_dir \"runs/gpu-resnet-$(echo $flags | tr -d ' -')\"",
        "done",
        "for flags in '--amp_dtype bfloat16' '--amp_dtype bfloat16 --compile'; do",
        "  ddprun --standalone --nproc_per_node=$gpus -m ddptrain train \\",
        "    --dataset chars --model gpt --block_size 256 --width 384 --batch_size 64 \\",
        "    --epochs 5 $flags --output_dir \"runs/gpu-gpt-$(echo $flags | tr -d ' -')\"",
        "done",
        "ddptrain plot runs/gpu-* -o gpu-curves.png",
        "```",
    ]


def _chart(figures: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    names = list(figures)
    width = 0.8 / len(ORDER)
    for i, c in enumerate(ORDER):
        xs, ys, lo, hi = [], [], [], []
        for j, w in enumerate(names):
            per = figures[w]["contestants"]
            if c not in per or "raw" not in per:
                continue
            ref = per["raw"]["step_ms"]
            xs.append(j + (i - (len(ORDER) - 1) / 2) * width)
            ys.append(per[c]["step_ms"] / ref)
            lo.append(ys[-1] - per[c]["min_ms"] / ref)
            hi.append(per[c]["max_ms"] / ref - ys[-1])
        ax1.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=c)
        xs2 = [j + (i - (len(ORDER) - 1) / 2) * width for j, w in enumerate(names)
               if c in figures[w]["contestants"]]
        ys2 = [figures[w]["contestants"][c]["first_step_s"] for w in names
               if c in figures[w]["contestants"]]
        ax2.bar(xs2, ys2, width, label=c)
    ax1.axhline(1.0, color="black", linewidth=0.8)
    ax1.set_xticks(range(len(names)), names)
    ax1.set_ylabel("median step time / raw loop (bars: min..max)")
    ax1.set_title("step time, 2 CPU ranks (lower is better)")
    ax1.legend(fontsize="small")
    ax2.set_xticks(range(len(names)), names)
    ax2.set_ylabel("seconds from launch")
    ax2.set_title("time to first optimizer step")
    ax2.legend(fontsize="small")
    fig.savefig(out, dpi=110)
    plt.close(fig)
