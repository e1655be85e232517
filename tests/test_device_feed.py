"""The GPU path's feed, with CPU stand-ins: in-memory batches sliced and pinned one ahead
in a thread, moved to the device on a side stream the step's stream waits for; and a
background DCP save that copies the weights off the device in the stager's thread, which
the next optimizer step waits for (not for the write).

The stream calls go through `ddptrain.data.batch._streams`, replaced here by a recorder;
pinning is `cuda_standin.fake_pinning`; the staging is DCP's own, on CPU tensors."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar, NamedTuple

import pytest
import torch
from cuda_standin import fake_pinning
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager

import ddptrain.checkpoint.dcp as dcp_module
import ddptrain.data.batch as batch_module
import ddptrain.data.train_batches as train_batches
from ddptrain.checkpoint.common import CheckpointWriteError
from ddptrain.checkpoint.dcp import ShardedCheckpointer, load_sharded, staging_options
from ddptrain.checkpoint.manager import Checkpointer, load_checkpoint
from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data import ArrayDataset, TrainBatches, to_device
from ddptrain.train.stepping import optimizer_step

# A background save in one process has no group to agree on: DCP says so, in its thread.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

GPU = DistributedContext(0, 0, 1, torch.device("cuda", 0))
CPU = DistributedContext(0, 0, 1, torch.device("cpu"))


# ---------------------------------------------------------------- to_device
class FakeStreams:
    """Records the stream calls of `to_device`; a "copy" is a clone on the CPU."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.streams: dict[torch.device, object] = {}
        self.inside: object | None = None
        self.copies: list[torch.Tensor] = []

    def stream_for(self, device: torch.device) -> object:
        return self.streams.setdefault(device, object())

    @contextlib.contextmanager
    def use(self, stream: object) -> Iterator[None]:
        self.events.append(("enter", stream))
        self.inside = stream
        try:
            yield
        finally:
            self.inside = None
            self.events.append(("exit", stream))

    def copy(self, t: torch.Tensor, device: torch.device, memory_format: Any) -> torch.Tensor:
        self.copies.append(t.clone())
        self.events.append(("copy", self.inside))
        return self.copies[-1]

    def wait(self, device: torch.device, stream: object) -> None:
        self.events.append(("wait", device, stream))

    def record(self, t: torch.Tensor, device: torch.device) -> None:
        self.events.append(("record", t, device))


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def _leaves(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, (list, tuple)) or isinstance(batch, dict):
        return [t for item in items for t in _leaves(item)]
    return []


