"""Whole weights written by the ranks one tensor at a time (`checkpoint/streamed.py`): the
file is a safetensors file with ddptrain's checksums, its own checksum summed as it was
written, and on two ranks each tensor arrives whole at its writer from FSDP's shards or
from the one rank that holds it (a pipeline stage's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_ranks

from ddptrain.checkpoint.integrity import safetensors_damage
from ddptrain.files import file_crc


def test_a_streamed_file_is_a_safetensors_file_with_its_checksums(tmp_path: Path) -> None:
    from safetensors import safe_open

    from ddptrain.checkpoint.streamed import SafetensorsStream

    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16),
               "empty": torch.zeros(0, 4), "steps": torch.arange(5),
               "t": torch.randn(4, 6).T}  # not contiguous
    path = tmp_path / "w.safetensors"
    stream = SafetensorsStream(path, [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()],
                               {"format": "pt", "tied:head": "a.weight"})
    for name, value in reversed(tensors.items()):  # each at its place, in any order
        stream.write(name, value)
    assert stream.close() == file_crc(path)  # the file's checksum, without reading it back
    header = int.from_bytes(path.read_bytes()[:8], "little")
    assert header % 8 == 0  # the data starts aligned, as safetensors' own writer has it
    with safe_open(str(path), framework="pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        metadata = f.metadata()
    assert metadata["format"] == "pt" and metadata["tied:head"] == "a.weight"
    assert sorted(got) == sorted(tensors)
    for name, value in tensors.items():
        assert torch.equal(got[name], value), name
    assert safetensors_damage(got, metadata) is None
    got["b"][0] += 1
    assert safetensors_damage(got, metadata) is not None
    short = SafetensorsStream(tmp_path / "short.safetensors", [("a", (2,), torch.float32),
                                                              ("b", (2,), torch.float32)], {})
    short.write("b", torch.ones(2))
    with pytest.raises(ValueError, match="1 tensor\\(s\\) never written, a first"):
        short.close()


def _export_from_shards_and_stages(rank: int, out: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddptrain.checkpoint.export import export_streamed
    from ddptrain.checkpoint.streamed import Catalog, Item, Target, write_files
    from ddptrain.context import DistributedContext

    dist.init_process_group("gloo")
    ctx = DistributedContext(rank, rank, 2, torch.device("cpu"), "gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(9, 6), nn.Linear(6, 5), nn.Linear(5, 9, bias=False))
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    local = dict(get_model_state_dict(model))
    # as pipeline stages hold them: one tensor only on rank 0, another only on rank 1
    torch.manual_seed(1)
    stage = {"first.weight": torch.randn(4, 3), "last.weight": torch.randn(2, 2)}
    whole.update(stage)
    local["first.weight" if rank == 0 else "last.weight"] = stage[
        "first.weight" if rank == 0 else "last.weight"]
    catalog = Catalog(local, ctx)
    export_streamed(catalog, [["0.weight", "tied.weight"]], Path(out) / "model.safetensors")
    # rank 1 writes one file and rank 0 another, in one walk: rank 0's stage tensor is
    # sent to rank 1, rank 1's to rank 0, a sharded one made whole once for both
    items = [Item(name, (name,)) for name in catalog.meta]
    got = write_files(catalog, [Target(Path(out) / "by1.safetensors", 1, items, {}),
                                Target(Path(out) / "by0.safetensors", 0, items[::-1], {})])
    dist.barrier()
    dist.destroy_process_group()
    return {"whole": whole, "sums": got}


@pytest.mark.slow
def test_two_ranks_send_each_tensor_whole_to_its_writer(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from ddptrain.checkpoint.export import read_safetensors_state

    results = run_ranks(_export_from_shards_and_stages, 2, tmp_path, str(tmp_path))
    whole = results[0]["whole"]
    exported = read_safetensors_state(tmp_path / "model.safetensors")
    assert sorted(exported) == sorted([*whole, "tied.weight"])
    for name, value in whole.items():
        assert torch.equal(exported[name], value), name
    assert exported["tied.weight"] is exported["0.weight"]
    for rank in (0, 1):
        path = tmp_path / f"by{rank}.safetensors"
        written = load_file(path)
        assert sorted(written) == sorted(whole)
        for name, value in whole.items():
            assert torch.equal(written[name], value), name
        assert results[rank]["sums"] == {path: file_crc(path)}


def test_export_of_a_step_directory_reads_a_few_tensors_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ddptrain export STEP_DIR`: the model read from the step directory a bounded number
    of bytes at a time (here 4 KB: many reads) and streamed to the file, equal to the
    run's own `model.safetensors`."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from ddptrain import fit
    from ddptrain.checkpoint import dcp as ddcp
    from ddptrain.cli import main

    run = tmp_path / "run"
    fit(dataset="digits", model="mlp", epochs=1, optimizer="sgd", checkpoint_format="dcp",
        tensorboard=False, curves=False, output_dir=str(run))
    loads: list[int] = []
    real = dcp.load
    monkeypatch.setattr(ddcp.model_chunks_from_dir, "__defaults__", (4096,))
    monkeypatch.setattr(ddcp.dcp, "load", lambda state, **kw: (
        loads.append(len(state["model"])), real(state, **kw))[1])
    out = tmp_path / "out.safetensors"
    assert main(["export", str(run / "checkpoints" / "latest"), str(out)]) == 0
    exported, final = load_file(str(out)), load_file(str(run / "model.safetensors"))
    assert sorted(exported) == sorted(final) and len(loads) > 2 and sum(loads) == len(final)
    for name, value in final.items():
        assert torch.equal(exported[name], value), name
