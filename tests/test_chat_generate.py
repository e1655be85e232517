"""`ddptrain predict` with a `chat:` dataset of prompts and a `.jsonl` output: the
assistant's replies, generated greedily (`train.generate`). The loop is the argmax of a
hand-run of the model at each step and stops at a stop token, at `--max_new_tokens` and at
`--block_size`; the end-of-turn token is read from the chat template; a run's replies are
those transformers' own greedy `generate` gives for its exported model, one line per
prompt in order. Slow tier: a tiny Llama fine-tuned with LoRA on 2 ranks learns to swap
two words, and answers prompts it never saw, on 2 ranks, exactly."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from chatplug import make_tokenizer, write_jsonl
from conftest import one_error_line, run_torchrun

from ddptrain.train.generate import Prompt, encode_prompt, greedy, stop_ids

transformers = pytest.importorskip("transformers")

# The words of the swap task (all in the test tokenizer's vocabulary).
WORDS = ["hello", "hi", "how", "are", "you", "fine", "thanks", "what", "two", "plus", "four",
         "cat", "sat", "mat", "dog", "ran"]


def _llama(directory: Path, vocab: int, hidden: int = 32, seed: int = 0) -> Path:
    """A tiny Llama saved beside the tokenizer in `directory` (`--model hf:DIR`)."""
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=2 * hidden, max_position_embeddings=64,
        tie_word_embeddings=False,
    )).save_pretrained(directory)
    return directory


def _chat(user: str, reply: str | None = None) -> dict[str, Any]:
    turns = [{"role": "user", "content": user}]
    return {"messages": turns + ([{"role": "assistant", "content": reply}] if reply else [])}


class Scripted(torch.nn.Module):
    """Logits whose argmax after a sequence of length T is `script[T - start]`; it keeps
    the lengths it was called with."""

    def __init__(self, script: list[int], start: int, vocab: int = 12) -> None:
        super().__init__()
        self.script, self.start, self.vocab = script, start, vocab
        self.seen: list[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen.append(ids.shape[1])
        logits = torch.zeros(1, ids.shape[1], self.vocab)
        logits[0, -1, self.script[ids.shape[1] - self.start]] = 1.0
        return logits


def test_greedy_is_the_argmax_of_a_hand_run_and_stops_where_it_should(tokenizer: Any) -> None:
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)).eval()

    def step(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits

    prompt = encode_prompt(tokenizer, _chat("hello how are you"), 64).ids
    got = greedy(step, prompt, 6, stops=set(), limit=64)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):  # by hand: the whole sequence each step, its last row's argmax
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt):]
    # a stop token ends the reply and is not part of it
    assert greedy(step, prompt, 6, stops={got[2]}, limit=64) == got[:2]
    # scripted: 5, 7, then the stop token 3
    scripted = Scripted([5, 7, 3, 9], start=4)
    assert greedy(scripted, [1, 2, 4, 6], 10, stops={3}, limit=64) == [5, 7]
    assert scripted.seen == [4, 5, 6]  # the whole sequence, one token longer each step
    assert greedy(Scripted([5, 7, 3], 4), [1, 2, 4, 6], 1, stops={3}, limit=64) == [5]
    assert greedy(Scripted([5, 7, 8], 4), [1, 2, 4, 6], 10, stops={3}, limit=6) == [5, 7]


def test_the_end_of_turn_token_is_read_from_the_chat_template(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    assert stop_ids(tokenizer) == {eos}  # the test template closes a reply with </s>
    other = transformers.AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    other.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    other.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                           "<|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> "
                           "{% endif %}")
    assert stop_ids(other) == {eos, other.convert_tokens_to_ids("<|end|>")}
    prompt = encode_prompt(other, {"prompt": [{"role": "user", "content": "hi"}],
                                   "completion": "ignored"}, 32)
    assert other.convert_ids_to_tokens(prompt.ids) == ["<|user|>", "hi", "<|end|>",
                                                       "<|assistant|>"]


def test_prompts_are_chats_to_answer_or_plain_text(tokenizer: Any) -> None:
    asked = encode_prompt(tokenizer, _chat("hello how are you"), 32)
    assert tokenizer.convert_ids_to_tokens(asked.ids) == [
        "<s>", "<|user|>", "hello", "how", "are", "you", "<|assistant|>"]
    # a chat that ends with a reply is answered anew from the turns before it
    again = encode_prompt(tokenizer, _chat("hello how are you", "fine"), 32)
    assert again == Prompt(asked.shown, asked.ids)
    plain = encode_prompt(tokenizer, {"prompt": "what is two plus two"}, 32)
    assert tokenizer.convert_ids_to_tokens(plain.ids) == ["what", "is", "two", "plus", "two"]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"text": "x"}, "no 'messages'"), ({"prompt": 3}, "neither text"),
        (_chat("hello how are you"), "no room for a reply")]
    for row, reason in bad:
        with pytest.raises(ValueError, match=reason):
            encode_prompt(tokenizer, row, 7)


def test_predict_writes_transformers_greedy_replies_one_line_per_prompt_in_order(
    tmp_path: Path, tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddptrain.cli import main

    model = _llama(make_tokenizer(tmp_path / "model"), len(tokenizer))
    pairs = list(itertools.pairwise(WORDS))
    data = write_jsonl(tmp_path / "chats.jsonl", [_chat(f"{a} {b}", f"{b} {a}") for a, b in pairs])
    run = tmp_path / "run"
    assert main(["train", "--model", f"hf:{model}", "--dataset", f"chat:{data}", "--pack",
                 "--block_size", "32", "--batch_size", "4", "--epochs", "1", "--optimizer",
                 "adamw", "--lr", "0.01", "--no-tensorboard", "--output_dir", str(run)]) == 0
    rows: list[Any] = [_chat("hello how"), {"prompt": [{"role": "user", "content": "cat sat"}]},
            {"prompt": "the dog ran "}, _chat("fine thanks", "thanks fine"), "{bad"]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "replies.jsonl"
    assert main(["predict", str(run), "--dataset", f"chat:{prompts}", "--output", str(out),
                 "--max_new_tokens", "5"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2, 3]
    assert [line["prompt"] for line in lines] == [
        rows[0]["messages"], rows[1]["prompt"], "the dog ran ", rows[3]["messages"][:1]]
    trained = transformers.LlamaForCausalLM.from_pretrained(run / "hf").eval()
    stops = sorted(stop_ids(tokenizer, trained))
    for line, row in zip(lines, rows, strict=False):
        ids = encode_prompt(tokenizer, row, 32).ids
        made = trained.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                                eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
        reply = [t for t in made[0, len(ids):].tolist() if t not in stops]
        assert line["reply"] == tokenizer.decode(reply, skip_special_tokens=True).strip()
    # refused before any work, one line each
    err = one_error_line(capsys, ["predict", str(run), "--dataset", f"chat:{prompts}",
                                  "--output", str(tmp_path / "r2.jsonl"), "--split", "val"])
    assert "--split val is invalid with prompts to answer" in err
    err = one_error_line(capsys, ["predict", str(run), "--dataset", f"chat:{prompts}",
                                  "--output", str(tmp_path / "r3.jsonl"),
                                  "--max_new_tokens", "0"])
    assert "--max_new_tokens 0 is invalid" in err
    err = one_error_line(capsys, ["predict", str(run), "--output", str(tmp_path / "r4.npy"),
                                  "--max_new_tokens", "3"])
    assert "--max_new_tokens 3 applies to replies, and there are none" in err


@pytest.mark.slow
@pytest.mark.heavy
def test_a_lora_run_on_2_ranks_answers_prompts_it_never_saw(
    tmp_path: Path, tokenizer: Any
) -> None:
    """The pattern: the user says two words, the assistant says them swapped. Eight pairs
    are held out of training; the model must answer each exactly."""
    model = _llama(make_tokenizer(tmp_path / "model"), len(tokenizer), hidden=64)
    pairs = [(a, b) for a in WORDS for b in WORDS if a != b]
    random.Random(0).shuffle(pairs)
    held, seen = pairs[:8], pairs[8:]
    data = write_jsonl(tmp_path / "train.jsonl", [_chat(f"{a} {b}", f"{b} {a}") for a, b in seen])
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [_chat(f"{a} {b}") for a, b in held])
    run, out = tmp_path / "run", tmp_path / "replies.jsonl"
    trained = run_torchrun(2, [
        "train", "--model", f"hf:{model}", "--dataset", f"chat:{data}", "--pack",
        "--block_size", "64", "--batch_size", "4", "--epochs", "200", "--optimizer", "adamw",
        "--lr", "0.01", "--lora_rank", "8", "--lora_alpha", "16", "--val_fraction", "0.05",
        "--save_every", "0", "--no-tensorboard", "--output_dir", str(run)], cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    done = run_torchrun(2, ["predict", str(run), "--dataset", f"chat:{prompts}",
                            "--output", str(out), "--max_new_tokens", "8"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["index"] for line in lines] == list(range(len(held)))
    assert [line["prompt"][0]["content"] for line in lines] == [f"{a} {b}" for a, b in held]
    assert [line["reply"] for line in lines] == [f"{b} {a}" for a, b in held], trained.stdout[-800:]
