"""The GPU path's per-step costs and failure lines: host reads of device values per step
(counted), pinned in-memory batches, and a failed or hung NCCL collective as exit 3.

The training step never waits for the device. What counts as a host read, and which reads
of host values by design are left out, is `bench/host_reads.py` (counted by dispatch);
the runs are real single-process CPU runs.

Each read is filed under `progress.step` when it happens: reads filed under step k are
those of step k's metric sync (if any) and of step k+1's forward, backward and optimizer
step. The only reads allowed:

- the metric sync (`reduce_snapshots`), at most one read, on the steps that sync;
- the verdict of the non-finite check, one read per step, when `--max_bad_steps` > 0:
  the step itself is skipped on the device (fused optimizers), and `Verdicts.settle`
  reads the flag once, after the next step's forward and backward are queued (on a GPU
  from a pinned copy: nothing waits), or at once where a log row or a sync needs its
  figures. No read is made where the step is taken (`optimizer_step`). With
  `--max_bad_steps 0` a step that does not sync reads nothing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from bench.host_reads import HostReads
from ddptrain import fit
from ddptrain.config import TrainingConfig
from ddptrain.observe.hooks import TrainerHook

SYNC_SITE = "reduce_snapshots"
FINITE_SITES = ("settle",)


class Watch(TrainerHook):
    """Counts host reads from the first step to the end of the last epoch's training (it
    reads the loop's internals: a `TrainerHook`)."""

    def __init__(self, reads: HostReads) -> None:
        self.reads = reads
        self.synced: set[int] = set()
        self.unread: set[int] = set()
        self.last = 0

    def on_epoch_start(self, trainer: Any, epoch: int) -> None:
        import ddptrain.train.trainer as loop

        real = loop.reduce_snapshots

        def reduce(*a: Any, **k: Any) -> Any:
            self.synced.add(trainer.progress.step)
            return real(*a, **k)

        loop.reduce_snapshots = reduce  # restored by the test's monkeypatch
        self.reads.step = trainer.progress.step
        self.reads.__enter__()

    def on_step_end(self, trainer: Any) -> None:
        self.reads.step = self.last = trainer.progress.step
        held = trainer.verdicts._held
        if held is not None and held[0] == trainer.progress.step:
            self.unread.add(trainer.progress.step)  # its verdict is still on the device

    def on_row(self, trainer: Any, row: dict[str, Any]) -> None:
        if row["split"] == "val" and self.reads.active:
            self.reads.__exit__(None, None, None)


def _check(watch: Watch, finite_reads: int) -> None:
    reads = watch.reads.reads
    steps = range(1, watch.last)  # the last step's reads are the epoch's end
    quiet = [k for k in steps if k not in watch.synced]
    assert len(quiet) > len(steps) // 2, watch.synced
    for k in steps:
        extra = [r for r in reads.get(k, []) if not any(s in r for s in FINITE_SITES)]
        finite = [r for r in reads.get(k, []) if any(s in r for s in FINITE_SITES)]
        assert len(finite) == finite_reads, (k, finite)
        if finite_reads:  # read later than the step was taken
            assert k in watch.unread, f"step {k}'s verdict was read as it was taken"
        if k in watch.synced:
            assert len(extra) <= 1 and all(SYNC_SITE in r for r in extra), (k, extra)
        else:
            assert not extra, f"step {k} reads device values on the host: {extra}"


def _run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, datasets: Any = None, **fields: Any
) -> Watch:
    import ddptrain.train.trainer as loop

    monkeypatch.setattr(loop, "reduce_snapshots", loop.reduce_snapshots)
    reads = HostReads()
    watch = Watch(reads)
    try:
        config = TrainingConfig(
            output_dir=str(tmp_path / "run"), epochs=1, save_every=0, tensorboard=False,
            **fields,
        )
        fit(config, hooks=[watch], datasets=datasets)
    finally:
        if reads.active:
            reads.__exit__(None, None, None)
    return watch


@pytest.mark.parametrize("max_bad_steps", [0, 5])
def test_a_step_reads_nothing_back_from_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_bad_steps: int
) -> None:
    watch = _run(
        tmp_path, monkeypatch, dataset="digits", model="mlp", batch_size=16, width=16,
        log_interval=4, grad_accum_steps=2, max_bad_steps=max_bad_steps,
    )
    _check(watch, 1 if max_bad_steps else 0)


