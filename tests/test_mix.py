"""`--mix DATASET=WEIGHT ...`: several datasets drawn by weight as one training set.

The draw is fixed by the seed alone, position by position: the proportions are the
weights' within sampling error, each source's samples come in an order of its own, and
the mixture is a map-style dataset like any other, so the epoch plan's guarantees hold:
one rank and two end with the same weights at the same global batch, and a run SIGKILLed
mid-epoch resumes bit for bit on two ranks, and on one at the same global sample. Bad input
is one line, exit 2.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_torchrun, write_npz
from procs import assert_bitwise, sigkill_then_resume, weights

from ddptrain.cli import main
from ddptrain.data.mix import Mixture


def test_a_mixture_draws_each_source_by_its_weight_the_same_for_a_seed() -> None:
    sizes, weights_ = (3000, 5000, 2000), (3.0, 6.0, 1.0)  # weights need not sum to 1
    sources = [torch.arange(n) + 100_000 * s for s, n in enumerate(sizes)]
    mix = Mixture(sources, ["a", "b", "c"], list(weights_), seed=7)  # type: ignore[arg-type]
    n = len(mix)
    assert n == sum(sizes)
    for (name, count), w in zip(mix.counts.items(), weights_, strict=True):
        p = w / sum(weights_)
        assert abs(count - p * n) < 4 * math.sqrt(n * p * (1 - p)), (name, count, p * n)
    drawn = np.array([int(mix[i]) for i in range(n)])
    for s, size in enumerate(sizes):
        mine = drawn[mix.source == s] - 100_000 * s
        order = mix.orders[s]
        # the j-th draw of a source is its j-th sample in its own order, round again
        assert (mine == order[np.arange(len(mine)) % size]).all()
        if len(mine) >= size:  # upsampled: every sample of it in each round
            assert set(mine[:size].tolist()) == set(range(size))
    again = Mixture(sources, ["a", "b", "c"], list(weights_), seed=7)  # type: ignore[arg-type]
    other = Mixture(sources, ["a", "b", "c"], list(weights_), seed=8)  # type: ignore[arg-type]
    assert (again.source == mix.source).all() and not (other.source == mix.source).all()


def _sources(tmp_path: Path) -> list[str]:
    # one task (6 features, 3 classes), three sizes
    return [str(write_npz(tmp_path / f"{name}.npz", n, seed=s))
            for s, (name, n) in enumerate((("web", 300), ("code", 200), ("math", 100)))]


def _job(tmp_path: Path) -> list[str]:
    web, code, math_ = _sources(tmp_path)
    return ["train", "--mix", f"{web}=0.6", f"{code}=0.3", f"{math_}=0.1",
            "--model", "guardplug:killable_mlp", "--width", "16", "--epochs", "2",
            "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--max_grad_norm", "1.0",
            "--log_interval", "2", "--num_workers", "0", "--no-tensorboard", "--no-curves"]


def test_a_mixed_run_logs_and_records_what_each_epoch_draws(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main([*_job(tmp_path), "--batch_size", "16", "--output_dir", str(run)]) == 0
    out = capfd.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if "--mix: an epoch of" in line]
    assert len(said) == 1 and "web.npz" in said[0] and "weight 0.6" in said[0], said
    summary = json.loads((run / "summary.json").read_text())
    drawn = summary["mix"]["per_epoch"]
    train = 240 + 160 + 80  # each source's training part (--val_fraction 0.2)
    assert sum(drawn.values()) == train and summary["samples"] == 2 * train
    assert drawn[str(tmp_path / "web.npz")] > drawn[str(tmp_path / "math.npz")]
    # a resume with another mixture would put other samples at the epoch's positions
    web, code, math_ = _sources(tmp_path)
    assert main([*_job(tmp_path)[:2], f"{web}=0.5", f"{code}=0.4", f"{math_}=0.1",
                 *_job(tmp_path)[5:], "--batch_size", "16", "--epochs", "3",
                 "--output_dir", str(run), "--resume_from", "auto"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was trained with --mix" in err[0], err


@pytest.mark.parametrize("args, says", [
    (["--mix", "digits=x"], "give DATASET=WEIGHT with a positive weight"),
    (["--mix", "digits=0"], "give DATASET=WEIGHT with a positive weight"),
    (["--mix", "digits=1", "digits=2"], "it names 'digits' twice"),
    (["--mix", "nosuch=1"], "--mix 'nosuch' is invalid: choose one of"),
    (["--mix", "digits=1", "--dataset", "chars"], "--mix and --dataset 'chars' both name"),
    (["--mix", "digits=1", "breast_cancer=1"], "disagree on input_shape"),
    (["--mix", "guardplug:epoch_stream=1"], "--mix takes map-style datasets"),
])
def test_bad_mixtures_are_one_line_and_exit_2(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    run = tmp_path / "run"
    assert main(["train", *args, "--epochs", "1", "--output_dir", str(run)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptrain: error:") and says in err[0], err
    assert not (run / "model.safetensors").exists()


@pytest.mark.slow
def test_a_mixture_is_the_same_on_one_rank_and_two_and_resumes_on_either(
    tmp_path: Path
) -> None:
    job = _job(tmp_path)
    one = tmp_path / "one"
    assert main([*job, "--batch_size", "16", "--output_dir", str(one)]) == 0
    two = tmp_path / "two"
    done = run_torchrun(2, [*job, "--batch_size", "8", "--output_dir", str(two)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for name, value in weights(one).items():
        torch.testing.assert_close(weights(two)[name], value, atol=1e-5, rtol=0, msg=name)
    # rank 1 dies at its 23rd forward (of the first epoch's 30 steps of 16), after the
    # save at step 20; the resume ends bit for bit as the run that was never stopped
    resumed = tmp_path / "resumed"
    kept = tmp_path / "other" / "checkpoints"
    kept.mkdir(parents=True)
    sigkill_then_resume(
        2, [*job, "--batch_size", "8", "--save_every_steps", "10"], resumed, tmp_path,
        kill_at=23, between=lambda: shutil.copy(
            resumed / "checkpoints" / "step_000000020.pt", kept / "step_000000020.pt"),
    )
    assert_bitwise(weights(resumed), weights(two))
    # the same checkpoint resumed by one rank goes on at the same global sample
    assert main([*job, "--batch_size", "16", "--save_every_steps", "10",
                 "--output_dir", str(kept.parent),
                 "--resume_from", str(kept / "step_000000020.pt")]) == 0
    for name, value in weights(two).items():
        torch.testing.assert_close(weights(kept.parent)[name], value, atol=1e-5, rtol=0)


def test_code_a_stored_mixture_names_is_not_run_after_training(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`--mix` entries can name code (`package.module:fn`): `ddptrain evaluate` of the run
    imports none of it unless the command names the mixture again."""
    run = tmp_path / "run"
    job = ["--mix", "guardplug:augmented=1", "guardplug:flipped=1"]
    assert main(["train", *job, "--model", "guardplug:dropout_net", "--epochs", "1",
                 "--no-tensorboard", "--no-curves", "--output_dir", str(run)]) == 0
    capfd.readouterr()
    assert main(["evaluate", str(run)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("names code to import and run (--mix guardplug:augmented=1 "
                              "guardplug:flipped=1") in err[0], err
    assert main(["evaluate", str(run), *job, "--model", "guardplug:dropout_net"]) == 0


def test_a_config_file_gives_a_mixture_as_a_mapping(tmp_path: Path) -> None:
    from ddptrain.config_cli import parse_config

    config_file = tmp_path / "run.yaml"
    config_file.write_text("data:\n  mix:\n    digits: 0.7\n    mymod:code: 0.3\n"
                           "  val: {again: digits}\n")
    config = parse_config(["--config", str(config_file)])
    assert config.mix == ["digits=0.7", "mymod:code=0.3"] and config.val == ["again=digits"]


def test_weights_whose_sum_overflows_are_one_line_and_exit_2(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Each weight finite and positive, their sum not (1e308 twice): refused with the
    flags, before any data is read, not by numpy's draw."""
    a, b = write_npz(tmp_path / "a.npz", 40), write_npz(tmp_path / "b.npz", 40, seed=1)
    run = tmp_path / "run"
    assert main(["train", "--mix", f"{a}=1e308", f"{b}=1e308", "--epochs", "1",
                 "--output_dir", str(run)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptrain: error: --mix ") and (
        "the weights sum past the largest float" in err[0]), err
    assert not run.exists()
    from ddptrain.errors import ConfigError

    sources = [torch.arange(4), torch.arange(4)]
    with pytest.raises(ConfigError, match="give finite positive weights whose sum is finite"):
        Mixture(sources, ["a", "b"], [1e308, 1e308], seed=0)  # type: ignore[arg-type]
