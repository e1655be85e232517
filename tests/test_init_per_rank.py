"""`--init_from` a sharded Hugging Face directory under fsdp, tp and pp: each rank reads
from the safetensors shards only the slices it holds (about half the bytes each on 2
ranks, where ddp's ranks read it whole, as they hold it whole), and every layout ends
with the weights of plain training from the same directory on one process.

What a rank reads is counted at DCP's Hugging Face reader, which takes each slice from
the memory-mapped file (`safe_open(...).get_slice`), request by request."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from nd_workers import fit_in_group, fit_runs

from ddptrain.config import TrainingConfig
from ddptrain.launch.process_group import setup_distributed, teardown_distributed

transformers = pytest.importorskip("transformers")

RUN = dict(dataset="hfplug:counting_windows", epochs=1, optimizer="sgd", lr=0.5,
           momentum=0.9, max_grad_norm=3.0, log_interval=1, seed=3, tensorboard=False,
           curves=False, batch_size=16)


def _llama(seed: int) -> Any:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=20, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    ))


def _fit_counting_reads(rank: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`fit_runs`, with the bytes this rank asked the safetensors files for in each run,
    and the bytes of `hf/`'s weight files it wrote at the end."""
    from ddptrain.checkpoint.init import SafetensorsReader
    from ddptrain.checkpoint.streamed import SafetensorsStream

    asked: list[int] = []
    wrote: list[int] = []
    real = SafetensorsReader._process_read_request
    real_write = SafetensorsStream.write

    def counting(self: Any, f: Any, req: Any, planner: Any) -> None:
        itemsize = self.storage_data[req.storage_index].dtype.itemsize
        asked.append(math.prod(req.lengths) * itemsize)
        real(self, f, req, planner)

    def writing(self: Any, name: str, tensor: torch.Tensor) -> None:
        if self.path.parent.name == ".hf.partial":
            wrote.append(tensor.numel() * tensor.element_size())
        real_write(self, name, tensor)

    SafetensorsReader._process_read_request = counting  # type: ignore[method-assign]
    SafetensorsStream.write = writing  # type: ignore[method-assign]
    ctx = setup_distributed(TrainingConfig(**runs[0]).validate())
    clean, results = False, []
    try:
        for run in runs:
            asked.clear()
            wrote.clear()
            (result,) = fit_in_group(ctx, [run])
            results.append({**result, "read": sum(asked), "wrote": sum(wrote)})
        clean = True
    finally:
        teardown_distributed(clean)
    return results


@pytest.mark.slow
def test_each_rank_reads_and_writes_only_its_part_of_a_sharded_hugging_face_directory(
    tmp_path: Path
) -> None:
    """... and each writes about half of the run's `hf/` (weight files of at most 0.1 MB
    here), which loads with `from_pretrained` as the run's `model.safetensors`."""
    _llama(0).save_pretrained(tmp_path / "base")
    source = tmp_path / "source"
    _llama(1).save_pretrained(source, max_shard_size="100KB")
    shards = sorted(source.glob("model-*.safetensors"))
    assert len(shards) >= 3
    whole = sum(p.numel() * p.element_size() for p in _llama(1).state_dict().values())

    def run(name: str, **fields: Any) -> dict[str, Any]:
        return {**RUN, "model": f"hf:{tmp_path / 'base'}", "init_from": str(source),
                "output_dir": str(tmp_path / name), "export_shard_mb": 0.1, **fields}

    (plain,) = fit_runs(0, [run("plain")])
    # the same global batch of 16 in each: ddp and fsdp split it over their 2 ranks
    layouts = {"ddp": {"batch_size": 8}, "fsdp": {"strategy": "fsdp", "batch_size": 8},
               "tp": {"tp": 2}, "pp": {"pp": 2}}
    per_rank = run_ranks(_fit_counting_reads, 2, tmp_path,
                         [run(name, **fields) for name, fields in layouts.items()])
    for i, layout in enumerate(layouts):
        reads = [per_rank[r][i]["read"] for r in range(2)]
        if layout == "ddp":  # each rank holds the model whole
            assert reads == [whole, whole], reads
        else:  # each reads about half; together all of it
            assert sum(reads) >= whole and max(reads) < 0.6 * whole, (layout, reads, whole)
        wrote = [per_rank[r][i]["wrote"] for r in range(2)]
        assert sum(wrote) == whole and max(wrote) < 0.7 * whole, (layout, wrote, whole)
        _hf_is_the_runs_export(tmp_path / layout)
        got = per_rank[0][i]
        assert sorted(got["weights"]) == sorted(plain["weights"])
        for name, value in plain["weights"].items():
            torch.testing.assert_close(got["weights"][name], value, atol=1e-5, rtol=0,
                                       msg=f"{layout} {name}")
    # the run started from the source's weights, not the base directory's
    assert not torch.equal(plain["weights"]["model.embed_tokens.weight"],
                           _llama(0).state_dict()["model.embed_tokens.weight"])


def _hf_is_the_runs_export(run_dir: Path) -> None:
    """The run's `hf/`: several weight files, with their index and checksums, loading with
    `from_pretrained` as the run's `model.safetensors`."""
    from ddptrain.checkpoint.export import read_safetensors_state
    from ddptrain.files import sums_damage

    hf = run_dir / "hf"
    assert len(list(hf.glob("model-*-of-*.safetensors"))) >= 3
    assert (hf / "model.safetensors.index.json").is_file() and sums_damage(hf) is None
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf).state_dict()
    exported = read_safetensors_state(run_dir / "model.safetensors")
    assert sorted(loaded) == sorted(exported)
    for name, value in exported.items():
        assert torch.equal(loaded[name], value), name


def _init_error(rank: int, run: dict[str, Any]) -> str:
    """The error this rank stops with while its trainer loads `--init_from`."""
    from ddptrain.checkpoint.common import CheckpointError
    from ddptrain.data.sources import load_data
    from ddptrain.train.plan import resolve
    from ddptrain.train.trainer import Trainer

    config = TrainingConfig(**run).validate()
    ctx = setup_distributed(config)
    try:
        Trainer(resolve(config, load_data(config), ctx.world_size, ctx.device), ctx)
    except CheckpointError as exc:
        return str(exc)
    finally:
        teardown_distributed(True)
    return ""


@pytest.mark.slow
def test_a_damaged_directory_is_refused_alike_on_every_rank_each_file_checked_once(
    tmp_path: Path
) -> None:
    """A run's `hf/` carries its files' checksums: the ranks split the checking (each file
    by one rank) and all stop with the line of the rank that found the damage."""
    _llama(1).save_pretrained(tmp_path / "base")
    exported = tmp_path / "hf"
    _llama(1).save_pretrained(exported, max_shard_size="100KB")
    from ddptrain.files import write_sums

    write_sums(exported, [p.name for p in exported.glob("*.safetensors")])
    victim = sorted(exported.glob("*.safetensors"))[1]  # rank 1's share: files 1, 3, ...
    with victim.open("r+b") as f:
        f.seek(victim.stat().st_size - 16)
        f.write(b"\xff" * 8)
    run = {**RUN, "model": f"hf:{tmp_path / 'base'}", "init_from": str(exported),
           "output_dir": str(tmp_path / "run"), "strategy": "fsdp"}
    errors = run_ranks(_init_error, 2, tmp_path, run)
    assert errors[0] == errors[1] and f"{victim.name} does not match its checksum" in errors[0]
