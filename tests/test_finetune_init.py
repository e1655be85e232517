"""Fine-tuning from weights already there: `--init_from` (a safetensors file, a run
directory, a `.pt` checkpoint, a DCP step directory) and `--model hf:DIR`.

A run started from another run's weights with `--lr 0` ends with those weights, bit for
bit: every tensor was loaded, and nothing else (optimizer, schedule, progress) came with
it. Weights that do not fit are one line and exit 2 before anything is written. A Hugging
Face directory fine-tuned on 2 ranks leaves `hf/`, which `from_pretrained` loads into a
model that reproduces the run's validation loss.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_torchrun, write_npz
from dist_utils import run_ranks
from procs import assert_bitwise, weights

from ddptrain.checkpoint import list_checkpoints, list_step_dirs
from ddptrain.cli import main


def _job(data: Path) -> list[str]:
    return ["train", "--dataset", str(data), "--model", "mlp", "--width", "16",
            "--batch_size", "16", "--epochs", "1", "--num_workers", "0", "--no-tensorboard",
            "--no-curves",
            "--optimizer", "adamw", "--weight_decay", "0.1"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Two finished one-process runs: one writes .pt files, the other DCP step directories."""
    root = tmp_path_factory.mktemp("sources")
    data = write_npz(root / "data.npz", 160)
    for name, fmt in (("pt", "file"), ("dcp", "dcp")):
        assert main([*_job(data), "--lr", "0.05", "--checkpoint_format", fmt,
                     "--output_dir", str(root / name)]) == 0
    yield {"data": data, "pt": root / "pt", "dcp": root / "dcp"}


