"""The CLI end to end: bad input gives one line and exit code 2; real runs under torchrun."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, run_torchrun, write_npz
from dist_utils import free_port
from safetensors.torch import load_file

from ddptrain.cli import main


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ddptrain: error: "), err
    return err


BAD_FLAGS = [
    (["train", "--batch_size", "0"], "--batch_size 0 is invalid: use a whole number"),
    (["train", "--grad_accum_steps", "0"], "--grad_accum_steps 0 is invalid"),
    (["train", "--dataset", "cifar"], "--dataset 'cifar' is invalid: choose one of"),
    (["train", "--nonsense"], "unrecognized arguments: --nonsense"),
    (["train", "--backend", "nccl"], "NCCL needs CUDA devices"),
    (["train", "--device", "cuda"], "no CUDA device is visible"),
    (["train", "--amp_dtype", "float16"], "float16 autocast is a GPU feature"),
    (["train", "--dataset", "nosuchmod:fn"], "cannot import 'nosuchmod'"),
    (["train", "--dataset", "digits", "--model", "mlp", "--in_channels", "4",
      "--model", "miniresnet"], "--in_channels 4 does not match"),
    (["train", "--dataset", "breast_cancer", "--model", "miniresnet"], "needs images"),
    (["train", "--batch_size", "1000", "--drop_last"], "drops all 455 training samples"),
    (["train", "--dataset", "missing.npz"], "no such file; give the path of an .npz"),
    (["train", "--resume_from", "missing.pt"], "give an existing checkpoint file"),
    (["frobnicate"], "unknown command 'frobnicate'"),
    (["train", "--global_batch_size", "30", "--batch_size", "8"], "is not a multiple of 1"),
    (["train", "--strategy", "fsdp", "--find_unused_parameters"],
     "--find_unused_parameters is a DDP setting and --strategy is 'fsdp'"),
    (["train", "--strategy", "fsdp", "--static_graph"], "--static_graph is a DDP setting"),
    (["train", "--static_graph", "--grad_accum_steps", "2"],
     "--static_graph with gradient accumulation (2 micro-steps a step) is unsupported"),
    (["train", "--early_stopping", "2", "--early_stopping_min_delta", "nan"],
     "--early_stopping_min_delta nan is invalid: use a finite number"),
    (["train", "--lr", "inf"], "--lr inf is invalid: use a finite number"),
    (["train", "--epo", "2"], "unrecognized arguments: --epo 2 (did you mean --epochs?)"),
    (["train", "--stratgy", "fsdp"], "--stratgy fsdp (did you mean --strategy?)"),  # typo
    (["train", "--model", "mlp", "--model_args", "experts=4"],
     "--model mlp takes no --model_args (given: experts=4)"),
    (["train", "--freeze", "*"], "--freeze * freezes every parameter: nothing would train"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA errors need a CPU-only host")
@pytest.mark.parametrize(("argv", "needle"), BAD_FLAGS)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = _one_line_error(capsys, [*argv, "--output_dir", str(tmp_path / "run")])
    assert needle in err


def test_bad_yaml_and_unknown_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: [\n")
    assert "is not valid YAML at line" in _one_line_error(capsys, ["train", "--config", str(bad)])
    bad.write_text("epoch: 3\n")
    assert "unknown field(s) epoch" in _one_line_error(capsys, ["train", "--config", str(bad)])


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RANK": "0"}, "you set RANK=0 but not LOCAL_RANK, WORLD_SIZE"),
        ({"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK must be in 0..1"),
        ({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set"),
        ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
          "MASTER_PORT": "99999"}, "you set MASTER_PORT=99999, which is not a TCP port"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"},
         "you set MASTER_PORT=0, which is not a TCP port"),  # a pod per rank
    ],
)
def test_bad_launcher_environment(
    env: dict[str, str], needle: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    err = capsys.readouterr
    rc = main(["train", "--output_dir", str(tmp_path / "run")])
    out = err().err
    assert rc == 2 and needle in out and len(out.strip().splitlines()) == 1, out


def test_a_master_name_that_never_resolves_is_one_line_after_the_timeout(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Not c10d's warning each second while it retries the name: one line of ours."""
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29400"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    capfd.readouterr()
    t0 = time.monotonic()
    rc = main(["train", "--timeout_s", "2", "--output_dir", str(tmp_path / "run")])
    took, err = time.monotonic() - t0, capfd.readouterr().err.strip()
    assert rc == 2 and err.splitlines() == [
        "[rank 1] ddptrain: error: MASTER_ADDR=no-such-host.invalid does not resolve to an "
        "address "
        "(waited 2s): check the host name, or raise --timeout_s while the master's host (a "
        "Kubernetes Service: its pod) comes up"
    ], err
    assert 2 <= took < 30


