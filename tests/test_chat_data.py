"""`--dataset chat:PATH`: chats rendered with the tokenizer's own chat template, labels on
the assistant replies alone (checked token by token against the template), kept through
`--pack` (a packed window of two chats scores each as alone); bad rows and chats too long
for `--block_size` are named once, a file of nothing usable is one line and exit 2; a
run trains a Hugging Face model on a chat file end to end. The tokenizer is built here
from local text with `tokenizers` (no download)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from chatplug import CHAT, make_model, make_tokenizer, write_jsonl
from conftest import one_error_line, run_cli

from ddptrain.config import TrainingConfig
from ddptrain.data.batch import ModelCall
from ddptrain.data.chat import encode_row
from ddptrain.data.pack import IGNORE, Packed, PackedStream
from ddptrain.data.sources import load_data
from ddptrain.data.tokenized import Documents

transformers = pytest.importorskip("transformers")



def _by_hand(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The template's tokens written out turn by turn, and the labels a chat must get:
    each reply's words and the end-of-sequence token that closes it, nothing else."""
    ids, labels = [tokenizer.bos_token_id], [IGNORE]
    for m in messages:
        role = tokenizer.convert_tokens_to_ids(f"<|{m['role']}|>")
        words = tokenizer.convert_tokens_to_ids(m["content"].split())
        reply = m["role"] == "assistant"
        ids += [role, *words] + ([tokenizer.eos_token_id] if reply else [])
        labels += [IGNORE] + ([*words, tokenizer.eos_token_id] if reply else
                              [IGNORE] * len(words))
    return ids, labels


def test_chat_labels_are_exactly_the_assistant_tokens(tokenizer: Any) -> None:
    ids, labels = encode_row(tokenizer, {"messages": CHAT})
    want_ids, want_labels = _by_hand(tokenizer, CHAT)
    rendered = tokenizer(tokenizer.apply_chat_template(CHAT, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    assert ids.tolist() == rendered == want_ids
    assert labels.tolist() == want_labels
    trained = tokenizer.convert_ids_to_tokens(ids[labels != IGNORE].tolist())
    assert trained == ["fine", "thanks", "</s>", "four", "</s>"]


def test_prompt_completion_rows_train_on_the_completion_alone(tokenizer: Any) -> None:
    ids, labels = encode_row(tokenizer, {"prompt": "what is two plus two ",
                                         "completion": "four"})
    tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
    assert tokens == ["what", "is", "two", "plus", "two", "four", "</s>"]
    assert tokenizer.convert_ids_to_tokens(ids[labels != IGNORE].tolist()) == ["four", "</s>"]
    # as turns: the prompt's own reply is read, not trained on
    ids, labels = encode_row(tokenizer, {"prompt": CHAT[:5], "completion": CHAT[5:]})
    assert ids.tolist() == _by_hand(tokenizer, CHAT)[0]
    assert tokenizer.convert_ids_to_tokens(ids[labels != IGNORE].tolist()) == ["four", "</s>"]


def _config(tmp_path: Path, dataset: str, tokdir: Path, **fields: Any) -> TrainingConfig:
    return TrainingConfig(dataset=dataset, tokenizer=f"hf:{tokdir}", model="gpt",
                          output_dir=str(tmp_path / "run"), **fields)


def test_a_packed_window_of_two_chats_scores_each_as_alone(tokenizer: Any) -> None:
    first = encode_row(tokenizer, {"messages": CHAT})
    second = encode_row(tokenizer, {"messages": [
        {"role": "user", "content": "tell me more"}, {"role": "assistant",
                                                     "content": "sure the cat sat"}]})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        max_position_embeddings=64)).eval()
    call = ModelCall(model, packed=True)

    def per_token(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = call(model, {k: v[None] for k, v in batch.items() if k != "labels"}).prediction
        return F.cross_entropy(logits[0, :-1], batch["labels"][1:], ignore_index=IGNORE,
                               reduction="none")

    chats = Documents([first, second], len(tokenizer))
    packed_set = Packed(chats, 40, "chats")
    window = packed_set[0]
    streamed = next(iter(PackedStream(chats, 40, "chats")))  # a stream packs them alike
    assert all(torch.equal(streamed[k], window[k]) for k in window)
    assert packed_set.trained == int((window["labels"] != IGNORE).sum()) == 5 + 5
    n, m = len(first[0]), len(second[0])
    # the labels survive packing: each chat's own, the second's first token excluded
    assert window["labels"][:n].tolist() == first[1].tolist()
    assert window["labels"][n + 1:n + m].tolist() == second[1][1:].tolist()
    assert window["labels"][n + m:].eq(IGNORE).all()
    packed = per_token(window)
    for part, (ids, labels) in zip([packed[:n - 1], packed[n:n + m - 1]], [first, second],
                                   strict=True):
        alone = per_token({"input_ids": ids, "labels": labels})
        torch.testing.assert_close(part, alone, atol=1e-5, rtol=0)


def test_without_pack_a_chat_is_one_sample_padded_on_the_right(
    tmp_path: Path, tokdir: Path, tokenizer: Any
) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}] * 5)
    data = load_data(_config(tmp_path, f"chat:{path}", tokdir, block_size=32))
    sample = data.train[0]
    ids, labels = encode_row(tokenizer, {"messages": CHAT})
    n = len(ids)
    assert data.facts.dict_batches and len(data.train) == 4 and len(data.val) == 1
    assert sample["input_ids"][:n].tolist() == ids.tolist()
    assert sample["labels"][:n].tolist() == labels.tolist()
    assert sample["labels"][n:].eq(IGNORE).all() and len(sample["labels"]) == 32
    assert sample["attention_mask"].tolist() == [1] * n + [0] * (32 - n)
    assert sample["input_ids"][n:].eq(tokenizer.pad_token_id).all()


