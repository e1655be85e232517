"""`--pack`: token documents packed end to end into windows, each document positioned and
attending on its own, no token predicted across a boundary. A document scored in a
packed window has the loss and the gradients it has alone (the built-in GPT, and a
Hugging Face Llama through its 4-D attention mask); windows are samples like any other,
so two ranks equal one. Bad input is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import run_torchrun
from packplug import VOCAB, Documents

from ddptrain.cli import main
from ddptrain.data.batch import ModelCall
from ddptrain.data.pack import IGNORE, Packed
from ddptrain.models.gpt import build_gpt


def test_windows_hold_every_token_in_order_with_positions_and_labels_per_document() -> None:
    docs = Documents([5, 3, 11, 1, 4], seed=0)
    packed = Packed(docs, 8, "docs")
    windows = [packed[w] for w in range(len(packed))]
    assert len(packed) == 3  # 24 tokens in windows of 8
    stream = torch.cat([w["input_ids"] for w in windows])
    assert torch.equal(stream, torch.cat(docs.docs))
    # pieces: [5, 3] | [8 of 11] | [3 of 11, 1, 4]
    expected_pos = torch.cat([torch.arange(5), torch.arange(3), torch.arange(8),
                              torch.arange(3), torch.arange(1), torch.arange(4)])
    positions = torch.cat([w["position_ids"] for w in windows])
    assert torch.equal(positions, expected_pos)
    labels = torch.cat([w["labels"] for w in windows])
    assert torch.equal(labels == IGNORE, positions == 0)  # each piece's first token only
    assert packed.trained == 4 + 2 + (7 + 2) + 0 + 3  # 11 cut in two: each piece's first
    rows = Packed(Documents([5, 3, 11, 1, 4], seed=0, as_dicts=True), 8, "rows")  # HF rows
    assert all(torch.equal(rows[w]["input_ids"], windows[w]["input_ids"]) for w in range(3))
    padded = Packed(Documents([5, 4], seed=0), 8, "docs")[1]  # 9 tokens: one padded window
    assert padded["labels"][1:].eq(IGNORE).all() and padded["position_ids"][1:].tolist() == \
        list(range(7))


def _alone_and_packed(model: Any, call: ModelCall, docs: list[torch.Tensor], block: int,
                      apart: bool = True):
    """Per-document summed losses and gradients: each alone, and all in one window
    (`apart`: with the window's positions, else as one sequence)."""
    def losses(ids: torch.Tensor, labels: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
        out = call(model, {"input_ids": ids[None], **{k: v[None] for k, v in extra.items()}})
        logits = out.prediction[0, :-1]
        return F.cross_entropy(logits, labels[1:], ignore_index=IGNORE, reduction="none")

    model.zero_grad()
    alone = [losses(d, d).sum() for d in docs]
    sum(alone).backward()
    grads_alone = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    window = Packed(Documents([len(d) for d in docs], seed=0), block, "docs")
    window.documents.docs = docs  # type: ignore[attr-defined]
    w = window[0]
    per_token = losses(w["input_ids"], w["labels"],
                       **({"position_ids": w["position_ids"]} if apart else {}))
    ends = torch.cumsum(torch.tensor([len(d) for d in docs]), 0)
    packed = [per_token[max(int(a) - 1, 0):int(b) - 1].sum()
              for a, b in zip([0, *ends[:-1].tolist()], ends.tolist(), strict=True)]
    sum(packed).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return alone, packed, grads_alone, grads


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_document_in_a_packed_window_has_its_own_loss_and_gradients(kind: str) -> None:
    torch.manual_seed(0)
    if kind == "gpt":
        model: Any = build_gpt(VOCAB, 32, 32)
    else:
        transformers = pytest.importorskip("transformers")
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32))
    model.eval()
    docs = Documents([7, 12, 5, 8], seed=3).docs  # 32 tokens: one window
    alone, packed, grads_alone, grads = _alone_and_packed(
        model, ModelCall(model, packed=True), docs, 32)
    for a, b in zip(alone, packed, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert grads.keys() == grads_alone.keys()
    for name, g in grads_alone.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=0, msg=name)
    # the check can fail: as one sequence, the documents see each other
    together = _alone_and_packed(model, ModelCall(model, packed=True), docs, 32, apart=False)
    assert (together[1][1] - alone[1]).abs() > 1e-3


