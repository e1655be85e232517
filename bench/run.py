"""The benchmark suite: ddptrain against a hand-written DDP loop, Lightning Fabric and
HF Accelerate, on 2 CPU ranks (gloo, one thread each). `make bench` runs it:

    .venv-bench/bin/python bench/run.py --repeats 5      # writes docs/BENCHMARKS.md + chart

Every contestant trains the same model on the same data with the same batch, epochs and
process count. The contestants run alternately, in an order rotated every repeat, so a
slow spell of the machine hits all of them alike; the report gives medians over the
repeats and the ratios of the medians. Raw results are kept in runs/bench/results.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import LAUNCH_ENV, WORKLOADS  # noqa: E402

CONTESTANTS = {
    "raw": "bench/contestants/raw.py",
    "ddptrain": "bench/contestants/ddptrain_api.py",
    "fabric": "bench/contestants/fabric.py",
    "accelerate": "bench/contestants/accelerate_loop.py",
}


def launch(
    contestant: str, workload: str, nproc: int, out_dir: Path, tag: str, *extra: str
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
        cmd += ["--run_dir", str(out_dir / f"{tag}-run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    for _attempt in range(2):  # one retry: a port clash or a stray signal is not a result
        env[LAUNCH_ENV] = repr(time.time())
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode == 0 and out.exists():
            break
    row: dict[str, Any] = {"contestant": contestant, "workload": workload, "nproc": nproc}
    if proc.returncode != 0 or not out.exists():
        (out_dir / f"{tag}.log").write_text(proc.stdout + proc.stderr)
        row["error"] = f"exit {proc.returncode}, see {out_dir / (tag + '.log')}"
        print(f"  {tag}: FAILED ({row['error']})", flush=True)
        return row
    row.update(json.loads(out.read_text()))
    print(f"  {tag}: {row['step_time_s'] * 1e3:.2f} ms/step", flush=True)
    return row


def run_suite(repeats: int, out_dir: Path, contestants: list[str]) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    started = time.time()
    load_at_start = os.getloadavg()[0]
    for workload in WORKLOADS:
        for r in range(repeats):
            print(f"{workload}: repeat {r + 1}/{repeats}", flush=True)
            shift = r % len(contestants)
            order = contestants[shift:] + contestants[:shift]
            for name in order:
                rows.append({**launch(name, workload, 2, out_dir, f"{workload}-{name}-{r}"),
                             "repeat": r})
            # weak scaling: the same per-rank batch on one rank
            rows.append({**launch("ddptrain", workload, 1, out_dir, f"{workload}-ddptrain1-{r}"),
                         "repeat": r})
    print("all-reduce rounds with --grad_accum_steps 4", flush=True)
    accum = ("--grad_accum_steps", "4", "--timed_epochs", "1", "--count_allreduce")
    rounds = {
        "ddptrain": launch("ddptrain", "mlp", 2, out_dir, "rounds-ddptrain", *accum),
        "seed_loop": launch("raw", "mlp", 2, out_dir, "rounds-seed", *accum, "--seed_style"),
    }
    return {
        "rows": rows, "rounds": rounds, "repeats": repeats,
        "suite_seconds": time.time() - started,
        "machine": {**machine(), "load_1min": [load_at_start, os.getloadavg()[0]]},
    }


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
    parser.add_argument("--out_dir", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    parser.add_argument(
        "--report_only", action="store_true", help="rebuild the docs from the saved results"
    )
    args = parser.parse_args()
    results_path = args.out_dir / "results.json"
    if not args.report_only:
        contestants = [c for c in CONTESTANTS if c in ("raw", "ddptrain") or _importable(c)]
        results = run_suite(args.repeats, args.out_dir, contestants)
        results_path.write_text(json.dumps(results, indent=1) + "\n")
    results = json.loads(results_path.read_text())
    from bench.report import write_report

    md, png = write_report(results, args.docs)
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
