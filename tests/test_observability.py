"""What a run lets you see: metric rows, TensorBoard events, profiler traces, plots, FLOPs,
and the benchmark's all-reduce counter."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from ddptrain.cli import main
from ddptrain.context import DistributedContext
from ddptrain.observe.flops import (
    count_flops,
    gpu_fields,
    meta_shadow,
    mfu,
    peak_fields,
    peak_flops,
)
from ddptrain.observe.writer import MetricsWriter

REPO = Path(__file__).resolve().parent.parent
TRAIN_FIELDS = (
    "epoch", "step", "loss", "accuracy", "lr", "samples_per_sec", "step_time_s",
    "data_wait_frac", "peak_rss_mb",
)


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny single-process run with profiling on (breast_cancer, 2 epochs of 8 steps)."""
    out = tmp_path_factory.mktemp("run")
    code = main([
        "train", "--dataset", "breast_cancer", "--epochs", "2", "--batch_size", "57",
        "--log_interval", "2", "--enable_profiling", "--output_dir", str(out),
    ])
    assert code == 0
    return out


def test_train_rows_have_the_documented_fields_with_plausible_values(run_dir: Path) -> None:
    train = [r for r in _rows(run_dir) if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(2, 17, 2))
    for row in train:
        assert set(TRAIN_FIELDS) <= set(row)
        assert 0.0 <= row["data_wait_frac"] <= 1.0
        assert row["samples_per_sec"] > 0 and row["step_time_s"] > 0
        assert row["peak_rss_mb"] > 0 and 0.0 <= row["accuracy"] <= 1.0
        assert "mfu" not in row and "peak_cuda_mb" not in row  # CPU: no GPU figures
    val = [r for r in _rows(run_dir) if r["split"] == "val"]
    assert [r["epoch"] for r in val] == [1, 2]


_IMPORTED_AT = time.perf_counter()


def test_the_start_up_phases_are_in_the_summary_and_count_from_the_process_start(
    run_dir: Path,
) -> None:
    """summary.json holds each start-up phase, in order, up to the first step; the first
    counts from the process's start (the interpreter and the imports), which was before
    this module was imported."""
    from ddptrain.observe.startup import process_age

    phases = json.loads((run_dir / "summary.json").read_text())["startup_s"]
    assert list(phases) == ["imports", "data", "group", "model", "first step"], phases
    assert all(s >= 0 for s in phases.values()) and phases["first step"] > 0, phases
    assert process_age() >= time.perf_counter() - _IMPORTED_AT > 0