@pytest.mark.parametrize("kind", ["safetensors", "run_dir", "pt", "dcp"])
def test_a_run_started_from_weights_at_lr_0_ends_with_them(
    kind: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    run = sources["dcp" if kind == "dcp" else "pt"]
    source = (
        run / "model.safetensors" if kind == "safetensors"
        else run if kind == "run_dir"
        else list_checkpoints(run / "checkpoints")[0] if kind == "pt"
        else list_step_dirs(run / "checkpoints")[0]
    )
    out = tmp_path / "fine"
    # the weight average (--ema_decay) starts from the loaded weights too
    ema = ["--ema_decay", "0.5"] if kind == "safetensors" else []
    assert main([*_job(sources["data"]), "--lr", "0", "--init_from", str(source),
                 "--output_dir", str(out), *ema]) == 0
    assert_bitwise(weights(out), weights(run))
    if ema:
        from safetensors.torch import load_file

        assert_bitwise(load_file(str(out / "model_ema.safetensors")), weights(run))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == json.loads((run / "summary.json").read_text())["steps"]


def test_weights_of_another_architecture_are_one_line_and_nothing_is_written(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fine"
    code = main([*_job(sources["data"]), "--width", "8", "--init_from", str(sources["pt"]),
                 "--output_dir", str(out)])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2
    assert " INFO run " not in captured.out  # refused before the directory was claimed
    assert len(err) == 1 and err[0].startswith("ddptrain: error: --init_from"), err
    assert "5 of another shape" in err[0] and "net.1.weight (16, 6) vs (8, 6)" in err[0]
    assert "(+1 more)" in err[0]
    assert not out.exists()


def test_not_strict_loads_what_fits_and_a_resume_wins(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A model with a wider head: the rest of the weights fit, the last layer does not.
    data = write_npz(tmp_path / "five.npz", 160, classes=5)
    out = tmp_path / "fine"
    job = [*_job(data), "--lr", "0", "--init_from", str(sources["pt"]), "--output_dir", str(out)]
    assert main([*job, "--no-init_strict"]) == 0
    got, src = weights(out), weights(sources["pt"])
    assert "2 of another shape" in capsys.readouterr().out
    head = {"net.5.weight", "net.5.bias"}
    assert_bitwise({k: v for k, v in got.items() if k not in head},
                   {k: v for k, v in src.items() if k not in head})
    assert not torch.equal(got["net.5.bias"][:3], src["net.5.bias"])
    # A second start in the same directory resumes its own checkpoint: no new start.
    assert main([*job, "--no-init_strict", "--epochs", "2", "--resume_from", "auto"]) == 0
    out = capsys.readouterr().out
    assert "is ignored: the run resumes from" in out
    assert "initial weights from" not in out


def test_a_damaged_checkpoint_is_refused(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.pt"
    raw = bytearray(list_checkpoints(sources["pt"] / "checkpoints")[0].read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 64] = bytes(b ^ 0xFF for b in raw[middle:middle + 64])
    broken.write_bytes(bytes(raw))
    out = tmp_path / "fine"
    assert main([*_job(sources["data"]), "--init_from", str(broken),
                 "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {str(broken)!r} is damaged: tensor" in err, err
    assert not out.exists()


def _fit(rank: int, job: dict[str, Any]) -> None:
    from ddptrain import TrainingConfig, fit

    fit(TrainingConfig(**job))


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize(("strategy", "kind"), [("ddp", "pt"), ("fsdp", "dcp")])  # zero: as ddp
def test_initial_weights_reach_every_rank(
    strategy: str, kind: str, sources: dict[str, Path], tmp_path: Path
) -> None:
    """Rank 0 reads the weights and the others receive them (fsdp: each keeps its shard)."""
    checkpoints = sources[kind] / "checkpoints"
    source = list_checkpoints(checkpoints)[0] if kind == "pt" else list_step_dirs(checkpoints)[0]
    job = dict(dataset=str(sources["data"]), model="mlp", width=16, batch_size=8, epochs=1,
               num_workers=0, tensorboard=False, curves=False, optimizer="adamw", lr=0.0,
               strategy=strategy,
               init_from=str(source), output_dir=str(tmp_path / "run"))
    run_ranks(_fit, 2, tmp_path, job)
    assert_bitwise(weights(tmp_path / "run"), weights(sources[kind]))


def _tiny_gpt2(directory: Path) -> Path:
    """A one-layer GPT-2 saved as Hugging Face's `save_pretrained` does."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(
        vocab_size=30, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )).save_pretrained(directory)
    return directory


def test_a_hugging_face_directory_runs_no_code_of_its_own_and_its_load_is_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    pretrained = _tiny_gpt2(tmp_path / "tiny-gpt2")
    job = ["train", "--dataset", "hfplug:sentiment", "--model", f"hf:{pretrained}",
           "--epochs", "1", "--batch_size", "32", "--no-tensorboard"]
    # As a sequence classifier: the new head starts fresh, told in one line of ours, not
    # transformers' multi-line load report
    capfd.readouterr()
    assert main([*job, "--output_dir", str(tmp_path / "cls")]) == 0
    out = capfd.readouterr()
    assert "LOAD REPORT" not in out.out + out.err
    assert (f"--model hf:{pretrained}: AutoModelForSequenceClassification starts 1 tensor(s) "
            "fresh (score.weight)") in out.out + out.err
    # The run's hf/ carries its shards' checksums: a flipped byte is refused, not trained on
    exported = tmp_path / "cls" / "hf"
    shard = exported / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0xFF
    shard.write_bytes(bytes(data))
    for args in (["--model", f"hf:{exported}"], ["--model", f"hf:{pretrained}", "--init_from",
                                                 str(exported)]):
        assert main([*job, *args, "--output_dir", str(tmp_path / "again")]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is damaged: model.safetensors does not match its checksum" \
            in err[0], err
    # A directory that brings its own code (auto_map, a model type transformers lacks):
    # one line, the code never imported, no [y/N] question
    config = json.loads((pretrained / "config.json").read_text())
    config.update(model_type="planted", auto_map={"AutoConfig": "planted.PlantedConfig"})
    (pretrained / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (pretrained / "planted.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    assert main([*job, "--output_dir", str(tmp_path / "planted")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds its own Python code (auto_map in its config.json)" in err[0]
    assert "add --model_args trust_remote_code=true" in err[0] and not marker.exists(), err


@pytest.mark.slow
@pytest.mark.heavy
def test_a_hugging_face_directory_fine_tunes_on_two_ranks_and_leaves_hf(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import hfplug
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    pretrained = tmp_path / "tiny-gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(
        vocab_size=20, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
    )).save_pretrained(pretrained)
    (pretrained / "tokenizer_config.json").write_text('{"model_max_length": 32}\n')
    run = tmp_path / "run"
    proc = run_torchrun(2, [
        "train", "--dataset", "hfplug:counting", "--model", f"hf:{pretrained}",
        "--epochs", "2", "--batch_size", "8", "--optimizer", "adamw", "--lr", "0.01",
        "--output_dir", str(run), "--no-tensorboard",
    ], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "lm" and summary["world_size"] == 2

    tuned = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert isinstance(tuned, GPT2LMHeadModel)
    assert tuned.lm_head.weight.data_ptr() == tuned.transformer.wte.weight.data_ptr()
    assert (run / "hf" / "tokenizer_config.json").read_text() == '{"model_max_length": 32}\n'
    start = AutoModelForCausalLM.from_pretrained(pretrained)
    assert not torch.equal(start.transformer.h[0].mlp.c_fc.weight,
                           tuned.transformer.h[0].mlp.c_fc.weight)  # it trained
    _, val = hfplug.counting(None)
    tuned.eval()
    with torch.no_grad():
        batch = {k: torch.stack([item[k] for item in val.items]) for k in val.items[0]}
        loss = tuned(**batch).loss
    assert float(loss) == pytest.approx(summary["val_loss"], rel=1e-5)


def _with_metadata(path: Path, out: Path, change: Any) -> None:
    """`path`, a safetensors file, written to `out` with `change(metadata)` made to its
    header's metadata and nothing else (the tensors' bytes and offsets as they were)."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    change(header["__metadata__"])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    out.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])


def test_a_tie_added_to_a_runs_weights_is_damage_not_another_model(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tied:ALIAS` in `model.safetensors`' metadata makes a loader read one tensor for
    another: the metadata carries its own checksum, so an added tie (with or without that
    checksum) is damage to evaluate, predict and --init_from, one line, exit 2."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_bytes((sources["pt"] / "config.yaml").read_bytes())
    weights_file = run / "model.safetensors"
    _with_metadata(sources["pt"] / "model.safetensors", weights_file, lambda m: None)
    assert main(["evaluate", str(run)]) == 0  # the header rewritten as it was: whole

    def tie(metadata: dict[str, str]) -> None:
        metadata["tied:net.3.bias"] = "net.1.bias"  # both (16,): it would load

    def tie_unsummed(metadata: dict[str, str]) -> None:
        tie(metadata)
        metadata.pop("ddptrain:metadata", None)

    for change in (tie, tie_unsummed):
        _with_metadata(sources["pt"] / "model.safetensors", weights_file, change)
        for command in (["evaluate", str(run)],
                        ["predict", str(run), "--output", str(tmp_path / "p.npy")],
                        [*_job(sources["data"]), "--init_from", str(weights_file),
                         "--output_dir", str(tmp_path / "fine")]):
            capsys.readouterr()
            assert main(command) == 2, (change.__name__, command)
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("ddptrain: error: ") and (
                "model.safetensors' is damaged: its metadata" in err), err
        assert not (tmp_path / "p.npy").exists() and not (tmp_path / "fine").exists()


def test_an_exported_hf_directory_is_checked_whole_its_index_and_its_set_of_files(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`hf/`'s ddptrain_checksums.json covers every file a loader reads (the shards, their
    index, config.json) and the set of files: an index pointed at an added shard (a zeroed
    weight), an added shard alone, a changed index or config are damage to `--model
    hf:DIR` and `--init_from DIR`, one line each, exit 2. A tokenizer file that is a link
    in the source directory is not copied into `hf/`."""
    pytest.importorskip("transformers")
    import shutil

    from safetensors.torch import load_file, save_file

    from ddptrain.errors import ConfigError
    from ddptrain.files import SUMS_FILE, sums_damage
    from ddptrain.models.hf import build_hf

    pretrained = _tiny_gpt2(tmp_path / "tiny-gpt2")
    (tmp_path / "secret").write_text("a secret\n")
    (pretrained / "tokenizer_config.json").symlink_to(tmp_path / "secret")
    (pretrained / "vocab.json").write_text("{}\n")
    job = ["train", "--dataset", "hfplug:sentiment", "--epochs", "1", "--batch_size", "32",
           "--no-tensorboard", "--no-curves"]
    assert main([*job, "--model", f"hf:{pretrained}", "--export_shard_mb", "0.005",
                 "--output_dir", str(tmp_path / "cls")]) == 0
    exported = tmp_path / "cls" / "hf"
    assert not (exported / "tokenizer_config.json").exists()  # a link: left out
    assert (exported / "vocab.json").read_text() == "{}\n"
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # shards and their index
    assert sums_damage(exported) is None and set(json.loads((exported / SUMS_FILE).read_text(
    ))) == {p.name for p in exported.iterdir()} - {SUMS_FILE}  # every file, summed
    name = "transformer.h.0.mlp.c_fc.weight"
    zeroed = {name: torch.zeros_like(load_file(exported / index["weight_map"][name])[name])}

    def pointed(hf: Path) -> None:  # the index names an added shard for one weight
        save_file(zeroed, str(hf / "model-zero.safetensors"), metadata={"format": "pt"})
        moved = {**index, "weight_map": {**index["weight_map"], name: "model-zero.safetensors"}}
        (hf / "model.safetensors.index.json").write_text(json.dumps(moved, indent=2) + "\n")

    def added(hf: Path) -> None:  # a weight file no index names
        save_file(zeroed, str(hf / "model-zero.safetensors"), metadata={"format": "pt"})

    def reindexed(hf: Path) -> None:  # the same index, written otherwise
        (hf / "model.safetensors.index.json").write_text(json.dumps(index))

    def configured(hf: Path) -> None:
        config = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1.0}))

    says = {pointed: "model-zero.safetensors is not among the files",
            added: "model-zero.safetensors is not among the files",
            reindexed: "model.safetensors.index.json holds",  # ... bytes, ... were written
            configured: "config.json holds"}
    capfd.readouterr()
    for change, what in says.items():
        hf = tmp_path / change.__name__
        shutil.copytree(exported, hf, symlinks=True)
        change(hf)
        for args in (["--model", f"hf:{hf}"],
                     ["--model", f"hf:{pretrained}", "--init_from", str(hf)]):
            assert main([*job, *args, "--output_dir", str(tmp_path / "again")]) == 2, (
                change.__name__, args)
            err = capfd.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "is damaged: " + what in err[0], (change.__name__, err)
        assert not (tmp_path / "again").exists()
        if change is configured:  # built on the meta device (fsdp, tp, pp): checked first
            with torch.device("meta"), pytest.raises(ConfigError, match=r"config\.json holds"):
                build_hf(f"hf:{hf}", {}, "classification", 2, torch.device("meta"))


def test_a_tokenizer_file_that_is_a_link_or_no_regular_file_is_not_copied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`hf/` takes the source directory's tokenizer files that are regular files; a link
    (to a secret, say) and a FIFO are left out, with one warning naming them."""
    import logging
    import os

    from ddptrain.checkpoint.export import _copy_tokenizer

    source, out = tmp_path / "source", tmp_path / "out"
    source.mkdir()
    out.mkdir()
    (tmp_path / "secret").write_text("a secret\n")
    (source / "tokenizer_config.json").symlink_to(tmp_path / "secret")
    os.mkfifo(source / "tokenizer.json")  # read, it would block the export
    (source / "vocab.json").write_text('{"a": 0}\n')
    (source / "tokenizer_extra").mkdir()  # a directory: not a tokenizer file, passed over
    logger = logging.getLogger("ddptrain")
    logger.addHandler(caplog.handler)
    try:
        _copy_tokenizer(source, out)
    finally:
        logger.removeHandler(caplog.handler)
    assert sorted(p.name for p in out.iterdir()) == ["vocab.json"]
    assert (out / "vocab.json").read_text() == '{"a": 0}\n'
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 file(s)" in warnings[0], warnings
    assert "tokenizer.json" in warnings[0] and "tokenizer_config.json" in warnings[0]