def test_clipping_reads_once_for_the_finite_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    watch = _run(
        tmp_path, monkeypatch, dataset="digits", model="mlp", batch_size=32, width=16,
        log_interval=3, max_grad_norm=1.0, optimizer="adamw",
    )
    _check(watch, 1)
    watch = _run(
        tmp_path / "b", monkeypatch, dataset="digits", model="mlp", batch_size=32, width=16,
        log_interval=3, max_grad_norm=1.0, max_bad_steps=0,
    )
    _check(watch, 0)


class Stream(IterableDataset):
    """Samples of unknown count: the step rescales by the window's true count."""

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(0)
        for i in range(200):
            yield torch.randn(4, generator=g), torch.tensor(i % 2)


def test_a_stream_step_rescales_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    val = TensorDataset(torch.randn(8, 4), torch.arange(8) % 2)
    watch = _run(
        tmp_path, monkeypatch, datasets=(Stream(), val), model="mlp", batch_size=8,
        width=8, log_interval=4, max_bad_steps=0, num_classes=2,
    )
    _check(watch, 0)


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3,), float(i)), i % 2


def _tensors(batch: Any) -> list[torch.Tensor]:
    return [t for t in batch if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_in_memory_batches_are_pinned_for_a_gpu_only(device: str) -> None:
    """The batches sliced in-process (no DataLoader to pin them) are page-locked on the
    cuda path, so the non-blocking copy is asynchronous; a CPU run copies nothing."""
    from cuda_standin import fake_pinning

    from ddptrain.context import DistributedContext
    from ddptrain.data import ArrayDataset, TrainBatches, make_val_loader

    config = TrainingConfig(batch_size=8, output_dir="unused")
    ctx = DistributedContext(0, 0, 1, torch.device(device, 0) if device == "cuda" else
                             torch.device("cpu"))
    data = ArrayDataset(torch.randn(40, 3), torch.arange(40) % 2)
    with fake_pinning() as pinned:
        batches = TrainBatches(data, config, ctx)
        train = [t for b, _, _ in batches.epoch(1, 0) for t in _tensors(b)]
        val = [t for b in make_val_loader(data, config, ctx) for t in _tensors(b)]
        # A DataLoader (not sliced in-process) pins in its own thread: asked to on cuda.
        loader = TrainBatches(Rows(), config, ctx)
    assert len(train) == 10 and len(val) == 10
    on_gpu = device == "cuda"
    assert all((t.data_ptr() in pinned) == on_gpu for t in train + val)
    assert len(pinned) == (20 if on_gpu else 0)
    assert loader.loader is not None and loader.loader.pin_memory == on_gpu


# ---------------------------------------------------------------------- NCCL failures
WATCHDOG = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=9, NumelOut=9, Timeout(ms)=600000) ran "
    "for 600018 milliseconds before timing out."
)
ABORTED = (
    "[../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2010] NCCL communicator was "
    "aborted on rank 1."
)
TIMED_OUT = "[Rank 1] ProcessGroupNCCL's watchdog: work ALLREDUCE timed out after 600000ms"


