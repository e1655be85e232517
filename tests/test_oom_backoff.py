"""`--oom_backoff`: an out-of-memory in the first steps halves the micro-batch and doubles
the accumulation; the run then equals one started at the smaller micro-batch.

The out-of-memory is the model's own: `--model test_oom_backoff:capped_mlp` raises
`torch.OutOfMemoryError` in a training forward (or backward) of more than
$OOM_ABOVE samples, on the ranks $OOM_RANKS names (all unless set).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import run_torchrun, write_npz
from safetensors.torch import load_file
from torch import nn

from ddptrain.cli import main
from ddptrain.config import TrainingConfig
from ddptrain.errors import ConfigError
from ddptrain.train.backoff import ARMED_STEPS, Backoff, refuse_unsupported, smaller


def capped_mlp(config: Any, input_shape: tuple[int, ...], outputs: int) -> nn.Module:
    """`--model mlp` (with dropout) that runs out of memory on a training batch above
    $OOM_ABOVE samples (in its forward, or with $OOM_WHERE=backward in its backward), on
    the ranks of $OOM_RANKS (comma-separated; every rank unless set)."""
    from ddptrain.models.nets import MLP

    model = MLP(int(np.prod(input_shape)), outputs, config.width)
    # dropout: a window run again must draw what the run of the smaller batch draws
    model.net.insert(3, nn.Dropout(0.2))
    cap = int(os.environ.get("OOM_ABOVE", "2"))
    ranks = os.environ.get("OOM_RANKS")
    if ranks is not None and os.environ.get("RANK", "0") not in ranks.split(","):
        return model

    def too_big(rows: int) -> None:
        if rows > cap:
            raise torch.OutOfMemoryError(f"CUDA out of memory (a batch of {rows} > {cap})")

    if os.environ.get("OOM_WHERE") == "backward":
        def backward(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
            too_big(grad_out[0].shape[0])

        model.net[-1].register_full_backward_hook(backward)
    else:
        def forward(module: nn.Module, args: Any) -> None:
            if module.training:
                too_big(args[0].shape[0])

        model.register_forward_pre_hook(forward)
    return model


def _args(npz: Path, out: Path, *more: str) -> list[str]:
    return ["train", "--dataset", str(npz), "--model", "test_oom_backoff:capped_mlp",
            "--width", "16", "--epochs", "2", "--lr", "0.05", "--momentum", "0.9",
            "--warmup_epochs", "0.5", "--log_interval", "2", "--seed", "3", "--no-tensorboard",
            "--output_dir", str(out), *more]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())


def _config(run: Path) -> dict[str, Any]:
    return yaml.safe_load((run / "config.yaml").read_text())


def _train_rows(run: Path) -> list[tuple[int, int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["epoch"], r["step"], r["loss"]) for r in rows if r["split"] == "train"]


def _summary(run: Path) -> dict[str, Any]:
    return json.loads((run / "summary.json").read_text())


# ---------------------------------------------------------------- pure logic
def test_smaller_divides_by_the_smallest_factor() -> None:
    assert [smaller(b) for b in (8, 4, 2, 6, 3, 9, 7)] == [4, 2, 1, 3, 1, 3, 1]
    assert ARMED_STEPS == 3


@pytest.mark.parametrize(("fields", "strategy", "iterable", "said"), [
    ({"pp": 2}, "ddp", False, "--pp 2: the forward and backward hold collectives"),
    ({"dp_replicate": 2}, "fsdp", False, "--dp_replicate 2: the forward and backward hold "),
    ({"sync_bn": True}, "ddp", False, "--sync_bn"),
    ({}, "ddp", True, "an iterable dataset"),
    ({"drop_last": True}, "ddp", False, "--drop_last"),
])
def test_layouts_it_cannot_keep_exact_are_refused(
    fields: dict[str, Any], strategy: str, iterable: bool, said: str
) -> None:
    config = TrainingConfig(oom_backoff=True, **fields)
    with pytest.raises(ConfigError, match=r"^--oom_backoff is unsupported with ") as caught:
        refuse_unsupported(config, strategy, iterable)
    assert said in str(caught.value)
    refuse_unsupported(TrainingConfig(**fields), strategy, iterable)  # not asked for: fine
    for strategy in ("single process", "ddp", "zero", "fsdp"):
        refuse_unsupported(TrainingConfig(oom_backoff=True), strategy, False)
    with pytest.raises(ConfigError, match="--moe_aux_scope global: "):
        refuse_unsupported(TrainingConfig(oom_backoff=True), "ddp", False, routed_globally=True)


def test_the_refusal_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    npz = write_npz(tmp_path / "d.npz", 48)
    code = main(_args(npz, tmp_path / "run", "--oom_backoff", "--drop_last"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("ddptrain: error: --oom_backoff is unsupported with --drop_last")


# ---------------------------------------------------------------- one process
def test_without_oom_backoff_it_is_the_usual_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OOM_ABOVE", "2")
    npz = write_npz(tmp_path / "d.npz", 48)
    run = tmp_path / "run"
    code = main(_args(npz, run, "--batch_size", "8"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("ddptrain: error: out of memory on rank 0 (cpu) after step 0: ")


def test_one_sample_that_does_not_fit_is_the_usual_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OOM_ABOVE", "0")
    npz = write_npz(tmp_path / "d.npz", 48)
    code = main(_args(npz, tmp_path / "run", "--batch_size", "4", "--oom_backoff"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith("ddptrain: error: out of memory on rank 0 (cpu) after step 0: ")
    assert "lower --batch_size (now 1;" in err[-1]


def test_one_process_backs_off_to_the_run_of_the_smaller_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two backoffs (8 -> 4 -> 2) in the first step; the run ends with the weights, the
    samples, the steps and the config of a run of 2 x 4 from the start, bit for bit. Only
    the first 3 steps' micro-steps go through the backoff's (the 2 that ran out of
    memory, then 3 steps x 4): the rest are the plain ones."""
    monkeypatch.setenv("OOM_ABOVE", "2")
    calls = []
    armed = Backoff.micro_step

    def counted(self: Backoff, *args: Any) -> Any:
        calls.append(self.steps_left)
        return armed(self, *args)

    monkeypatch.setattr(Backoff, "micro_step", counted)
    npz = write_npz(tmp_path / "d.npz", 60)  # 48 train: 3 steps of 16 an epoch
    backed, ref = tmp_path / "backed", tmp_path / "ref"
    assert main(_args(npz, backed, "--batch_size", "8", "--oom_backoff")) == 0
    err = "".join(capsys.readouterr())
    assert "out of memory at micro-batch 8: now 4 x accumulation 2, the same global batch " \
           "of 8" in err, err
    assert "out of memory at micro-batch 4: now 2 x accumulation 4, the same global batch " \
           "of 8" in err, err
    assert calls == [3, 3] + [3] * 4 + [2] * 4 + [1] * 4
    assert main(_args(npz, ref, "--batch_size", "2", "--grad_accum_steps", "4")) == 0
    _assert_equal(_weights(backed), _weights(ref))
    assert _train_rows(backed) == _train_rows(ref)
    a, b = _summary(backed), _summary(ref)
    assert a["samples"] == b["samples"] == 2 * 48 and a["steps"] == b["steps"] == 2 * 6
    config = _config(backed)
    assert (config["batch_size"], config["grad_accum_steps"]) == (2, 4)


