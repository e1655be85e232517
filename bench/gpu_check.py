"""`make gpu-check`: every training path that fits one GPU, checked and measured there.

    python bench/gpu_check.py --out runs/gpu-check      # about 17 minutes on one H200

Calls of 10 minutes take it in parts: `--skip speed` (about 6 minutes), then the
throughput rows, a few a call (`--skip checks tests --speed b4 b8 --update
runs/gpu-check/gpu_check.json`; about a minute each, the compiled ones more).

Without CUDA it says so in one line and exits 0. With CUDA it runs, each as a user starts
it (`python -m ddptrain train`, or torchrun for 2 ranks), each with its own time limit, so
one that fails or hangs is recorded and the rest still run:

1. Checks against a CPU reference. ddptrain's GPT (2 blocks, width 128, 64-token windows)
   trains one epoch of 12 SGD steps (momentum 0.9, a clip that acts) on the CPU, then on
   the GPU under each path: plain fp32, zero and fsdp on one rank, activation
   checkpointing, torch.compile, and on 2 ranks sharing the GPU (gloo: NCCL takes one GPU
   per rank) ddp, tp 2 and pp 2. Each run's final weights (model.safetensors) are compared
   with the CPU run's: fp32 paths (IEEE float32, `--tf32 off`) must agree within
   `FP32_TOL`. TF32, bf16 and fp16 autocast runs must end within `AMP_LOSS_TOL` of the fp32
   validation loss. A 2-rank NCCL run is
   recorded as what NCCL says of two ranks on one GPU. The built-in GPT with 4 experts a
   block (`--model_args experts=4 top_k=2`: the grouped GEMM) is checked against a CPU run
   of its own, by validation loss (routing is discrete): fp32, fsdp, bf16 autocast, and
   `--ep 2` over NCCL recorded.
2. The CUDA-only tests (`tests/test_precision.py`).
3. Throughput: a Llama-style model of about 1.1B parameters (22 layers, width 2048, GQA
   32/8 heads, vocab 32000; TinyLlama's shape) through `--model hf:DIR`, bf16 autocast,
   AdamW, 2048-token windows at a few batch sizes: tokens/s, MFU and peak memory read from
   the run's own train rows (the median after the warm-up steps).

Figures go to OUT/gpu_check.json as each step ends (what finished survives a cut-off
call); `--report_only OUT/gpu_check.json` writes the "GPU" section of docs/BENCHMARKS.md
from them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

START, END = "<!-- gpu:start -->", "<!-- gpu:end -->"
FP32_TOL = 1e-4
AMP_LOSS_TOL = 0.02  # relative, on the validation loss
SMALL = ["train", "--dataset", "bench.layouts:windows", "--model", "gpt", "--width", "128",
         "--block_size", "64", "--epochs", "1", "--optimizer", "sgd", "--momentum", "0.9",
         "--max_grad_norm", "0.5", "--lr", "0.05", "--log_interval", "1", "--no-tensorboard",
         "--seed", "0"]
LLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}
SEQ, STEPS, WARMUP = 2048, 10, 3
# (batch, flags): the batch sizes plain, then the paths that change a step's cost.
SPEED_RUNS: list[tuple[int, list[str]]] = [
    (4, []), (8, []), (8, ["--activation_checkpointing"]),
    (8, ["--activation_checkpointing", "selective"]),
    (8, ["--strategy", "fsdp"]), (8, ["--float8", "tensorwise"]),
    (8, ["--float8", "rowwise"]), (8, ["--compile"]), (8, ["--float8", "tensorwise", "--compile"]),
]

# The mixture of experts checked: 4 experts a block, 2 a token (width 128: one grouped GEMM)
MOE = ["--model_args", "experts=4", "top_k=2"]

# name -> (ranks, flags, kind): "fp32" compared by weights, "amp" by loss, "loss" in fp32
# by loss (a mixture's routing is discrete: a last-bit tie may send a token elsewhere),
# "info" recorded, "refused" must end with ddptrain's one line naming the way out. Runs
# of the mixture compare with a CPU run of the mixture.
CHECKS: dict[str, tuple[int, list[str], str]] = {
    "plain fp32": (1, [], "fp32"),
    "zero": (1, ["--strategy", "zero"], "fp32"),
    "fsdp": (1, ["--strategy", "fsdp"], "fp32"),
    "activation checkpointing": (1, ["--activation_checkpointing"], "fp32"),
    "selective activation checkpointing": (1, ["--activation_checkpointing", "selective"],
                                           "fp32"),
    "fp32 with TF32 matmuls": (1, ["--no-use_amp", "--tf32", "on"], "amp"),
    "bf16 autocast": (1, ["--use_amp", "--amp_dtype", "bfloat16"], "amp"),
    "fp16 autocast + GradScaler": (1, ["--use_amp", "--amp_dtype", "float16"], "amp"),
    "float8 tensorwise (bf16 autocast)": (
        1, ["--use_amp", "--amp_dtype", "bfloat16", "--float8", "tensorwise"], "amp"),
    "float8 rowwise, fsdp (bf16 autocast)": (
        1, ["--use_amp", "--amp_dtype", "bfloat16", "--float8", "rowwise", "--strategy",
            "fsdp"], "amp"),
    "ddp 2 ranks (gloo)": (2, ["--backend", "gloo"], "fp32"),
    # tp and pp on CUDA need NCCL, one GPU per rank: over gloo they are refused (checked)
    "tp 2 (gloo): refused": (2, ["--backend", "gloo", "--tp", "2"], "refused"),
    "pp 2 (gloo): refused": (2, ["--backend", "gloo", "--pp", "2"], "refused"),
    "ddp 2 ranks (nccl, one GPU)": (2, ["--backend", "nccl"], "info"),
    "torch.compile": (1, ["--compile"], "fp32"),
    "experts fp32 (grouped GEMM)": (1, MOE, "loss"),
    "experts, fsdp": (1, [*MOE, "--strategy", "fsdp"], "loss"),
    "experts, bf16 autocast": (1, [*MOE, "--use_amp", "--amp_dtype", "bfloat16"], "amp"),
    "experts --ep 2 (nccl, one GPU)": (2, [*MOE, "--backend", "nccl", "--ep", "2"], "info"),
}


def speed_name(batch: int, flags: list[str]) -> str:
    """A throughput run's name on the command line: b8, b8-activation_checkpointing-selective."""
    return "-".join([f"b{batch}", *(f.lstrip("-") for f in flags)])


