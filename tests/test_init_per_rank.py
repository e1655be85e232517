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
@pytest.mark.parametrize("start", ["init_from", "model"])
def test_each_rank_reads_and_writes_only_its_part_of_a_sharded_hugging_face_directory(
    tmp_path: Path, start: str
) -> None:
    """... whether the directory is `--init_from` (the `--model hf:DIR` it fills is then
    not read at all) or `--model hf:DIR` itself (built on the meta device, no template on
    rank 0); and each writes about half of the run's `hf/` (weight files of at most 0.1 MB
    here), which loads with `from_pretrained` as the run's `model.safetensors`."""
    _llama(0).save_pretrained(tmp_path / "base")
    source = tmp_path / "source"
    _llama(1).save_pretrained(source, max_shard_size="100KB")
    shards = sorted(source.glob("model-*.safetensors"))
    assert len(shards) >= 3
    whole = sum(p.numel() * p.element_size() for p in _llama(1).state_dict().values())
    starts = {"init_from": {"model": f"hf:{tmp_path / 'base'}", "init_from": str(source)},
              "model": {"model": f"hf:{source}"}}[start]

    def run(name: str, **fields: Any) -> dict[str, Any]:
        return {**RUN, **starts, "output_dir": str(tmp_path / name), "export_shard_mb": 0.1,
                **fields}

    (plain,) = fit_runs(0, [run("plain")])
    # the same global batch of 16 in each: ddp and fsdp split it over their 2 ranks
    layouts = {"ddp": {"batch_size": 8}, "fsdp": {"strategy": "fsdp", "batch_size": 8},
               "tp": {"tp": 2}, "pp": {"pp": 2}}
    per_rank = run_ranks(_fit_counting_reads, 2, tmp_path,
                         [run(name, **fields) for name, fields in layouts.items()])
    for i, layout in enumerate(layouts):
        reads = [per_rank[r][i]["read"] for r in range(2)]
        if layout == "ddp":  # each rank holds the model whole: from_pretrained maps it
            assert reads == ([whole, whole] if start == "init_from" else [0, 0]), reads
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

    write_sums(exported)  # every file: config.json, generation_config.json, shards, index
    victim = sorted(exported.glob("*.safetensors"))[1]  # rank 1's share: files 1, 3, ...
    with victim.open("r+b") as f:
        f.seek(victim.stat().st_size - 16)
        f.write(b"\xff" * 8)
    run = {**RUN, "model": f"hf:{tmp_path / 'base'}", "init_from": str(exported),
           "output_dir": str(tmp_path / "run"), "strategy": "fsdp"}
    errors = run_ranks(_init_error, 2, tmp_path, run)
    assert errors[0] == errors[1] and f"{victim.name} does not match its checksum" in errors[0]


def test_what_a_directory_lacks_starts_alike_loaded_whole_or_built_on_meta(
    tmp_path: Path
) -> None:
    """A head the task adds (a classifier's `score`), the rotary frequencies a Llama
    computes as it is built, and LoRA's adapters start from values that depend on the seed
    and the tensor's name alone: the model `from_pretrained` loads whole (ddp, one
    process) holds the values `start_values` and `adapter_start` make from its structure
    on the meta device, which fsdp, tp and pp ranks copy their parts of."""
    from types import SimpleNamespace

    from ddptrain.models.hf import build_hf, start_values
    from ddptrain.observe.flops import meta_shadow
    from ddptrain.parallel.lora import adapt, adapter_start

    _llama(1).save_pretrained(tmp_path / "lm")  # a causal LM: no classification head
    name, args = f"hf:{tmp_path / 'lm'}", {"auto_class": "AutoModelForSequenceClassification"}
    whole = build_hf(name, args, "classification", 3, torch.device("cpu"), seed=5)
    with torch.device("meta"):
        skeleton = build_hf(name, args, "classification", 3, torch.device("meta"), seed=5)
    assert skeleton.score.weight.is_meta
    keys = ["score.weight", "model.rotary_emb.inv_freq"]
    values = start_values(meta_shadow(skeleton), keys, seed=5)
    assert torch.equal(values["score.weight"], whole.score.weight)
    assert torch.equal(values["model.rotary_emb.inv_freq"], whole.model.rotary_emb.inv_freq)
    assert values["score.weight"].std() > 0
    assert not torch.equal(start_values(skeleton, keys, seed=6)["score.weight"],
                           values["score.weight"])
    config = SimpleNamespace(lora_rank=2, lora_alpha=None, lora_dropout=0.0, lora_targets=[],
                             fsdp_wrap=None, model=name, seed=5)
    adapt(whole, config)
    adapters = {k: v for k, v in whole.state_dict().items() if ".lora_" in k}
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 linears in each of 2 layers
    for key, value in adapters.items():
        assert torch.equal(value, adapter_start(key, value.shape, value.dtype, seed=5)), key
        assert (value.abs().sum() == 0) == (".lora_B." in key), key


@pytest.mark.slow
@pytest.mark.heavy
def test_a_model_of_1_gb_is_written_and_read_back_with_no_rank_holding_it_whole(
    tmp_path: Path
) -> None:
    """bench/exports.py's 325M-parameter Llama (1.3 GB in fp32), FSDP2 on 2 ranks: the
    streamed export of `model.safetensors` and `hf/` (files of at most 400 MB), then the
    per-rank read of that `hf/` into a fresh sharded skeleton. No rank's resident memory
    grows by more than its own half of the model plus one file in either (gathering on
    rank 0 grows it by 1.6 GB, `from_pretrained` on rank 0 by 1.9 GB), and each rank
    asks the files for its half alone."""
    from bench.exports import measure

    export, load = measure(8, ["streamed", "per-rank"], tmp_path)
    whole = export[0]["parameters"] * 4
    bound = whole / 2 + 400 * 10**6
    for rank in (0, 1):
        assert export[rank]["rss_growth"] < bound, (rank, export[rank], bound)
        assert load[rank]["rss_growth"] < bound, (rank, load[rank], bound)
    asked = [load[rank]["asked"] for rank in (0, 1)]
    assert sum(asked) == whole and max(asked) < 0.55 * whole, (asked, whole)


@pytest.mark.slow
def test_adapters_on_a_directory_read_per_rank_start_and_end_as_ddps(tmp_path: Path) -> None:
    """`--lora_rank` on `--model hf:DIR` under fsdp (the model built on meta, each rank
    reading its shards, the adapters from `adapter_start`) trains the same adapters as
    ddp (the model loaded whole, the adapters drawn the same way)."""
    _llama(1).save_pretrained(tmp_path / "source", max_shard_size="100KB")
    runs = [{**RUN, "model": f"hf:{tmp_path / 'source'}", "lora_rank": 4, "batch_size": 8,
             "strategy": strategy, "output_dir": str(tmp_path / strategy)}
            for strategy in ("ddp", "fsdp")]
    ddp, fsdp = run_ranks(fit_runs, 2, tmp_path, runs)[0]
    assert any(".lora_A." in k for k in ddp["weights"])
    assert ddp["weights"].keys() == fsdp["weights"].keys()
    for name, value in ddp["weights"].items():
        torch.testing.assert_close(fsdp["weights"][name], value, atol=1e-5, rtol=0, msg=name)
