"""`ddptrain evaluate` and `ddptrain predict`: a trained run's model rebuilt from its config
and weights, its metrics over a whole set and its outputs per sample, on 1 and 2 ranks.

Runs train in this process (the public CLI) into tmp directories; 2-rank checks run the
public API on real gloo ranks (`run_ranks`) and the CLI under torchrun.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from afterplug import net, samples, whole
from conftest import run_torchrun
from dist_utils import run_ranks
from safetensors.torch import load_file

import ddptrain
from ddptrain.cli import main
from ddptrain.errors import ConfigError
from ddptrain.files import publish
from ddptrain.train.predict import interleave

# The run's code, named again: a stored `module:fn` is not imported unless the command does.
CODE = ["--dataset", "afterplug:pair", "--model", "afterplug:net"]
CLS = [*CODE, "--batch_size", "16", "--epochs", "2", "--lr", "0.1", "--no-tensorboard"]
LM = ["--dataset", "chars", "--block_size", "16", "--width", "16", "--batch_size", "128",
      "--val_fraction", "0.1", "--optimizer", "adamw", "--lr", "0.01", "--epochs", "1",
      "--no-tensorboard"]


def last_val_row(run: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "val"][-1]


def assert_same_figures(figures: dict[str, float], row: dict[str, Any]) -> None:
    assert figures["samples"] == row["samples"]
    names = [k for k, v in figures.items() if k != "samples" and isinstance(v, float)]
    assert "loss" in names and len(names) >= 2
    for name in names:
        assert abs(figures[name] - row[name]) <= 1e-6 * max(1.0, abs(row[name])), name


def train(argv: list[str]) -> None:
    """Train in this process, without curves.png (drawing it costs seconds here)."""
    assert main(["train", "--no-curves", *argv]) == 0


@pytest.fixture(scope="module")
def cls_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("after") / "cls"
    train([*CLS, "--output_dir", str(run)])
    return run


def by_hand(run: Path) -> torch.Tensor:
    """The exported weights in a model built here, applied to the 101 validation inputs."""
    model = net(None, outputs=2)  # type: ignore[arg-type]
    model.load_state_dict(load_file(run / "model.safetensors"))
    with torch.no_grad():
        return model(samples()[0][64:])


def read_rows(path: Path) -> torch.Tensor:
    if path.suffix == ".npy":
        return torch.from_numpy(np.load(path))
    if path.suffix == ".pt":
        return torch.load(path, weights_only=True)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(len(lines)))
    return torch.tensor([line["prediction"] for line in lines])


def test_evaluate_equals_the_runs_last_validation_row(cls_run: Path, tmp_path: Path) -> None:
    row = last_val_row(cls_run)
    assert_same_figures(ddptrain.evaluate(cls_run, argv=CODE), row)  # model.safetensors
    latest = cls_run / "checkpoints" / "latest.pt"
    # the .pt carries its config
    assert_same_figures(ddptrain.evaluate(latest, trust_checkpoint_code=True), row)
    out = tmp_path / "metrics.json"
    assert main(["evaluate", str(cls_run), *CODE, "--batch_size", "7", "--output", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["split"] == "val" and written["source"].endswith("model.safetensors")
    assert_same_figures(written, row)
    # another set: the train half, which the run's last row does not describe
    train = ddptrain.evaluate(cls_run, split="train", argv=CODE)
    assert train["samples"] == 64 and train["loss"] != row["loss"]


def test_predict_writes_one_row_per_sample_in_order(cls_run: Path, tmp_path: Path) -> None:
    expected = by_hand(cls_run)
    for suffix in (".npy", ".pt", ".jsonl"):
        out = tmp_path / f"p{suffix}"
        assert ddptrain.predict(cls_run, out, argv=CODE, batch_size=16) == 101
        got = read_rows(out)
        assert got.shape == (101, 2)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "p.npy", "p.pt"]
    train = tmp_path / "train.npy"
    assert main(["predict", str(cls_run), "--trust_checkpoint_code", "--split", "train",
                 "--output", str(train)]) == 0
    assert np.load(train).shape == (64, 2)


class _Watching(torch.utils.data.Dataset):
    """The 101 validation samples; reading the last one notes how many rows the output
    already holds."""

    def __init__(self, out: Path) -> None:
        self.x, self.y = (t[64:] for t in samples())
        self.out, self.rows_before_last = out, -1

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == len(self.y) - 1:
            partial = list(self.out.parent.glob(f".{self.out.name}.*.tmp"))
            self.rows_before_last = sum(len(p.read_text().splitlines()) for p in partial)
        return self.x[i], self.y[i]


def test_predict_writes_as_it_goes(cls_run: Path, tmp_path: Path) -> None:
    """Rows reach the file a round at a time: memory holds a round, not the set."""
    out = tmp_path / "p.jsonl"
    watching = _Watching(out)
    train = torch.utils.data.TensorDataset(*(t[:64] for t in samples()))
    assert ddptrain.predict(cls_run, out, datasets=(train, watching), batch_size=16,
                            argv=["--model", "afterplug:net"]) == 101
    assert watching.rows_before_last == 96  # 6 rounds of 16 written; the 7th being read
    torch.testing.assert_close(read_rows(out), by_hand(cls_run), rtol=0, atol=1e-6)


def test_new_data_is_predicted_and_evaluated_whole_and_the_split_is_said(
    cls_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `--dataset` other than the run's, one dataset (which training would split 80/20),
    is taken whole, in its order, and the line says so; `--split` picks a part of it; the
    run's own data keeps its validation set, and `--split all` takes a pair's train then
    val."""
    model = net(None, outputs=2)  # type: ignore[arg-type]
    model.load_state_dict(load_file(cls_run / "model.safetensors"))
    new = ["--dataset", "afterplug:whole", "--model", "afterplug:net"]
    out = tmp_path / "p.npy"
    capsys.readouterr()
    assert main(["predict", str(cls_run), *new, "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert "predict: wrote 37 rows (all 37 of afterplug:whole)" in said, said
    inputs = whole(None).tensors[0]  # type: ignore[arg-type]
    with torch.no_grad():
        torch.testing.assert_close(read_rows(out), model(inputs), rtol=0, atol=1e-6)
    val = tmp_path / "val.npy"
    assert main(["predict", str(cls_run), *new, "--split", "val", "--output", str(val)]) == 0
    assert np.load(val).shape == (7, 2)
    assert ("predict: wrote 7 rows (the val split: 7 of the 37 samples of afterplug:whole; "
            "--split all takes every one)") in capsys.readouterr().out
    assert ddptrain.evaluate(cls_run, argv=new)["samples"] == 37
    assert ddptrain.evaluate(cls_run, argv=[*new, "--val_fraction", "0.5"], split="train",
                             )["samples"] == 19  # 37 - round(18.5)
    # the run's own data: its validation set by default, all of a pair is train then val
    assert ddptrain.predict(cls_run, tmp_path / "own.npy", argv=CODE) == 101
    both = tmp_path / "both.npy"
    assert main(["predict", str(cls_run), *CODE, "--split", "all", "--output", str(both)]) == 0
    assert "predict: wrote 165 rows (all 165 of afterplug:pair)" in capsys.readouterr().out
    with torch.no_grad():
        torch.testing.assert_close(read_rows(both), model(samples()[0]), rtol=0, atol=1e-6)
    figures = ddptrain.evaluate(cls_run, argv=CODE, split="all", output=tmp_path / "m.json")
    assert figures["samples"] == 165
    assert json.loads((tmp_path / "m.json").read_text())["split"] == "all"
    _one_line_exit_2(["predict", str(cls_run), *new, "--split", "every", "--output",
                      str(tmp_path / "x.npy")], capsys, "--split")
    with pytest.raises(ConfigError, match="choose val, train, all"):
        ddptrain.predict(cls_run, tmp_path / "x.npy", split="every", argv=new)


def _one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str], says: str) -> None:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddptrain: error: ") and says in err, err


