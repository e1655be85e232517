"""A run's exports from a sharded model: what writing `model.safetensors` and `hf/` costs
each rank, streamed (`checkpoint.streamed`, what the trainer does) or gathered (the whole
model collected on rank 0's CPU, then `save_file` and `save_pretrained`, as before).

A Llama-style model from a config (hidden 1536, 8 layers, MLP 4096, vocabulary 32000:
324M parameters, 1.3 GB in fp32) is built on the meta device on 2 CPU ranks (gloo, one
thread each), sharded with FSDP2 and filled; each case then exports it once with `hf/` in
files of at most 400 MB. Per rank: wall time, bytes written (`wchar`) and peak RSS
growth (the high-water mark reset just before).

    .venv/bin/python bench/exports.py [--layers 8] [--cases streamed,gathered]

Prints a markdown table: its rows go into docs/BENCHMARKS.md between
`<!-- exports:start -->` and `<!-- exports:end -->`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _rss_peak_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark back to now


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _wchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise KeyError("wchar")


def _rank(rank: int, port: int, layers: int, case: str, out: str) -> None:
    import torch.distributed as dist
    import transformers
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddptrain.checkpoint.export import HfExport, export_safetensors_state, export_streamed
    from ddptrain.checkpoint.streamed import Catalog
    from ddptrain.context import DistributedContext

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ctx = DistributedContext(rank, rank, 2, torch.device("cpu"), "gloo")
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1536, num_hidden_layers=layers, num_attention_heads=12,
        num_key_value_heads=12, intermediate_size=4096, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    parameters = sum(p.numel() for p in model.parameters())
    run = Path(out) / case
    if rank == 0:
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
    dist.barrier()
    _rss_peak_reset()
    rss0, w0, t0 = _status("VmRSS"), _wchar(), time.perf_counter()
    if case == "streamed":
        catalog = Catalog(get_model_state_dict(model), ctx)
        export_streamed(catalog, [], run / "model.safetensors",
                        hf=HfExport(model, run / "hf", shard_bytes=400 * 10**6))
    else:
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            export_safetensors_state(state, run / "model.safetensors")
            model.save_pretrained(run / "hf", state_dict=state, max_shard_size="400MB")
        del state
    dist.barrier()
    seconds = time.perf_counter() - t0
    result = {"rank": rank, "case": case, "seconds": seconds, "written": _wchar() - w0,
              "rss_growth": _status("VmHWM") - rss0, "parameters": parameters}
    (Path(out) / f"{case}.{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cases", default="streamed,gathered")
    parser.add_argument("--out", default=None, help="where the exports go (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="ddptrain-exports-")
    rows = []
    for i, case in enumerate(args.cases.split(",")):
        mp.start_processes(_rank, args=(29611 + i, args.layers, case, out), nprocs=2,
                           start_method="spawn")
        rows.append([json.loads((Path(out) / f"{case}.{r}.json").read_text()) for r in (0, 1)])
        shutil.rmtree(Path(out) / case, ignore_errors=True)
    gb = 1e9
    n = rows[0][0]["parameters"]
    print(f"Llama-style, {args.layers} layers: {n / 1e6:.0f}M parameters, "
          f"{n * 4 / gb:.2f} GB in fp32, FSDP2 on 2 CPU ranks\n")
    print("| export | s | GB written (rank 0 / 1) | peak RSS growth GB (rank 0 / 1) |")
    print("| --- | --- | --- | --- |")
    for r0, r1 in rows:
        print(f"| {r0['case']} | {max(r0['seconds'], r1['seconds']):.1f} | "
              f"{r0['written'] / gb:.2f} / {r1['written'] / gb:.2f} | "
              f"{r0['rss_growth'] / gb:.2f} / {r1['rss_growth'] / gb:.2f} |")
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    raise SystemExit(main())
