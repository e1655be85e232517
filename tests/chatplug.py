"""A chat tokenizer and model built here (no download): a word-level tokenizer of a small
corpus with role markup and a chat template, a tiny Llama, JSONL files of rows
(tests/test_chat_data.py, test_text_data.py, test_chat_generate.py; the `tokdir` and
`tokenizer` fixtures are conftest's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# the words the tests' texts use; one text the tokenizer is trained on
CORPUS = ("hello hi how are you fine thanks what is two plus four the cat sat on a mat dog "
          "ran be brief tell me more sure it was sunny lookup result weather")
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|tool|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}{{ eos_token }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello how are you"},
    {"role": "assistant", "content": "fine thanks"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "tool", "content": "lookup result four"},
    {"role": "assistant", "content": "four"},
]


def make_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer of `CORPUS` with role markup and a chat template, saved as
    `save_pretrained` saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([CORPUS], trainers.WordLevelTrainer(
        special_tokens=SPECIALS))
    import transformers

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(directory)
    return directory


def make_model(directory: Path, vocab: int) -> Path:
    """A tiny Llama, its weights and the tokenizer in one directory (`--model hf:DIR`)."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
    )).save_pretrained(directory)
    return directory


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path