SPEED_NAMES = [speed_name(b, f) for b, f in SPEED_RUNS]


def env() -> dict[str, str]:
    out = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "src"), out.get("PYTHONPATH")])
    )
    return out


def launch(ranks: int, args: list[str], timeout_s: float) -> tuple[int, str, float]:
    """`ddptrain` with `args` on `ranks` processes; (exit code, output tail, seconds)."""
    from bench.run import run_command

    cmd = [sys.executable, "-m", "ddptrain", *args]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", "-m", "ddptrain", *args]
    code, out, seconds = run_command(cmd, env(), timeout_s)
    return code, _tail(out), seconds


def _tail(out: str) -> str:
    """The output's error lines (torchrun's own report hides the ranks' under it), then
    its end."""
    lines = out.splitlines()
    errors = [x for x in lines if "rror" in x and "ChildFailedError" not in x][:8]
    return "\n".join([*errors, "...", *lines[-15:]])


def weights(run: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(run / "model.safetensors"))


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    if a.keys() != b.keys():
        return math.inf
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


def checks(out: Path, results: dict[str, Any], save: Any, names: list[str]) -> None:
    """The CHECKS in `names`, against the CPU run (made at the first call)."""
    refs: dict[bool, tuple[dict[str, Any], float]] = {}
    for name in names:
        ranks, flags, kind = CHECKS[name]
        moe = MOE[0] in flags
        if moe not in refs:
            ref_dir = out / ("cpu-experts" if moe else "cpu")
            if not (ref_dir / "summary.json").exists():
                rc, tail, secs = launch(1, [*SMALL, *(MOE if moe else []), "--no-use_amp",
                                            "--device", "cpu", "--batch_size", "8",
                                            "--output_dir", str(ref_dir)], 120)
                if rc:
                    results["checks"][f"cpu reference{' (experts)' if moe else ''}"] = {
                        "ok": False, "rc": rc, "tail": tail}
                    save()
                    return
            refs[moe] = weights(ref_dir), summary(ref_dir)["val_loss"]
        ref, ref_loss = refs[moe]
        run = out / name.replace(" ", "_").replace("(", "").replace(")", "").replace(",", "")
        model_parallel = "--tp" in flags or "--pp" in flags  # its ranks read one batch
        batch = str(8 if model_parallel else 8 // ranks)
        # fp32 paths are compared with IEEE float32; TF32 is a check of its own
        amp = [] if kind == "amp" else ["--no-use_amp", "--tf32", "off"]
        rc, tail, secs = launch(ranks, [*SMALL, *amp, "--device", "cuda", *flags,
                                        "--batch_size", batch, "--output_dir", str(run)],
                                240 if "compile" in name else 120)
        row: dict[str, Any] = {"ranks": ranks, "flags": " ".join(flags), "kind": kind,
                               "rc": rc, "seconds": round(secs, 1)}
        if rc == 0:
            diff, loss = max_diff(ref, weights(run)), summary(run)["val_loss"]
            row.update(max_weight_diff=diff, val_loss=loss, ref_val_loss=ref_loss)
            rel = abs(loss - ref_loss) / abs(ref_loss)
            row["ok"] = diff <= FP32_TOL if kind == "fp32" else rel <= AMP_LOSS_TOL
        elif kind == "refused":
            row.update(ok="use --backend nccl" in tail, tail=tail)
        else:
            row.update(ok=kind == "info", tail=tail)
        results["checks"][name] = row
        print(f"{name:32s} rc {rc} {row.get('max_weight_diff', '-')} "
              f"{'ok' if row['ok'] else 'FAILED'} ({secs:.0f} s)", flush=True)
        save()
        shutil.rmtree(run, ignore_errors=True)


def cuda_tests(results: dict[str, Any], save: Any) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/test_precision.py", "-k", "cuda"]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True,
                              timeout=180)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = 124, "timed out"
    results["cuda_tests"] = {"rc": rc, "tail": tail, "seconds": time.perf_counter() - t0}
    print(f"CUDA tests: rc {rc}", flush=True)
    save()


