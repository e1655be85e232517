"""A sharded model to and from Hugging Face files: what writing `model.safetensors` and
`hf/` costs each rank, streamed (`checkpoint.streamed`, what the trainer does) or gathered
(the whole model collected on rank 0's CPU, then `save_file` and `save_pretrained`, as
before); and what reading that `hf/` back into the shards costs, per rank
(`checkpoint.init.fill_pretrained`, what `--model hf:DIR` does under fsdp, tp and pp) or
through rank 0 (`from_pretrained` on rank 0, each tensor then broadcast, as before).

A Llama-style model from a config (hidden 1536, 8 layers, MLP 4096, vocabulary 32000:
324M parameters, 1.3 GB in fp32) is built on the meta device on 2 CPU ranks (gloo, one
thread each), sharded with FSDP2 and filled; each export case then writes it once with
`hf/` in files of at most 400 MB, and each read case fills a fresh sharded skeleton from
the streamed case's `hf/`. Per rank: wall time, bytes written (`wchar`), bytes asked of
the safetensors files, and peak RSS growth (the high-water mark reset just before; the
files are memory-mapped, so the pages a rank touches count).

    .venv/bin/python bench/exports.py [--layers 8] [--cases streamed,gathered,per-rank,rank0]

Prints a markdown table: its rows go into docs/BENCHMARKS.md between
`<!-- exports:start -->` and `<!-- exports:end -->`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
        set_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddptrain.checkpoint.export import HfExport, export_safetensors_state, export_streamed
    from ddptrain.checkpoint.init import SafetensorsReader, fill_pretrained
    from ddptrain.checkpoint.streamed import Catalog
    from ddptrain.context import DistributedContext
    from ddptrain.observe.flops import meta_shadow

    asked: list[int] = []
    real_read = SafetensorsReader._process_read_request

    def counting(self: Any, f: Any, req: Any, planner: Any) -> None:
        asked.append(math.prod(req.lengths) * self.storage_data[req.storage_index].dtype.itemsize)
        real_read(self, f, req, planner)

    SafetensorsReader._process_read_request = counting  # type: ignore[method-assign]

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
    skeleton = meta_shadow(model)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    reading = case in ("per-rank", "rank0")
    if not reading:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
    parameters = sum(p.numel() for p in model.parameters())
    run = Path(out) / case
    if rank == 0 and not reading:
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
    source = Path(out) / "streamed" / "hf"
    dist.barrier()
    _rss_peak_reset()
    rss0, w0, t0 = _status("VmRSS"), _wchar(), time.perf_counter()
    if case == "per-rank":
        fill_pretrained(model, skeleton, f"hf:{source}", ctx, seed=0, ties=[])
    elif case == "rank0":
        state = {}
        if rank == 0:
            state = transformers.AutoModelForCausalLM.from_pretrained(source).state_dict()
        set_model_state_dict(model, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        del state
    elif case == "streamed":
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
              "rss_growth": _status("VmHWM") - rss0, "parameters": parameters,
              "asked": sum(asked)}
    (Path(out) / f"{case}.{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(layers: int, cases: list[str], out: Path) -> list[list[dict[str, Any]]]:
    """Each case on 2 ranks, one after the other: per case, each rank's figures."""
    rows = []
    for case in cases:
        with socket.socket() as probe:  # a free port for this case's process group
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        mp.start_processes(_rank, args=(port, layers, case, str(out)), nprocs=2,
                           start_method="spawn")
        rows.append([json.loads((out / f"{case}.{r}.json").read_text()) for r in (0, 1)])
        if case != "streamed":
            shutil.rmtree(out / case, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cases", default="streamed,gathered,per-rank,rank0",
                        help="the read cases read the streamed case's hf/: run it first")
    parser.add_argument("--out", default=None, help="where the exports go (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="ddptrain-exports-")
    rows = measure(args.layers, args.cases.split(","), Path(out))
    gb = 1e9
    n = rows[0][0]["parameters"]
    print(f"Llama-style, {args.layers} layers: {n / 1e6:.0f}M parameters, "
          f"{n * 4 / gb:.2f} GB in fp32, FSDP2 on 2 CPU ranks\n")
    print("| case | s | GB written (rank 0 / 1) | GB asked of the files (rank 0 / 1) | "
          "peak RSS growth GB (rank 0 / 1) |")
    print("| --- | --- | --- | --- | --- |")
    for r0, r1 in rows:
        print(f"| {r0['case']} | {max(r0['seconds'], r1['seconds']):.1f} | "
              f"{r0['written'] / gb:.2f} / {r1['written'] / gb:.2f} | "
              f"{r0['asked'] / gb:.2f} / {r1['asked'] / gb:.2f} | "
              f"{r0['rss_growth'] / gb:.2f} / {r1['rss_growth'] / gb:.2f} |")
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    raise SystemExit(main())
