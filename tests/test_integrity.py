"""Every byte trusted: checksums written with every checkpoint and checked before a resume
loads it; the state written once however many names it has; a resume reads each file once.

A damaged newest checkpoint (flipped bytes inside tensor data, or a truncated file) is
skipped with a warning naming it, the previous whole one is used, and the run ends
bitwise equal to one that was never interrupted. The kill is the model SIGKILLing its
own process at an exact training forward (`guardplug.py`, GUARD_KILL_AT).
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli, run_torchrun
from procs import assert_bitwise, weights

from ddptrain.checkpoint import list_checkpoints, list_step_dirs, load_checkpoint, save_checkpoint
from ddptrain.checkpoint.common import CheckpointError, forget_reads
from ddptrain.checkpoint.dcp import META, load_metadata, read_meta
from ddptrain.cli import main
from ddptrain.context import DistributedContext

CPU = torch.device("cpu")
# 192 training samples at batch 8: 24 steps an epoch on one process, 12 on two.
JOB = ["train", "--dataset", "guardplug:augmented", "--model", "guardplug:dropout_net",
       "--batch_size", "8", "--epochs", "2", "--lr", "0.05", "--num_workers", "0",
       "--save_every_steps", "5", "--log_interval", "4"]


def _flip(path: Path, offset: int, n: int = 64) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(n))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _member_offset(path: Path, info: zipfile.ZipInfo) -> int:
    """Where a stored (uncompressed) member's bytes start in its zip file."""
    with path.open("rb") as f:
        f.seek(info.header_offset + 26)
        name_len = int.from_bytes(f.read(2), "little")
        extra_len = int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + name_len + extra_len


def _tensor_bytes_of_pt(path: Path) -> int:
    """The offset of the middle of the largest tensor record of a torch zip file."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    return _member_offset(path, info) + info.file_size // 2


def _flip_a_field(path: Path, key: str) -> None:
    """Flip the lowest bit of the value stored under `key` in a torch zip file's pickle:
    a small int (`K` n) or the first character of a string (`X` length text), the bytes
    after the key's string and its memo entry (`q` i)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    with path.open("rb") as f:  # the record as stored (ddptrain's zip records carry no CRC)
        f.seek(_member_offset(path, info))
        data = f.read(info.file_size)
    name = key.encode()
    at = data.find(b"X" + len(name).to_bytes(4, "little") + name)
    assert at >= 0, key
    value = at + 5 + len(name) + 2  # past the key and its BINPUT
    assert data[at + 5 + len(name)] == ord("q") and data[value] in b"KX", (key, data[value:][:8])
    byte = value + (1 if data[value] == ord("K") else 5)
    with path.open("r+b") as f:
        f.seek(_member_offset(path, info) + byte)
        original = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([original ^ 1]))


def _own_chunk(shard: Path) -> int:
    """Where the largest tensor chunk of a DCP shard file that starts past offset 0 lies
    in the file: under fsdp on 2 ranks, a chunk that only the rank that wrote it reads
    back (rank 1's in `__1_0.distcp`)."""
    metadata = load_metadata((shard.parent / ".metadata").read_bytes())
    chunks = [info for index, info in metadata.storage_data.items()
              if info.relative_path == shard.name and index.offset is not None
              and any(index.offset)]
    return max(chunks, key=lambda info: info.length).offset