def test_tensorboard_events_hold_every_logged_scalar(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for row in _rows(run_dir):
        for name, value in row.items():
            if name in ("split", "step", "run_id"):  # labels, not curves
                continue
            tag = f"{row['split']}/{name}"
            assert tag in tags
            logged = {e.step: e.value for e in events.Scalars(tag)}
            assert logged[row["step"]] == pytest.approx(value, rel=1e-6)


def test_profiler_writes_a_trace_naming_the_model_ops(run_dir: Path) -> None:
    traces = list((run_dir / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert "aten::addmm" in names  # the MLP's linear layers
    assert any(str(n).startswith("ProfilerStep#") for n in names)


def test_every_run_leaves_curves_png(run_dir: Path) -> None:
    # drawn by a child process during the teardown, and there when the job has ended
    curves = run_dir / "curves.png"
    assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(run_dir.glob(".curves.png.*"))  # no half-drawn temporary left


@pytest.mark.curves
def test_no_curves_draws_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--no-curves", "--dataset", "breast_cancer", "--epochs", "1",
                 "--no-tensorboard", "--output_dir", str(out)]) == 0
    assert (out / "metrics.jsonl").is_file() and not list(out.glob("*curves*"))


def test_a_drawing_that_fails_is_one_warning_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ddptrain.observe.plot import draw_in_background, wait_for_drawings

    out = tmp_path / "curves.png"
    draw_in_background(tmp_path / "no-such-run", out)
    with caplog.at_level("WARNING", logger="ddptrain"):
        wait_for_drawings()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "was not drawn" in lines[0] and "does not exist" in lines[0]
    assert not out.exists()


def test_plot_overlays_two_runs(run_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    rows = [
        {"split": "train", "epoch": 1, "step": s, "loss": 1 / s, "accuracy": 0.5, "lr": 0.1,
         "samples_per_sec": 100.0 * s}
        for s in range(1, 6)
    ]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "curves.png"
    assert main(["plot", str(run_dir), str(other), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # an existing file is replaced only when asked
    assert main(["plot", str(run_dir), "-o", str(out)]) == 2
    assert main(["plot", str(run_dir), "-o", str(out), "--overwrite"]) == 0


def test_runs_of_different_tasks_say_whose_metric_each_curve_is(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    from ddptrain.observe.plot import draw_runs

    runs = []
    for name, metric, value in (("cls", "accuracy", 0.9), ("lm", "perplexity", 12.0)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"split": split, "epoch": 1, "step": 5, "loss": 1.0, metric: value, "lr": 0.1}
                for split in ("train", "val")]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(run)
    fig = draw_runs(runs)
    panel = fig.axes[1]
    assert panel.get_title() == "accuracy / perplexity"
    labels = [line.get_label() for line in panel.get_lines()]
    assert labels == ["cls accuracy train", "cls accuracy val", "lm perplexity train",
                      "lm perplexity val"]
    assert fig.axes[0].get_lines()[0].get_label() == "cls train"  # the loss: one name
    plt.close(fig)
    fig = draw_runs(runs[:1])  # one task: its metric, the run's name alone
    assert fig.axes[1].get_title() == "accuracy"
    assert fig.axes[1].get_lines()[0].get_label() == "cls train"
    plt.close(fig)


@pytest.mark.curves
def test_the_done_line_does_not_wait_for_the_curves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The done line is out before the job waits for curves.png's drawing (seconds on a
    busy machine), and the file is there when the job ends."""
    import ddptrain.observe.plot as plot

    printed: list[str] = []
    wait = plot.wait_for_drawings

    def waiting(*args: Any, **kwargs: Any) -> None:
        printed.append(capsys.readouterr().out)
        wait(*args, **kwargs)

    monkeypatch.setattr(plot, "wait_for_drawings", waiting)
    run = tmp_path / "run"
    assert main(["train", "--dataset", "digits", "--model", "mlp", "--width", "8",
                 "--epochs", "1", "--no-tensorboard", "--output_dir", str(run)]) == 0
    assert printed and printed[-1].splitlines()[-1].startswith("done: 1 epochs")
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_draws_every_validation_set(tmp_path: Path) -> None:
    """A run with `--val hard=... noisy=...`: each set's loss and metric are lines of
    their own, named after the set, beside the run's own validation line."""
    import matplotlib.pyplot as plt

    from ddptrain.observe.plot import draw_runs

    run = tmp_path / "r"
    run.mkdir()
    rows = [{"split": "train", "epoch": e, "step": 5 * e, "loss": 1.0 / e, "accuracy": 0.5,
             "lr": 0.1} for e in (1, 2)]
    rows += [{"split": "val", "epoch": e, "step": 5 * e, "loss": 1.0, "accuracy": 0.6,
              "hard/loss": 2.0, "hard/accuracy": 0.3, "hard/samples": 10,
              "noisy/loss": 3.0, "noisy/accuracy": 0.1} for e in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = draw_runs([run])
    for panel, field in ((fig.axes[0], "loss"), (fig.axes[1], "accuracy")):
        lines = {line.get_label(): list(line.get_ydata()) for line in panel.get_lines()}
        assert list(lines) == ["r train", "r val", "r val hard", "r val noisy"]
        assert lines["r val hard"] == [rows[2][f"hard/{field}"]] * 2
        assert lines["r val noisy"] == [rows[2][f"noisy/{field}"]] * 2
    plt.close(fig)


def test_plot_of_a_missing_run_dir_is_one_line_and_exit_2(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    assert main(["plot", str(run_dir), str(missing), "-o", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptrain: error:") and str(missing) in err[0]
    assert not (tmp_path / "c.png").exists()


def test_tensorboard_resume_hides_events_after_the_checkpoint(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tensorboard"
    writer = MetricsWriter(tmp_path / "metrics.jsonl", enabled=True, tensorboard_dir=tb)
    writer.start(keep_step=None, keep_epoch=None)
    for step in (1, 2, 3, 4):
        writer.write({"split": "train", "epoch": 1, "step": step, "loss": float(step)})
    writer.close()
    # Event files sort by name, whose first field is the second they were opened in (then
    # a per-process counter, compared as text: 9 > 10); a resume is a later second.
    time.sleep(1.05)
    writer.start(keep_step=2, keep_epoch=0)  # resumed from a checkpoint at step 2
    writer.write({"split": "train", "epoch": 1, "step": 3, "loss": 30.0})
    writer.close()
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 1.0), (2, 2.0), (3, 30.0)
    ]
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]


def test_no_tensorboard_dir_writes_only_jsonl(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl", enabled=True, tensorboard_dir=None)
    writer.start(keep_step=None, keep_epoch=None)
    writer.write({"split": "train", "step": 1, "loss": 0.5})
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


# ---------------------------------------------------------------------- FLOPs and MFU
def test_count_flops_counts_forward_and_backward_without_touching_the_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = 5
    flops = count_flops(model, torch.randn(batch, 8))
    forward = 2 * batch * (8 * 16 + 16 * 4)
    # backward: weight gradients of both layers, input gradient of the second only
    backward = 2 * batch * (8 * 16 + 16 * 4) + 2 * batch * 16 * 4
    assert flops == forward + backward
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _NoCopy(nn.Linear):
    """Refuses to be copied, as an FSDP module does."""

    def __deepcopy__(self, memo: dict) -> None:
        raise AssertionError("FSDP does not support deepcopy")


def test_flops_are_counted_on_a_meta_shadow_taken_before_wrapping(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ddptrain.models import GPT, GPTConfig

    gpt = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32))
    shadow = meta_shadow(gpt)
    assert shadow is not None
    assert all(p.device.type == "meta" for p in shadow.parameters())
    assert all(p.device.type == "cpu" for p in gpt.parameters())
    tied = [n for n, _ in shadow.named_parameters(remove_duplicate=True)]
    assert len(tied) == len(list(gpt.named_parameters(remove_duplicate=True)))
    tokens = torch.randint(0, 50, (3, 16))
    assert count_flops(shadow, tokens) == count_flops(gpt, tokens) > 0
    # A CUDA stand-in: the device reads cuda, the CUDA queries are faked, the wrapped
    # model is never touched (it may refuse to be copied, as FSDP does).
    # A fake allocator: the peak since the last reset, now 3 MB (then 1 MB after a reset).
    peak = [3 * 2**20]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak[0])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: peak.__setitem__(0, 2**20))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    cuda = DistributedContext(0, 0, 2, torch.device("cuda", 0), "nccl")
    row = gpu_fields(meta_shadow(nn.Linear(8, 4)), torch.zeros(5, 8), 1e6, cuda, torch.bfloat16)
    per_sample = 4 * 8 * 4  # forward and weight gradient: no input gradient for a first layer
    assert peak_fields(cuda) == {"peak_cuda_mb": 3}
    assert row["tflops_per_sec"] == pytest.approx(per_sample * 1e6 / 1e12)
    assert row["mfu"] == pytest.approx(per_sample * 1e6 / (2 * 989e12))
    assert meta_shadow(_NoCopy(8, 4)) is None  # no MFU rather than a crash
    # Each row's peak is its own interval's: the first row's 3 MB is not carried on.
    assert peak_fields(cuda) == {"peak_cuda_mb": 1}
    assert gpu_fields(None, torch.zeros(5, 8), 1e6, cuda, None) == {}


def test_each_train_row_reads_the_peak_of_its_own_steps_though_rows_are_written_in_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU run whose peak readings a CUDA stand-in answers: each step's forward
    allocates step-numbered megabytes above the 1 MB held between steps. Rows are all-reduced
    and written several at a time; each must carry its own interval's peak."""
    import dataclasses

    import ddptrain.train.trainer as loop
    from ddptrain.api import fit
    from ddptrain.config import TrainingConfig
    from ddptrain.observe.hooks import Hook

    peak = [2**20]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak[0])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: peak.__setitem__(0, 2**20))
    monkeypatch.setattr(loop, "peak_fields", lambda ctx: peak_fields(
        dataclasses.replace(ctx, device=torch.device("cuda", 0))))

    class Steps(Hook):
        def on_step_end(self, run: Any) -> None:
            peak[0] = max(peak[0], (10 + run.step) * 2**20)

    run = tmp_path / "run"
    fit(TrainingConfig(dataset="digits", model="mlp", width=16, epochs=1, log_interval=2,
                       save_every=0, tensorboard=False, output_dir=str(run)), hooks=[Steps()])
    train = [r for r in _rows(run) if r["split"] == "train"]
    assert len(train) > 3
    assert [r["peak_cuda_mb"] for r in train] == [10 + r["step"] for r in train]


def test_mfu_and_peak_table() -> None:
    assert mfu(1e9, 1000.0, 2, 1e12) == pytest.approx(0.5)
    assert peak_flops("NVIDIA H100 PCIe", half_precision=True) == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3", half_precision=True) == 989e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", half_precision=False) == 19.5e12
    assert peak_flops("Some Future GPU", half_precision=True) is None
    cpu = DistributedContext(0, 0, 1, torch.device("cpu"))
    assert gpu_fields(nn.Linear(2, 2), torch.zeros(1, 2), 10.0, cpu, None) == {}


