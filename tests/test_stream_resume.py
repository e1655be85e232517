"""A stream that shards itself (`shard(num_shards, index)`: a reader of its own, a Hugging
Face `datasets.IterableDataset`) resumes mid-epoch exactly: each (rank, DataLoader
worker) shard's position is saved and handed back to the same shard. Where the saved
positions are another layout's (world size, `--num_workers`), the interrupted epoch
restarts, re-sharded, with one warning naming why.

Plugins: tests/shardstreamplug.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Generator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from conftest import run_cli, run_torchrun
from procs import assert_bitwise, weights
from shardstreamplug import SCALE

from ddptrain.checkpoint import list_checkpoints, load_checkpoint
from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.iterable import IterableBatches

CPU = torch.device("cpu")
N = 64  # samples; 2 ranks x 2 workers x batch 4: 8 steps an epoch, 4 batches a worker
STEPS = 8
JOB = ["train", "--model", "shardstreamplug:recorder", "--num_classes", "2",
       "--batch_size", "4", "--epochs", "2", "--lr", "0.05", "--num_workers", "2",
       "--save_every_steps", "5", "--log_interval", "2", "--no-tensorboard"]


def _recorded(record: Path, ranks: int = 2) -> list[list[list[int]]]:
    """Per rank, the ids of each training batch in the order trained on."""
    lines = [(record / f"rank{r}.txt").read_text().splitlines() for r in range(ranks)]
    return [[[int(v) for v in line.split()] for line in rank] for rank in lines]


def _ids(batches: list[list[list[int]]]) -> list[int]:
    return sorted(i for rank in batches for batch in rank for i in batch)


def _run(base: Path, name: str, args: list[str], env: dict[str, str] | None = None,
         ranks: int = 2) -> tuple[Path, str]:
    record = base / f"{name}-record"
    record.mkdir()
    env = {"GUARD_RECORD": str(record), **(env or {})}
    proc = (run_torchrun(ranks, [*JOB, *args], cwd=base, env=env) if ranks > 1
            else run_cli([*JOB, *args], cwd=base, env=env))
    if "GUARD_KILL_AT" in env:
        assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return record, proc.stdout + proc.stderr


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["shardstreamplug:stream", "shardstreamplug:hf"])
def test_a_stream_that_shards_itself_resumes_mid_epoch_bitwise_in_loader_workers(
    tmp_path: Path, dataset: str
) -> None:
    """2 ranks x 2 workers, each reading its own shard at the source. Rank 1 is SIGKILLed
    at step 7's forward; the resume from step 5 (worker 0 of each rank 3 batches in,
    worker 1 two) trains every later step on the uninterrupted run's samples and ends
    with its weights, every sample of the epoch trained once across the restart."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    job = ["--dataset", dataset]
    whole, _ = _run(tmp_path, "reference", [*job, "--output_dir", str(reference)])
    killed, _ = _run(tmp_path, "killed", [*job, "--output_dir", str(run)],
                     {"GUARD_KILL_AT": "7"})
    newest = load_checkpoint(list_checkpoints(run / "checkpoints")[0], CPU)
    assert newest["step"] == 5
    other = tmp_path / "other-world"
    shutil.copytree(run, other)
    resumed, said = _run(tmp_path, "resumed", [*job, "--output_dir", str(run),
                                               "--resume_from", "auto"])
    assert "restarts from its beginning" not in said, said[-3000:]
    expected = _recorded(whole)
    assert [rank[:2 * STEPS] for rank in expected] == expected  # 2 epochs, nothing more
    before = [rank[:5] for rank in _recorded(killed)]
    after = _recorded(resumed)
    assert [b + a for b, a in zip(before, after, strict=True)] == expected
    assert _ids([[*b, *a[:STEPS - 5]] for b, a in zip(before, after, strict=True)]) == list(
        range(N)), "a sample of the interrupted epoch trained twice, or never"
    assert_bitwise(weights(run), weights(reference))

    # The same checkpoint on one rank: its positions are 2 ranks' shards, which this run
    # does not read; the epoch restarts, re-sharded, with a warning naming the cause.
    one, said = _run(tmp_path, "one-rank", [*job, "--output_dir", str(other),
                                           "--resume_from", "auto"], ranks=1)
    warned = [x for x in said.splitlines() if "restarts from its beginning" in x]
    assert len(warned) == 1, said[-3000:]
    assert "2 ranks" in warned[0] and "this run has 1" in warned[0], warned
    (seen,) = _recorded(one, ranks=1)
    assert _ids([seen[: 2 * STEPS]]) == _ids([seen[2 * STEPS :]]) == list(range(N))


# ---------------------------------------------------------------- in one process
def _ids_of(batch: Any) -> list[int]:
    x = batch["x"] if isinstance(batch, dict) else batch[0]
    return [round(float(v) * SCALE) for v in x[:, 0]]