def _damage(target: Path, how: str, where: str = "middle") -> Path:
    """Flip 64 bytes inside the tensor data of `target` (a .pt file, or the largest shard
    of a step directory: its middle, or with `where="own chunk"` the zip header of a
    tensor chunk only its writer reads, `_own_chunk`), or cut the file in half; returns
    the file damaged."""
    if target.is_dir():
        victim = max(target.glob("*.distcp"), key=lambda p: p.stat().st_size)
        middle = victim.stat().st_size // 2 if where == "middle" else _own_chunk(victim)
    else:
        victim, middle = target, _tensor_bytes_of_pt(target)
    if how == "flip":
        _flip(victim, middle)
    else:
        os.truncate(victim, victim.stat().st_size // 2)
    return victim


def _killed_then_resumed(
    tmp_path: Path, launch, extra: list[str], kill_at: int, how: str
) -> tuple[Path, str]:
    run = tmp_path / "run"
    args = [*JOB, *extra, "--output_dir", str(run)]
    killed = launch(args, {"GUARD_KILL_AT": str(kill_at)})
    assert killed.returncode != 0
    ckpt = run / "checkpoints"
    newest = (list_step_dirs(ckpt) or list_checkpoints(ckpt))[0]
    _damage(newest, how)
    resumed = launch([*args, "--resume_from", "auto"], {})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return newest, resumed.stdout + resumed.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_newest_pt_is_skipped_and_the_run_ends_bitwise_equal(
    tmp_path: Path, how: str
) -> None:
    def launch(args: list[str], env: dict[str, str]):
        return run_cli(args, cwd=tmp_path, env={"GUARD_KILL_RANK": "0", **env})

    reference = tmp_path / "reference"
    assert launch([*JOB, "--output_dir", str(reference)], {}).returncode == 0
    # killed at step 23's forward: the newest checkpoint is step 20, the one before it 15
    newest, log = _killed_then_resumed(tmp_path, launch, [], 23, how)
    assert newest.name == "step_000000020.pt"
    assert "skipping unusable checkpoint" in log and str(newest) in log
    if how == "flip":
        assert "is damaged: tensor" in log and "does not match its checksum" in log
    assert "epoch 0 done, step 15" in log
    assert_bitwise(weights(tmp_path / "run"), weights(reference))


@pytest.mark.heavy
# a truncated shard: test_a_dcp_step_is_summed_as_it_is_written_and_checked_as_it_is_read...
def test_a_damaged_shard_of_the_newest_dcp_step_is_skipped_and_the_run_ends_bitwise_equal(
    tmp_path: Path,
) -> None:
    """64 flipped bytes in the largest shard (`__1_0.distcp`) of the newest step directory
    (fsdp, 2 ranks), each damage on a copy of one killed run: in its middle, an entry
    every rank reads (an optimizer setting), and in the zip header of a tensor chunk only
    rank 1 reads, which fails to deserialise on rank 1 before its check. Both ranks skip
    the step (rank 0 read nothing damaged) and end equal to the uninterrupted run."""
    def launch(args: list[str], env: dict[str, str]):
        return run_torchrun(2, args, cwd=tmp_path, env=env)

    fsdp = ["--strategy", "fsdp"]
    reference = tmp_path / "reference"
    assert launch([*JOB, *fsdp, "--output_dir", str(reference)], {}).returncode == 0
    killed = tmp_path / "killed"
    args = [*JOB, *fsdp, "--output_dir", str(killed)]
    assert launch(args, {"GUARD_KILL_AT": "18"}).returncode != 0
    for where in ("middle", "own chunk"):
        run = tmp_path / where.replace(" ", "_")
        shutil.copytree(killed, run, symlinks=True)
        # rank 1 died at step 18's forward: the newest step directory is 15, the one
        # before it 12 (the end of epoch 1)
        newest = list_step_dirs(run / "checkpoints")[0]
        assert newest.name == "step_000000015"
        assert _damage(newest, "flip", where).name == "__1_0.distcp"
        resumed = launch([*JOB, *fsdp, "--output_dir", str(run), "--resume_from", "auto"], {})
        assert resumed.returncode == 0, (where, resumed.stderr[-3000:])
        log = resumed.stdout + resumed.stderr
        for rank in (0, 1):
            assert any(f"[rank {rank}]" in line and "skipping unusable checkpoint" in line
                       and "is damaged" in line and str(newest) in line
                       for line in log.splitlines()), (where, rank, log[-3000:])
        assert "epoch 1 done, step 12" in log
        assert_bitwise(weights(run), weights(reference))


def _load_a_chunk_damaged_on_rank_1(rank: int, directory: str) -> str:
    """A 2-rank step directory of one tensor sharded by rows; rank 0 flips the zip header
    of rank 1's chunk, then both load it: what each was told."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ddptrain.checkpoint.dcp import ShardedCheckpointer, load_sharded

    dist.init_process_group("gloo")
    try:
        ctx = DistributedContext(rank, rank, 2, CPU, "gloo")
        mesh = init_device_mesh("cpu", (2,))

        def state(whole: torch.Tensor) -> dict[str, Any]:
            return {"model": {"w": distribute_tensor(whole, mesh, [Shard(0)])},
                    "optim": {"lr": 0.1}}

        saver = ShardedCheckpointer(Path(directory), ctx, keep_last=0, background=False)
        path = saver.save(3, {"step": 3, "epoch": 0}, state(torch.arange(64.0)), best=False)
        meta = read_meta(path, CPU)
        if rank == 0:
            _flip(path / "__1_0.distcp", _own_chunk(path / "__1_0.distcp"))
        dist.barrier()
        try:
            load_sharded(path, state(torch.zeros(64)), meta)
        except CheckpointError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "loaded"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_an_entry_damaged_where_one_rank_reads_is_damage_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's chunk fails to deserialise (its zip header is damaged) before its check;
    rank 0 read nothing damaged, but is given rank 1's failure: both are told the same
    damage (a resume skips the step on both), not rank 0 a model that does not fit."""
    from dist_utils import run_ranks

    told = run_ranks(_load_a_chunk_damaged_on_rank_1, 2, tmp_path, str(tmp_path / "ckpt"))
    assert told[0] == told[1], told
    assert told[0].startswith("DamagedCheckpoint: ") and "__1_0.distcp" in told[0], told
    assert "does not match its checksum" in told[0], told


def test_resume_from_a_damaged_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    base = ["train", "--batch_size", "32", "--log_interval", "4", "--output_dir", str(run)]
    assert main([*base, "--epochs", "1"]) == 0
    step = list_checkpoints(run / "checkpoints")[0]
    _damage(step, "flip")
    capsys.readouterr()
    forget_reads()
    assert main([*base, "--epochs", "2", "--resume_from", str(step)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("ddptrain: error: checkpoint"), err
    assert "is damaged: tensor" in err[0] and "does not match its checksum" in err[0]


@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_a_bit_flipped_in_any_field_is_damage_not_a_silent_resume(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Progress, schedule and config are under the checksums as the tensors are: one bit
    of `samples_in_epoch`, `step`, the scheduler's `last_epoch` or the config's dataset,
    in a `.pt` or a step directory's `meta.pt`, and the checkpoint is refused."""
    run = tmp_path / "run"
    assert main(["train", "--dataset", "digits", "--model", "mlp", "--epochs", "1",
                 "--batch_size", "512",
                 "--no-tensorboard", "--checkpoint_format", fmt,
                 "--output_dir", str(run)]) == 0
    (step,) = sorted((run / "checkpoints").glob("step_*"))
    for key in ("samples_in_epoch", "step", "last_epoch", "dataset"):
        copy = tmp_path / key / step.name
        if fmt == "dcp":
            shutil.copytree(step, copy)
            target = copy / META
        else:
            copy.parent.mkdir()
            target = Path(shutil.copyfile(step, copy))
        _flip_a_field(target, key if key != "dataset" else "digits")
        forget_reads()
        with pytest.raises(CheckpointError, match=r"a field other than the tensors .* does "
                           r"not match its checksum"):
            read_meta(copy, CPU) if fmt == "dcp" else load_checkpoint(copy, CPU, verify=True)


def test_a_step_directory_that_lost_a_file_is_skipped_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    job = ["train", "--dataset", "digits", "--model", "mlp", "--batch_size", "512",
           "--no-tensorboard",
           "--checkpoint_format", "dcp", "--output_dir", str(tmp_path / "run")]
    assert main([*job, "--epochs", "2"]) == 0
    newest = max((tmp_path / "run" / "checkpoints").glob("step_*"))
    for lost, says in ((META, "it lacks meta.pt"), (".metadata", "cannot be read")):
        if lost == META:
            (newest / META).unlink()
        else:
            os.truncate(newest / ".metadata", 10)
        capsys.readouterr()
        assert main([*job, "--epochs", "3", "--resume_from", "auto"]) == 0
        out = capsys.readouterr()
        warned = [line for line in (out.out + out.err).splitlines() if "skipping unusable" in line]
        assert len(warned) == 1 and str(newest) in warned[0] and says in warned[0], warned
        newest = max((tmp_path / "run" / "checkpoints").glob("step_*"))


def _written() -> int:
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("wchar:")).split()[1])


def test_a_checkpoint_is_written_once_latest_and_best_are_links_to_it(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    ctx = DistributedContext(0, 0, 1, CPU)
    state = {"step": 3, "model_state_dict": {"w": torch.ones(4_000_000)}}  # 16 MB
    before = _written()
    path = save_checkpoint(directory, 3, state, ctx, keep_last=0, best=True)
    written = _written() - before
    size = path.stat().st_size
    assert size <= written < 1.1 * size, f"{written} bytes written for a {size}-byte state"
    inodes = {(directory / name).stat().st_ino for name in (path.name, "latest.pt", "best.pt")}
    assert len(inodes) == 1
    # pruning the step file leaves best.pt whole
    save_checkpoint(directory, 4, {**state, "step": 4}, ctx, keep_last=1)
    assert not path.exists()
    assert load_checkpoint(directory / "best.pt", CPU, verify=True)["step"] == 3


def test_a_resume_reads_its_checkpoint_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    base = ["train", "--batch_size", "32", "--log_interval", "4", "--output_dir", str(run)]
    assert main([*base, "--epochs", "1"]) == 0
    forget_reads()
    loads: list[str] = []
    real_load = torch.load

    def counting(f, *args, **kwargs):
        loads.append(str(f))
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    assert main([*base, "--epochs", "2", "--resume_from", "auto"]) == 0
    read = [p for p in loads if "checkpoints" in p]
    # the finished-run check, the locating (with its checksums) and the load: one read
    assert len(read) == 1, read


@pytest.mark.heavy
@pytest.mark.slow
def test_a_slow_checkpoint_write_is_told_apart_from_a_lost_peer(tmp_path: Path) -> None:
    """Rank 0's first save takes 12 s more. The other rank waits for it on the checkpoint's
    own group: past --timeout_s (6 s) the run goes on; past --checkpoint_timeout_s the
    waiting rank stops with a line about the storage (exit 74), not about a dead peer."""
    env = {"GUARD_SLOW_SAVE_S": "12"}
    args = [*JOB, "--epochs", "1", "--timeout_s", "6", "--no-tensorboard"]
    ok = run_torchrun(2, [*args, "--output_dir", str(tmp_path / "ok")], cwd=tmp_path, env=env)
    assert ok.returncode == 0, ok.stderr[-3000:]
    stuck = run_torchrun(
        2, [*args, "--checkpoint_timeout_s", "3", "--output_dir", str(tmp_path / "stuck")],
        cwd=tmp_path, env=env,
    )
    assert stuck.returncode != 0
    lines = [x for x in stuck.stderr.splitlines() if "ddptrain: " in x]
    assert any(
        "did not finish writing the checkpoint" in x and "--checkpoint_timeout_s 3" in x
        and "the storage is slow or stuck" in x for x in lines
    ), stuck.stderr[-3000:]
    assert "exitcode  : 74" in stuck.stderr or "exitcode: 74" in stuck.stderr, stuck.stderr[-2000:]


def test_a_large_ddp_state_is_written_by_every_rank() -> None:
    """`--checkpoint_format auto` under ddp: one file from rank 0 while the state is small,
    a DCP step directory (every rank writes a part) once it passes 2 GiB."""
    from ddptrain.config import TrainingConfig
    from ddptrain.parallel import resolve_strategy

    small, large = 10_000_000, 200_000_000  # AdamW: x3 fp32 -> 120 MB, 2.4 GB
    ddp = resolve_strategy(TrainingConfig(), 8, "cpu")
    assert ddp.checkpoint_kind_for(small, 2) == "file"
    assert ddp.checkpoint_kind_for(large, 2) == "dcp"
    forced = resolve_strategy(TrainingConfig(checkpoint_format="file"), 8, "cpu")
    assert forced.checkpoint_kind_for(large, 2) == "file"
    single = resolve_strategy(TrainingConfig(), 1, "cpu")
    assert single.checkpoint_kind_for(large, 2) == "file"


def _read() -> int:
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")).split()[1])


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_dcp_step_is_summed_as_it_is_written_and_checked_as_it_is_read_each_byte_once(
    tmp_path: Path, how: str
) -> None:
    """A save reads nothing back to checksum it; a resume that locates the directory and
    loads it reads each byte of its shards once, and a damaged entry is refused as it is
    read (before it is loaded), as the same error a pre-check gave."""
    from ddptrain.checkpoint.common import DamagedCheckpoint
    from ddptrain.checkpoint.dcp import ShardedCheckpointer, load_sharded
    from ddptrain.checkpoint.manager import locate_resume
    from ddptrain.files import file_crc

    ctx = DistributedContext(0, 0, 1, CPU)
    gen = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(2_000_000, generator=gen), "b": torch.randn(7)},
             "optim": {"momentum": torch.randn(2_000_000, generator=gen), "lr": 0.1}}
    saver = ShardedCheckpointer(tmp_path / "ckpt", ctx, keep_last=0, background=False)
    before = _read()
    path = saver.save(7, {"step": 7, "epoch": 0}, state, best=False)
    assert _read() - before < 100_000, "the save read its shards back"
    files = [p for p in path.iterdir() if p.name != META]
    size = sum(p.stat().st_size for p in files)
    before = _read()
    found = locate_resume(str(path), tmp_path / "ckpt", ctx, checked_in_load=True)
    assert found is not None
    assert _read() - before < size / 10, "locating read the shards before the load"
    meta = found[1]
    assert meta["shards"] == {p.name: file_crc(p) for p in files}
    assert set(meta["items"]) == {"model.w@0", "model.b@0", "optim.momentum@0", "optim.lr"}

    def load() -> tuple[dict[str, Any], int]:
        into = {"model": {"w": torch.zeros(2_000_000), "b": torch.zeros(7)},
                "optim": {"momentum": torch.zeros(2_000_000), "lr": 0.0}}
        before = _read()
        load_sharded(path, into, meta)
        return into, _read() - before

    into, read = load()
    assert size <= read < 1.05 * size, f"{read} bytes read for {size} bytes of shards"
    assert torch.equal(into["model"]["w"], state["model"]["w"])
    assert into["optim"]["lr"] == 0.1
    (shard,) = path.glob("*.distcp")
    if how == "flip":
        _flip(shard, shard.stat().st_size // 2)
    else:
        os.truncate(shard, shard.stat().st_size // 2)
    with pytest.raises(DamagedCheckpoint, match=rf"is damaged: {shard.name}.* (does not match "
                       "its checksum|short of an entry)"):
        load()


def test_a_files_crc_is_folded_from_its_entries_crcs_as_zlib_would_sum_the_bytes() -> None:
    """A step directory's file CRC takes each entry's CRC instead of summing its bytes a
    second time (`integrity.crc32_combine`)."""
    import zlib

    from ddptrain.checkpoint.integrity import crc32_combine

    for head, tail in ((b"", b""), (b"PK\x03\x04", os.urandom(1)), (os.urandom(999),
                                                                   os.urandom(70_001))):
        assert crc32_combine(zlib.crc32(head), zlib.crc32(tail), len(tail)) == zlib.crc32(
            head + tail)


def test_a_state_is_summed_in_chunks_on_threads_as_zlib_sums_it_whole_and_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tensor_crcs` splits large tensors among threads and folds the chunks' CRCs: the
    same [bytes, crc] as one zlib pass over each tensor. A `.pt` save sums each byte that
    once: torch's zip writer, which would sum every record again with a CRC of its own
    (about as long as the write), is told not to, and its option is restored."""
    import zlib

    import ddptrain.checkpoint.integrity as integrity

    monkeypatch.setattr(integrity, "_CHUNK", 1 << 16)
    tensors = [torch.randn(100_003), torch.zeros(0), torch.arange(7, dtype=torch.int8),
               torch.randn(64, 64).t()]  # several chunks, empty, tiny, not contiguous
    expected = []
    for tensor in tensors:
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        expected.append([len(raw), zlib.crc32(raw)])
    assert integrity.tensor_crcs(tensors) == expected

    ctx = DistributedContext(0, 0, 1, CPU)
    path = save_checkpoint(tmp_path, 1, {"step": 1, "w": tensors[0]}, ctx, keep_last=0)
    with zipfile.ZipFile(path) as z:
        assert {i.CRC for i in z.infolist()} == {0}
    assert torch.serialization.get_crc32_options()
    forget_reads()
    assert torch.equal(load_checkpoint(path, CPU, verify=True)["w"], tensors[0])
