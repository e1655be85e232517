"""A character-level language-modelling corpus that ships with scikit-learn (no download).

The corpus is the reStructuredText descriptions of scikit-learn's bundled datasets
(`sklearn/datasets/descr/*.rst`), concatenated in sorted file-name order so that every
install of the same scikit-learn version yields the same text, vocabulary and split.

The text is cut into non-overlapping windows of `block_size + 1` characters; each window
gives an input `x = window[:-1]` and a next-character target `y = window[1:]`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Dataset

from ddptrain.data.bundled import bundled_dir

CORPUS = "scikit-learn's bundled dataset descriptions (sklearn/datasets/descr/*.rst)"
_DESCR_PACKAGE = "sklearn.datasets.descr"


class TokenWindows(Dataset):
    """Fixed-length token windows held in memory: inputs `x` (N, T), next tokens `y` (N, T).

    `batch` and `__getitems__` fetch many windows with one indexing operation, so a loader
    can slice batches in-process instead of collating single samples. `targets_each`: T
    where every target is scored (none is -100), so that a step's token count is its
    windows' count times T, known without counting (or all-reducing) it; else None.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if x.shape != y.shape or x.dim() != 2:
            raise ValueError(
                f"x and y must both have shape (N, T), got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        self.x, self.y = x, y
        self.targets_each = int(y.shape[1]) if bool((y != -100).all()) else None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch(torch.as_tensor(indices, dtype=torch.long))

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]


def load_char_corpus() -> str:
    """The corpus text: every `.rst` file in `sklearn/datasets/descr`, sorted, joined by a
    blank line (read without importing scikit-learn: `data.bundled`)."""
    descr = bundled_dir("descr")
    # Sorting fixes the order: directory listing order differs between file systems.
    files = sorted(descr.glob("*.rst")) if descr is not None else []
    files = [f for f in files if f.is_file()]
    if not files:
        raise FileNotFoundError(f"no .rst files found in {_DESCR_PACKAGE}; is scikit-learn intact?")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def unigram_perplexity(tokens: np.ndarray, vocab_size: int) -> float:
    """exp(entropy) of the token frequencies: the perplexity of always predicting them.

    A language model that does not beat this has learnt nothing beyond character counts.
    """
    counts = np.bincount(tokens.ravel(), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return math.exp(float(-(p * np.log(p)).sum()))


def char_lm_datasets(
    block_size: int, val_fraction: float, seed: int
) -> tuple[TokenWindows, TokenWindows, int, float]:
    """Train and validation windows of the corpus, its vocabulary size, and the baseline.

    Returns `(train, val, vocab_size, unigram_perplexity)`. The vocabulary is the sorted set
    of the corpus's characters; the split is a permutation of the windows fixed by `seed`
    alone. The unigram perplexity is measured on the training targets, the characters a
    model is trained to predict.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    text = load_char_corpus()
    vocab = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(vocab)}
    data = np.fromiter((stoi[ch] for ch in text), dtype=np.int64, count=len(text))

    window = block_size + 1
    n = len(data) // window  # the tail shorter than one window is dropped
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise ValueError(
            f"the corpus gives {n} windows of {window} characters; val_fraction "
            f"{val_fraction} leaves none for training: lower block_size or val_fraction"
        )
    windows = data[: n * window].reshape(n, window)
    perm = np.random.default_rng(seed).permutation(n)
    val_idx, train_idx = perm[:n_val], perm[n_val:]

    def make(idx: np.ndarray) -> TokenWindows:
        w = torch.from_numpy(windows[np.sort(idx)])
        # Contiguous copies: slices of `w` would keep the whole corpus array alive and make
        # every batch gather from strided memory.
        return TokenWindows(w[:, :-1].contiguous(), w[:, 1:].contiguous())

    train, val = make(train_idx), make(val_idx)
    return train, val, len(vocab), unigram_perplexity(train.y.numpy(), len(vocab))
