"""scikit-learn's bundled data (the `breast_cancer` and `digits` sets, the `chars` corpus),
read from the files scikit-learn ships without importing scikit-learn: its import (with
SciPy's) costs each rank 2-3 CPU-seconds, more than torch's, and every rank of a run reads
its data. The arrays are those of `sklearn.datasets.load_breast_cancer()` and
`load_digits()`, bit for bit (tests/test_tasks.py compares them); where the files are
not where this module looks, scikit-learn's own loaders are used.
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
from pathlib import Path

import numpy as np


def bundled_dir(part: str) -> Path | None:
    """`sklearn/datasets/<part>`, found without importing scikit-learn; None when absent."""
    spec = importlib.util.find_spec("sklearn")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(p) / "datasets" / part for p in locations]
    return next((p for p in found if p.is_dir()), None)


def _data_file(name: str) -> Path | None:
    data = bundled_dir("data")
    return data / name if data is not None and (data / name).is_file() else None


def breast_cancer() -> tuple[np.ndarray, np.ndarray]:
    """569 tumours, 30 float64 features, integer targets (0 malignant, 1 benign)."""
    path = _data_file("breast_cancer.csv")
    if path is None:
        from sklearn.datasets import load_breast_cancer

        bunch = load_breast_cancer()
        return bunch.data, bunch.target
    with path.open(newline="") as f:
        rows = csv.reader(f)
        n_samples, n_features = (int(v) for v in next(rows)[:2])
        x = np.empty((n_samples, n_features))
        y = np.empty((n_samples,), dtype=int)
        for i, row in enumerate(rows):
            x[i] = np.asarray(row[:-1], dtype=np.float64)
            y[i] = int(row[-1])
    return x, y


def digits() -> tuple[np.ndarray, np.ndarray]:
    """1,797 8x8 images of digits, pixel values 0..16 (float64), integer targets."""
    path = _data_file("digits.csv.gz")
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, "rt") as f:
        flat = np.loadtxt(f, delimiter=",")
    return flat[:, :-1].reshape(-1, 8, 8), flat[:, -1].astype(int, copy=False)