def _nested() -> tuple[Any, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    inputs = {"ids": torch.randint(9, (4, 5), generator=gen), "extra": [
        torch.randn(4, 3, generator=gen), Pair(torch.randn(4), torch.randn(4, 2)), "name"]}
    return inputs, torch.arange(4)


def test_a_gpu_batch_is_copied_on_a_side_stream_the_step_waits_for(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeStreams()
    monkeypatch.setattr(batch_module, "_streams", fake)
    device = torch.device("cuda", 0)
    batch = _nested()
    moved = to_device(batch, device)
    side = fake.streams[device]
    leaves = _leaves(batch)
    assert len(leaves) == 5
    # every leaf copied inside the side stream; then one wait; then each copy recorded
    assert fake.events[0] == ("enter", side) and fake.events[len(leaves) + 1] == ("exit", side)
    assert fake.events[1 : len(leaves) + 1] == [("copy", side)] * len(leaves)
    assert fake.events[len(leaves) + 2] == ("wait", device, side)
    records = fake.events[len(leaves) + 3 :]
    assert [e[0] for e in records] == ["record"] * len(leaves)
    assert {id(e[1]) for e in records} == {id(t) for t in fake.copies}
    assert all(e[2] == device for e in records)
    # the batch keeps its shape: each leaf is its copy, other values as they were
    assert [id(t) for t in _leaves(moved)] == [id(t) for t in fake.copies]
    assert all(torch.equal(a, b) for a, b in zip(_leaves(moved), leaves, strict=True))
    assert isinstance(moved, tuple) and isinstance(moved[0]["extra"][1], Pair)
    assert moved[0]["extra"][2] == "name"
    # one side stream per device, kept from batch to batch
    to_device(batch, device)
    to_device(batch, torch.device("cuda", 1))
    assert len(fake.streams) == 2
    assert sum(e[0] == "wait" for e in fake.events) == 3


def test_a_cpu_batch_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeStreams()
    monkeypatch.setattr(batch_module, "_streams", fake)
    batch = _nested()
    assert to_device(batch, torch.device("cpu")) is batch
    images = torch.randn(2, 3, 4, 4)
    moved = to_device(images, torch.device("cpu"), torch.channels_last)
    assert moved.is_contiguous(memory_format=torch.channels_last)
    assert fake.events == [] and fake.streams == {}


# ---------------------------------------------------------------- in-process batches
class CountedPool(train_batches.ThreadPoolExecutor):
    made = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        CountedPool.made += 1
        super().__init__(*args, **kwargs)


def _feeders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ddptrain-batches")]


def test_gpu_batches_are_sliced_and_pinned_one_ahead_in_a_thread(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(train_batches, "ThreadPoolExecutor", CountedPool)
    CountedPool.made = 0
    config = TrainingConfig(batch_size=8, output_dir="unused", drop_last=False)
    data = ArrayDataset(torch.randn(44, 3), torch.arange(44) % 2)
    expected = [b for b, _, _ in TrainBatches(data, config, CPU).epoch(2, 0)]
    assert CountedPool.made == 0 and not _feeders()  # a CPU run starts no thread
    pins: list[int] = []
    two_made = threading.Event()
    with fake_pinning() as pinned, monkeypatch.context() as patch:
        fake_pin = torch.Tensor.pin_memory

        def pin(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            pins.append(threading.get_ident())
            if len(pins) == 4:  # both tensors of the first two batches
                two_made.set()
            return fake_pin(t, *args, **kwargs)

        patch.setattr(torch.Tensor, "pin_memory", pin)
        epoch = TrainBatches(data, config, GPU).epoch(2, 0)
        first, _, _ = next(epoch)
        # the next batch is made while the step holds this one, and no further
        assert two_made.wait(10)
        time.sleep(0.1)
        assert len(pins) == 4
        got = [first] + [b for b, _, _ in epoch]
        threads = set(pins)
        assert not _feeders()  # the thread ended with the epoch
        early = TrainBatches(data, config, GPU).epoch(2, 0)
        next(early)
        early.close()
        assert not _feeders()  # and with an epoch closed before its end
    assert CountedPool.made == 2
    assert len(got) == len(expected) == 6
    assert len(threads) == 1 and threading.get_ident() not in threads  # one, not this
    for batch, want in zip(got, expected, strict=True):
        assert len(batch) == len(want) == 2
        for t, w in zip(batch, want, strict=True):
            assert t.data_ptr() in pinned and torch.equal(t, w)


# ---------------------------------------------------------------- DCP staging
class GatedStager(DefaultStager):
    """DCP's stager, whose copy waits for `gate` and then notes it is done."""

    gate: ClassVar[threading.Event] = threading.Event()
    events: ClassVar[list[str]] = []
    fail: ClassVar[BaseException | None] = None

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        assert GatedStager.gate.wait(30)
        if GatedStager.fail is not None:
            raise GatedStager.fail
        staged = super()._stage(state_dict, **kwargs)
        GatedStager.events.append("staged")
        return staged


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[GatedStager]]:
    """Staging as a GPU run does it (asynchronously), on CPU tensors: the decision is
    the real one, without what needs CUDA (pinned buffers, a non-blocking copy)."""
    real = staging_options

    def cpu_capable(device: torch.device) -> Any:
        return dataclasses.replace(
            real(device), use_pinned_memory=False, use_non_blocking_copy=False
        )

    monkeypatch.setattr(dcp_module, "staging_options", cpu_capable)
    monkeypatch.setattr(dcp_module, "DefaultStager", GatedStager)
    GatedStager.gate = threading.Event()
    GatedStager.events = []
    GatedStager.fail = None
    yield GatedStager
    GatedStager.gate.set()


def _release_later(stager: type[GatedStager], after_s: float = 0.3) -> threading.Timer:
    def release() -> None:
        stager.events.append("released")
        stager.gate.set()

    timer = threading.Timer(after_s, release)
    timer.start()
    return timer


def test_a_gpu_run_stages_its_background_saves_asynchronously(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert staging_options(torch.device("cuda", 0)).use_async_staging
    assert not staging_options(torch.device("cpu")).use_async_staging
    made: list[Any] = []
    monkeypatch.setattr(dcp_module, "DefaultStager", lambda options: made.append(options))
    gpu = ShardedCheckpointer(tmp_path / "a", GPU, keep_last=0, background=True)
    assert gpu.async_staging and made[-1].use_async_staging and made[-1].use_pinned_memory
    monkeypatch.undo()
    cpu = ShardedCheckpointer(tmp_path / "b", CPU, keep_last=0, background=True)
    assert not cpu.async_staging and cpu.stager is not None
    assert not cpu.stager._config.use_async_staging
    cpu.settle()  # nothing in flight: nothing to wait for
    cpu.close()


def test_settle_waits_for_the_copy_and_the_save_is_whole_after_wait(
    gated: type[GatedStager], tmp_path: Path
) -> None:
    saver = ShardedCheckpointer(tmp_path / "ckpt", GPU, keep_last=0, background=True)
    weights = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    saved = weights.clone()
    state = {"model": {"w": weights}, "optim": {"momentum": torch.ones(3), "lr": 0.1}}
    try:
        path = saver.save(3, {"step": 3, "epoch": 0}, state, best=False)
        assert gated.events == []  # the save came back before its copy was made
        timer = _release_later(gated)
        saver.settle()
        gated.events.append("settled")
        assert gated.events == ["released", "staged", "settled"]
        weights.add_(1.0)  # the step after: the copy is made already
        saver.wait()
        timer.join()
    finally:
        saver.close()
    meta = load_checkpoint(path, torch.device("cpu"))
    into = {"model": {"w": torch.zeros(1000)}, "optim": {"momentum": torch.zeros(3), "lr": 0.0}}
    load_sharded(path, into, meta)
    assert torch.equal(into["model"]["w"], saved)
    assert torch.equal(into["optim"]["momentum"], torch.ones(3)) and into["optim"]["lr"] == 0.1
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == path.name


def test_a_failed_copy_is_the_save_failure_it_was(
    gated: type[GatedStager], tmp_path: Path
) -> None:
    """Copied asynchronously or not, a staging error ends the save with the same line;
    `settle` leaves it to `wait`, which every rank calls."""
    gated.fail = OSError(28, "No space left on device")
    state = {"model": {"w": torch.ones(4)}}
    errors = []
    for ctx, name in ((GPU, "gpu"), (CPU, "cpu")):
        gated.gate.clear()
        saver = ShardedCheckpointer(tmp_path / name, ctx, keep_last=0, background=True)
        timer = _release_later(gated, 0.2)  # the copy fails once the save has come back
        with pytest.raises(CheckpointWriteError) as caught:
            saver.save(5, {"step": 5, "epoch": 0}, state, best=False)
            saver.settle()
            saver.wait()
        timer.join()
        errors.append(str(caught.value).replace(name, "DIR"))
        saver.close()
    assert errors[0] == errors[1] and "No space left on device" in errors[0]


def test_the_next_optimizer_step_waits_for_the_copy(
    gated: type[GatedStager], tmp_path: Path
) -> None:
    """The weights, and batch norm's statistics a forward changes in place meanwhile,
    are saved as they were when the save was asked for."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    config = TrainingConfig(output_dir=str(tmp_path), checkpoint_format="dcp",
                            async_checkpoint=True, max_bad_steps=0)
    strategy = SimpleNamespace(
        sharded_state=lambda module, opt: (module.state_dict(), {"lr": 0.5}),
        local_optimizer=lambda opt: opt, finish_gradients=lambda: None,
    )
    checkpoints = Checkpointer(config, GPU, strategy, "dcp")  # type: ignore[arg-type]
    events = gated.events

    def step(opt: torch.optim.Optimizer) -> None:
        events.append("step")
        opt.step()

    trainer = SimpleNamespace(
        config=config, strategy=strategy, optimizer=optimizer, dynamic=False, ema=None,
        precision=SimpleNamespace(scaler=None), checkpoints=checkpoints,
        scaler=SimpleNamespace(step=step, update=lambda: None),
        scheduler=SimpleNamespace(step=lambda: None), steer=SimpleNamespace(apply=lambda: None),
    )
    model(torch.randn(8, 3)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        path = checkpoints.save(1, {"step": 1, "epoch": 0}, model, optimizer)
        assert events == []
        model(torch.randn(8, 3) * 5).square().sum().backward()  # the next forward, backward
        assert not torch.equal(model[1].running_mean, before["1.running_mean"])
        timer = _release_later(gated)
        optimizer_step(trainer, SimpleNamespace())  # type: ignore[arg-type]
        assert events == ["released", "staged", "step"]
        assert not torch.equal(model[0].weight, before["0.weight"])
        checkpoints.wait()
        timer.join()
    finally:
        checkpoints.close()
    into = {"model": {k: torch.zeros_like(v) for k, v in before.items()}, "optim": {"lr": 0.0}}
    load_sharded(path, into, load_checkpoint(path, torch.device("cpu")))
    for name, value in before.items():
        assert torch.equal(into["model"][name], value), name