def tokens(config: Any) -> Any:
    """Random token windows for the throughput runs: STEPS batches, and one to validate."""
    import torch
    from torch.utils.data import TensorDataset

    class Windows(TensorDataset):
        vocab_size = LLAMA["vocab_size"]

    n = config.batch_size * STEPS
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, LLAMA["vocab_size"], (n + config.batch_size, config.block_size + 1),
                         generator=g)
    x, y = data[:, :-1], data[:, 1:]
    return Windows(x[:n], y[:n]), Windows(x[n:], y[n:])


def make_llama(directory: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def throughput(out: Path, results: dict[str, Any], save: Any, names: list[str]) -> None:
    """The SPEED_RUNS in `names`; each row replaces an earlier one of the same run."""
    model_dir = out / "llama-1b"
    results["llama_parameters"] = make_llama(model_dir)
    save()
    # Each run ends with a checkpoint of 13 GB (weights and AdamW's moments): in memory,
    # where the machine has a tmpfs, so the run's time is mostly its steps
    scratch = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    for batch, flags in SPEED_RUNS:
        if speed_name(batch, flags) not in names:
            continue
        run = scratch / f"ddptrain-gpu-check-b{batch}"
        args = ["train", "--dataset", "bench.gpu_check:tokens", "--model", f"hf:{model_dir}",
                "--block_size", str(SEQ), "--batch_size", str(batch), "--epochs", "1",
                "--optimizer", "adamw", "--lr", "1e-4", "--use_amp", "--amp_dtype", "bfloat16",
                "--log_interval", "1", "--no-tensorboard", "--output_dir", str(run), *flags]
        rc, tail, secs = launch(1, args, 300 if "--compile" in flags else 180)
        row: dict[str, Any] = {"batch": batch, "seq": SEQ, "flags": " ".join(flags), "rc": rc,
                               "seconds": round(secs, 1)}
        if rc == 0:
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            train = [r for r in rows if r.get("split") == "train"][WARMUP:]
            step = statistics.median(r["step_time_s"] for r in train)
            row.update(step_ms=step * 1e3, tokens_per_s=batch * SEQ / step,
                       mfu=statistics.median(r.get("mfu", math.nan) for r in train),
                       peak_gib=max(r.get("peak_cuda_mb", 0) for r in train) / 1024,
                       last_loss=train[-1].get("loss"),
                       bad_steps=summary(run).get("bad_steps"))
        else:
            row["tail"] = tail
        rows = results["throughput"]
        rows[:] = [r for r in rows if (r["batch"], r["flags"]) != (batch, row["flags"])]
        rows.append(row)
        print(f"llama b{batch}: {row}", flush=True)
        save()
        shutil.rmtree(run, ignore_errors=True)


def gpu_info() -> dict[str, Any]:
    import torch

    from bench.run import machine

    props = torch.cuda.get_device_properties(0)
    info = machine()
    info.update(gpu=torch.cuda.get_device_name(0), capability=f"{props.major}.{props.minor}",
                gpu_memory_gib=round(props.total_memory / 2**30, 1),
                cuda=torch.version.cuda)
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["driver"] = "unknown"
    return info


def _verdict(r: dict[str, Any]) -> str:
    """A check's result column: an expected refusal says so, not its exit code."""
    if not r.get("ok"):
        return f"FAILED (exit {r.get('rc')})"
    if r.get("rc") and r.get("kind") == "refused":
        return "refused before the process group in one line (use --backend nccl), as expected"
    if r.get("rc") and r.get("kind") == "info":
        nccl = "NCCL" in r.get("tail", "")
        return ("refused by NCCL, as expected: NCCL takes one GPU per rank" if nccl else
                f"exit {r['rc']} (recorded)")
    return "ok"


def section(results: dict[str, Any]) -> str:
    m = results["machine"]
    earlier = [x["date_utc"] for x in results.get("earlier_machines", [])
               if x["date_utc"] != m["date_utc"]]
    lines = [
        "## GPU", "",
        f"`make gpu-check` (bench/gpu_check.py), {m['date_utc']}: {m['gpu']} (capability "
        f"{m['capability']}, {m['gpu_memory_gib']} GiB), driver {m['driver']}, CUDA "
        f"{m['cuda']}, torch {m['torch']}, {m['cores']} CPU cores."
        + (f" Rows not run then come from the run(s) of {', '.join(earlier)} (`--update`), "
           "on the same kind of card." if earlier else ""), "",
        "### Paths checked against a CPU reference", "",
        f"ddptrain's GPT (2 blocks, width 128) for 12 SGD steps; fp32 paths must end within "
        f"{FP32_TOL:g} of the CPU run's weights, autocast runs within {AMP_LOSS_TOL:.0%} of "
        "its validation loss; the runs with experts (`--model_args experts=4 top_k=2`) "
        f"within {AMP_LOSS_TOL:.0%} of a CPU run's with experts.", "",
        "| path | ranks | max weight diff vs CPU | val loss (CPU) | result |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, r in results["checks"].items():
        diff = f"{r['max_weight_diff']:.1e}" if "max_weight_diff" in r else "-"
        loss = (f"{r['val_loss']:.4f} ({r['ref_val_loss']:.4f})" if "val_loss" in r else "-")
        verdict = r.get("note") or _verdict(r)
        lines.append(f"| {name} | {r.get('ranks', 1)} | {diff} | {loss} | {verdict} |")
    if "cuda_tests" in results:
        lines += ["", f"CUDA-only tests (`tests/test_precision.py -k cuda`): exit "
                      f"{results['cuda_tests']['rc']}."]
    if results.get("throughput"):
        n = results.get("llama_parameters", 0)
        lines += [
            "", "### Throughput: a Llama-style model on one GPU", "",
            f"{n / 1e9:.2f}B parameters (22 layers, width 2048, 32/8 heads, vocab 32000), "
            f"{SEQ}-token windows, bf16 autocast over fp32 weights, AdamW, one process; the "
            f"median of steps {WARMUP + 1}-{STEPS} of the run's own train rows. MFU counts the "
            "model's FLOPs (forward and backward) against the card's dense bf16 peak.", "",
            "| batch | flags | tokens/s | step (ms) | MFU | peak memory (GiB) |",
            "| ---: | --- | ---: | ---: | ---: | ---: |",
        ]
        order = {name: i for i, name in enumerate(SPEED_NAMES)}
        rows = sorted(results["throughput"], key=lambda r: (
            r["batch"], order.get(speed_name(r["batch"], r["flags"].split()), len(order))))
        for r in rows:
            flags = f"`{r['flags']}`" if r.get("flags") else ""
            if r["rc"]:
                why = r.get("note") or f"failed (exit {r['rc']})"
                lines.append(f"| {r['batch']} | {flags} | {why} | | | |")
                continue
            # fp32 weights, gradients and AdamW's two moments stay resident: a peak below
            # them is a reading that missed part of the process (flagged, not trusted)
            peak = f"{r['peak_gib']:.1f}"
            if r["peak_gib"] < 16 * n / 2**30:
                peak += f" (below the {16 * n / 2**30:.1f} held: an early reading, not trusted)"
            lines.append(f"| {r['batch']} | {flags} | {r['tokens_per_s']:,.0f} | "
                         f"{r['step_ms']:.0f} | {r['mfu']:.1%} | {peak} |")
    lines += [
        "", "The GPU machine runs its own image's torch (above), not the torch this project "
        "pins for CPU machines: the code is the same. MFU divides the FLOPs counted on the "
        "meta device (attention included) by the step time and the card's dense bf16 peak "
        "from `ddptrain.observe.flops` (989 TFLOP/s for an H100 or H200 SXM). One process "
        "holds fp32 weights, gradients and AdamW's two moments (16 bytes a parameter, "
        "18 GB here); the rest of the peak is activations, which activation checkpointing "
        "trades for one more forward. fsdp on one rank costs nothing measurable over plain "
        "training.",
    ]
    rows = results.get("throughput", [])
    if any("float8" in r["flags"] and "compile" not in r["flags"] for r in rows):
        lines[-1] += (" float8 without `--compile` runs torchao's scaling and casts as kernels "
                      "of their own, slower than bf16 (ddptrain warns so).")
        if not any("float8" in r["flags"] and "compile" in r["flags"] and not r["rc"]
                   for r in rows):
            lines[-1] += " float8 under `--compile` is not measured yet."
    speeds = {r["flags"]: r for r in rows if not r["rc"] and r["batch"] == 8}
    both = speeds.get("--compile"), speeds.get("--float8 tensorwise --compile")
    if both[0] and both[1]:
        lines[-1] += (f" float8 tensorwise under `--compile` ran at {both[1]['tokens_per_s']:,.0f} "
                      f"tokens/s against {both[0]['tokens_per_s']:,.0f} for bf16 under "
                      f"`--compile` (x{both[1]['tokens_per_s'] / both[0]['tokens_per_s']:.2f}).")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check")
    parser.add_argument("--report_only", type=Path, default=None,
                        help="write docs/BENCHMARKS.md's GPU section from this gpu_check.json")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "BENCHMARKS.md")
    parser.add_argument("--skip", nargs="*", default=[], choices=["checks", "tests", "speed"])
    parser.add_argument("--checks", nargs="*", default=list(CHECKS), choices=list(CHECKS),
                        metavar="NAME", help="the checks to run (default: all)")
    parser.add_argument("--speed", nargs="*", default=SPEED_NAMES, choices=SPEED_NAMES,
                        metavar="RUN", help=f"the throughput runs (default: all: "
                        f"{' '.join(SPEED_NAMES)})")
    parser.add_argument("--update", type=Path, default=None,
                        help="start from this earlier gpu_check.json: the rows run now "
                        "replace its rows of the same name, the rest are kept")
    args = parser.parse_args()
    from bench.sharding import write_section

    if args.report_only:
        write_section(args.docs, section(json.loads(args.report_only.read_text())), START, END)
        print(f"wrote the GPU section of {args.docs}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here: nothing to check (run it on a GPU machine)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"checks": {}, "throughput": []}
    if args.update:
        results = json.loads(args.update.read_text())
        results["earlier_machines"] = [*results.get("earlier_machines", []),
                                       results["machine"]]
    results["machine"] = gpu_info()
    record = args.out / "gpu_check.json"

    def save() -> None:
        record.write_text(json.dumps(results, indent=1) + "\n")

    save()
    print(results["machine"], flush=True)
    # The slowest (compilation) last: a call cut short keeps the figures made before.
    slow = ["torch.compile"]
    if "checks" not in args.skip:
        checks(args.out, results, save, [n for n in args.checks if n not in slow])
    if "tests" not in args.skip:
        cuda_tests(results, save)
    if "speed" not in args.skip:
        throughput(args.out, results, save, args.speed)
    if "checks" not in args.skip:
        checks(args.out, results, save, [n for n in args.checks if n in slow])
    print(section(results))
    failed = [n for n, r in results["checks"].items() if not r.get("ok")]
    failed += [f"llama b{r['batch']}" for r in results["throughput"] if r["rc"]]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