@pytest.mark.parametrize(("kind", "text"), [
    ("DistBackendError", WATCHDOG), ("RuntimeError", WATCHDOG), ("RuntimeError", ABORTED),
    ("DistBackendError", TIMED_OUT), ("RuntimeError", TIMED_OUT),
])
def test_a_failed_nccl_collective_ends_with_exit_3_and_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    npz400: Path, kind: str, text: str,
) -> None:
    """Raised where the loop's collective is (the metric all-reduce), through the trainer,
    the teardown and the command line, as a watchdog's abort surfaces in the main thread."""
    import torch.distributed as dist

    import ddptrain.train.trainer as loop
    from ddptrain.cli import main
    from ddptrain.errors import EXIT_PEER_LOST

    error = getattr(dist, kind) if kind != "RuntimeError" else RuntimeError

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise error(text + "\nException raised from watchdogHandler at ...\nframe #0: ...")

    monkeypatch.setattr(loop, "reduce_snapshots", fails)
    exit_file = tmp_path / "exit"
    monkeypatch.setenv("DDPTRAIN_EXIT_FILE", str(exit_file))
    rc = main(["train", "--dataset", str(npz400), "--model", "mlp", "--epochs", "1",
               "--log_interval", "2", "--no-tensorboard", "--output_dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_PEER_LOST and exit_file.read_text() == f"{EXIT_PEER_LOST} 0\n"
    assert len(err) == 1 and err[0].startswith(
        "ddptrain: error: lost contact with the other ranks ("
    ), err
    assert ".cpp:" not in err[0] and "frame #0" not in err[0]


def test_an_error_of_this_process_is_nolost_peer() -> None:
    from ddptrain.launch.process_group import lost_peer

    assert not lost_peer(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not lost_peer(ValueError(WATCHDOG))  # not raised by a collective


@pytest.mark.parametrize(("before", "after"), [
    (None, "2"), ("1", "2"), ("0", "0"), ("2", "2"), ("3", "3"),
])
def test_nccl_aborts_a_hung_collective_instead_of_killing_the_process(
    monkeypatch: pytest.MonkeyPatch, before: str | None, after: str
) -> None:
    """torchrun sets 1 (tear down: the watchdog kills the process); ddptrain asks for 2
    (abort the communicators, raise in the main thread), before the group starts."""
    import torch.distributed as dist

    from ddptrain.launch.cluster import ClusterEnv
    from ddptrain.launch.process_group import ASYNC_ERROR_HANDLING, setup_distributed

    seen: dict[str, str | None] = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(
        value=os.environ.get(ASYNC_ERROR_HANDLING)))
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    if before is None:
        monkeypatch.delenv(ASYNC_ERROR_HANDLING, raising=False)
    else:
        monkeypatch.setenv(ASYNC_ERROR_HANDLING, before)
    cluster = ClusterEnv(0, 0, 2, "torchrun", "127.0.0.1", 29999)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    config = TrainingConfig(output_dir="unused")
    setup_distributed(config, cluster, torch.device("cpu"), "nccl")
    assert seen["value"] == after
    monkeypatch.delenv(ASYNC_ERROR_HANDLING, raising=False)
    setup_distributed(config, cluster, torch.device("cpu"), "gloo")
    assert seen["value"] is None  # gloo has no watchdog to set



@pytest.mark.parametrize(
    ("visible", "local_rank", "want"),
    [(1, 5, "cuda:0"), (8, 5, "cuda:5"), (8, 0, "cuda:0"), (2, 3, None)],
)
def test_each_rank_takes_its_own_visible_device(
    monkeypatch: pytest.MonkeyPatch, visible: int, local_rank: int, want: str | None
) -> None:
    """One device visible per task (Slurm --gpus-per-task=1): every rank is cuda:0. All
    of a node's devices visible: rank i is cuda:i. Between, the count does not fit."""
    from ddptrain.errors import ConfigError
    from ddptrain.launch.process_group import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    config = TrainingConfig(output_dir="unused")
    if want is None:
        with pytest.raises(ConfigError, match="LOCAL_RANK=3 but this process sees 2 CUDA"):
            resolve_device(config, local_rank, 8)
    else:
        assert str(resolve_device(config, local_rank, 8)) == want


@pytest.mark.parametrize(("backend", "bound"), [("nccl", True), ("gloo", False)])
def test_only_nccl_is_bound_to_the_device(
    monkeypatch: pytest.MonkeyPatch, backend: str, bound: bool
) -> None:
    """A process group bound to a CUDA device makes DeviceMesh split it, deep-copying the
    backend's options: gloo's cannot be copied (tp and pp over gloo on a GPU failed so), so
    only NCCL is bound."""
    import torch.distributed as dist

    from ddptrain.launch import process_group
    from ddptrain.launch.cluster import ClusterEnv

    seen: dict[str, Any] = {}

    def record(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise SystemExit(0)  # the call is all this test needs

    monkeypatch.setattr(dist, "init_process_group", record)
    monkeypatch.setattr(process_group, "_attempt_store", lambda *a: None)
    monkeypatch.setattr(process_group, "abort_hung_collectives", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # the call sets them: restored after it
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    cluster = ClusterEnv(rank=0, local_rank=0, world_size=2, source="torchrun",
                         master_addr="127.0.0.1", master_port=29500)
    with pytest.raises(SystemExit):
        process_group.setup_distributed(TrainingConfig(output_dir="unused"), cluster,
                                        torch.device("cuda", 0), backend)
    assert (seen["device_id"] is not None) == bound


def test_mfu_counts_a_hugging_face_models_flops() -> None:
    """A Hugging Face model returns a ModelOutput, not a tensor: its FLOPs are counted from
    the logits (the 1.1B Llama of `make gpu-check` failed on its first MFU row before)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ddptrain.observe.flops import count_flops

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config)
    flops = count_flops(model, torch.zeros(2, 8, dtype=torch.long))
    # forward and backward: at least 6 FLOPs per parameter per token of the matmuls
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if "proj" in n)
    assert flops >= 6 * matmul_params * 16


def test_mfu_counts_the_experts_of_a_mixture() -> None:
    """The GPT's experts (the grouped GEMM) are counted on the meta device: a second expert
    a token costs one more MLP a token (the GPU's MFU row crashed on "meta" before)."""
    from ddptrain.models.gpt import build_gpt
    from ddptrain.observe.flops import count_flops

    batch = torch.zeros(2, 16, dtype=torch.long)
    one, two = (count_flops(build_gpt(64, 16, 128, experts=4, top_k=k), batch)
                for k in (1, 2))
    mlp = 6 * batch.numel() * 2 * 128 * 512 * 2  # forward and backward, 2 blocks
    assert mlp <= two - one <= 1.05 * mlp  # the one-hot bias products beside it


@pytest.mark.parametrize(
    ("layout", "backend", "device", "refused"),
    [({"tp": 2}, "gloo", "cuda", True), ({"pp": 2}, "gloo", "cuda", True),
     ({"tp": 2, "pp": 2}, "gloo", "cuda", True), ({"tp": 2}, "auto", "cuda", False),
     ({"pp": 2}, "nccl", "cuda", False), ({"pp": 2}, "gloo", "cpu", False),
     ({}, "gloo", "cuda", False)],
)
def test_tp_and_pp_on_cuda_need_nccl(
    layout: dict[str, int], backend: str, device: str, refused: bool
) -> None:
    """On an H200, pp over gloo ended in `writev: Bad address` (gloo cannot send a CUDA
    tensor) and tp over gloo in a segfault (DTensor's functional all-gather): both are
    refused before the process group, with the way out."""
    from ddptrain.errors import ConfigError
    from ddptrain.launch.process_group import resolve_backend

    config = TrainingConfig(output_dir="unused", backend=backend,  # type: ignore[arg-type]
                            **layout)
    if refused:
        with pytest.raises(ConfigError, match=r"on CUDA is unsupported.*use --backend nccl"):
            resolve_backend(config, torch.device(device))
    else:
        assert resolve_backend(config, torch.device(device)) in ("gloo", "nccl")



def test_gpu_check_reports_its_committed_figures_and_says_when_there_is_no_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """`make gpu-check` without CUDA: one line, exit 0. Its committed figures
    (bench/gpu_check.json, merged from H200 runs with --update) render the GPU section,
    each check with its verdict, an expected refusal as such."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root))
    from bench import gpu_check

    monkeypatch.setattr(sys, "argv", ["gpu_check", "--out", str(tmp_path / "out")])
    assert gpu_check.main() == 0
    assert capsys.readouterr().out.startswith("gpu-check: no CUDA device here")
    assert not (tmp_path / "out").exists()
    docs = tmp_path / "B.md"
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--report_only",
                                      str(root / "bench" / "gpu_check.json"), "--docs",
                                      str(docs)])
    assert gpu_check.main() == 0
    text = docs.read_text()
    assert "Rows not run then come from the run(s) of" in text
    assert "| float8 tensorwise (bf16 autocast) | 1 |" in text
    assert ("| pp 2 (gloo): refused | 2 | - | - | refused before the process group in one "
            "line (use --backend nccl), as expected |") in text
    assert ("| experts --ep 2 (nccl, one GPU) | 2 | - | - | refused by NCCL, as expected"
            in text)
    assert "| experts fp32 (grouped GEMM) | 1 | 1.2e-07 |" in text
    assert "| 8 | `--compile` | 52,359 |" in text
    assert "FAILED" not in text


def test_gpu_check_compares_the_runs_with_experts_with_a_cpu_run_with_experts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA runs cannot start here: a stand-in launcher writes each run's weights and
    loss from the model it was asked for (dense or with experts). Each check must meet the
    CPU run of its own model: a dense reference for a run with experts would fail it."""
    from safetensors.torch import save_file

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from bench import gpu_check

    launched: list[list[str]] = []

    def launch(ranks: int, args: list[str], timeout_s: float) -> tuple[int, str, float]:
        launched.append(args)
        experts = gpu_check.MOE[0] in args
        run = Path(args[args.index("--output_dir") + 1])
        run.mkdir(parents=True)
        save_file({"w": torch.full((2,), 2.0 if experts else 1.0)}, str(run / "model.safetensors"))
        (run / "summary.json").write_text(json.dumps({"val_loss": 2.0 if experts else 1.0}))
        return 0, "", 0.1

    monkeypatch.setattr(gpu_check, "launch", launch)
    results: dict[str, Any] = {"checks": {}}
    names = ["plain fp32", "experts fp32 (grouped GEMM)", "experts, bf16 autocast"]
    gpu_check.checks(tmp_path, results, lambda: None, names)
    assert all(results["checks"][n]["ok"] for n in names), results["checks"]
    cpu = [a for a in launched if a[a.index("--device") + 1] == "cpu"]
    assert [gpu_check.MOE[0] in a for a in cpu] == [False, True]  # one reference each


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