def _job() -> list[str]:
    return ["train", "--dataset", "packplug:documents", "--pack", "--block_size", "32",
            "--model", "gpt", "--width", "32", "--epochs", "2", "--optimizer", "sgd",
            "--lr", "0.1", "--momentum", "0.9", "--max_grad_norm", "1.0", "--num_workers", "0",
            "--log_interval", "1", "--no-tensorboard", "--no-curves"]


def test_a_packed_run_says_how_much_of_its_windows_it_trains(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main([*_job(), "--batch_size", "4", "--output_dir", str(run)]) == 0
    out = capfd.readouterr()
    said = [x for x in (out.out + out.err).splitlines() if "--pack: 48 documents" in x]
    assert len(said) == 1 and "of window positions trained" in said[0], said
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "lm" and summary["val_perplexity"] > 0


@pytest.mark.parametrize("args, says", [
    (["--dataset", "digits", "--pack"], "--pack packs token documents, and --dataset 'digits'"),
    (["--dataset", "packplug:floats", "--pack"], "gives (5,) torch.float32"),
    (["--dataset", "packplug:documents", "--pack", "--pp", "2"], "a mask that --pp does not"),
    (["--dataset", "packplug:documents", "--pack", "--tp", "2", "--sequence_parallel"],
     "a mask that --sequence_parallel does not"),
])
def test_bad_packing_is_one_line_and_exit_2(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert main(["train", *args, "--output_dir", str(tmp_path / "run")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptrain: error:") and says in err[0], err


@pytest.mark.slow
def test_two_ranks_of_packed_windows_equal_one(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([*_job(), "--batch_size", "4", "--output_dir", str(one)]) == 0
    done = run_torchrun(2, [*_job(), "--batch_size", "2", "--output_dir", str(two)],
                        cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    from procs import weights

    for name, value in weights(one).items():
        torch.testing.assert_close(weights(two)[name], value, atol=1e-5, rtol=0, msg=name)


def test_a_stream_of_documents_packs_as_the_dataset_does_and_resumes_by_windows() -> None:
    from ddptrain.data.pack import PackedStream

    docs = Documents([5, 3, 11, 1, 4, 9, 2], seed=0)

    class InOrder(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(docs.docs)

    packed = Packed(docs, 8, "docs")
    stream = PackedStream(InOrder(), 8, "docs")
    got = list(stream)
    assert len(got) == len(packed) == 5
    for w, window in enumerate(got):
        for key, value in packed[w].items():
            assert torch.equal(window[key], value), (w, key)
    # its position is the windows given: a fresh one told it skips them
    again = PackedStream(InOrder(), 8, "docs")
    it = iter(again)
    next(it), next(it)
    state = again.state_dict()
    resumed = PackedStream(InOrder(), 8, "docs")
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert state == {"windows": 2} and len(rest) == 3
    assert all(torch.equal(a["input_ids"], b["input_ids"])
               for a, b in zip(rest, got[2:], strict=True))


@pytest.mark.slow
def test_a_packed_stream_in_two_loader_workers_resumes_mid_epoch_bitwise(
    tmp_path: Path
) -> None:
    from procs import assert_bitwise, sigkill_then_resume, weights

    job = ["train", "--dataset", "packplug:stream", "--pack", "--block_size", "32",
           "--model", "packplug:killable_gpt", "--width", "32", "--epochs", "2",
           "--batch_size", "2", "--num_workers", "2", "--optimizer", "sgd", "--lr", "0.1",
           "--log_interval", "1", "--save_every_steps", "2", "--no-tensorboard"]
    reference = tmp_path / "reference"
    done = run_torchrun(2, [*job, "--output_dir", str(reference)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 1 dies at its 4th forward of the first epoch (checkpoint at step 2)
    resumed = tmp_path / "resumed"
    log = sigkill_then_resume(2, job, resumed, tmp_path, kill_at=4)
    assert "restarts from its beginning" not in log.stderr
    assert_bitwise(weights(resumed), weights(reference))


def test_the_trained_share_counts_each_piece_a_window_cuts_and_none_is_refused() -> None:
    """`trained` is what the windows' labels train (a cut document's second piece loses its
    first token too), so the logged share is true; windows that train nothing (no loss to
    count: a loss of nan, logged as trained) are refused."""
    from ddptrain.errors import ConfigError

    for lengths, block in (([5, 3, 11, 1, 4], 8), ([1, 2, 1, 9, 30, 2], 2), ([7], 3)):
        packed = Packed(Documents(lengths, seed=0), block, "docs")
        labels = torch.cat([packed[w]["labels"] for w in range(len(packed))])
        assert packed.trained == int((labels != IGNORE).sum()), (lengths, block)
    for lengths, block in (([4, 5], 1), ([1, 1, 1], 8), ([1, 2], 2)):  # [1, 2]: cut 1 | 1
        with pytest.raises(ConfigError, match="leaves no token to predict"):
            Packed(Documents(lengths, seed=0), block, "docs")
    from packplug import DocumentStream

    from ddptrain.data.pack import PackedStream

    stream = PackedStream(DocumentStream(Documents([1] * 5, seed=0)), 4, "docs")
    with pytest.raises(ConfigError, match="leaves no token to predict"):  # after a pass
        list(stream)


@pytest.mark.parametrize("args, says", [
    (["--dataset", "packplug:documents", "--block_size", "1"],
     "--block_size 1 is invalid: --pack predicts each token of a window from those before"),
    (["--dataset", "packplug:single_tokens", "--block_size", "8"],
     "'packplug:single_tokens' leaves no token to predict in windows of 8"),
    (["--dataset", "packplug:bad_ids"], "document 3 of --dataset 'packplug:bad_ids' holds "
     "token id 20, outside the dataset's vocabulary of 20"),
    (["--dataset", "packplug:bad_ids", "--dataset_args", "token=-1"],
     "holds token id -1, and token ids count from 0"),
    # a stream's documents are checked as its windows are built: the first bad one
    (["--dataset", "packplug:bad_ids", "--dataset_args", "token=25", "stream=true"],
     "document 26 of --dataset 'packplug:bad_ids' (a stream) holds token id 25"),
])
def test_packed_documents_that_cannot_train_are_one_line_and_exit_2(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    run = tmp_path / "run"
    assert main(["train", *args, "--pack", "--model", "gpt", "--width", "16", "--epochs", "1",
                 "--no-tensorboard", "--no-curves", "--output_dir", str(run)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddptrain: error:") and says in err[0], err
    assert not (run / "model.safetensors").exists()


@pytest.mark.parametrize("saved, workers", [(2, 1), (2, 0), (0, 2), (2, 2), (0, 0)])
def test_a_packed_stream_resumed_with_other_loader_workers_restarts_its_epoch(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], saved: int, workers: int
) -> None:
    """A packed stream stopped mid-epoch with `saved` DataLoader workers (its position:
    each worker's, torchdata's; without workers the stream's own) and resumed with another
    `--num_workers`: the saved position is not one this loader can take, so the
    interrupted epoch restarts, with one warning naming why (not torchdata's
    AssertionError, or a KeyError, on every rank at every try). With as many workers as
    before it goes on where it stood."""
    pytest.importorskip("torchdata")
    from steerplug import StopAt

    from ddptrain import fit

    run = tmp_path / "run"
    settings: dict[str, Any] = {
        "dataset": "packplug:stream", "pack": True, "block_size": 32, "model": "gpt",
        "width": 32, "epochs": 2, "batch_size": 4, "num_workers": saved, "optimizer": "sgd",
        "lr": 0.1, "log_interval": 1, "save_every_steps": 2, "tensorboard": False,
        "output_dir": str(run),
    }
    stopped = fit(hooks=[StopAt(step=2)], **settings)
    assert stopped["steps"] == 2 and stopped["stopped_early"]
    capfd.readouterr()
    done = fit(**{**settings, "num_workers": workers, "resume_from": "auto"})
    assert not done.get("stopped_early")
    said = capfd.readouterr()
    warned = [x for x in (said.out + said.err).splitlines() if "restarts from its beginning" in x]
    if saved == workers:
        assert not warned, warned
        return
    assert len(warned) == 1, warned
    assert f"--num_workers {saved}, this run has {workers}" in warned[0], warned
