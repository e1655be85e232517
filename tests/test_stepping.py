"""A step skipped on the device is no step at all: the built-in optimizers (fused) given
the non-finite flag leave the weights, their state and step count, and the EMA exactly as
they were, also when the very first step is skipped; a later good step is bit for bit
the step of a twin that never saw the bad one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddptrain.config import TrainingConfig
from ddptrain.parallel.base import fused_where_it_can, zero_state
from ddptrain.train.ema import EMA
from ddptrain.train.optim import optimizer_spec
from ddptrain.train.stepping import skips_on_device


def _build(optimizer: str) -> tuple[nn.Module, torch.optim.Optimizer, EMA]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    cls, kwargs = optimizer_spec(TrainingConfig(optimizer=optimizer, output_dir="unused"), 0.1)
    groups = [{"params": list(model.parameters())}]
    opt = cls(groups, **fused_where_it_can(cls, groups, kwargs), **kwargs)
    return model, opt, EMA(model, 0.9)


def _step(model: nn.Module, opt: torch.optim.Optimizer, ema: EMA, seed: int,
          bad: bool | None) -> None:
    """One step from batch `seed`; `bad`: given the device flag (True: non-finite)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=gen)
    if bad:
        x[0, 0] = float("nan")
    model(x).square().mean().backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    flag = None
    if bad is not None:
        flag = torch.tensor(float(bad))
        if not opt.state:
            zero_state(opt)
        opt.found_inf = flag  # type: ignore[attr-defined]
    opt.step()
    if bad is not None:
        del opt.found_inf  # type: ignore[attr-defined]
    ema.update(flag)
    opt.zero_grad(set_to_none=True)


def _state(model: nn.Module, opt: torch.optim.Optimizer, ema: EMA) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        tensors += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors + [s.clone() for s in ema.shadow]


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("bad_at", [0, 2])
def test_a_step_skipped_on_the_device_leaves_everything_as_it_was(
    optimizer: str, bad_at: int
) -> None:
    model, opt, ema = _build(optimizer)
    twin, twin_opt, twin_ema = _build(optimizer)
    assert skips_on_device(opt)
    for seed in range(5):
        if seed == bad_at:
            before = _state(model, opt, ema)
            _step(model, opt, ema, 100, bad=True)
            after = _state(model, opt, ema)
            if len(after) != len(before):  # the first step: the state starts as zeros
                after = [t for t in after if t.abs().sum() != 0]
            _assert_bitwise(after, before)
        _step(model, opt, ema, seed, bad=False)
        _step(twin, twin_opt, twin_ema, seed, bad=None)  # the plain loop: no flag at all
        _assert_bitwise(_state(model, opt, ema), _state(twin, twin_opt, twin_ema))


def test_a_gpu_verdict_is_read_from_a_pinned_copy_once_its_event_has_passed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a GPU (a stand-in here) the flag is copied without blocking into one of two
    pinned slots as the step is taken, an event recorded behind it; `settle` waits on
    that event alone (not on the device's whole queue), then folds the step's window
    only if it was good and counts it."""
    from cuda_standin import fake_pinning

    from ddptrain.checkpoint.schema import Progress
    from ddptrain.train.metrics import MetricSums
    from ddptrain.train.stepping import Verdicts
    from ddptrain.train.tasks import Task

    calls: list[str] = []

    class Event:
        def record(self) -> None:
            calls.append("record")

        def synchronize(self) -> None:
            calls.append("synchronize")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    with fake_pinning() as pinned:
        verdicts = Verdicts(torch.device("cuda", 0), 2, tmp_path)
    assert {s.data_ptr() for s in verdicts._slots} == pinned and len(pinned) == 2
    sums, progress = MetricSums(Task(), torch.device("cpu")), Progress()
    for step, bad in enumerate([0.0, 1.0, 0.0], start=1):
        sums.update(_score(float(step)))
        verdicts.settle(progress)
        progress.step = step
        verdicts.hold(step, torch.tensor(bad), sums)
        assert calls[-1] == "record"
        assert verdicts._held is not None and verdicts._held[1].data_ptr() in pinned
    verdicts.settle(progress)
    assert calls == ["record", "synchronize"] * 3
    assert progress.bad_steps == 1 and progress.bad_streak == 0
    assert sums.snapshot()[0].item() == 1.0 + 3.0  # step 2's window dropped


def _score(loss: float) -> Any:
    from ddptrain.train.tasks import Score

    return Score(torch.tensor(loss), 1, {}, 1)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "dataset", "extra"), [
    ("ddp", "packplug:documents", 1), ("fsdp", "packplug:documents", 1),
    ("ddp", "chars", 0), ("fsdp", "chars", 1),
])
def test_a_language_model_step_makes_at_most_one_collective_beyond_the_gradient_reduction(
    tmp_path: Path, strategy: str, dataset: str, extra: int
) -> None:
    """Packed documents (some targets not scored): the window's token count and (fsdp:
    each rank checks its own shards) the non-finite flag travel in one all-reduce; ddp's
    ranks hold the same gradients, so its flag needs none. Windows of a token stream
    score every target: their count is known, and ddp's step makes no collective of its
    own, fsdp's the flag's alone."""
    from dist_utils import run_ranks
    from workers import count_step_collectives

    cfg = dict(dataset=dataset, block_size=16, width=16, batch_size=16, epochs=1,
               strategy=strategy, log_interval=2, use_amp=False, pack=dataset != "chars",
               num_workers=0, output_dir=str(tmp_path / "run"), tensorboard=False)
    ranks = run_ranks(count_step_collectives, 2, tmp_path, cfg)
    for r in ranks:
        assert r["steps"] > 1 and r["per_step"] == [extra] * r["steps"], r
