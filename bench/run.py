"""The benchmark suite: ddptrain against a hand-written DDP loop, Lightning Fabric and
HF Accelerate, on 2 CPU ranks (gloo, one thread each). `make bench` runs it:

    .venv-bench/bin/python bench/run.py --repeats 5      # writes docs/BENCHMARKS.md + chart

Every contestant trains the same model on the same data with the same batch, epochs and
process count. The contestants run alternately, in an order rotated every repeat, so a
slow spell of the machine hits all of them alike; the report gives medians over the
repeats and the ratios of the medians. Raw results are kept in runs/bench/results.json.

Sections (`--only` picks some): `steps` (step time of every contestant on every workload,
weak scaling, data wait, start-up split), `rounds` (all-reduces per step with gradient
accumulation), `process` (ddptrain's CLI against a hand-written script, launch to exit),
`channels_last` (ddptrain's MiniResNet in either memory format), `compile` (ddptrain with
torch.compile against eager, one repeat each: compilation takes minutes on small CPUs;
`--no-compile` leaves it out). For a try-out:

    .venv-bench/bin/python bench/run.py --quick --repeats 1 --only steps --workloads dataset

A run with `--quick`, `--only`, `--workloads` or `--contestants` writes its results and
report under runs/bench-quick/ unless `--out_dir` / `--docs` say otherwise, so that
docs/ only ever holds a full run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    DDPTRAIN_ONLY,
    LAUNCH_ENV,
    TIMED_EPOCHS,
    USER_DATASET,
    WORKLOADS,
)

CONTESTANTS = {
    "raw": "bench/contestants/raw.py",
    "ddptrain": "bench/contestants/ddptrain_api.py",
    "fabric": "bench/contestants/fabric.py",
    "accelerate": "bench/contestants/accelerate_loop.py",
}
SECTIONS = ("steps", "rounds", "process", "channels_last", "compile")
# Weak scaling (the same per-rank batch on one rank) is measured where it says something
# new: the user-dataset workloads would repeat the mlp's figure at twice the suite time.
WEAK_SCALING = ("mlp", "resnet")
COMPILE_WORKLOADS = ("resnet", "gpt")
PROCESS_EPOCHS = 5  # whole-process runs: enough epochs that training is not a rounding error
QUICK_EPOCHS = 1  # timed epochs of every workload under --quick
LAUNCH_TIMEOUT_S = 600.0  # one contestant run; a compiled run gets COMPILE_TIMEOUT_S
COMPILE_TIMEOUT_S = 1800.0


def bench_env() -> dict[str, str]:
    """One thread per rank; the repo root (for `bench`) and src/ on the path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH")])
    )
    return env


def run_command(
    cmd: list[str], env: dict[str, str], timeout_s: float
) -> tuple[int, str, float]:
    """Run `cmd` in its own session; returns (exit code, output, seconds from launch to
    exit). On a timeout the whole session is killed: torchrun's workers with it."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, out + f"\n(killed after {timeout_s:.0f}s)\n", time.perf_counter() - t0
    return proc.returncode, out, time.perf_counter() - t0


def launch(
    contestant: str, workload: str, nproc: int, out_dir: Path, tag: str, *extra: str,
    timeout_s: float = LAUNCH_TIMEOUT_S,
) -> dict[str, Any]:
    """Run one contestant under torchrun; returns its result (with `error` on failure)."""
    out = out_dir / f"{tag}.json"
    out.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", CONTESTANTS[contestant], "--workload", workload,
        "--out", str(out), *extra,
    ]
    if contestant == "ddptrain":
        run_dir = out_dir / f"{tag}-run"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd += ["--run_dir", str(run_dir)]
    env = bench_env()
    for _attempt in range(2):  # one retry: a port clash or a stray signal is not a result
        env[LAUNCH_ENV] = repr(time.time())
        code, output, _ = run_command(cmd, env, timeout_s)
        if code == 0 and out.exists():
            break
    row: dict[str, Any] = {"contestant": contestant, "workload": workload, "nproc": nproc}
    if code != 0 or not out.exists():
        (out_dir / f"{tag}.log").write_text(output)
        row["error"] = f"exit {code}, see {out_dir / (tag + '.log')}"
        print(f"  {tag}: FAILED ({row['error']})", flush=True)
        return row
    row.update(json.loads(out.read_text()))
    print(f"  {tag}: {row['step_time_s'] * 1e3:.2f} ms/step", flush=True)
    return row


def process_command(contestant: str, run_dir: Path, epochs: int) -> list[str]:
    """The whole run as a user starts it: ddptrain's own CLI, or the hand-written script."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2"]
    if contestant == "ddptrain":
        w = WORKLOADS["dataset"]
        return [
            *torchrun, "-m", "ddptrain", "train", "--dataset", USER_DATASET,
            "--num_classes", str(w["num_classes"]), "--batch_size", str(w["batch_size"]),
            "--width", str(w["width"]), "--epochs", str(epochs), "--output_dir", str(run_dir),
        ]
    return [*torchrun, "bench/contestants/raw_script.py", "--epochs", str(epochs),
            "--out_dir", str(run_dir)]


