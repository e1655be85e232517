"""Hooks that steer a run (a stop every rank agrees to, the LR multiplier), early
stopping built as such a hook, and the EMA of the weights (updated, exported, resumed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_torchrun
from dist_utils import run_ranks
from procs import assert_bitwise, assert_same_log, sigkill_then_resume, weights
from safetensors.torch import load_file
from steerplug import HalveLR, Record, StopAt, Weights
from torch.optim.lr_scheduler import LambdaLR

from ddptrain import RunView, fit
from ddptrain.checkpoint import Progress, list_checkpoints, load_checkpoint
from ddptrain.checkpoint.dcp import list_step_dirs
from ddptrain.cli import main
from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.train.optim import warmup_cosine
from ddptrain.train.steer import EarlyStopping, Steering

CPU = torch.device("cpu")


def _settings(data: Path, run: Path, **more: Any) -> dict[str, Any]:
    return {
        "dataset": str(data), "width": 16, "batch_size": 16, "lr": 0.1,
        "epochs": 2, "log_interval": 5, "tensorboard": False, "output_dir": str(run), **more,
    }


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- pure logic
def _view() -> tuple[RunView, Steering]:
    """The view a hook gets, of a run ranked by accuracy (max), and its controls."""
    steer = Steering(*_optimizer())
    ctx = DistributedContext(0, 0, 1, CPU)
    return RunView(TrainingConfig(), ctx, steer, Progress(), 10, 20, ("accuracy", "max")), steer


def _optimizer() -> tuple[torch.optim.Optimizer, LambdaLR]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return opt, LambdaLR(opt, lambda step: 1.0 / (step + 1))


def test_early_stopping_counts_epochs_without_an_improvement_beyond_min_delta() -> None:
    (run, steer), hook = _view(), EarlyStopping(patience=2, min_delta=0.01)
    for epoch, acc in enumerate([0.5, 0.6, 0.605, 0.7, 0.7, 0.705], start=1):
        hook.on_row(run, {"split": "train", "epoch": epoch})  # train rows do not count
        hook.on_row(run, {"split": "val", "epoch": epoch, "accuracy": acc})
        assert steer.requested == run.stop_requested == (epoch == 6), epoch
    assert (hook.best, hook.best_epoch) == (0.7, 4) and steer.finish
    assert "did not improve for 2 epochs (best 0.7 at epoch 4)" in str(steer.reason)
    again = EarlyStopping(2)
    again.load_state_dict(hook.state_dict())
    assert again.state_dict() == hook.state_dict()


def test_lr_multiplier_scales_each_scheduled_rate_and_is_kept_in_the_state() -> None:
    opt, sched = _optimizer()
    steer = Steering(opt, sched)
    steer.lr_multiplier = 0.5
    assert opt.param_groups[0]["lr"] == 0.5  # at once, on the current rate
    for step in (1, 2):
        opt.step()
        sched.step()
        steer.apply()
        assert opt.param_groups[0]["lr"] == 0.5 / (step + 1)  # never compounded
    steer.lr_multiplier = 1.0
    assert opt.param_groups[0]["lr"] == 1.0 / 3
    steer.lr_multiplier = 0.25
    fresh_opt, fresh_sched = _optimizer()
    for _ in (1, 2):
        fresh_opt.step()
        fresh_sched.step()
    fresh = Steering(fresh_opt, fresh_sched)
    fresh.load_state_dict(steer.state_dict())
    assert fresh_opt.param_groups[0]["lr"] == 0.25 / 3
    with pytest.raises(ValueError, match="lr_multiplier -1"):
        steer.lr_multiplier = -1


# ---------------------------------------------------------------- one process
def test_hook_stop_at_step_7_checkpoints_there_and_a_resume_goes_on_at_step_8(
    tmp_path: Path, npz400: Path
) -> None:
    run = tmp_path / "run"
    summary = fit(hooks=[StopAt(step=7)], **_settings(npz400, run))
    assert summary["steps"] == 7 and summary["stopped_early"]
    assert summary["stop_reason"] == "asked at step 7"
    assert json.loads((run / "summary.json").read_text())["stop_reason"] == "asked at step 7"
    assert (run / "model.safetensors").is_file()
    newest = load_checkpoint(list_checkpoints(run / "checkpoints")[0], CPU)
    assert newest["step"] == 7 and newest["samples_in_epoch"] == 7 * 16
    record = Record()
    resumed = fit(hooks=[record], **_settings(npz400, run, resume_from="auto"))
    assert record.steps[0] == 8 and resumed["steps"] == 40 and "stopped_early" not in resumed


def test_lr_multiplier_set_by_a_hook_reaches_the_optimizer(tmp_path: Path, npz400: Path) -> None:
    record = Record()
    fit(hooks=[HalveLR(step=3), record], **_settings(npz400, tmp_path / "r", epochs=1))
    # the rate each step leaves for the next: 0.1 x the schedule (x 1/2 from step 3 on)
    schedule = warmup_cosine(0, 20)
    want = [0.1 * schedule(step) * (0.5 if step >= 3 else 1.0) for step in range(1, 21)]
    assert record.lrs == pytest.approx(want, rel=1e-12)


def test_early_stopping_with_lr_0_ends_after_epoch_3_and_a_resume_has_finished(
    tmp_path: Path, npz400: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    args = ["train", "--dataset", str(npz400), "--model", "mlp", "--width", "16",
            "--batch_size", "32", "--epochs", "8", "--lr", "0", "--early_stopping", "2",
            "--no-tensorboard", "--output_dir", str(run)]
    assert main(args) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_early"] and summary["stopped_at_epoch"] == 3
    assert summary["best_epoch"] == 1 and "early stopping" in summary["stop_reason"]
    assert [r["epoch"] for r in _rows(run) if r["split"] == "val"] == [1, 2, 3]
    assert (run / "model.safetensors").is_file()
    newest = load_checkpoint(list_checkpoints(run / "checkpoints")[0], CPU)
    assert newest["epoch"] == 3
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("done: stopped early after epoch 3 of 8 epochs")
    assert "(best accuracy" in out[-1] and "epoch 1)" in out[-1]
    assert main([*args, "--resume_from", "auto"]) == 0
    assert "already finished: it stopped early (early stopping" in capsys.readouterr().out
    assert len(list_checkpoints(run / "checkpoints")) == 3  # nothing trained


def test_exported_ema_equals_an_ema_computed_by_hand_from_every_steps_weights(
    tmp_path: Path, npz400: Path
) -> None:
    decay, run, record = 0.8, tmp_path / "run", Weights()
    fit(hooks=[record], **_settings(npz400, run, ema_decay=decay, export_ema=True, epochs=1))
    assert len(record.params) == 1 + 20  # the start, then 320 / 16 steps
    by_hand = {n: t.double() for n, t in record.params[0].items()}
    for step in record.params[1:]:
        by_hand = {n: decay * by_hand[n] + (1 - decay) * step[n].double() for n in by_hand}
    exported = load_file(str(run / "model_ema.safetensors"))
    raw = load_file(str(run / "model_raw.safetensors"))
    assert exported.keys() == by_hand.keys()
    for name, value in by_hand.items():
        torch.testing.assert_close(exported[name].double(), value, rtol=0, atol=1e-6)
        assert not torch.allclose(exported[name], raw[name])  # not the weights themselves
        assert torch.equal(raw[name], record.params[-1][name])
    assert_bitwise(weights(run), exported)  # --export_ema: the average is the main export
    val = [r for r in _rows(run) if r["split"] == "val"][-1]
    assert {"ema_loss", "ema_accuracy"} <= val.keys() and val["ema_loss"] != val["loss"]


# ---------------------------------------------------------------- two ranks
def _stop_on_rank_0(rank: int, data: str, run: str, resume: bool) -> dict[str, Any]:
    record = Record()
    hooks = [record] if resume else [StopAt(step=7, rank=0), record]
    settings = _settings(Path(data), Path(run), log_interval=7, epochs=1)
    summary = fit(hooks=hooks, resume_from="auto" if resume else None, **settings)
    return {"summary": summary, "steps": record.steps, "rows": record.rows,
            "places": record.places}


@pytest.mark.slow
def test_a_stop_asked_on_one_rank_ends_every_rank_at_that_step(
    tmp_path: Path, npz400: Path
) -> None:
    # 320 train samples on 2 ranks x 16: 10 steps; the first sync is at --log_interval 7
    run = tmp_path / "run"
    ranks = run_ranks(_stop_on_rank_0, 2, tmp_path, str(npz400), str(run), False)
    for rank, got in enumerate(ranks):
        assert got["steps"] == list(range(1, 8)) and got["summary"]["steps"] == 7
        # what each rank's view said: (step, epoch, step in epoch, rank, world, main)
        assert got["places"] == [(k, 1, k, rank, 2, rank == 0) for k in range(1, 8)]
    assert ranks[0]["summary"]["stop_reason"] == "asked at step 7"
    # every rank's hooks see the same global figures (timings are each rank's own)
    figures = [[{k: r[k] for k in ("step", "loss", "accuracy", "samples")} for r in got["rows"]]
               for got in ranks]
    assert figures[0] == figures[1] and figures[0][0]["samples"] == 7 * 32
    newest = load_checkpoint(list_checkpoints(run / "checkpoints")[0], CPU)
    assert newest["step"] == 7
    ranks = run_ranks(_stop_on_rank_0, 2, tmp_path, str(npz400), str(run), True)
    for got in ranks:
        assert got["steps"] == [8, 9, 10] and "stopped_early" not in got["summary"]


def _stop_on_rank_1_at_epoch_1(rank: int, data: str, run: str) -> dict[str, Any]:
    return fit(hooks=[StopAt(epoch=1, rank=1, finish=True)], **_settings(Path(data), Path(run)))


@pytest.mark.heavy
@pytest.mark.slow
def test_early_stopping_on_two_ranks_and_never_a_rank_alone(
    tmp_path: Path, npz400: Path
) -> None:
    args = ["train", "--dataset", str(npz400), "--model", "mlp", "--width", "16",
            "--batch_size", "16", "--epochs", "8", "--lr", "0", "--early_stopping", "2",
            "--no-tensorboard", "--output_dir", str(tmp_path / "es")]
    done = run_torchrun(2, args, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "es" / "summary.json").read_text())
    assert summary["stopped_at_epoch"] == 3 and summary["best_epoch"] == 1
    # a stop only rank 1 asks for at its epoch-1 validation: rank 0 stops with it
    ranks = run_ranks(_stop_on_rank_1_at_epoch_1, 2, tmp_path, str(npz400), str(tmp_path / "r"))
    for summary in ranks:
        assert summary["stopped_at_epoch"] == 1 and summary["steps"] == 10
    assert ranks[0]["stop_reason"] == "a stop requested by a hook on another rank"
    assert ranks[1]["stop_reason"] == "asked at epoch 1"


# ---------------------------------------------------------------- EMA through a SIGKILL
# breast_cancer on 2 ranks x 8: 23 steps an epoch; rank 1 dies at step 8's forward.
EMA_JOB = ["train", "--dataset", "breast_cancer", "--model", "guardplug:killable_mlp",
           "--batch_size", "8", "--epochs", "2", "--lr", "0.05", "--save_every_steps", "5",
           "--log_interval", "5", "--ema_decay", "0.9", "--no-tensorboard"]


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp"])  # the sharded averages; ddp's: whole tensors
def test_sigkill_then_resume_with_ema_is_bitwise_exact(tmp_path: Path, strategy: str) -> None:
    job = [*EMA_JOB, "--strategy", strategy]
    reference = tmp_path / "reference"
    done = run_torchrun(2, [*job, "--output_dir", str(reference)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    resumed = sigkill_then_resume(2, job, run, tmp_path, kill_at=8)
    assert "epoch 0 done, step 5" in resumed.stdout + resumed.stderr
    assert_bitwise(weights(run), weights(reference))
    ema = load_file(str(run / "model_ema.safetensors"))
    assert_bitwise(ema, load_file(str(reference / "model_ema.safetensors")))
    assert_same_log(run, reference)
    val = [r for r in _rows(run) if r["split"] == "val"]
    assert [r["ema_loss"] for r in val] == [
        r["ema_loss"] for r in _rows(reference) if r["split"] == "val"
    ]
    assert all(r["ema_loss"] != r["loss"] for r in val)  # the average is what was validated


def test_a_loss_spike_is_a_train_loss_above_k_times_the_running_median_for_m_rows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from ddptrain.train.steer import LossSpikes

    run, steer = _view()
    hook = LossSpikes(factor=5, rows=2, on_spike="stop")
    losses = [1.0, 0.9, 0.8, 0.8, 0.7, 9.0, 0.7, 6.0, 7.0, 0.6]  # steps 1..10
    for step, loss in enumerate(losses, start=1):
        hook.on_row(run, {"split": "val", "step": step, "loss": 100.0})  # not train
        hook.on_row(run, {"split": "train", "step": step, "loss": loss})
        # step 6 alone is one row above the bar; steps 8 and 9 are two running
        assert steer.requested == (step >= 9), step
    assert "loss spike: train loss 7 at step(s) 8, 9 is above 5x the running median 0.8" in (
        steer.reason or "")
    assert hook.losses == [1.0, 0.9, 0.8, 0.8, 0.7, 0.7, 0.6]  # spikes never raise the bar
    again = LossSpikes(5, 2)
    again.load_state_dict(hook.state_dict())
    assert again.state_dict() == hook.state_dict()
    caplog.clear()
    early = LossSpikes(factor=5, rows=1)  # no median before 5 rows
    for step, loss in enumerate([1.0, 50.0, 1.0], start=1):
        early.on_row(run, {"split": "train", "step": step, "loss": loss})
    assert not early.streak and "loss spike" not in caplog.text


def test_a_poisoned_batch_is_named_and_on_spike_stop_ends_the_run_there(
    tmp_path: Path,
) -> None:
    """Two training samples scaled 100x with flipped labels: the rows of the steps whose
    batch holds one are spikes (the default --spike_factor); `--on_spike stop` ends the
    run with a checkpoint and the spike as its stop_reason. The same data unpoisoned
    names none."""
    args = ["train", "--model", "mlp", "--width", "16", "--batch_size", "16", "--epochs", "2",
            "--lr", "0.05", "--log_interval", "1", "--no-tensorboard"]
    run = tmp_path / "run"
    assert main([*args, "--dataset", "guardplug:poisoned", "--on_spike", "stop",
                 "--output_dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert "loss spike: train loss" in summary["stop_reason"], summary
    # it names the first step whose batch held a poisoned sample (the loss of a clean
    # batch stays below 2.5 here, a poisoned one's above 10)
    train = [r for r in _rows(run) if r["split"] == "train"]
    first = next(r for r in train if r["loss"] > 5)
    assert f"at step(s) {first['step']} is above 5x" in summary["stop_reason"], summary
    assert summary["stopped_early"] and summary["steps"] == train[-1]["step"]
    clean = tmp_path / "clean"
    assert main([*args, "--dataset", "guardplug:flipped", "--on_spike", "stop",
                 "--output_dir", str(clean)]) == 0
    assert "stop_reason" not in json.loads((clean / "summary.json").read_text())


def test_on_spike_rollback_ends_with_the_weights_of_a_run_that_skips_the_spiked_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """`guardplug:poisoned` spikes the loss at steps 17 and 27 (its poisoned samples' other
    batches come before the detector has a median). `--on_spike rollback` goes back to the
    checkpoints of steps 16 and 24 and skips those steps: the run ends bit for bit as one
    started with `--skip_steps 17 27`, its log the same rows. With `--max_rollbacks 1` the
    second spike ends the run (exit 4); a resume from before the first rollback (as after
    a kill before the next checkpoint) skips its step again from `rollbacks.json`."""
    args = ["train", "--model", "mlp", "--width", "16", "--batch_size", "16", "--epochs", "2",
            "--lr", "0.05", "--log_interval", "1", "--no-tensorboard", "--dataset",
            "guardplug:poisoned", "--save_every_steps", "4"]
    skip, back = tmp_path / "skip", tmp_path / "back"
    assert main([*args, "--skip_steps", "17", "27", "--output_dir", str(skip)]) == 0
    assert main([*args, "--on_spike", "rollback", "--output_dir", str(back)]) == 0
    assert_bitwise(weights(back), weights(skip))
    assert_same_log(back, skip)
    done = json.loads((back / "summary.json").read_text())
    assert (done["rollbacks"], done["skipped_steps"], done["steps"]) == (2, 2, 30), done
    recorded = json.loads((back / "rollbacks.json").read_text())["rollbacks"]
    assert [(r["first"], r["last"], r["to_step"]) for r in recorded] == [(17, 17, 16),
                                                                         (27, 27, 24)]
    assert [p.name for p in list_checkpoints(back / "checkpoints")] == [
        p.name for p in list_checkpoints(skip / "checkpoints")]
    capsys.readouterr()

    once = tmp_path / "once"
    assert main([*args, "--on_spike", "rollback", "--max_rollbacks", "1",
                 "--output_dir", str(once)]) == 4
    said = capsys.readouterr()
    err = said.out + said.err
    assert "at step(s) 27 is above 5x" in err and "rolled back 1 time(s) already " \
        "(--max_rollbacks)" in err, err
    ckpts = once / "checkpoints"
    assert list_checkpoints(ckpts)[0].name == "step_000000024.pt"  # none after the spike
    for newer in list_checkpoints(ckpts)[:2]:  # killed before step 20's checkpoint
        newer.unlink()
    (ckpts / "latest.pt").unlink()
    (ckpts / "latest.pt").hardlink_to(ckpts / "step_000000016.pt")
    assert main([*args, "--on_spike", "rollback", "--max_rollbacks", "2", "--resume_from",
                 "auto", "--output_dir", str(once)]) == 0
    said = capsys.readouterr()
    err = said.out + said.err  # the log's handler keeps the stream of its first run
    assert "step(s) 17 " not in err and "at step(s) 27 is above" in err, err
    assert_bitwise(weights(once), weights(skip))
    recorded = json.loads((once / "rollbacks.json").read_text())["rollbacks"]
    assert [(r["first"], r["to_step"]) for r in recorded] == [(17, 16), (27, 24)]


def test_a_rollbacks_json_of_the_wrong_shape_is_one_line_naming_it_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A `rollbacks.json` of this run whose records are not what a rollback writes (a step
    that is not a number, records that are not a list, ...) ends the start with one
    `ddptrain: error:` line naming the file and the fix, exit 2: no traceback (on several
    ranks every rank raises the same, from rank 0's reading; none is left waiting). Once
    it is removed the run resumes."""
    run = tmp_path / "run"
    args = ["train", "--batch_size", "64", "--no-tensorboard", "--output_dir", str(run)]
    assert main([*args, "--epochs", "1"]) == 0
    run_id = json.loads((run / "summary.json").read_text())["run_id"]
    record = run / "rollbacks.json"
    for rollbacks, says in (
        ([{"first": "x"}], "rollback 0's 'first' is 'x', not a step number"),
        ([{"first": 3, "last": None}], "rollback 0's 'last' is None, not a step number"),
        ([{"first": 5, "last": 4}], "rollback 0's first step 5 is after its last 4"),
        ({"first": 3}, '"rollbacks" is a dict, not a list'),
        (["x"], "rollback 0 is a str, not an object"),
    ):
        record.write_text(json.dumps({"run_id": run_id, "rollbacks": rollbacks}))
        capsys.readouterr()
        assert main([*args, "--epochs", "2", "--resume_from", "auto"]) == 2, rollbacks
        said = capsys.readouterr()
        err = [line for line in said.err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("ddptrain: error: "), err
        assert str(record) in err[0] and says in err[0] and "remove it" in err[0], err
    record.write_text("{not json")
    capsys.readouterr()
    assert main([*args, "--epochs", "2", "--resume_from", "auto"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "is not JSON" in err[0] and str(record) in err[0], err
    record.unlink()
    assert main([*args, "--epochs", "2", "--resume_from", "auto"]) == 0


@pytest.mark.heavy
@pytest.mark.slow
def test_a_rollback_on_two_fsdp_ranks_killed_before_its_next_checkpoint_resumes_past_it(
    tmp_path: Path,
) -> None:
    """fsdp on 2 ranks, DCP steps every 3: the spike at step 17 rolls every rank back to
    step 15; rank 1 is SIGKILLed at step 18, before its checkpoint. The resume starts at
    step 15 again and skips step 17 from `rollbacks.json` (not rolled back a second time),
    then rolls back the later spikes: the run ends with the weights and the log of one
    started with `--skip_steps` of the three spiked steps."""
    base = ["train", "--model", "guardplug:killable_mlp", "--width", "16", "--batch_size", "8",
            "--epochs", "3", "--lr", "0.05", "--log_interval", "1", "--no-tensorboard",
            "--dataset", "guardplug:poisoned", "--save_every_steps", "3", "--strategy", "fsdp"]
    run, reference = tmp_path / "back", tmp_path / "skip"

    def killed_after_the_first_rollback() -> None:
        recorded = json.loads((run / "rollbacks.json").read_text())["rollbacks"]
        assert [(r["first"], r["to_step"]) for r in recorded] == [(17, 15)]
        assert list_step_dirs(run / "checkpoints")[0].name == "step_000000015"

    # rank 1's forwards: steps 1-17, then 16 again and 18 (17 is skipped)
    sigkill_then_resume(2, [*base, "--on_spike", "rollback"], run, tmp_path, kill_at=19,
                        between=killed_after_the_first_rollback)
    firsts = [r["first"] for r in json.loads((run / "rollbacks.json").read_text())["rollbacks"]]
    assert firsts[0] == 17 and len(firsts) == len(set(firsts)) == 3, firsts
    done = run_torchrun(2, [*base, "--skip_steps", *map(str, firsts), "--output_dir",
                            str(reference)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_bitwise(weights(run), weights(reference))
    assert_same_log(run, reference)
