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


def test_a_hugging_face_directory_runs_no_code_of_its_own_and_its_load_is_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    pretrained = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(
        vocab_size=30, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )).save_pretrained(pretrained)
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
