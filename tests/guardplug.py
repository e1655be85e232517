"""User code for tests/test_guarantees.py and tests/test_exact_n.py, named as
`--dataset guardplug:NAME` / `--model guardplug:NAME`: the built-in MLP with a kill
switch, a model with dropout and a dataset with random augmentation (the RNG states a
resume must restore), a stream that shuffles by its epoch, a model that records the
samples it trains on, and a validation set that gets worse as training goes on (the best
epoch is the first).

Two environment variables steer the models without changing the run's config, so a
killed run and its resume are the same run:
  GUARD_KILL_AT=N    the process of rank GUARD_KILL_RANK (default 1) SIGKILLs itself at
                     its N-th training forward: a kill at an exact step, at any load
  GUARD_STALL_S=S    ... or, instead, sleeps S seconds there: user code that stalls
  GUARD_SIGNAL=SIGSTOP  ... or sends itself this signal instead of SIGKILL
  GUARD_RECORD=DIR   the recorder appends the sample ids of each training batch to
                     DIR/rank<R>.txt, one line per batch
  GUARD_SLOW_SAVE_S=S  rank 0's first checkpoint after training began takes S seconds
                     longer (the model's state is read that much later): a slow disk
  GUARD_STOP_AT_SAVE=1  rank GUARD_KILL_RANK stops itself (SIGSTOP) as its model's state
                     is read for the first checkpoint after training began: a peer that
                     hangs while rank 0 writes
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _KillSwitch:
    """SIGKILL this process at its GUARD_KILL_AT-th training forward."""

    def __init__(self) -> None:
        at = os.environ.get("GUARD_KILL_AT")
        victim = int(os.environ.get("GUARD_KILL_RANK", "1"))
        self.at = int(at) if at and _rank() == victim else 0
        self.forwards = 0

    def tick(self) -> None:
        self.forwards += 1
        if self.at and self.forwards == self.at:
            stall = float(os.environ.get("GUARD_STALL_S", "0"))
            if stall:  # user code that takes too long: its peers wait in a collective
                time.sleep(stall)
            else:
                os.kill(os.getpid(), getattr(signal, os.environ.get("GUARD_SIGNAL", "SIGKILL")))


# ---------------------------------------------------------------- RNG: dropout + augmentation
class DropoutNet(nn.Module):
    def __init__(self, in_features: int, outputs: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, outputs)
        )
        self.kill = _KillSwitch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.kill.tick()
        return self.net(x)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        slow = float(os.environ.get("GUARD_SLOW_SAVE_S", "0"))
        if slow and _rank() == 0 and self.kill.forwards and not getattr(self, "_slowed", 0):
            self._slowed = 1
            time.sleep(slow)
        victim = _rank() == int(os.environ.get("GUARD_KILL_RANK", "1"))
        if os.environ.get("GUARD_STOP_AT_SAVE") and self.kill.forwards and victim:
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().state_dict(*args, **kwargs)


def dropout_net(config: Any, input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    return DropoutNet(input_shape[0], outputs)


def killable_mlp(config: Any, input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """`--model mlp` itself (ddptrain's MLP at --width), with the kill switch."""
    from ddptrain.models.nets import MLP

    model = MLP(int(np.prod(input_shape)), outputs, config.width)
    kill = _KillSwitch()
    model.register_forward_pre_hook(lambda m, args: kill.tick() if m.training else None)
    return model


def killable_moe_gpt(config: Any, input_shape: tuple[int, ...], outputs: int,
                     vocab_size: int | None = None, **_: Any) -> nn.Module:
    """The built-in GPT at --width with 4 experts a block (top 2), with the kill switch."""
    from ddptrain.models.gpt import build_gpt

    model = build_gpt(outputs, input_shape[0], config.width, experts=4, top_k=2)
    kill = _KillSwitch()
    model.register_forward_pre_hook(lambda m, args: kill.tick() if m.training else None)
    return model


class Augmented(Dataset):
    """Map-style samples; with `noise`, each read adds fresh noise drawn from torch's,
    numpy's and Python's global generators: all three are part of a rank's RNG state."""

    num_classes = 2

    def __init__(self, x: torch.Tensor, y: torch.Tensor, noise: float) -> None:
        self.x, self.y, self.noise = x, y, noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.noise:
            jitter = torch.from_numpy(np.random.normal(0.0, self.noise, x.shape))
            scale = random.uniform(0.8, 1.2)
            x = scale * (x + self.noise * torch.randn(x.shape) + jitter.float())
        return x, self.y[i]


def augmented(config: Any, n: int = 240) -> tuple[Dataset, Dataset]:
    # ddptrain seeds torch per rank (seed + rank) but not numpy's and Python's global
    # generators in the training process, so the dataset seeds them, the same way.
    np.random.seed(config.seed + _rank())
    random.seed(config.seed + _rank())
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).long()
    cut = n * 4 // 5
    return Augmented(x[:cut], y[:cut], noise=0.3), Augmented(x[cut:], y[cut:], noise=0.0)