def test_bad_inputs_are_one_line_and_exit_2(
    cls_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.npy"
    _one_line_exit_2(["evaluate", str(tmp_path / "nowhere")], capsys, "does not exist")
    _one_line_exit_2(["predict", str(cls_run), "--output", str(tmp_path / "p.csv")], capsys,
                     "unknown suffix")
    _one_line_exit_2(["predict", str(cls_run)], capsys, "--output")
    _one_line_exit_2(["evaluate", str(tmp_path)], capsys, "no config.yaml")
    # a damaged checkpoint: bytes flipped inside its tensor data
    step = sorted((cls_run / "checkpoints").glob("step_*.pt"))[-1]
    broken = tmp_path / "broken.pt"
    data = bytearray(step.read_bytes())
    weight = load_file(cls_run / "model.safetensors")["0.weight"].numpy().tobytes()
    at = bytes(data).find(weight[:16])
    assert at > 0
    data[at : at + 8] = bytes(8)
    broken.write_bytes(bytes(data))
    _one_line_exit_2(["predict", str(broken), *CODE, "--output", str(out)], capsys, "damaged")
    # a damaged export: the safetensors header cut
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_bytes((cls_run / "config.yaml").read_bytes())
    (run / "model.safetensors").write_bytes((cls_run / "model.safetensors").read_bytes()[:20])
    _one_line_exit_2(["evaluate", str(run), *CODE], capsys, "damaged")
    # 64 bytes flipped inside its tensor data: the checksums the export wrote catch them
    data = bytearray((cls_run / "model.safetensors").read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    (run / "model.safetensors").write_bytes(bytes(data))
    predict = ["predict", str(run), *CODE, "--output", str(out)]
    for command in (["evaluate", str(run), *CODE], predict):
        _one_line_exit_2(command, capsys, "model.safetensors' is damaged: tensor")
    init = ["train", *CLS, "--init_from", str(run / "model.safetensors"),
            "--output_dir", str(tmp_path / "init")]
    _one_line_exit_2(init, capsys, "does not match its checksum")
    _one_line_exit_2(["evaluate", str(cls_run), *CODE, "--width", "0"], capsys, "--width 0")
    assert not out.exists() and not list(tmp_path.glob(".*tmp*"))


def test_a_dcp_step_directory_evaluates_and_a_damaged_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "dcp"
    train([*CLS, "--epochs", "1", "--checkpoint_format", "dcp", "--output_dir", str(run)])
    (step,) = (run / "checkpoints").glob("step_*")
    assert step.is_dir()
    assert_same_figures(ddptrain.evaluate(step, argv=CODE), last_val_row(run))
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _one_line_exit_2(["evaluate", str(step), *CODE], capsys, "damaged")


def test_a_dcp_runs_latest_and_best_and_the_run_itself_are_taken_by_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`checkpoints/latest` and `best` of a DCP run are files naming a step directory:
    export, evaluate, --resume_from and --init_from take them, export takes the run."""
    run = tmp_path / "dcp"
    train([*CLS, "--checkpoint_format", "dcp", "--output_dir", str(run)])
    ckpts = run / "checkpoints"
    newest = sorted(ckpts.glob("step_*"))[-1]
    assert (ckpts / "latest").read_text().strip() == newest.name
    weights = {}
    for name, given in (("step", newest), ("latest", ckpts / "latest"),
                        ("best", ckpts / "best"), ("run", run)):
        out = tmp_path / f"{name}.safetensors"
        assert main(["export", str(given), str(out)]) == 0, capsys.readouterr().err
        weights[name] = load_file(out)
    best = (ckpts / "best").read_text().strip()
    for name in ("latest", "run") + (("best",) if best == newest.name else ()):
        assert weights[name].keys() == weights["step"].keys()
        assert all(torch.equal(weights[name][k], weights["step"][k]) for k in weights["step"])
    assert_same_figures(ddptrain.evaluate(ckpts / "latest", argv=CODE), last_val_row(run))
    train([*CLS, "--epochs", "3", "--resume_from", str(ckpts / "latest"),
           "--output_dir", str(tmp_path / "more")])
    more = [json.loads(x) for x in (tmp_path / "more" / "metrics.jsonl").read_text().splitlines()]
    assert {r["epoch"] for r in more} == {3}  # epochs 1-2 came from the checkpoint
    train([*CLS, "--epochs", "1", "--init_from", str(ckpts / "best"),
           "--output_dir", str(tmp_path / "init")])
    (ckpts / "latest").write_text("step_000000999\n")  # names a directory since removed
    _one_line_exit_2(["export", str(ckpts / "latest"), str(tmp_path / "x.safetensors")],
                     capsys, "step_000000999, which is not in")


PLANTED = """
from pathlib import Path

import afterplug

Path(__file__).with_name("imported").touch()


def build(config, outputs=2):
    Path(__file__).with_name("called").touch()
    return afterplug.net(config, outputs)
"""


def test_code_a_checkpoint_names_runs_only_when_the_command_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A downloaded checkpoint trained with `--model planted:build`, shipped with its
    `planted.py`, evaluated from its folder (where `python -m` imports from)."""
    folder = tmp_path / "downloaded"
    folder.mkdir()
    (folder / "planted.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(folder)
    train(["--dataset", "afterplug:pair", "--model", "planted:build", "--epochs", "1",
           "--no-tensorboard", "--output_dir", str(folder / "run")])
    ran = [folder / "imported", folder / "called"]
    for sources in (["run"], ["run/checkpoints/latest.pt"]):
        for mark in ran:
            mark.unlink(missing_ok=True)
        monkeypatch.delitem(sys.modules, "planted", raising=False)
        for command in ("evaluate", "predict"):
            _one_line_exit_2(
                [command, *sources, "--dataset", "afterplug:pair", "--output", "p.npy"], capsys,
                "names code to import and run (--model planted:build); ddptrain runs only "
                "code your command names: give --model planted:build again if you trust it, "
                "or add --trust_checkpoint_code",
            )
        assert not any(mark.exists() for mark in ran) and not Path("p.npy").exists()
    # Named again on the command line, in the user's --config file, or trusted: it runs.
    (folder / "mine.yaml").write_text("model: planted:build\n")
    for named in (["--model", "planted:build"], ["--config", "mine.yaml"],
                  ["--trust_checkpoint_code"]):
        for mark in ran:
            mark.unlink(missing_ok=True)
        monkeypatch.delitem(sys.modules, "planted", raising=False)
        assert main(["evaluate", "run", "--dataset", "afterplug:pair", *named]) == 0
        assert all(mark.exists() for mark in ran), named


def test_outputs_replace_no_file_unasked_and_stay_out_of_a_live_run(
    cls_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddptrain.launch.rundir import RunLock

    for command, name in (("predict", "p.npy"), ("evaluate", "m.json")):
        out = tmp_path / name
        out.write_bytes(b"the user's own file\n")
        _one_line_exit_2([command, str(cls_run), *CODE, "--output", str(out)], capsys,
                         f"--output {str(out)!r} exists: give another name, or add --overwrite")
        assert out.read_bytes() == b"the user's own file\n"
        assert main([command, str(cls_run), *CODE, "--output", str(out), "--overwrite"]) == 0
        assert out.read_bytes() != b"the user's own file\n"
    fifo = tmp_path / "fifo.npy"
    os.mkfifo(fifo)
    _one_line_exit_2(["predict", str(cls_run), *CODE, "--output", str(fifo), "--overwrite"],
                     capsys, "is not a regular file")
    # a run directory a live job holds: not even a new file goes in
    live = tmp_path / "live"
    lock = RunLock(live)
    lock.acquire()
    try:
        _one_line_exit_2(["predict", str(cls_run), *CODE, "--output", str(live / "p.npy")],
                         capsys, f"is inside the run directory {str(live)!r}, which a live run "
                         f"holds (host {socket.gethostname()} pid {os.getpid()})")
    finally:
        lock.release()
    assert main(["predict", str(cls_run), *CODE, "--output", str(live / "p.npy")]) == 0
    # a prediction killed mid-way left its temporary files; one still writing holds its own
    out = tmp_path / "again.pt"
    killed = [tmp_path / ".again.pt.4194000.tmp", tmp_path / ".again.pt.4194000.tmp.npy"]
    for path in killed:
        path.write_bytes(b"rows")
    writing = tmp_path / ".again.pt.4194001.tmp"
    with writing.open("wb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert main(["predict", str(cls_run), *CODE, "--output", str(out)]) == 0
        assert writing.exists() and not any(path.exists() for path in killed)


def test_a_file_that_appears_while_the_output_is_written_is_kept(tmp_path: Path) -> None:
    out, tmp = tmp_path / "p.npy", tmp_path / ".p.npy.tmp"
    tmp.write_text("rows")
    out.write_text("appeared")
    with pytest.raises(ConfigError, match="appeared while it was written"):
        publish(tmp, out, overwrite=False)
    assert out.read_text() == "appeared"
    publish(tmp, out, overwrite=True)
    assert out.read_text() == "rows" and not tmp.exists()


def test_a_run_of_any_layout_evaluates_on_one_process_without_layout_flags(
    cls_run: Path, tmp_path: Path
) -> None:
    """Evaluation runs the whole plain model on every rank and steps no optimizer: the
    tp x pp x HSDP layout and the optimizer a run trained with (here written into its
    config.yaml) ask for no `--tp 1 --pp 1`, and their stored code is not imported."""
    import yaml

    run = tmp_path / "laid_out"
    run.mkdir()
    config = yaml.safe_load((cls_run / "config.yaml").read_text())
    config.update(strategy="fsdp", dp_replicate=2, tp=2, pp=2, pp_microbatches=2,
                  pp_split="afterplug:net", tp_plan="afterplug:net", sequence_parallel=True,
                  optimizer="afterplug:net", scheduler="afterplug:net")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "model.safetensors").write_bytes((cls_run / "model.safetensors").read_bytes())
    assert_same_figures(ddptrain.evaluate(run, argv=CODE), last_val_row(cls_run))
    assert main(["predict", str(run), *CODE, "--output", str(tmp_path / "p.npy")]) == 0


def test_interleave_puts_the_ranks_rows_back_in_order() -> None:
    # 7 samples on 3 ranks, batch 2: round 2 holds samples 6 (rank 0) only
    shard = [torch.arange(r, 7, 3) for r in range(3)]
    first = interleave([s[:2] for s in shard])
    second = interleave([s[2:] if len(s) > 2 else None for s in shard])
    assert [int(r) for r in first + second] == list(range(7))
    assert [int(r) for r in interleave([torch.tensor([0, 2]), torch.tensor([1])])] == [0, 1, 2]


def test_rows_padded_per_batch_differ_between_ranks_and_go_to_jsonl(tmp_path: Path) -> None:
    """Two ranks' batches padded to their own longest sample: rank 0's rows are 3 wide,
    rank 1's 5. .jsonl takes rows of any shape; .npy says to use .jsonl."""
    from ddptrain.errors import ConfigError
    from ddptrain.train.predict import _writer

    rows = interleave([torch.zeros(2, 3), torch.ones(2, 5)])
    assert [tuple(r.shape) for r in rows] == [(3,), (5,), (3,), (5,)]
    sink = _writer(tmp_path / "p.jsonl", 4, overwrite=False)
    sink.write(rows)
    sink.close()
    lines = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [len(x["prediction"]) for x in lines] == [3, 5, 3, 5]
    npy = _writer(tmp_path / "p.npy", 4, overwrite=False)
    with pytest.raises(ConfigError, match=r"change shape from \(3,\) to \(5,\).*jsonl"):
        npy.write(rows)
    npy.abort()
    assert not (tmp_path / "p.npy").exists()


def _two_ranks(rank: int, run: Path, out: Path) -> dict[str, Any]:
    figures = ddptrain.evaluate(run, argv=CODE)
    # the order is the writers' input
    ddptrain.predict(run, out / "two.npy", argv=CODE, batch_size=16)
    return figures


@pytest.mark.heavy
@pytest.mark.slow
def test_two_ranks_evaluate_and_predict_as_one(cls_run: Path, tmp_path: Path) -> None:
    """101 samples on 2 ranks (shards of 51 and 50): no sample twice, none left out."""
    figures = run_ranks(_two_ranks, 2, tmp_path, cls_run, tmp_path)
    row = last_val_row(cls_run)
    for rank_figures in figures:
        assert_same_figures(rank_figures, row)
    one = tmp_path / "one.npy"
    ddptrain.predict(cls_run, one, argv=CODE, batch_size=16)
    expected = read_rows(one)
    torch.testing.assert_close(expected, by_hand(cls_run), rtol=0, atol=1e-6)
    got = read_rows(tmp_path / "two.npy")
    assert got.shape == (101, 2)
    # Equal to the last bits only where a row sat at the same place in a batch of the
    # same size: a BLAS kernel rounds a row by its position in the batch.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    nearest = torch.cdist(got, expected).argmin(1)
    assert nearest.tolist() == list(range(101))  # each row is its own sample's


@pytest.mark.heavy
@pytest.mark.slow
def test_lm_evaluate_on_one_and_two_ranks_equals_the_last_row(tmp_path: Path) -> None:
    """The built-in GPT on chars: perplexity and token accuracy from token-weighted sums."""
    run = tmp_path / "lm"
    train([*LM, "--output_dir", str(run)])
    row = last_val_row(run)
    assert_same_figures(ddptrain.evaluate(run), row)
    out = tmp_path / "m.json"
    done = run_torchrun(2, ["evaluate", str(run), "--output", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert "perplexity" in figures
    assert_same_figures(figures, row)


def test_a_stored_trust_remote_code_runs_only_when_the_command_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A downloaded run whose config stores `model: hf:DIR` with `model_args:
    {trust_remote_code: true}`, DIR's config.json naming its own module (`auto_map`):
    evaluate and predict import none of it unless the command names that entry again."""
    pytest.importorskip("transformers")
    import transformers.dynamic_module_utils as dynamic
    import yaml
    from transformers import GPT2Config, GPT2LMHeadModel

    from ddptrain.train.inference import Source, source_config

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    pretrained = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=30, n_positions=16, n_embd=8, n_layer=1,
                               n_head=2)).save_pretrained(pretrained)
    config = json.loads((pretrained / "config.json").read_text())
    config.update(auto_map={"AutoConfig": "planted.PlantedConfig"})
    (pretrained / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (pretrained / "planted.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "dataset": "hfplug:sentiment", "model": f"hf:{pretrained}",
        "model_args": {"trust_remote_code": True}}))
    (run / "model.safetensors").write_bytes(b"")  # never read: refused before
    says = ("names code to import and run (--model_args trust_remote_code=true); ddptrain "
            "runs only code your command names: give --model_args trust_remote_code=true "
            "again if you trust it, or add --trust_checkpoint_code")
    data = ["--dataset", "hfplug:sentiment"]
    for command in (["evaluate", str(run), *data],
                    ["predict", str(run), *data, "--output", str(tmp_path / "p.npy")],
                    ["evaluate", str(run), *data, "--model_args", "num_labels=2"]):
        _one_line_exit_2(command, capsys, says)
        assert not marker.exists(), command
    # dataset_args and task_args the same way, named by the field
    for field in ("dataset_args", "task_args"):
        stored = Source({"dataset": "digits", field: {"loader": {"trust_remote_code": True}}},
                        run / "model.safetensors")
        with pytest.raises(ConfigError, match=f"give --{field} loader="):
            source_config(stored)
        assert source_config(stored, [f"--{field}", "loader={trust_remote_code: true}"])
    # Named again (or trusted), it runs: the directory's module is imported
    for named in (["--model_args", "trust_remote_code=true"], ["--trust_checkpoint_code"]):
        marker.unlink(missing_ok=True)
        for module in [m for m in sys.modules if m.startswith("transformers_modules")]:
            monkeypatch.delitem(sys.modules, module)  # imported again, as in a new process
        main(["evaluate", str(run), *data, *named])
        assert marker.exists(), named
