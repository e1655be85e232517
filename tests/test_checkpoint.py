"""Checkpoint files: atomic under SIGKILL, weights-only, refused with one line when unusable."""

from __future__ import annotations

import os
import pickle
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import tmpfs
from safetensors.torch import load_file

from ddptrain.checkpoint.manager import find_resumable, load_checkpoint
from ddptrain.checkpoint.pt import LATEST, list_checkpoints, save_checkpoint
from ddptrain.cli import main
from ddptrain.context import DistributedContext


def _write_until_killed(directory: Path, step: int, progress: int, blob: torch.Tensor) -> None:
    """Child: 8 MB checkpoints, one after another, until SIGKILL; after each write it
    reports the step on the `progress` pipe. `blob` comes from the parent: a forked child
    must not start OpenMP work (filling a large tensor does), whose thread pool the
    parent may already hold and the child cannot."""
    ctx = DistributedContext(0, 0, 1, torch.device("cpu"))
    while True:
        step += 1
        state = {"step": step, "model_state_dict": {"w": blob, "tag": torch.tensor([step])}}
        save_checkpoint(directory, step, state, ctx, keep_last=2)
        os.write(progress, b"%d\n" % step)


def _await_writes(progress: int, k: int) -> float:
    """Block until the child has reported `k` completed writes; returns the mean seconds
    one write took, so a delay drawn from it lands inside the next write at any load."""
    t0, done = time.monotonic(), 0
    while done < k:
        chunk = os.read(progress, 4096)
        assert chunk, f"the writer died after {done} completed writes"
        done += chunk.count(b"\n")
    return (time.monotonic() - t0) / done


def test_kill_during_checkpoint_writes_never_leaves_a_broken_newest(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    rng = random.Random(0)
    step, trials, torn = 0, 30, 0
    blob = torch.zeros(2_000_000)
    for _ in range(trials):
        # The kill comes after the child's k-th completed write (counted, not timed),
        # then a random part of one write later: kills land at every phase of a write,
        # however busy the machine is.
        k = rng.randint(1, 3)
        progress, report = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(progress)
                _write_until_killed(directory, step, report, blob)
            finally:
                os._exit(1)
        os.close(report)
        try:
            write_s = _await_writes(progress, k)
            time.sleep(rng.uniform(0.0, write_s))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(progress)
        torn += any(directory.glob(".*.tmp"))
        found = find_resumable(directory, torch.device("cpu"))
        assert found is not None, f"no checkpoint loads after {k} completed writes"
        _, payload = found
        assert payload["step"] >= step + k  # every completed write is kept
        assert int(payload["model_state_dict"]["tag"]) == payload["step"]
        # latest.pt is whole and is the newest state written, even when the kill came
        # before that state's step file got its name.
        latest = load_checkpoint(directory / LATEST, torch.device("cpu"))
        assert latest["step"] == payload["step"]
        # Every named step file is whole, and none is ahead of latest.pt (a kill between
        # committing latest.pt and naming the step file loses only that file's name).
        named = list_checkpoints(directory)
        for path in named:
            assert load_checkpoint(path, torch.device("cpu"))["step"] <= payload["step"]
        step = payload["step"]
    assert step > trials, "too few writes completed to mean anything"
    assert torn > 0, "no kill landed inside a write"


def _run(tmp_path: Path, *extra: str) -> Path:
    run = tmp_path / "run"
    rc = main(["train", "--epochs", "1", "--batch_size", "32", "--output_dir", str(run), *extra])
    assert rc == 0
    return run


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("ddptrain: error: "), err
    return err


class _RunsCode:
    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))

    def __init__(self, marker: Path) -> None:
        self.marker = marker


def _bytes_read() -> int:
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")).split()[1])


def test_reading_a_checkpoints_progress_does_not_read_its_weights(tmp_path: Path) -> None:
    """Where a resume starts and whether a run finished are read from a checkpoint's
    metadata; its tensors are mapped, and read only when they are loaded."""
    directory = tmp_path / "ckpt"
    ctx = DistributedContext(0, 0, 1, torch.device("cpu"))
    weights = {"w": torch.ones(16_000_000)}  # 64 MB
    path = save_checkpoint(directory, 7, {"step": 7, "model_state_dict": weights}, ctx, 0)
    before = _bytes_read()
    payload = load_checkpoint(path, torch.device("cpu"))
    assert payload["step"] == 7
    assert _bytes_read() - before < 4_000_000, "the whole file was read for its progress"
    assert torch.equal(payload["model_state_dict"]["w"], weights["w"])  # and loads whole


