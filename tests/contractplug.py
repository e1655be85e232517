"""A tiny token corpus for the fast layout-contract tests (tests/test_contracts.py):
`--dataset contractplug:tokens`, 150 training windows of `--block_size` tokens from a
noisy rule over 32 symbols (learnable, so the gradients change from step to step), and
40 validation windows."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

VOCAB = 32


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    vocab_size = VOCAB

    def __init__(self, n: int, block: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        stream = torch.empty(n * block + 1, dtype=torch.long)
        stream[0] = 1
        noise = torch.randint(VOCAB, (len(stream),), generator=g)
        keep = torch.rand(len(stream), generator=g) < 0.7
        for i in range(1, len(stream)):
            stream[i] = (3 * stream[i - 1] + 1) % VOCAB if keep[i] else noise[i]
        self.x = stream[:-1].view(n, block)
        self.y = stream[1:].view(n, block)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def tokens(config: object, train: int = 150, val: int = 40) -> tuple[Windows, Windows]:
    block = int(getattr(config, "block_size", 16))
    return Windows(train, block, 0), Windows(val, block, 1)


def gpt(config: object, vocab_size: int, dropout: float = 0.0) -> torch.nn.Module:
    """The built-in GPT's layout with dropout (`--model_args dropout=0.1`)."""
    from ddptrain.models.gpt import DEFAULT_N_HEAD, DEFAULT_N_LAYER, GPT, GPTConfig

    block, width = int(getattr(config, "block_size", 16)), int(getattr(config, "width", 16))
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block, n_layer=DEFAULT_N_LAYER,
                         n_head=DEFAULT_N_HEAD, n_embd=width, dropout=dropout))