# ---------------------------------------------------------------- 2 gloo ranks (ddp)
@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The data, and a 2-rank run of --batch_size 2 --grad_accum_steps 4 (no backoff)."""
    tmp = tmp_path_factory.mktemp("oom_ref")
    npz = write_npz(tmp / "d.npz", 120)  # 96 train: 6 steps of 16 an epoch
    ref = tmp / "ref"
    proc = run_torchrun(2, _args(npz, ref, "--batch_size", "2", "--grad_accum_steps", "4",
                                 "--save_every_steps", "4"), tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return npz, ref


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_two_ranks_back_off_to_the_run_of_the_smaller_batch(
    tmp_path: Path, two_rank_reference: tuple[Path, Path], where: str
) -> None:
    """Every rank runs out of memory above 2 samples; the ranks agree, back off twice in
    step 1, and end with the weights, samples and config of the 2 x 4 run."""
    npz, ref = two_rank_reference
    run = tmp_path / "backed"
    proc = run_torchrun(2, _args(npz, run, "--batch_size", "8", "--oom_backoff"), tmp_path,
                        env={"OOM_ABOVE": "2", "OOM_WHERE": where})
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert said.count("out of memory at micro-batch") == 2, said[-3000:]  # rank 0's alone
    assert ("out of memory at micro-batch 8: now 4 x accumulation 2, the same global batch "
            "of 16") in said
    assert ("out of memory at micro-batch 4: now 2 x accumulation 4, the same global batch "
            "of 16") in said
    _assert_equal(_weights(run), _weights(ref))
    assert _train_rows(run) == _train_rows(ref)  # the dropped windows' losses left out
    a, b = _summary(run), _summary(ref)
    assert a["samples"] == b["samples"] == 2 * 96 and a["steps"] == b["steps"] == 2 * 6
    config = _config(run)
    assert (config["batch_size"], config["grad_accum_steps"]) == (2, 4)


ONE_RANK = {"OOM_ABOVE": "2", "OOM_RANKS": "1", "OOM_WHERE": "backward"}


@pytest.fixture(scope="module")
def one_rank_backed(
    tmp_path_factory: pytest.TempPathFactory, two_rank_reference: tuple[Path, Path]
) -> tuple[Path, str]:
    """A 2-rank run of --batch_size 8 --oom_backoff whose rank 1 alone runs out of memory
    above 2 samples, in its backward; a checkpoint every 4 steps. (its dir, its output)"""
    npz, _ = two_rank_reference
    tmp = tmp_path_factory.mktemp("oom_one_rank")
    run = tmp / "backed"
    args = _args(npz, run, "--batch_size", "8", "--oom_backoff", "--save_every_steps", "4")
    proc = run_torchrun(2, args, tmp, env=ONE_RANK, timeout=240)
    return run, f"{proc.returncode}\n{proc.stdout}{proc.stderr}"


@pytest.mark.slow
def test_an_out_of_memory_on_one_rank_backs_off_on_both(
    one_rank_backed: tuple[Path, str], two_rank_reference: tuple[Path, Path]
) -> None:
    """Rank 1 alone runs out of memory, inside its backward (where DDP's reducer would
    have rank 0 waiting in the gradient all-reduce): no hang, both ranks back off, rank 0's
    partial window (gradients, losses) is dropped, and the run is the 2 x 4 run."""
    run, said = one_rank_backed
    _, ref = two_rank_reference
    assert said.startswith("0\n"), said[-3000:]
    assert said.count("out of memory at micro-batch") == 2, said[-3000:]
    _assert_equal(_weights(run), _weights(ref))
    assert _train_rows(run) == _train_rows(ref)


@pytest.mark.slow
def test_a_resume_after_a_backoff_continues_at_the_next_sample(
    tmp_path: Path, one_rank_backed: tuple[Path, str], two_rank_reference: tuple[Path, Path]
) -> None:
    """A checkpoint taken after the backoff records 2 x 4; a resume from it with the run's
    config.yaml continues at the next sample, bit for bit the 2 x 4 run; one with the
    first command (8, --oom_backoff) continues there too and backs off again."""
    npz, ref = two_rank_reference
    run, said = one_rank_backed
    assert said.startswith("0\n"), said[-3000:]
    # A resume from step 4 (mid-epoch 1: 64 of its 96 samples) with the run's config.yaml
    # (2 x 4, recorded by the backoff): the same layout, bit for bit the 2 x 4 run.
    step4 = run / "checkpoints" / "step_000000004.pt"
    payload = torch.load(step4, map_location="cpu", weights_only=False)
    assert (payload["config"]["batch_size"], payload["config"]["grad_accum_steps"]) == (2, 4)
    assert payload["samples_in_epoch"] == 64 and payload["step"] == 4
    resumed = tmp_path / "resumed"
    proc = run_torchrun(2, ["train", "--config", str(run / "config.yaml"), "--output_dir",
                            str(resumed), "--resume_from", str(step4)], tmp_path, env=ONE_RANK)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "out of memory at micro-batch" not in said
    _assert_equal(_weights(resumed), _weights(ref))
    assert _train_rows(resumed) == [r for r in _train_rows(ref) if r[1] > 4]

    # With the first command (8, --oom_backoff) it continues at the next sample, backs off
    # again, and ends at the same step count and samples (another layout than the
    # checkpoint's: the random state is drawn afresh, as any such resume draws it).
    again = tmp_path / "again"
    proc = run_torchrun(2, [*_args(npz, again, "--batch_size", "8", "--oom_backoff"),
                            "--resume_from", str(step4)], tmp_path, env=ONE_RANK)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "continues at global sample 64" in said, said[-3000:]
    assert said.count("out of memory at micro-batch") == 2, said[-3000:]
    assert _summary(again)["steps"] == _summary(ref)["steps"]
    assert [r[:2] for r in _train_rows(again)] == [r[:2] for r in _train_rows(ref) if r[1] > 4]


# ---------------------------------------------------------------- 2 gloo ranks (fsdp)
@pytest.mark.slow
def test_fsdp_ranks_agree_before_each_gather_and_reduce_scatter(tmp_path: Path) -> None:
    """Under fsdp the forward and backward are full of collectives. Rank 1 alone runs out
    of memory in its backward (rank 0 is then at a reduce-scatter or a gather of the
    backward), then rank 0 alone in its forward (rank 1 at the next unit's gather): both
    times the ranks agree, FSDP's state is reset and the run is the fsdp run of 2 x 4."""
    npz = write_npz(tmp_path / "d.npz", 120)
    ref = tmp_path / "ref"
    fsdp = ["--strategy", "fsdp"]
    proc = run_torchrun(2, _args(npz, ref, *fsdp, "--batch_size", "2", "--grad_accum_steps",
                                 "4"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for ranks, where in (("1", "backward"), ("0", "forward")):
        run = tmp_path / f"rank{ranks}_{where}"
        env = {"OOM_ABOVE": "2", "OOM_RANKS": ranks, "OOM_WHERE": where}
        proc = run_torchrun(2, _args(npz, run, *fsdp, "--batch_size", "8", "--oom_backoff"),
                            tmp_path, env=env, timeout=240)
        said = proc.stdout + proc.stderr
        assert proc.returncode == 0, said[-3000:]
        assert said.count("out of memory at micro-batch") == 2, said[-3000:]
        _assert_equal(_weights(run), _weights(ref))
        assert _train_rows(run) == _train_rows(ref)
