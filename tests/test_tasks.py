"""Any task, any batch: the task seam, dict batches, user code and its arguments,
iterable and memory-mapped data, the Python API.

The equivalence proofs run on real 2-rank gloo groups: N ranks x batch B end with the
weights of 1 rank x batch N*B for every built-in task, on datasets whose size does not
divide by the global batch.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import child_env, run_torchrun, write_npz
from dist_utils import run_ranks
from safetensors.torch import load_file
from workers import run_training

from ddptrain import TrainingConfig, fit
from ddptrain.cli import main
from ddptrain.errors import ConfigError
from ddptrain.train.tasks import Classification, LanguageModel, MultiLabel, Regression


# ---------------------------------------------------------------- the tasks' arithmetic
def test_regression_metrics_match_sklearn_and_squeeze_a_single_output_head() -> None:
    from sklearn.metrics import mean_absolute_error, r2_score

    g = torch.Generator().manual_seed(0)
    y = torch.randn(40, generator=g)
    pred = (y + 0.5 * torch.randn(40, generator=g))[:, None]  # a (B, 1) head, (B,) targets
    task = Regression(())
    task.check(pred, y)
    loss, count = task.loss(pred, y)
    sums = {"loss": float(loss), **{k: float(v) for k, v in task.metrics(pred, y).items()}}
    out = task.summarize(sums, count)
    assert out["mse"] == pytest.approx(float(((pred[:, 0] - y) ** 2).mean()), rel=1e-5)
    assert out["mae"] == pytest.approx(mean_absolute_error(y, pred[:, 0]), rel=1e-5)
    assert out["r2"] == pytest.approx(r2_score(y, pred[:, 0]), rel=1e-5)
    with pytest.raises(ConfigError, match="shaped like the targets"):
        task.check(torch.randn(40, 3), y)  # never broadcast (B, 3) against (B,)


def test_multilabel_f1_matches_sklearn_micro() -> None:
    from sklearn.metrics import f1_score

    g = torch.Generator().manual_seed(1)
    y = (torch.rand(30, 5, generator=g) > 0.5).float()
    logits = torch.randn(30, 5, generator=g)
    task = MultiLabel(5)
    sums = {k: float(v) for k, v in task.metrics(logits, y).items()}
    out = task.summarize({"loss": 0.0, **sums}, 30)
    assert out["f1"] == pytest.approx(f1_score(y, (logits > 0).float(), average="micro"))
    assert out["exact_match"] == float(((logits > 0).float() == y).all(dim=1).float().mean())


def test_lm_ignores_padding_and_classification_counts_top5() -> None:
    logits = torch.randn(2, 4, 7)
    targets = torch.tensor([[1, 2, -100, -100], [3, 4, 5, -100]])
    loss, count = LanguageModel(7, shift=False).loss(logits, targets)
    keep = targets != -100
    want = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum")
    assert int(count) == 5 and float(loss) == pytest.approx(float(want), rel=1e-6)
    task = Classification(10)
    scores = torch.eye(10)[:4] * 10
    sums = task.metrics(scores, torch.tensor([0, 1, 9, 9]))
    assert int(sums["correct"]) == 2 and int(sums["correct_top5"]) == 2 + 0  # 9 not in top 5


# ---------------------------------------------------------------- N ranks == one big batch
def _cfg(out: Path, **kw: Any) -> dict[str, Any]:
    cfg = dict(
        epochs=2, lr=0.05, momentum=0.9, weight_decay=1e-4, warmup_epochs=0.5, use_amp=False,
        log_interval=3, seed=7, output_dir=str(out), tensorboard=False,
    )
    cfg.update(kw)
    return cfg


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


CASES = {
    # 455 training samples: neither 32 nor 16 divides it
    "classification": dict(dataset="breast_cancer", model="mlp"),
    "regression": dict(dataset="diabetes", model="mlp", lr=0.02),
    "multilabel": dict(dataset="taskplug:multilabel", model="mlp", task="multilabel"),
    "lm": dict(dataset="taskplug:tokens", model="taskplug:tiny_lm", lr=0.1),
}


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_rank_with_double_batch_for_every_task(
    tmp_path: Path, name: str
) -> None:
    case = CASES[name]
    run_ranks(run_training, 2, tmp_path, _cfg(tmp_path / "two", batch_size=16, **case))
    run_ranks(run_training, 1, tmp_path, _cfg(tmp_path / "one", batch_size=32, **case))
    two, one = _weights(tmp_path / "two"), _weights(tmp_path / "one")
    assert _max_diff(two, one) < 1e-5
    if name == "classification":  # the check has teeth: another global batch ends elsewhere
        run_ranks(run_training, 1, tmp_path, _cfg(tmp_path / "other", batch_size=16, **case))
        assert _max_diff(_weights(tmp_path / "other"), one) > 1e-3
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["task"] == name and summary["best_metric"] in summary["best_metric"]


@pytest.mark.slow
def test_last_global_batch_smaller_than_the_world_size(tmp_path: Path) -> None:
    # 321 training samples with 2 x 16: the last global batch holds 1 sample, so rank 1
    # has none and runs a zero-weight stand-in micro-batch.
    npz = write_npz(tmp_path / "d.npz", 401)
    cfg = dict(dataset=str(npz), model="mlp", val_fraction=80 / 401)
    run_ranks(run_training, 2, tmp_path, _cfg(tmp_path / "two", batch_size=16, **cfg))
    run_ranks(run_training, 1, tmp_path, _cfg(tmp_path / "one", batch_size=32, **cfg))
    assert _max_diff(_weights(tmp_path / "two"), _weights(tmp_path / "one")) < 1e-5
    rows = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r["split"] == "val"]
    assert [r["train_loss"] > 0 for r in val] == [True, True]


# ---------------------------------------------------------------- user code and arguments
def test_user_task_with_arguments_and_user_dataset_split_by_val_fraction(tmp_path: Path) -> None:
    run = tmp_path / "huber"
    rc = main([
        "train", "--dataset", "taskplug:regression", "--dataset_args", "n=200", "outputs=1",
        "--task", "taskplug:huber", "--task_args", "delta=0.5", "--model", "mlp",
        "--val_fraction", "0.25", "--epochs", "2", "--batch_size", "10",
        "--output_dir", str(run),
    ])
    assert rc == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "huber" and summary["best_metric"] == "mae"
    val = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert val["samples"] == 50  # 25 % of n=200: the argument and the fraction both applied


def test_regression_refuses_nothing_silently(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cases = [
        # float targets with classification
        (["--dataset", "diabetes", "--task", "classification"], "float targets"),
        # (B, T, V) predictions with regression
        (["--dataset", "diabetes", "--model", "taskplug:sequence_head"], "--task lm"),
        # a model output with neither tensor nor loss/logits
        (["--model", "taskplug:chatty"], "neither a tensor nor holds"),
        # dict batches without labels, a model without its own loss
        (["--dataset", "taskplug:dicts", "--dataset_args", "labels=false",
          "--model", "taskplug:logits_only"], "no 'labels'"),
        # ... and a task named for them: refused, not replaced by the model's own loss
        (["--dataset", "taskplug:dicts", "--dataset_args", "labels=false",
          "--model", "taskplug:logits_only", "--task", "lm"], "--task lm scores targets"),
        # --val_fraction with a dataset that brings its own split
        (["--dataset", "taskplug:multilabel", "--val_fraction", "0.3"], "cannot apply"),
        (["--dataset_args", "x"], "expected key=value"),
    ]
    for i, (args, expected) in enumerate(cases):
        rc = main(["train", "--epochs", "1", "--output_dir", str(tmp_path / f"bad{i}"), *args])
        err = capsys.readouterr().err
        assert rc == 2, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ddptrain: error:"), err
        assert expected in lines[0], lines[0]


def test_dict_batches_and_a_model_that_computes_its_own_loss(tmp_path: Path) -> None:
    run = tmp_path / "dict"
    summary = fit(TrainingConfig(
        dataset="taskplug:dicts", model="taskplug:dict_net", epochs=3, batch_size=16,
        lr=0.1, output_dir=str(run), tensorboard=False,
    ))
    assert summary["task"] == "classification" and summary["val_accuracy"] > 0.6
    assert (run / "model.safetensors").exists()


# ---------------------------------------------------------------- the proofs have teeth
def _one_sgd_step(tmp_path: Path, name: str, **kw: Any) -> dict[str, torch.Tensor]:
    cfg = TrainingConfig(
        dataset="breast_cancer", model="mlp", epochs=1, batch_size=455, lr=0.1, momentum=0.0,
        weight_decay=0.0, output_dir=str(tmp_path / name), tensorboard=False, **kw,
    )
    torch.manual_seed(cfg.seed)
    from ddptrain.models.nets import MLP

    start = {k: v.clone() for k, v in MLP(30, 2, 64).state_dict().items()}
    fit(cfg)
    end = _weights(tmp_path / name)
    return {k: end[k] - v for k, v in start.items()}


def test_gradient_clipping_is_applied(tmp_path: Path) -> None:
    # One SGD step on the whole training set (455 samples): the update is lr x the
    # clipped gradient, so its global norm is exactly lr x max_grad_norm.
    delta = _one_sgd_step(tmp_path, "clip", max_grad_norm=0.01)
    norm = math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values()))
    assert norm == pytest.approx(0.1 * 0.01, rel=1e-3)
    free = _one_sgd_step(tmp_path, "free")
    assert math.sqrt(sum(float(d.pow(2).sum()) for d in free.values())) > 10 * norm


def test_bfloat16_autocast_is_applied(tmp_path: Path) -> None:
    from taskplug import DtypeProbe

    for flags, want in (({"amp_dtype": "bfloat16"}, {torch.bfloat16}), ({}, {torch.float32})):
        probe = DtypeProbe()
        fit(TrainingConfig(
            dataset="breast_cancer", epochs=1, output_dir=str(tmp_path / str(want)),
            tensorboard=False, **flags,
        ), model=probe)
        assert probe.seen == want


# ---------------------------------------------------------------- iterable and big data
def _iterable_ids(rank: int, overrides: dict[str, Any]) -> dict[str, Any]:
    from ddptrain.data.sources import load_data
    from ddptrain.launch.process_group import setup_distributed, teardown_distributed
    from ddptrain.train.plan import resolve
    from ddptrain.train.trainer import Trainer

    config = TrainingConfig(**overrides).validate()
    ctx = setup_distributed(config)
    trainer = Trainer(resolve(config, load_data(config), ctx.world_size, ctx.device), ctx)
    seen = {}
    for epoch in (1, 2):
        ids: list[int] = []
        steps = 0
        for batch, micro, _ in trainer.train_batches.epoch(epoch, 0):
            ids += batch[0][:, 0].long().tolist()
            steps += micro.ends_window
        seen[epoch] = (ids, steps)
    summary = trainer.fit()
    del trainer
    teardown_distributed(True)
    return {"seen": seen, "summary": summary}


@pytest.mark.heavy
@pytest.mark.slow
def test_iterable_dataset_is_sharded_over_ranks_and_workers(tmp_path: Path) -> None:
    cfg = dict(
        dataset="taskplug:stream", model="mlp", num_workers=2, batch_size=8, epochs=2,
        grad_accum_steps=2, output_dir=str(tmp_path / "it"), tensorboard=False, log_interval=2,
    )
    ranks = run_ranks(_iterable_ids, 2, tmp_path, cfg)
    for epoch in (1, 2):
        (ids0, steps0), (ids1, steps1) = ranks[0]["seen"][epoch], ranks[1]["seen"][epoch]
        assert steps0 == steps1 > 0  # every rank runs the same optimizer steps
        assert not set(ids0) & set(ids1)
        assert len(set(ids0)) == len(ids0) and len(set(ids1)) == len(ids1)
        # 203 samples, 4 shards of 51/51/51/50: each rank yields 102 and 101, 13 batches
        # of 8 (the last short); the shortest decides, so nothing here is dropped.
        assert sorted(ids0 + ids1) == list(range(203))
    assert ranks[0]["summary"]["steps"] == 2 * steps0


@pytest.mark.slow
def test_a_stream_that_shards_itself_is_read_once_per_epoch(tmp_path: Path) -> None:
    """2 ranks x 2 workers: each reads its own shard at the source, not the whole stream."""
    from collections import Counter

    from conftest import run_torchrun

    record = tmp_path / "reads"
    record.mkdir()
    proc = run_torchrun(2, [
        "train", "--dataset", "streamplug:build", "--dataset_args", f"record={record}",
        "n=48", "--model", "mlp", "--num_classes", "2", "--num_workers", "2", "--batch_size", "4",
        "--epochs", "2",
        "--output_dir", str(tmp_path / "run"),
    ], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = [p.read_text().split() for p in record.iterdir()]
    shards = [f for f in files if f != ["0"]]  # the rest: each rank's look at the first item
    assert len(shards) == 2 * 2 * 2 and all(len(f) == 48 // 4 for f in shards)
    reads = Counter(int(i) for f in shards for i in f)
    assert reads == Counter({i: 2 for i in range(48)}), "a sample read more than once an epoch"


def test_npy_pair_is_memory_mapped(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", (x[:, 0] > 0).astype(np.int64))
    from ddptrain.data.arrays import MemmapDataset
    from ddptrain.data.sources import load_data

    config = TrainingConfig(dataset=str(tmp_path / "x.npy")).validate()
    data = load_data(config)
    assert isinstance(data.train, MemmapDataset) and isinstance(data.train.mx, np.memmap)
    summary = fit(config, epochs=5, batch_size=16, lr=0.1, output_dir=str(tmp_path / "run"),
                  tensorboard=False)
    assert summary["val_accuracy"] > 0.9


# ---------------------------------------------------------------- the Python API
SCRIPT = '''
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset
from ddptrain import TrainingConfig, fit

g = torch.Generator().manual_seed(0)
x = torch.randn(200, 3, generator=g)
y = x.sum(dim=1, keepdim=True)
summary = fit(
    TrainingConfig(epochs=8, batch_size=16, lr=0.05, output_dir=sys.argv[1], tensorboard=False),
    model=nn.Linear(3, 1), datasets=TensorDataset(x, y),
)
# one write per line: both ranks print at once
sys.stdout.write(f"RESULT {summary['world_size']} {summary['task']} {summary['val_r2']:.3f}\\n")
'''


@pytest.mark.slow
def test_python_api_in_a_script_single_process_and_under_torchrun(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = tmp_path / "train_mine.py"
    script.write_text(SCRIPT)
    one = subprocess.run([sys.executable, str(script), "one"], cwd=tmp_path, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-2000:]
    from conftest import BIN

    two = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", str(script), "two"],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=180,
    )
    assert two.returncode == 0, two.stderr[-2000:]
    results = re.findall(r"RESULT (\d) (\w+) ([-\d.]+)", one.stdout + two.stdout)
    assert [r[:2] for r in results] == [("1", "regression"), ("2", "regression"),
                                        ("2", "regression")]
    assert all(float(r[2]) > 0.9 for r in results)


def test_public_names() -> None:
    import ddptrain

    assert {"fit", "TrainingConfig", "Task", "Hook"} <= set(dir(ddptrain))


# ---------------------------------------------------------------- the built-in demos
@pytest.mark.heavy
@pytest.mark.slow
def test_demos_reach_their_quality_bar(tmp_path: Path) -> None:
    from ddptrain.data.text import char_lm_datasets

    reg = run_torchrun(2, ["train", *DIABETES_DEMO, "--output_dir", str(tmp_path / "d")],
                       cwd=tmp_path)
    assert reg.returncode == 0, reg.stderr[-2000:]
    assert json.loads((tmp_path / "d" / "summary.json").read_text())["val_r2"] >= 0.4
    lm = run_torchrun(2, ["train", *CHARS_DEMO, "--output_dir", str(tmp_path / "c")],
                      cwd=tmp_path)
    assert lm.returncode == 0, lm.stderr[-2000:]
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    *_, unigram = char_lm_datasets(64, 0.2, 42)
    assert summary["val_perplexity"] < unigram / 2


DIABETES_DEMO = ["--dataset", "diabetes", "--epochs", "40", "--batch_size", "16",
                 "--lr", "0.005", "--width", "32"]
CHARS_DEMO = ["--dataset", "chars", "--epochs", "20", "--batch_size", "16",
              "--optimizer", "adamw", "--lr", "0.003"]


def test_lm_loss_is_the_mean_over_every_target_token_of_the_step(tmp_path: Path) -> None:
    # One optimizer step over the whole training set in two micro-batches whose token
    # counts differ: the update must be lr x the gradient of (summed token loss / tokens).
    from taskplug import TinyLM, tokens

    train, _ = tokens(None)
    cfg = TrainingConfig(
        dataset="taskplug:tokens", model="taskplug:tiny_lm", epochs=1, batch_size=36,
        grad_accum_steps=2, lr=0.5, momentum=0.0, weight_decay=0.0, use_amp=False,
        output_dir=str(tmp_path / "lm"), tensorboard=False,
    )
    torch.manual_seed(cfg.seed)
    reference = TinyLM(11)
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    x, y = train.tensors
    loss = torch.nn.functional.cross_entropy(
        reference(x).reshape(-1, 11), y.reshape(-1), ignore_index=-100, reduction="sum"
    ) / (y != -100).sum()
    loss.backward()
    fit(cfg)
    got = _weights(tmp_path / "lm")
    for name, p in reference.named_parameters():
        want = start[name] - 0.5 * p.grad
        assert torch.allclose(got[name], want, atol=1e-6), name


def test_the_bundled_sets_are_scikit_learns_without_importing_it() -> None:
    """`breast_cancer`, `digits` and the `chars` corpus are read from the files scikit-learn
    ships, bit for bit its loaders' arrays, and no rank pays for importing scikit-learn."""
    import subprocess
    import sys

    from sklearn.datasets import load_breast_cancer, load_digits

    from ddptrain.data.bundled import breast_cancer, digits

    for (x, y), want in ((breast_cancer(), load_breast_cancer()), (digits(), load_digits())):
        expected = want.images if x.ndim == 3 else want.data
        assert x.dtype == expected.dtype and np.array_equal(x, expected)
        assert y.dtype == want.target.dtype and np.array_equal(y, want.target)
    script = ("import sys; from ddptrain.config import TrainingConfig; "
              "from ddptrain.data.sources import load_data; "
              "[load_data(TrainingConfig(dataset=d, output_dir='/tmp/unused').validate()) "
              "for d in ('breast_cancer', 'digits', 'chars')]; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_the_plan_names_an_lm_vocabulary_and_the_models_own_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`--num_classes` sizes an lm's vocabulary, not classes; dicts without labels train
    the model's own loss, which the plan says in words."""
    rc = main(["train", "--dataset", "taskplug:tokens", "--model", "taskplug:tiny_lm",
               "--num_classes", "300", "--dry_run", "--output_dir", str(tmp_path / "lm")])
    out = capsys.readouterr().out
    assert rc == 0 and "task            lm, vocabulary of 300 tokens (from --num_classes)" in out
    rc = main(["train", "--dataset", "taskplug:dicts", "--dataset_args", "labels=false",
               "--model", "taskplug:dict_net", "--dry_run", "--output_dir", str(tmp_path / "d")])
    out = capsys.readouterr().out
    assert rc == 0 and "task            the model's own loss (the batches hold no 'labels')" in out