# ---------------------------------------------------------------- a stream shuffled by epoch
class EpochStream(IterableDataset):
    """Samples 0..n-1 in an order drawn from (seed, epoch): a new order every epoch once
    `set_epoch` says which. Feature 0 is the sample id."""

    num_classes = 2

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(i), (i % 5) / 5.0, (i % 3) / 3.0]), torch.tensor(i % 2)

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in self.order():
            yield self.sample(i)


class StatefulEpochStream(EpochStream):
    """The same, able to say where it stands in its epoch's order (exact mid-epoch
    resume); its state is the position alone, as the README describes it."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__(n, seed)
        self.pos = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        begin, self.pos = self.pos, 0
        for k, i in enumerate(self.order()):
            if k >= begin:
                self.pos = k + 1
                yield self.sample(i)
        self.pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def epoch_stream(
    config: Any, n: int = 64, stateful: bool = False
) -> tuple[IterableDataset, Dataset]:
    cls = StatefulEpochStream if stateful else EpochStream
    train = cls(n, config.seed)
    x = torch.stack([train.sample(i)[0] for i in range(16)])
    return train, TensorDataset(x, torch.arange(16) % 2)


class Recorder(nn.Module):
    """A linear model that writes down the sample ids (feature 0) it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 2)
        self.kill = _KillSwitch()
        where = os.environ.get("GUARD_RECORD")
        self.log = Path(where) / f"rank{_rank()}.txt" if where else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.kill.tick()
            if self.log is not None:
                with self.log.open("a") as f:
                    f.write(" ".join(str(int(v)) for v in x[:, 0].tolist()) + "\n")
        return self.net(x)


def recorder(config: Any) -> nn.Module:
    return Recorder()


# ---------------------------------------------------------------- the best epoch comes first
class _Labelled(TensorDataset):
    num_classes = 2


def flipped(config: Any, n: int = 320) -> tuple[Dataset, Dataset]:
    """Validation labels are the opposite of the training rule: the better the model
    learns, the worse it validates, so the best epoch is the first."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    cut = n * 3 // 4
    return _Labelled(x[:cut], y[:cut]), _Labelled(x[cut:], 1 - y[cut:])


# ---------------------------------------------------------------- a rank slow to load
class _SlowOn(Dataset):
    """`data`, whose samples take `seconds` each to load on rank `slow_rank`."""

    num_classes = 2

    def __init__(self, data: Dataset, slow_rank: int, seconds: float) -> None:
        self.data, self.slow, self.seconds = data, slow_rank == _rank(), seconds

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        if self.slow:
            time.sleep(self.seconds)
        return self.data[i]


def slow_data(config: Any, slow_rank: int = 1, seconds: float = 0.003) -> tuple[Dataset, Dataset]:
    """`augmented`'s data, loaded slowly on `slow_rank` (-1: on none)."""
    train, val = augmented(config, n=200)
    return _SlowOn(train, slow_rank, seconds), val


def oom_mlp(config: Any, input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """`--model mlp` whose third training forward runs out of (CUDA) memory."""
    from ddptrain.models.nets import MLP

    model = MLP(int(np.prod(input_shape)), outputs, config.width)
    calls = [0]

    def forward(module: nn.Module, args: Any) -> None:
        calls[0] += module.training
        if calls[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.register_forward_pre_hook(forward)
    return model


def poisoned(config: Any, n: int = 320, poison: int = 2) -> tuple[Dataset, Dataset]:
    """`flipped`'s training rule, with `poison` training samples scaled 1000x and their
    labels flipped: a batch that holds one has a loss far above the others'."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    x[:poison] *= 1000
    y[:poison] = 1 - y[:poison]
    cut = n * 3 // 4
    return _Labelled(x[:cut], y[:cut]), _Labelled(x[cut:], y[cut:])