def launch_process(contestant: str, out_dir: Path, tag: str, epochs: int) -> dict[str, Any]:
    """Time one whole run from launch to exit, as the orchestrator sees it."""
    run_dir = out_dir / f"{tag}-run"
    shutil.rmtree(run_dir, ignore_errors=True)  # ddptrain refuses a directory with a run
    code, output, wall = run_command(
        process_command(contestant, run_dir, epochs), bench_env(), LAUNCH_TIMEOUT_S
    )
    row: dict[str, Any] = {"contestant": contestant, "epochs": epochs}
    summary = run_dir / "summary.json"
    if code != 0 or not summary.exists():
        (out_dir / f"{tag}.log").write_text(output)
        row["error"] = f"exit {code}, see {out_dir / (tag + '.log')}"
        print(f"  {tag}: FAILED ({row['error']})", flush=True)
        return row
    figures = json.loads(summary.read_text())
    row.update({
        "wall_s": wall, "train_time_s": figures["train_time_s"], "steps": figures["steps"],
        "files": sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()),
    })
    print(f"  {tag}: {wall:.2f} s launch to exit ({figures['train_time_s']:.2f} s in the "
          "epochs)", flush=True)
    return row


def rotated(names: list[str], r: int) -> list[str]:
    shift = r % len(names)
    return names[shift:] + names[:shift]


def run_suite(args: argparse.Namespace, contestants: list[str]) -> dict[str, Any]:
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = args.only or list(SECTIONS)
    if not args.compile and "compile" in sections:
        sections.remove("compile")
    epochs = (lambda w: QUICK_EPOCHS) if args.quick else (lambda w: TIMED_EPOCHS[w])
    results: dict[str, Any] = {
        "rows": [], "variants": [], "process": [], "compile": [], "rounds": {},
        "repeats": args.repeats, "sections": sections, "quick": args.quick,
        "timed_epochs": {w: epochs(w) for w in (*WORKLOADS, *COMPILE_WORKLOADS)},
        "process_epochs": 2 if args.quick else PROCESS_EPOCHS,
    }
    started = time.time()
    load_at_start = os.getloadavg()[0]
    if "steps" in sections or "channels_last" in sections:
        _steps(args, contestants, sections, epochs, results)
    if "rounds" in sections:
        print("all-reduce rounds with --grad_accum_steps 4", flush=True)
        accum = ("--grad_accum_steps", "4", "--timed_epochs", "1", "--count_allreduce")
        results["rounds"] = {
            "ddptrain": launch("ddptrain", "mlp", 2, out_dir, "rounds-ddptrain", *accum),
            "seed_loop": launch("raw", "mlp", 2, out_dir, "rounds-seed", *accum, "--seed_style"),
        }
    if "process" in sections:
        for r in range(args.repeats):
            print(f"whole process: repeat {r + 1}/{args.repeats}", flush=True)
            for name in rotated(["raw", "ddptrain"], r):
                row = launch_process(name, out_dir, f"process-{name}-{r}",
                                     results["process_epochs"])
                results["process"].append({**row, "repeat": r})
    if "compile" in sections:
        for workload in (w for w in COMPILE_WORKLOADS if w in (args.workloads or [w])):
            print(f"{workload}: eager, then torch.compile (one run each)", flush=True)
            timed = ("--timed_epochs", str(epochs(workload)))
            for variant, flags in (("eager", ()), ("compile", ("--compile",))):
                row = launch("ddptrain", workload, 2, out_dir, f"{workload}-{variant}", *timed,
                             *flags, timeout_s=COMPILE_TIMEOUT_S)
                results["compile"].append({**row, "variant": variant})
    results["suite_seconds"] = time.time() - started
    results["machine"] = {**machine(), "load_1min": [load_at_start, os.getloadavg()[0]]}
    return results


