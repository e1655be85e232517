"""`--dataset text:PATH`: documents of `.jsonl`, `.jsonl.gz` and `.parquet` files (a glob
of shards read in sorted order) tokenized with the model's tokenizer, each ending with the
end-of-sequence token; the token stream is the one expected, packed or cut into windows;
bad rows are named once; a run trains the built-in GPT on text end to end."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import one_error_line

from ddptrain.config import TrainingConfig
from ddptrain.data.pack import IGNORE
from ddptrain.data.rowfiles import Rows, files_of
from ddptrain.data.sources import load_data, split_indices
from ddptrain.data.tokenized import texts, token_stream

pytest.importorskip("transformers")

SHARDS = [
    ["the cat sat on a mat", "a dog ran"],
    ["hello how are you", "fine thanks", "it was sunny"],
    ["what is two plus four"],
]


def write_shards(directory: Path, field: str = "text") -> Path:
    """The shards as `shard-2.jsonl.gz`, `shard-0...`, `shard-1...` (written out of order:
    the glob reads them sorted)."""
    directory.mkdir(exist_ok=True)
    for n in (2, 0, 1):
        with gzip.open(directory / f"shard-{n}.jsonl.gz", "wt", encoding="utf-8") as f:
            for text in SHARDS[n]:
                f.write(json.dumps({field: text, "id": n}) + "\n")
    return directory


def _expected(tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    return [t for shard in SHARDS for text in shard
            for t in [*tokenizer.convert_tokens_to_ids(text.split()), eos]]


def test_three_gzipped_shards_give_the_stream_with_eos_between_documents(
    tmp_path: Path, tokenizer: Any
) -> None:
    write_shards(tmp_path / "corpus")
    rows = Rows("text:corpus")
    paths = files_of(str(tmp_path / "corpus" / "shard-*.jsonl.gz"), "text:corpus")
    assert [p.name for p in paths] == [f"shard-{n}.jsonl.gz" for n in range(3)]
    documents, _ = texts(tokenizer, rows, paths, "text")
    assert not rows.bad and len(documents) == 6
    stream = token_stream(documents).tolist()
    assert stream == _expected(tokenizer)
    assert stream.count(tokenizer.eos_token_id) == 6 and stream[-1] == tokenizer.eos_token_id


def _config(tmp_path: Path, tokdir: Path, dataset: str, **fields: Any) -> TrainingConfig:
    return TrainingConfig(dataset=dataset, tokenizer=f"hf:{tokdir}", model="gpt", seed=0,
                          output_dir=str(tmp_path / "run"), **fields)


def test_text_is_packed_by_document_or_cut_into_windows_of_the_stream(
    tmp_path: Path, tokdir: Path, tokenizer: Any
) -> None:
    write_shards(tmp_path / "corpus", field="body")
    spec = f"text:{tmp_path}/corpus/*.jsonl.gz"
    documents, _ = texts(tokenizer, Rows(spec), files_of(spec[5:], spec), "body")
    train_idx, _ = split_indices(len(documents), 0.2, 0)  # the documents, as the seed splits
    train_stream = token_stream([documents[i] for i in train_idx])
    packed = load_data(_config(tmp_path, tokdir, spec, pack=True, block_size=8,
                               text_field="body", val_fraction=0.2))
    every = [packed.train[w] for w in range(len(packed.train))]
    tokens = torch.cat([w["input_ids"] for w in every])
    assert torch.equal(tokens[:len(train_stream)], train_stream)  # then the padding
    # each document positioned from 0, and no label across a document's start
    starts = torch.cat([w["position_ids"] for w in every]) == 0
    assert torch.cat([w["labels"] for w in every])[starts].eq(IGNORE).all()
    assert packed.facts.vocab_size == len(tokenizer)
    windows = load_data(_config(tmp_path, tokdir, spec, block_size=2, text_field="body",
                                val_fraction=0.2))
    n = len(train_stream) // 3
    cut = train_stream[:n * 3].view(n, 3)
    assert torch.equal(windows.train.x, cut[:, :-1]) and torch.equal(windows.train.y, cut[:, 1:])


def test_bad_text_rows_are_named_once_and_parquet_is_read(
    tmp_path: Path, tokdir: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": ["the cat sat", None, "a dog ran"]}), tmp_path / "a.parquet")
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(b'{"text": "hello"}\n[1, 2]\n{"title": "x"}\n\xff\xfe\n{"text": ""}\n')
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "hi"}\n')[:-6])
    rows = Rows("text:x")
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        documents, _ = texts(tokenizer, rows, files_of(f"{tmp_path}/*.*", "text:x"), "text")
        rows.report(len(documents), "documents")
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1, lines
    for where in (f"{tmp_path / 'a.parquet'}:2 ('text' is a NoneType", f"{bad}:2 (a JSON list",
                  f"{bad}:3 (no 'text' field", f"{bad}:4 (not UTF-8)", f"{bad}:5 (an empty",
                  f"{tmp_path / 'c.jsonl.gz'}:"):
        assert lines[0].count(where) == 1, (where, lines[0])
    assert "6 row(s) set aside" in lines[0]
    words = [tokenizer.convert_ids_to_tokens(ids.tolist()) for ids, _ in documents]
    assert words[:3] == [["the", "cat", "sat", "</s>"], ["a", "dog", "ran", "</s>"],
                         ["hello", "</s>"]]


def test_the_built_in_gpt_trains_on_text_files_end_to_end(
    tmp_path: Path, tokdir: Path
) -> None:
    from ddptrain.cli import main

    corpus = write_shards(tmp_path / "corpus")
    for n in range(3, 8):  # more of the same, for a few batches
        (corpus / f"shard-{n}.jsonl.gz").write_bytes((corpus / "shard-1.jsonl.gz").read_bytes())
    run = tmp_path / "run"
    assert main(["train", "--model", "gpt", "--width", "32", "--tokenizer", f"hf:{tokdir}",
                 "--dataset", f"text:{corpus}/*.jsonl.gz", "--pack", "--block_size", "16",
                 "--batch_size", "2", "--epochs", "1", "--optimizer", "adamw",
                 "--no-tensorboard", "--output_dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "lm" and summary["val_perplexity"] > 1


def _windows_of(data: Any) -> list[dict[str, torch.Tensor]]:
    return [data.train[w] for w in range(len(data.train))] + [
        data.val[w] for w in range(len(data.val))]


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_tokenize_stores_the_token_stream_a_run_would_make_and_refuses_it_damaged(
    tmp_path: Path, tokdir: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from chatplug import CHAT, write_jsonl

    from ddptrain.cli import main

    if kind == "text":
        spec = f"text:{write_shards(tmp_path / 'corpus')}/*.jsonl.gz"
    else:
        chats = [{"messages": CHAT[i:i + 2]} for i in (1, 3)] * 3
        spec = f"chat:{write_jsonl(tmp_path / 'chats.jsonl', [*chats, '{bad'])}"
    config = _config(tmp_path, tokdir, spec, pack=True, block_size=16)
    on_the_fly = _windows_of(load_data(config))
    assert main(["tokenize", "--dataset", spec, "--tokenizer", f"hf:{tokdir}"]) == 0
    stored = next((tmp_path / ("corpus" if kind == "text" else "")).glob("ddptrain_tokens/*"))
    assert stored.name.startswith(f"{kind}-") and (stored / "ids.npy").is_file()
    capsys.readouterr()
    cached = _windows_of(load_data(config))  # (the command set the log to print, at INFO)
    assert f"read from {stored}" in capsys.readouterr().out
    assert len(cached) == len(on_the_fly)
    for a, b in zip(cached, on_the_fly, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
    ids = stored / "ids.npy"
    ids.write_bytes(ids.read_bytes()[:-4] + b"\x01\x00\x00\x00")  # one id overwritten
    err = one_error_line(capsys, ["train", "--dataset", spec, "--tokenizer", f"hf:{tokdir}",
                                  "--pack", "--block_size", "16", "--model", "gpt",
                                  "--output_dir", str(tmp_path / "run")])
    assert f"its token files {str(stored)!r} are damaged: ids.npy does not match its " \
        "checksum: run ddptrain tokenize again" in err, err


@pytest.mark.slow
def test_two_ranks_on_text_files_equal_one_process(tmp_path: Path, tokdir: Path) -> None:
    """Text files tokenized as the run starts, cut into windows and packed by document: 2
    gloo ranks end on one process's weights with the same global batch (SGD with momentum
    and clipping; each rank tokenizes every file alike)."""
    from dist_utils import run_ranks
    from nd_workers import fit_runs

    corpus = write_shards(tmp_path / "corpus")
    for n in range(3, 12):
        (corpus / f"shard-{n}.jsonl.gz").write_bytes(
            (corpus / f"shard-{n % 3}.jsonl.gz").read_bytes())
    base = dict(dataset=f"text:{corpus}/*.jsonl.gz", tokenizer=f"hf:{tokdir}", model="gpt",
                width=32, block_size=8, epochs=1, optimizer="sgd", lr=0.1, momentum=0.9,
                max_grad_norm=1.0, seed=0, log_interval=1, tensorboard=False, curves=False,
                num_workers=0)

    def runs(name: str, batch: int) -> list[dict[str, Any]]:
        return [{**base, "pack": pack, "batch_size": batch,
                 "output_dir": str(tmp_path / name / str(pack))} for pack in (False, True)]

    two = run_ranks(fit_runs, 2, tmp_path, runs("two", 2))[0]
    one = run_ranks(fit_runs, 1, tmp_path, runs("one", 4))[0]
    for a, b in zip(two, one, strict=True):
        assert a["summary"]["steps"] > 1
        for name, value in b["weights"].items():
            torch.testing.assert_close(a["weights"][name], value, atol=1e-6, rtol=0,
                                       msg=name)