def _stream(name: str, config: TrainingConfig) -> Any:
    from shardstreamplug import hf, stream

    from ddptrain.data.hf import adapt

    return stream(config)[0] if name == "stream" else adapt(hf(config)[0], "hf")


@pytest.mark.parametrize("name", ["stream", "hf"])
def test_each_workers_shard_resumes_where_it_stood(name: str) -> None:
    """Rank 1 of 2, 2 DataLoader workers, each reading its own shard at the source: the
    position saved after 3 batches (worker 0 two batches in, worker 1 one) is each
    worker's shard's, and a new reader loaded with it hands out the rest of the epoch as
    the uninterrupted one did (mutant: the shards' positions not handed back)."""
    config = TrainingConfig(dataset="shardstreamplug:stream", num_workers=2, batch_size=4)
    ctx = DistributedContext(1, 0, 2, CPU)  # rank 1 of 2 without a process group
    readers: list[IterableBatches] = []

    def reader() -> IterableBatches:
        readers.append(IterableBatches(_stream(name, config), config, ctx))
        return readers[-1]

    try:
        whole = [_ids_of(b) for b, _, _ in reader().epoch(1)]
        first = reader()
        it = cast(Generator[Any, None, None], first.epoch(1))
        head = [_ids_of(next(it)[0]) for _ in range(3)]
        state = first.state_dict()
        it.close()
        again = reader()
        assert again.fits(state, 1) and not again.fits(state, 0)  # rank 1's shards
        assert state is not None
        again.load_state_dict(state)
        rest = [_ids_of(b) for b, _, _ in again.epoch(1, 3)]
    finally:  # StatefulDataLoader keeps its iterator: its workers go now, failed or not
        for used in readers:
            shutdown = getattr(getattr(used.loader, "_iterator", None), "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
    assert len(whole) == N // 2 // 4 and head + rest == whole
    assert len({i for batch in whole for i in batch}) == N // 2


def _cause(dataset: str, saved: dict[str, Any], payload: dict[str, Any], **now: Any) -> Any:
    from ddptrain.train.resume import _stream_cannot_continue

    config = TrainingConfig(dataset=dataset, batch_size=4, **now)
    ctx = DistributedContext(0, 0, 1, CPU)
    batches = IterableBatches(_plugin(dataset)(config)[0], config, ctx)
    trainer = cast(Any, SimpleNamespace(config=config, ctx=ctx, train_batches=batches))
    config_saved = {**config.to_dict(), **saved}
    same = payload["world_size"] == 1 and config_saved["batch_size"] == config.batch_size
    return _stream_cannot_continue(trainer, {"config": config_saved, **payload}, same)


def _plugin(dataset: str) -> Any:
    import shardstreamplug

    return getattr(shardstreamplug, dataset.partition(":")[2])


def test_the_warning_names_why_a_stream_cannot_continue_part_way() -> None:
    one = {"consumed": 0, "dataset": {"pos": 3, "shard": 0, "of": 1}, "reader": [1, 0, 1, 0]}
    stream = "shardstreamplug:stream"
    assert _cause(stream, {}, {"world_size": 1, "data_state": [one]}) is None
    said = _cause("shardstreamplug:plain", {}, {"world_size": 1, "data_state": [None]})
    assert "ShardStream" in said and "keeps no position" in said and "state_dict" in said
    said = _cause(stream, {}, {"world_size": 2, "data_state": [one, one]})
    assert "of 2 ranks, this run has 1" in said, said
    said = _cause(stream, {"num_workers": 2}, {"world_size": 1, "data_state": [one]})
    assert "--num_workers 2, this run has 0" in said, said
    said = _cause(stream, {"batch_size": 8}, {"world_size": 1, "data_state": [one]})
    assert "--batch_size 8 -> 4" in said, said
    other = {**one, "reader": [2, 1, 1, 0]}  # another reader's shard
    said = _cause(stream, {}, {"world_size": 1, "data_state": [other]})
    assert "no stream position this run's DataLoader can take" in said, said


def test_a_hugging_face_stream_shuffled_through_a_buffer_is_not_taken_as_resumable() -> None:
    """`datasets` refills a shuffle buffer on a resume, and the samples it held never
    train that epoch: such a stream restarts its epoch, and says why."""
    from shardstreamplug import hf

    from ddptrain.data.hf import adapt

    config = TrainingConfig(dataset="shardstreamplug:hf", batch_size=4)
    ctx = DistributedContext(0, 0, 1, CPU)
    plain = IterableBatches(adapt(hf(config)[0], "hf"), config, ctx)
    assert plain.stateful and plain.no_position is None
    shuffled = adapt(hf(config)[0].shuffle(seed=1, buffer_size=8), "hf")
    batches = IterableBatches(shuffled, config, ctx)
    assert not batches.stateful
    assert "shuffled through a buffer" in (batches.no_position or "")