def _steps(
    args: argparse.Namespace, contestants: list[str], sections: list[str], epochs: Any,
    results: dict[str, Any],
) -> None:
    """The contest, and channels_last runs of ddptrain interleaved with its resnet repeats
    (so that both formats meet the same spells of the machine)."""
    workloads = [w for w in WORKLOADS if w in (args.workloads or [w])]
    if "steps" not in sections:
        workloads = ["resnet"]
    for workload in workloads:
        timed = ("--timed_epochs", str(epochs(workload)))
        for r in range(args.repeats):
            print(f"{workload}: repeat {r + 1}/{args.repeats}", flush=True)
            if "steps" in sections:
                for name in rotated(contestants, r):
                    row = launch(name, workload, 2, args.out_dir, f"{workload}-{name}-{r}",
                                 *timed)
                    results["rows"].append({**row, "repeat": r})
                if workload in WEAK_SCALING and "ddptrain" in contestants:
                    # weak scaling: the same per-rank batch on one rank
                    row = launch("ddptrain", workload, 1, args.out_dir,
                                 f"{workload}-ddptrain1-{r}", *timed)
                    results["rows"].append({**row, "repeat": r})
            if workload == "resnet" and "channels_last" in sections:
                row = launch("ddptrain", workload, 2, args.out_dir,
                             f"{workload}-ddptrain-cl-{r}", *timed, "--channels_last")
                results["variants"].append({**row, "variant": "channels_last", "repeat": r})
                if "steps" not in sections:  # the contiguous runs to compare with
                    row = launch("ddptrain", workload, 2, args.out_dir,
                                 f"{workload}-ddptrain-{r}", *timed)
                    results["rows"].append({**row, "repeat": r})


def machine() -> dict[str, Any]:
    """What the numbers were measured on, read from the machine itself."""
    import platform

    import torch

    info: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "os": platform.platform(),
    }
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        kib = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
        info["memory_gib"] = round(kib / 2**20, 1)
    for package in ("lightning", "accelerate"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out_dir", type=Path, default=None,
                        help="results and run directories (default: runs/bench, or "
                        "runs/bench-quick for a partial run)")
    parser.add_argument("--docs", type=Path, default=None,
                        help="where the report goes (default: docs/, or the out_dir for a "
                        "partial run)")
    parser.add_argument(
        "--report_only", action="store_true", help="rebuild the docs from the saved results"
    )
    parser.add_argument("--only", nargs="+", choices=SECTIONS, metavar="SECTION",
                        help=f"run only these sections: {', '.join(SECTIONS)}")
    parser.add_argument("--workloads", nargs="+", choices=[*WORKLOADS, *DDPTRAIN_ONLY],
                        help="workloads of the steps and compile sections (default: all)")
    parser.add_argument("--contestants", nargs="+", choices=list(CONTESTANTS),
                        help="step-time contestants to run (default: all installed)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="run the torch.compile section (minutes on a small CPU)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_EPOCHS} timed epoch per workload and 2-epoch whole-"
                        "process runs: checks the pipeline, measures nothing worth reporting")
    args = parser.parse_args()
    partial = bool(args.quick or args.only or args.workloads or args.contestants)
    default_out = ROOT / "runs" / ("bench-quick" if partial else "bench")
    args.out_dir = args.out_dir or default_out
    docs = args.docs or (args.out_dir if partial else ROOT / "docs")
    results_path = args.out_dir / "results.json"
    if not args.report_only:
        wanted = args.contestants or list(CONTESTANTS)
        contestants = [c for c in wanted if c in ("raw", "ddptrain") or _importable(c)]
        results = run_suite(args, contestants)
        results_path.write_text(json.dumps(results, indent=1) + "\n")
    results = json.loads(results_path.read_text())
    from bench.report import write_report

    md, png = write_report(results, docs)
    print(f"wrote {md} and {png}")
    return 0


def _importable(contestant: str) -> bool:
    module = {"fabric": "lightning", "accelerate": "accelerate"}[contestant]
    if importlib.util.find_spec(module) is None:
        print(f"{module} is not installed: {contestant} left out (make .venv-bench)")
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
