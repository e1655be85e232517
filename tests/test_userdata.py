"""Data and models as users have them: Hugging Face `datasets` (map-style and iterable),
variable-length samples with a user's collate, class counts from where the data or the
model keeps them. The user code is tests/userdata_plug.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import run_cli
from dist_utils import run_ranks
from safetensors.torch import load_file
from torch.utils.data import TensorDataset
from workers import run_training

from ddptrain.cli import main
from ddptrain.config import TrainingConfig
from ddptrain.errors import ConfigError


def _cfg(out: Path, **kw: Any) -> dict[str, Any]:
    cfg = dict(
        epochs=2, lr=0.1, momentum=0.9, weight_decay=0.0, use_amp=False, log_interval=5,
        seed=7, output_dir=str(out), tensorboard=False,
    )
    cfg.update(kw)
    return cfg


def _max_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def _epochs_seen(record: Path, ranks: int, batches_per_epoch: int) -> list[Counter[int]]:
    """The ids each epoch trained on, over all ranks (each rank writes a line a batch)."""
    lines = [(record / f"rank{r}.txt").read_text().splitlines() for r in range(ranks)]
    epochs = len(lines[0]) // batches_per_epoch
    return [
        Counter(int(i) for rank in lines
                for line in rank[e * batches_per_epoch:(e + 1) * batches_per_epoch]
                for i in line.split())
        for e in range(epochs)
    ]


# ---------------------------------------------------------------- map-style datasets
@pytest.mark.slow
def test_hf_map_dataset_on_two_ranks_equals_one_rank_and_sees_every_sample_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("datasets")
    record = tmp_path / "ids"
    record.mkdir()
    monkeypatch.setenv("USERDATA_RECORD", str(record))
    case = dict(dataset="userdata_plug:hf_dict", model="userdata_plug:linear")
    run_ranks(run_training, 2, tmp_path, _cfg(tmp_path / "two", batch_size=8, **case))
    seen = _epochs_seen(record, 2, 160 // 16)
    assert len(seen) == 2 and all(s == Counter(range(160)) for s in seen)
    for f in record.iterdir():
        f.unlink()
    run_ranks(run_training, 1, tmp_path, _cfg(tmp_path / "one", batch_size=16, **case))
    assert _max_diff(tmp_path / "two", tmp_path / "one") < 1e-5


def test_hf_datasets_in_every_shape_a_factory_returns(tmp_path: Path) -> None:
    """A DatasetDict, with or without torch formatting, and one set split by
    --val_fraction; the string column is left out, `label` becomes `labels`, and the
    ClassLabel says 3 classes though only 2 occur."""
    pytest.importorskip("datasets")
    from userdata_plug import hf_dict, hf_one

    from ddptrain.data import bundle_datasets

    for made, name in ((hf_dict(None), "dict"), (hf_dict(None, torch_format=True), "torch")):
        data = bundle_datasets(made, TrainingConfig(dataset=f"userdata_plug:{name}"))
        row = data.train[0]
        assert set(row) == {"idx", "x", "labels"}, row
        assert isinstance(row["x"], torch.Tensor) and row["x"].shape == (4,)
        assert data.facts.num_classes == 3 and data.facts.classes_from == "features['labels']"
        assert data.facts.dict_batches and len(data.train) == 160 and len(data.val) == 40
    data = bundle_datasets(hf_one(None), TrainingConfig(dataset="userdata_plug:hf_one"))
    assert (len(data.train), len(data.val)) == (160, 40)
    with pytest.raises(ConfigError, match="'train' and one of"):
        bundle_datasets({"training": hf_one(None)}, TrainingConfig(dataset="m:f"))


def test_a_causal_lm_dataset_with_labels_equal_to_input_ids_is_read_as_tokens() -> None:
    """The standard causal-LM layout: `input_ids` and `labels` (= input_ids) per row. With
    datasets 5 a column is a lazy `Column`; a 2-D labels column is not class labels, and
    is never read whole to count classes."""
    datasets = pytest.importorskip("datasets")
    from ddptrain.data import bundle_datasets

    ids = [[i % 7, (i + 1) % 7, (i + 2) % 7, (i + 3) % 7] for i in range(12)]
    for fmt in (None, "torch"):
        ds = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
        ds = ds.with_format(fmt) if fmt else ds
        data = bundle_datasets({"train": ds, "validation": ds},
                               TrainingConfig(dataset="m:f", task="lm"))
        assert data.facts.num_classes is None
        assert data.train[0]["labels"].tolist() == ids[0]


@pytest.mark.slow
@pytest.mark.parametrize("shards,workers", [
    (4, 0), pytest.param(3, 0, marks=pytest.mark.heavy),
    pytest.param(4, 2, marks=pytest.mark.heavy),
])
def test_hf_iterable_dataset_on_two_ranks_reads_every_sample_once_per_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int, workers: int
) -> None:
    """4 shards: split at the source (with 2 workers, a rank's 2 shards among them); 3
    shards do not divide among 2 ranks: each keeps every other row. The stream shuffles
    by epoch."""
    pytest.importorskip("datasets")
    record = tmp_path / "ids"
    record.mkdir()
    monkeypatch.setenv("USERDATA_RECORD", str(record))
    cfg = _cfg(
        tmp_path / "it", dataset="userdata_plug:hf_stream", dataset_args={"shards": shards},
        model="userdata_plug:linear", batch_size=8, num_workers=workers, epochs=2,
    )
    summary = run_ranks(run_training, 2, tmp_path, cfg)[0]
    assert summary["steps"] == 2 * 10
    seen = _epochs_seen(record, 2, 10)
    assert len(seen) == 2 and all(s == Counter(range(160)) for s in seen)
    order = [(record / "rank0.txt").read_text().splitlines()[e * 10:(e + 1) * 10]
             for e in (0, 1)]
    assert order[0] != order[1], "the stream's order must change with the epoch"


# ---------------------------------------------------------------- a user's collate
@pytest.mark.slow
def test_variable_length_sequences_with_a_padding_collate_two_ranks_equal_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "ids"
    record.mkdir()
    monkeypatch.setenv("USERDATA_RECORD", str(record))
    case = dict(
        dataset="userdata_plug:sequences", model="userdata_plug:bag_of_tokens",
        collate="userdata_plug:pad",
    )
    run_ranks(run_training, 2, tmp_path, _cfg(tmp_path / "two", batch_size=8, **case))
    seen = _epochs_seen(record, 2, 10)
    assert len(seen) == 2 and all(s == Counter(range(160)) for s in seen)
    run_ranks(run_training, 1, tmp_path, _cfg(tmp_path / "one", batch_size=16, **case))
    assert _max_diff(tmp_path / "two", tmp_path / "one") < 1e-5


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_of_unequal_size_without_a_collate_say_so_in_one_line(
    tmp_path: Path, workers: int
) -> None:
    proc = run_cli([
        "train", "--dataset", "userdata_plug:sequences", "--model", "userdata_plug:bag_of_tokens",
        "--epochs", "1", "--num_workers", str(workers), "--output_dir", str(tmp_path / "r"),
    ], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ddptrain: error: the samples of a batch differ in size"), last
    assert "--collate" in last and "Traceback" not in proc.stderr


def test_collate_in_the_python_api_and_its_flag_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from userdata_plug import BagOfTokens, pad, sequences

    import ddptrain

    summary = ddptrain.fit(
        TrainingConfig(epochs=1, batch_size=16, output_dir=str(tmp_path / "api"),
                       tensorboard=False),
        model=BagOfTokens(2), datasets=sequences(None), collate=pad,
    )
    assert summary["steps"] == 10
    # What ran is not in its config: config.yaml says which fields objects stood in for,
    # and what would rebuild the run from it asks for them instead of using the defaults.
    run = tmp_path / "api"
    stored = yaml.safe_load((run / "config.yaml").read_text())
    assert stored["given_in_python"] == ["model", "dataset", "collate"]
    assert main(["evaluate", str(run)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ddptrain: error: {str(run / 'model.safetensors')!r} was trained on the model and "
        "dataset and collate given to ddptrain.fit as Python objects, which its config "
        "cannot name: pass the same objects (ddptrain.evaluate(..., model=..., datasets=..., "
        "collate=...)), or name them with --model ... --dataset ... --collate ..."]
    assert main(["train", "--config", str(run / "config.yaml"), "--output_dir",
                 str(tmp_path / "again")]) == 2
    assert "were Python objects given to ddptrain.fit" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()
    figures = ddptrain.evaluate(run, model=BagOfTokens(2), datasets=sequences(None),
                                collate=pad)
    assert figures["loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    with pytest.raises(ConfigError, match="--collate 'pad' is invalid"):
        TrainingConfig(collate="pad").validate()
    # a model named as --model names it, as a collate function as --collate does
    named = ddptrain.fit(model="mlp", dataset="digits", epochs=1, tensorboard=False,
                         output_dir=str(tmp_path / "named"))
    assert named["steps"] > 0


# ---------------------------------------------------------------- how many classes
def test_classes_come_from_the_dataset_the_model_or_the_labels() -> None:
    from userdata_plug import HFStyle

    from ddptrain.api import resolve_run
    from ddptrain.data import bundle_datasets

    def facts(made: Any, **kw: Any) -> tuple[int | None, str | None]:
        f = bundle_datasets(made, TrainingConfig(dataset="m:f", **kw)).facts
        return f.num_classes, f.classes_from

    x, y = torch.randn(20, 4), torch.arange(20) % 2
    pair = (TensorDataset(x, y), TensorDataset(x, y))
    assert facts(pair) == (2, "the labels seen")
    assert facts(pair, num_classes=5) == (5, "--num_classes")
    with_attr = TensorDataset(x, y)
    with_attr.num_classes = 4  # type: ignore[attr-defined]
    assert facts((with_attr, with_attr)) == (4, "dataset.num_classes")
    with_attr.classes = ["a", "b", "c", "d", "e", "f"]  # type: ignore[attr-defined]
    assert facts((with_attr, with_attr)) == (6, "dataset.classes")
    run = resolve_run(TrainingConfig(dataset="m:f").validate(), datasets=pair, model=HFStyle())
    assert (run.data.facts.num_classes, run.task.output_size) == (3, 3)  # type: ignore[attr-defined]


def test_an_image_folder_style_set_needs_no_num_classes(tmp_path: Path) -> None:
    proc = run_cli([
        "train", "--dataset", "userdata_plug:folder", "--dry_run",
        "--output_dir", str(tmp_path / "r"),
    ], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "classification, 4 classes (from dataset.classes)" in proc.stdout, proc.stdout