def test_unusable_checkpoints_are_refused_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path)
    good = list_checkpoints(run / "checkpoints")[0]
    original = good.read_bytes()
    args = ["train", "--epochs", "2", "--batch_size", "32", "--output_dir", str(tmp_path / "r2")]

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(original[: len(original) // 2])
    assert "cannot be read" in _one_line(capsys, [*args, "--resume_from", str(truncated)])

    noise = tmp_path / "noise.pt"
    noise.write_bytes(os.urandom(4096))
    assert "cannot be read" in _one_line(capsys, [*args, "--resume_from", str(noise)])

    plain = tmp_path / "plain.pt"
    torch.save({"weights": torch.zeros(3)}, plain)
    assert "is not a ddptrain checkpoint" in _one_line(capsys, [*args, "--resume_from", str(plain)])

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps({"format": "ddptrain-checkpoint", "x": _RunsCode(marker)}))
    err = _one_line(capsys, [*args, "--resume_from", str(evil)])
    assert "it is not a torch zip file" in err and "a bare pickle is never loaded" in err
    torch.save({"format": "ddptrain-checkpoint", "x": _RunsCode(marker)}, evil)  # zipped
    assert not marker.exists()
    err = _one_line(capsys, [*args, "--resume_from", str(evil)])
    assert "pickled Python objects, which are refused" in err
    assert not marker.exists(), "loading the checkpoint ran its code"

    err = _one_line(capsys, [*args, "--width", "32", "--resume_from", str(good)])
    assert "does not fit this model" in err and "net.1.weight (32, 30) vs (64, 30)" not in err
    assert "shape mismatch" in err and "net.1.weight" in err

    digits = ["--dataset", "digits", "--model", "miniresnet", "--width", "8"]
    err = _one_line(capsys, [*args, *digits, "--resume_from", str(good)])
    assert "missing fc.bias" in err and "unexpected net.1.bias" in err
    assert good.read_bytes() == original  # nothing already written was touched


def test_auto_resume_skips_a_corrupt_newest_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    base = ["train", "--batch_size", "32", "--output_dir", str(run), "--log_interval", "3"]
    assert main([*base, "--epochs", "2"]) == 0
    newest = list_checkpoints(run / "checkpoints")[0]
    for damaged in (newest, run / "checkpoints" / LATEST):  # latest.pt is a copy: tear both
        damaged.write_bytes(damaged.read_bytes()[:100])
    assert main([*base, "--epochs", "2", "--resume_from", "auto"]) == 0
    # It went back to epoch 1's checkpoint and trained epoch 2 again.
    assert torch.load(newest, weights_only=True)["epoch"] == 2


def test_export_writes_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run / "checkpoints" / LATEST), str(out)]) == 0
    exported, final = load_file(str(out)), load_file(str(run / "model.safetensors"))
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    assert "it is not a torch zip file" in _one_line(
        capsys, ["export", str(out), str(tmp_path / "again.safetensors")]
    )
    assert "exists: give another name, or add --overwrite" in _one_line(
        capsys, ["export", str(run / "checkpoints" / LATEST), str(out)]
    )
    assert main(["export", str(run / "checkpoints" / LATEST), str(out), "--overwrite"]) == 0
    assert "holds no LoRA adapters" in _one_line(  # --adapter_only of a run without them
        capsys, ["export", str(run / "checkpoints" / LATEST), str(tmp_path / "adapter"),
                 "--adapter_only"])
    assert not (tmp_path / "adapter").exists()


# ---------------------------------------------------------------- streamed .pt saves
def test_a_pt_save_streams_to_its_file_without_a_copy_in_memory(tmp_path: Path) -> None:
    """The state goes straight to the file: no serialised copy of it is held (on rank 0 at
    10-100 GB that copy was a host OOM). tracemalloc sees Python's buffers, where that
    copy lived; the tensors' own memory is not counted."""
    import tracemalloc

    from ddptrain.checkpoint.common import atomic_save

    payload = {"w": torch.zeros(2 * 2**20)}  # 8 MiB
    tracemalloc.start()
    try:
        atomic_save(payload, tmp_path / "s.pt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak  # the state is 8 MiB
    assert torch.equal(torch.load(tmp_path / "s.pt")["w"], payload["w"])


def test_a_pt_save_on_a_full_disk_raises_its_oserror_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """torch's zip writer turns a failed write into a RuntimeError about file positions;
    the save raises the OSError (ENOSPC) it was, and neither the file nor its temporary
    remains."""
    import errno

    from ddptrain.checkpoint.common import atomic_save

    with tmpfs(tmp_path / "small", "size=256k") as mount:
        with pytest.raises(OSError) as caught:
            atomic_save({"w": torch.zeros(2**20)}, mount / "s.pt")  # 4 MiB
        assert caught.value.errno == errno.ENOSPC
        assert list(mount.iterdir()) == []