# ---------------------------------------------------------------------- bench counter
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _count_rounds(rank: int, port: int, out: str) -> None:
    """Worker: rounds per optimizer step, ddptrain vs the seed-style loop, grad_accum 4."""
    sys.path.insert(0, str(REPO))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from bench.allreduce import AllReduceCounter
    from bench.loops import hand_written_epoch
    from ddptrain.config import TrainingConfig
    from ddptrain.data.sources import load_data
    from ddptrain.launch.cluster import ClusterEnv
    from ddptrain.launch.process_group import setup_distributed, teardown_distributed
    from ddptrain.models.factory import create_model
    from ddptrain.observe.hooks import Hook
    from ddptrain.train.plan import resolve
    from ddptrain.train.trainer import Trainer

    # 455 training samples: 228 per rank, 12 batches of 19, 3 windows of 4
    config = TrainingConfig(
        dataset="breast_cancer", batch_size=19, grad_accum_steps=4, epochs=1,
        log_interval=1000, output_dir=str(Path(out).parent / "run"), save_every=0,
    ).validate()
    data = load_data(config)
    ctx = setup_distributed(config, ClusterEnv(rank, rank, 2, "torchrun"))

    class Steps(Hook):
        count = 0

        def on_step_end(self, run: object) -> None:
            Steps.count += 1

    trainer = Trainer(resolve(config, data, ctx.world_size, ctx.device), ctx, hooks=[Steps()])
    counter = AllReduceCounter().attach(trainer.model)  # type: ignore[arg-type]
    trainer.train_epoch(1)
    ours = counter.rounds / Steps.count
    del trainer

    module = create_model(config, data, 2, ctx.device)
    model = torch.nn.parallel.DistributedDataParallel(module)
    seed_counter = AllReduceCounter().attach(model)
    loader = torch.utils.data.DataLoader(data.train, batch_size=19, collate_fn=lambda b: b,
                                         sampler=torch.utils.data.DistributedSampler(data.train))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    seed_steps: list[int] = []
    hand_written_epoch(
        model, loader, optimizer, scheduler, nn.CrossEntropyLoss(), 4, no_sync=False,
        keep_last_window=False, on_step=lambda: seed_steps.append(1),
    )
    seed = seed_counter.rounds / len(seed_steps)
    del model, optimizer
    teardown_distributed(True)
    if rank == 0:
        Path(out).write_text(json.dumps({"ddptrain": ours, "seed": seed, "steps": Steps.count}))