def _lone_rank(tmp_path: Path, port: int) -> tuple[int, str, float]:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    t0 = time.monotonic()
    proc = run_cli(["train", "--timeout_s", "3", "--output_dir", str(tmp_path / "r")],
                   cwd=tmp_path, env=env, timeout=120)
    return proc.returncode, proc.stderr.strip(), time.monotonic() - t0


def test_world_size_two_without_a_peer_fails_after_the_timeout(tmp_path: Path) -> None:
    rc, err, took = _lone_rank(tmp_path, free_port())
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "rank 0 of 2 waited 3s" in err and "not every rank arrived" in err
    assert took < 60


def test_master_port_in_use_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc, err, _ = _lone_rank(tmp_path, busy.getsockname()[1])
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "already in use" in err


def test_bad_data_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = ["--output_dir", str(tmp_path / "run")]
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file at all")
    err = _one_line_error(capsys, ["train", "--dataset", str(junk), *out])
    assert "is not a readable .npz" in err
    nox = tmp_path / "nox.npz"
    np.savez(nox, features=np.zeros((4, 2)), y=np.zeros(4, dtype=np.int64))
    assert "lacks array(s) x" in _one_line_error(capsys, ["train", "--dataset", str(nox), *out])
    data = write_npz(tmp_path / "three.npz", 100, classes=3)
    err = _one_line_error(
        capsys, ["train", "--dataset", str(data), "--num_classes", "2", "--batch_size", "8", *out]
    )
    assert "labels in 0..2 but --num_classes is 2" in err