def test_bad_rows_and_long_chats_are_each_named_once_in_one_line(
    tmp_path: Path, tokdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = {"messages": CHAT[1:3]}
    path = write_jsonl(tmp_path / "chats.jsonl", [
        good, "{not json", {"text": "no messages"}, good,
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"messages": CHAT * 4}, good, good,  # the long one: 4 x 6 turns
    ])
    with path.open("ab") as f:
        f.write(b'{"messages": "\xff\xfe"}\n')
    write_jsonl(tmp_path / "empty.jsonl", [])
    config = _config(tmp_path, f"chat:{tmp_path}/*.jsonl", tokdir, block_size=40)
    with caplog.at_level(logging.WARNING, logger="ddptrain"):
        data = load_data(config)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    bad, long = [x for x in lines if "set aside" in x], [x for x in lines if "longer" in x]
    assert len(bad) == 1 and len(long) == 1, lines
    for where in (f"{path}:2 (not JSON)", f"{path}:3 (no 'messages'",
                  f"{path}:5 (unknown role 'robot')", f"{path}:9 (not UTF-8)",
                  f"{tmp_path / 'empty.jsonl'} (an empty file)"):
        assert bad[0].count(where) == 1, (where, bad[0])
    assert "5 row(s) set aside" in bad[0]
    assert f"{path}:6 (" in long[0] and "1 chat(s) longer than --block_size 40" in long[0]
    assert len(data.train) + len(data.val) == 4  # the four good rows


def test_a_chat_file_of_nothing_usable_is_one_line_and_exit_2(
    tmp_path: Path, tokdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", ["nope", {"messages": []}])
    err = one_error_line(capsys, ["train", "--dataset", f"chat:{path}", "--tokenizer",
                                  f"hf:{tokdir}", "--model", "gpt",
                                  "--output_dir", str(tmp_path / "run")])
    assert f"--dataset 'chat:{path}' holds no usable chats: 2 set aside" in err, err
    assert f"{path}:1 (not JSON)" in err and f"{path}:2 ('messages' is not a list" in err


def test_a_hugging_face_model_trains_on_a_chat_file_end_to_end(
    tmp_path: Path, tokdir: Path, tokenizer: Any
) -> None:
    from ddptrain.cli import main

    model = make_model(make_tokenizer(tmp_path / "model"), len(tokenizer))
    replies = [("hello how are you", "fine thanks"), ("what is two plus two", "four"),
               ("tell me more", "the cat sat on a mat"), ("hi", "hello")]
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in replies] * 5
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    run = tmp_path / "run"
    args = ["train", "--model", f"hf:{model}", "--dataset", f"chat:{data}",
            "--block_size", "32", "--batch_size", "4", "--epochs", "2", "--optimizer",
            "adamw", "--lr", "0.01", "--no-tensorboard", "--output_dir", str(run), "--pack"]
    assert main(args) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "lm" and 1 < summary["val_perplexity"] < len(tokenizer)


def test_a_tokenizer_is_needed_and_read_from_its_directory_alone(tmp_path: Path) -> None:
    from ddptrain.errors import ConfigError

    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    config = dataclasses.replace(_config(tmp_path, f"chat:{path}", tmp_path), tokenizer=None)
    with pytest.raises(ConfigError, match="--model gpt brings no tokenizer: give --tokenizer"):
        load_data(config)
    with pytest.raises(ConfigError, match="no tokenizer can be read"):
        load_data(dataclasses.replace(config, tokenizer=f"hf:{tmp_path}"))


@pytest.mark.slow
def test_python_m_ddptrain_trains_a_hugging_face_model_on_chats(
    tmp_path: Path, tokenizer: Any
) -> None:
    model = make_model(make_tokenizer(tmp_path / "model"), len(tokenizer))
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}] * 12)
    run = tmp_path / "run"
    done = run_cli(["train", "--model", f"hf:{model}", "--dataset", f"chat:{data}",
                    "--pack", "--block_size", "32", "--batch_size", "2", "--epochs", "1",
                    "--optimizer", "adamw", "--no-tensorboard", "--output_dir", str(run)],
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--pack: 10 documents (260 tokens) in 9 windows" in done.stdout + done.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 5