@pytest.mark.slow
def test_allreduce_counter_sees_one_round_per_step_for_ddptrain_four_for_seed_loop(
    tmp_path: Path,
) -> None:
    out = tmp_path / "rounds.json"
    mp.spawn(_count_rounds, args=(_free_port(), str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    assert result["steps"] == 3
    assert result["ddptrain"] == 1.0
    assert result["seed"] == 4.0


# ---------------------------------------------------------------- stragglers
def test_a_rank_waiting_for_data_is_named_after_three_syncs_and_noise_never() -> None:
    from ddptrain.train.metrics import Stragglers

    found = Stragglers(3.0)
    for _ in range(10):  # even waits; a tenfold one under a tenth of the step is noise
        assert found.update([0.001, 0.0012, 0.0011], 0.05) == []
        assert found.update([0.00001, 0.0001, 0.00002], 0.05) == []
    assert found.now() == [] and found.named == []
    slow = [0.001, 0.04, 0.0012]
    assert found.update(slow, 0.05) == [] and found.update(slow, 0.05) == []
    assert found.update(slow, 0.05) == [(1, 0.04, pytest.approx(0.0011))]  # the third sync
    assert found.update(slow, 0.05) == [] and found.now() == [1]  # named once
    found.update([0.001, 0.001, 0.001], 0.05)
    assert found.now() == [] and found.named == [1]  # caught up; the run still names it
    assert Stragglers(0.0).update(slow, 0.05) == []  # --straggler_factor 0: off


@pytest.mark.slow
def test_a_rank_slow_to_load_its_batches_is_named_and_an_even_run_names_none(
    tmp_path: Path,
) -> None:
    from dist_utils import run_ranks
    from workers import fit_syncing_every_step

    def job(name: str, slow_rank: int) -> dict[str, Any]:
        return dict(dataset="guardplug:slow_data", dataset_args={"slow_rank": slow_rank},
                    model="mlp", width=16, batch_size=8, epochs=1, log_interval=1,
                    tensorboard=False, curves=False, output_dir=str(tmp_path / name))

    slow = run_ranks(fit_syncing_every_step, 2, tmp_path, job("slow", 1))[0]
    even = run_ranks(fit_syncing_every_step, 2, tmp_path, job("even", -1))[0]
    assert slow["stragglers"] == [1] and "stragglers" not in even
    named = [r["stragglers"] for r in _rows(tmp_path / "slow") if "stragglers" in r]
    assert named and all(r == [1] for r in named)
    assert not any("stragglers" in r for r in _rows(tmp_path / "even"))


def test_a_hang_report_names_the_ranks_that_wrote_no_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """The ranks whose collective failed each leave a record; those that left none are
    named as the ones that did not reach it. When every rank reported, none is blamed.
    `ddptrain diagnose` prints the report again, or says there is none, in one line."""
    from ddptrain.observe.hang import culprit_line, diagnose

    folder = tmp_path / "hang"
    folder.mkdir()

    def record(rank: int) -> None:
        (folder / f"rank{rank}.json").write_text(json.dumps({
            "rank": rank, "world_size": 4, "host": "node1", "step": 5, "op": "all_reduce",
            "group": "0", "seq": 12, "where": "mypkg/model.py:41 (forward)", "error": "timeout",
        }))

    record(0)
    record(2)
    t0 = time.monotonic()
    line = culprit_line(tmp_path, 4, rank=2, wait_s=0.3)
    assert time.monotonic() - t0 >= 0.3  # it waited for ranks 1 and 3
    assert line == (
        "ranks 1, 3 did not reach all_reduce #12 of the default group (after step 5), which "
        "ranks 0, 2 waited in at mypkg/model.py:41 (forward): they stopped, died or stayed "
        f"in their own code; report: {folder / 'report.txt'}")
    assert not (folder / "report.txt").exists()  # rank 0 writes it, the lowest that reported
    culprit_line(tmp_path, 4, rank=0, wait_s=0)
    assert (folder / "report.txt").read_text().startswith("ranks 1, 3 did not reach")
    record(1)
    record(3)
    (folder / "report.txt").unlink()
    assert diagnose(tmp_path).startswith(  # type: ignore[union-attr]
        "every rank reported a failed all_reduce #12 of the default group (after step 5)")
    assert main(["diagnose", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("every rank reported")
    assert main(["diagnose", str(tmp_path / "hang")]) == 2
    assert "holds no hang records" in capsys.readouterr().err
    # a rank that ended on its own error says so; a record older than this process (an
    # earlier attempt of a resumed run) is left out
    for path in folder.glob("rank*.json"):
        path.unlink()
    record(0)
    (folder / "rank1.json").write_text(json.dumps({
        "rank": 1, "world_size": 4, "host": "node2", "step": 5, "op": None, "group": "0",
        "seq": 12, "where": None, "error": "reading sample 200 raised ValueError",
        "own_error": True}))
    (folder / "rank2.json").write_text(json.dumps({"rank": 2, "time": 0.0, "world_size": 4}))
    line = culprit_line(tmp_path, 4, rank=0, wait_s=0)
    assert line is not None and line.startswith(
        "rank 1 ended on its own error (rank 1: reading sample 200 raised ValueError), and "
        "rank 0 waited for it in all_reduce #12 of the default group (after step 5)"), line
    assert "2  -  -  -  -  no record" in (folder / "report.txt").read_text()


def test_hang_files_of_another_shape_or_links_are_named_never_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A peer's record that is valid JSON of another shape (a list, a field missing, a
    field of another type, another rank's), a link or a FIFO is left out of the report,
    which names it and why; the rank still says its line. `ddptrain diagnose` prints the
    report with those notes, and never reads nor prints a `report.txt` (or a `hang/`)
    that is a link, or not a regular file: one line naming it, exit 2, no traceback."""
    from ddptrain.observe.hang import culprit_line

    folder = tmp_path / "hang"
    folder.mkdir()
    good = {"rank": 0, "world_size": 5, "host": "node1", "step": 5, "op": "all_reduce",
            "group": "0", "seq": 12, "where": "mypkg/model.py:41 (forward)", "error": "timeout"}
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({**good, "rank": 3, "host": "SECRET"}))
    (folder / "rank0.json").write_text(json.dumps(good))
    (folder / "rank1.json").write_text("[1, 2]")
    (folder / "rank2.json").write_text(json.dumps({**good, "rank": 2, "host": None}))
    (folder / "rank3.json").symlink_to(secret)
    (folder / "rank4.json").write_text(json.dumps({**good, "rank": 3}))
    (folder / "stalled1.json").write_text(json.dumps({"rank": 1, "step": "19", "where": "x"}))
    os.mkfifo(folder / "stalled2.json")  # read, it would block
    line = culprit_line(tmp_path, 5, rank=0, wait_s=0)
    assert line == (
        "ranks 1, 2, 3, 4 did not reach all_reduce #12 of the default group (after step 5), "
        "which rank 0 waited in at mypkg/model.py:41 (forward): they stopped, died or stayed "
        f"in their own code; report: {folder / 'report.txt'}")
    text = (folder / "report.txt").read_text()
    skipped = [x for x in text.splitlines() if x.startswith("skipped ")]
    assert skipped == [
        f"skipped {folder / 'rank1.json'}: a list in JSON, not an object: not a record "
        "ddptrain wrote",
        f"skipped {folder / 'rank2.json'}: its 'host' is null, not text: not a record "
        "ddptrain wrote",
        f"skipped {folder / 'rank3.json'}: a symbolic link",
        f"skipped {folder / 'rank4.json'}: it says rank 3, not the 4 of its name",
        f"skipped {folder / 'stalled1.json'}: its 'step' is text, not a whole number or "
        "null: not a record ddptrain wrote",
        f"skipped {folder / 'stalled2.json'}: not a regular file (a directory, device, FIFO "
        "or socket)",
    ], text
    assert "SECRET" not in text
    # diagnose makes the report again, with the same notes
    (folder / "report.txt").unlink()
    assert main(["diagnose", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ranks 1, 2, 3, 4 did not reach") and skipped[0] in out, out
    # a record missing a field it reads, and nothing else: one line naming the file
    for name in ("rank0.json", "rank2.json", "rank4.json"):
        (folder / name).unlink()
    (folder / "rank0.json").write_text(json.dumps({k: v for k, v in good.items() if k != "op"}))
    assert main(["diagnose", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"ddptrain: error: {str(folder)!r} holds no hang record ddptrain can read: "
        f"{folder / 'rank0.json'}: no 'op' field: not a record ddptrain wrote (and 2 more)\n")
    # a report that is a link (to /etc/hostname, say) or a FIFO is neither read nor printed
    for target, why in ((secret, "a symbolic link"), (None, "not a regular file")):
        if target is None:
            os.mkfifo(folder / "report.txt")
        else:
            (folder / "report.txt").symlink_to(target)
        assert main(["diagnose", str(tmp_path)]) == 2
        out, err = capsys.readouterr()
        assert not out and "SECRET" not in err, err
        assert err.startswith(f"ddptrain: error: {str(folder / 'report.txt')!r}: {why}")
        assert len(err.splitlines()) == 1, err
        (folder / "report.txt").unlink()
    # so is a hang/ folder that is a link
    elsewhere = tmp_path / "elsewhere"
    folder.rename(elsewhere)
    (elsewhere / "report.txt").write_text("SECRET\n")
    folder.symlink_to(elsewhere)
    assert main(["diagnose", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert not out and err == (f"ddptrain: error: {str(folder)!r} is a symbolic link: ddptrain "
                               "reads no hang records through it; remove it\n")

def _stuck_in_user_code(seconds: float) -> None:
    time.sleep(seconds)  # a user's forward that never returns


def test_a_rank_stuck_in_its_own_code_notes_where_and_its_peers_report_it(
    tmp_path: Path,
) -> None:
    """`StallWatch`: once the step count has not moved for half of --timeout_s, the rank
    notes the innermost line of its own code (not torch's, not Python's) and its stack;
    the note goes when the steps move on. A peer's report names that line for the rank
    that wrote no record; one process watches nothing."""
    from ddptrain.checkpoint.schema import Progress
    from ddptrain.observe.hang import POSITION, StallWatch, culprit_line

    progress = Progress()
    progress.step = 19
    POSITION.update(run_dir=str(tmp_path), progress=progress)
    note = tmp_path / "hang" / "stalled1.json"
    try:
        with StallWatch(tmp_path, rank=1, world_size=2, timeout_s=2):  # notes after 1 s
            _stuck_in_user_code(1.6)
            noted = json.loads(note.read_text())
            progress.step = 20
            time.sleep(0.6)
            assert not note.exists()  # the steps moved on
            progress.step = 21
            _stuck_in_user_code(1.6)
        with StallWatch(tmp_path, rank=0, world_size=1, timeout_s=0.4):
            _stuck_in_user_code(0.6)
    finally:
        POSITION.update(run_dir=None, progress=None)
    assert not (tmp_path / "hang" / "stalled0.json").exists()
    line_no = _stuck_in_user_code.__code__.co_firstlineno + 1
    assert noted["where"] == f"{__file__}:{line_no} (_stuck_in_user_code)", noted
    assert noted["step"] == 19 and "time.sleep(seconds)" in noted["stack"][-1], noted
    (tmp_path / "hang" / "rank0.json").write_text(json.dumps({
        "rank": 0, "world_size": 2, "host": "node1", "step": 21, "op": "all_reduce",
        "group": "0", "seq": 40, "where": "ddptrain/train/metrics.py:135 (reduce_snapshots)",
        "error": "timeout"}))
    line = culprit_line(tmp_path, 2, rank=0, wait_s=0)
    assert line is not None and line.startswith(
        "rank 1 did not reach all_reduce #40 of the default group (after step 21), which rank 0 "
        "waited in at ddptrain/train/metrics.py:135 (reduce_snapshots): rank 1 has been in "
        f"{__file__}:{line_no} (_stuck_in_user_code) since step 21; report: "), line
    assert f"1  -  21  -  {__file__}:{line_no} (_stuck_in_user_code)  in its own code" in (
        tmp_path / "hang" / "report.txt").read_text()


def test_out_of_memory_is_one_line_with_the_step_the_state_and_the_knobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """An OutOfMemoryError in a step ends the rank with exit 2 and one line: the rank, the
    step, the state's bytes per rank, which flags to turn; the report beside it. Without
    CUDA, --memory_snapshot is refused before anything starts."""
    run = tmp_path / "run"
    code = main(["train", "--dataset", "breast_cancer", "--model", "guardplug:oom_mlp",
                 "--batch_size", "16", "--output_dir", str(run)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("ddptrain: error: out of memory on rank 0 (cpu) after step 2: the "
                          "model's state is "), err
    assert ("lower --batch_size (now 16; --grad_accum_steps keeps the global batch), add "
            "--activation_checkpointing, shard the state with --strategy fsdp; report: "
            f"{run / 'oom' / 'rank0.txt'}") in err, err
    assert "Tried to allocate 2.00 GiB" in (run / "oom" / "rank0.txt").read_text()
    code = main(["train", "--dataset", "breast_cancer", "--memory_snapshot",
                 "--output_dir", str(tmp_path / "other")])
    assert code == 2
    assert "--memory_snapshot records CUDA's allocator, and this run is on cpu" in (
        capsys.readouterr().err)


def test_out_of_memory_on_cuda_dumps_the_allocation_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA path, on a stand-in (CUDA's queries faked): the line says what the tensors
    held of the device, and with --memory_snapshot the history is dumped beside the report."""
    from types import SimpleNamespace

    from ddptrain.config import TrainingConfig
    from ddptrain.observe import oom

    dumped: list[str] = []
    recorded: list[Any] = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 79 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_summary", lambda d: "|  allocator summary  |")
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dumped.append)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda **kw: recorded.append(kw))
    config = TrainingConfig(output_dir=str(tmp_path), memory_snapshot=True, batch_size=8,
                            strategy="fsdp").validate()
    gib = 2**30
    trainer = SimpleNamespace(
        config=config, ctx=SimpleNamespace(device=torch.device("cuda", 3), rank=3),
        progress=SimpleNamespace(step=87), module=None, optimizer=None,
        strategy=SimpleNamespace(rank_bytes=lambda m, o: {
            "params": 10 * gib, "grads": 10 * gib, "optimizer": 20 * gib}),
    )
    oom.record_history(torch.device("cuda", 3))
    error = oom.report(torch.OutOfMemoryError("CUDA out of memory"), trainer)
    assert recorded and recorded[0]["max_entries"] == oom.SNAPSHOT_ENTRIES
    assert str(error).startswith(
        "out of memory on rank 3 (cuda:3) after step 87: 79.0 GiB of 80.0 GiB held by "
        "tensors, of which the model's state is 40.0 GiB per rank (parameters 10.0 GiB, "
        "gradients 10.0 GiB, optimizer 20.0 GiB); lower --batch_size (now 8;"), error
    assert "split the layers further (--tp, --pp) or offload with --fsdp_cpu_offload" in str(
        error)
    assert dumped == [str(tmp_path / "oom" / "rank3.pickle")]
    text = (tmp_path / "oom" / "rank3.txt").read_text()
    assert "allocator summary" in text and "rank3.pickle" in text