def test_unwritable_output_dir_is_refused_and_nothing_is_damaged(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("keep me")
    err = _one_line_error(capsys, ["train", "--output_dir", str(blocker / "run")])
    assert "--output_dir" in err and "is not writable" in err
    assert blocker.read_text() == "keep me"


def test_subprocess_error_has_no_traceback(tmp_path: Path) -> None:
    proc = run_cli(["train", "--batch_size", "-3"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "ddptrain: error: --batch_size -3 is invalid: use a whole number of at least 1"
    )
    assert "Traceback" not in proc.stdout + proc.stderr


def test_help_lists_every_flag(tmp_path: Path) -> None:
    proc = run_cli(["train", "--help"], cwd=tmp_path)
    assert proc.returncode == 0
    for flag in ("--batch_size", "--no-use_amp", "--amp_dtype", "--scale_lr", "--config"):
        assert flag in proc.stdout


# ---------------------------------------------------------------------- end to end
def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _check_run_dir(run: Path, epochs: int) -> list[dict]:
    rows = _metrics(run)
    train_rows = [r for r in rows if r["split"] == "train"]
    val_rows = [r for r in rows if r["split"] == "val"]
    assert [r["epoch"] for r in val_rows] == list(range(1, epochs + 1))
    for r in train_rows:
        assert {"epoch", "step", "loss", "accuracy", "lr", "samples_per_sec"} <= r.keys()
    steps = [r["step"] for r in train_rows]
    assert steps == sorted(set(steps))
    assert (run / "config.yaml").is_file() and (run / "model.safetensors").is_file()
    latest = torch.load(run / "checkpoints" / "latest.pt", weights_only=True)
    assert {"epoch", "model_state_dict", "optimizer_state_dict", "scaler_state_dict",
            "scheduler_state_dict"} <= latest.keys()
    assert latest["epoch"] == epochs
    assert not any(k.startswith("module.") for k in latest["model_state_dict"])
    return rows


@pytest.mark.heavy
@pytest.mark.slow
def test_torchrun_breast_cancer_and_digits(tmp_path: Path) -> None:
    """The demo job, and MiniResNet on digits within the demo's 10-epoch budget."""
    run = tmp_path / "bc"
    proc = run_torchrun(
        2, ["train", "--dataset", "breast_cancer", "--batch_size", "8", "--epochs", "10",
            "--output_dir", str(run)], cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val accuracy" in proc.stdout and "[rank 1]" not in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["val_accuracy"] >= 0.95
    _check_run_dir(run, 10)

    run = tmp_path / "digits"
    proc = run_torchrun(
        2, ["train", "--dataset", "digits", "--model", "miniresnet", "--batch_size", "32",
            "--lr", "0.05", "--epochs", "4", "--save_every", "0", "--output_dir", str(run)],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_accuracy"] >= 0.95, summary
    _check_run_dir(run, 4)


@pytest.mark.heavy
@pytest.mark.slow
def test_torchrun_user_plugins(tmp_path: Path) -> None:
    """A user's dataset and model modules, imported by every rank."""
    run = tmp_path / "plug"
    proc = run_torchrun(
        2, ["train", "--dataset", "userplug:datasets", "--model", "userplug:model",
            "--batch_size", "16", "--epochs", "2", "--output_dir", str(run)], cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run_dir(run, 2)
    names = set(load_file(str(run / "model.safetensors")))
    assert names == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_single_process_without_torchrun(tmp_path: Path) -> None:
    run = tmp_path / "single"
    proc = run_cli(
        ["train", "--epochs", "2", "--batch_size", "32", "--output_dir", str(run)], cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 1
    _check_run_dir(run, 2)


_UNUSED = (
    "Expected to have finished reduction in the prior iteration before starting a new one. "
    "This error indicates that your module has parameters that were not used in producing "
    "loss. You can enable unused parameter detection by passing the keyword argument "
    "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by \n"
    "making sure all `forward` function outputs participate in calculating loss. \n"
)


@pytest.mark.parametrize(("text", "needles"), [
    (_UNUSED + "Parameter indices which did not receive grad for rank 1: 2 3\n In addition",
     ["(parameter indices 2 3)", "add --find_unused_parameters", "--static_graph"]),
    (_UNUSED + "Parameters which did not receive grad for rank 0: branch.bias, branch.weight\n",
     ["(branch.bias, branch.weight)", "add --find_unused_parameters"]),
    ("Expected to have finished reduction in the prior iteration before starting a new one. "
     "This error indicates that your module has parameters that were not used in producing "
     "loss. Since `find_unused_parameters=True` is enabled, this likely  means that not all "
     "`forward` outputs participate in computing loss.", ["compute the loss from all"]),
    ("Expected to have finished reduction in the prior iteration before starting a new one. "
     "This error indicates that your training graph has changed in this iteration, e.g., one "
     "parameter is used in first iteration, but then got unused in the second iteration. "
     "this is not compatible with static_graph set to True.",
     ["--static_graph says", "use --find_unused_parameters"]),
])
def test_ddps_unused_parameter_errors_are_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, text: str,
    needles: list[str],
) -> None:
    import ddptrain.cli as cli

    def fail(argv: list[str]) -> int:
        raise RuntimeError(text)

    monkeypatch.setitem(cli.COMMANDS, "train", fail)
    err = _one_line_error(capsys, ["train"])
    assert all(n in err for n in needles), err



@pytest.mark.parametrize(("argv", "needle"), [
    (["--seed", "-1"], "--seed -1 is invalid: use a whole number in 0..4294967295"),
    (["--seed", "1e23"], "argument --seed: expected int, got '1e23': give a whole number"),
    (["--width", "1000000000"], "--width 1000000000 is invalid: use at most"),
    # within the flag's range, past this host: counted on the meta device, never allocated
    (["--width", str(2**20), "--epochs", "1"], "more than this host's memory"),
])
def test_seeds_and_widths_no_run_can_use_are_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    assert needle in _one_line_error(capsys, ["train", *argv, "--output_dir", str(run)])
    assert not (run / "config.yaml").exists()


def test_a_built_in_model_its_device_cannot_allocate_is_one_line(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the host check (its memory unknown), an allocation that fails is a line too."""
    from ddptrain.config import TrainingConfig
    from ddptrain.data import load_data
    from ddptrain.errors import ConfigError
    from ddptrain.models import factory

    config = TrainingConfig(dataset="breast_cancer", model="mlp").validate()
    data = load_data(config)
    def unknown(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr("os.sysconf", unknown)  # the host's memory cannot be told
    real = factory._builtin

    def failing(*args: object) -> torch.nn.Module:
        model = real(*args)  # type: ignore[arg-type]
        if next(model.parameters()).device.type != "meta":
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                               "DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 120000000000 bytes. Error code 12")
        return model

    monkeypatch.setattr(factory, "_builtin", failing)
    with pytest.raises(ConfigError, match="which cpu cannot allocate: lower --width"):
        factory.create_model(config, data, 2, torch.device("cpu"))
