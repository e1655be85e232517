"""The tokenizer that turns raw text and chats into a model's token ids.

    ddptrain train --model hf:models/llama-tiny --dataset chat:data/chats.jsonl --pack
    ddptrain train --model gpt --tokenizer hf:models/llama-tiny --dataset text:corpus/*.jsonl.gz

`--tokenizer hf:DIR` names a directory `save_pretrained` wrote (a `tokenizer.json` or the
files its tokenizer class reads); without it, `--model hf:DIR`'s own directory holds the
tokenizer, the one the model was trained with. It is read with
`transformers.AutoTokenizer` from the directory alone: nothing is downloaded, and a
tokenizer's own Python code (`auto_map`) is never run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddptrain.errors import ConfigError
from ddptrain.log import quietly

PREFIX = "hf:"


def tokenizer_ref(tokenizer: str | None, model: str, dataset: str) -> str:
    """The `hf:DIR` a run's tokenizer comes from: `--tokenizer`, else `--model hf:DIR`."""
    if tokenizer:
        if not tokenizer.startswith(PREFIX) or not tokenizer[len(PREFIX):]:
            raise ConfigError(
                f"--tokenizer {tokenizer!r} is invalid: give hf:DIR, a directory Hugging "
                "Face's save_pretrained wrote"
            )
        return tokenizer
    if model.startswith(PREFIX):
        return model
    raise ConfigError(
        f"--dataset {dataset!r} is tokenized as it is read, and --model {model} brings no "
        "tokenizer: give --tokenizer hf:DIR (a directory holding the tokenizer's files)"
    )


def load_tokenizer(ref: str) -> Any:
    """The tokenizer in `ref` (`hf:DIR`), read from that directory alone; it must know an
    end-of-sequence token (placed between documents and after each reply)."""
    directory = Path(ref[len(PREFIX):])
    if not directory.is_dir():
        raise ConfigError(f"--tokenizer {ref}: {str(directory)!r} is not a directory: give "
                          "hf:DIR, a directory Hugging Face's save_pretrained wrote")

    def read() -> Any:
        import transformers

        return transformers.AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=False
        )

    try:
        tokenizer = quietly(read)
    except Exception as exc:  # a missing or malformed file: each library says it its way
        text = str(exc).strip()
        reason = text.splitlines()[0][:240] if text else type(exc).__name__
        raise ConfigError(f"--tokenizer {ref}: no tokenizer can be read from "
                          f"{str(directory)!r}: {reason}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"--tokenizer {ref} has no end-of-sequence token (eos_token): "
                          "set one in its tokenizer_config.json")
    return tokenizer


def vocabulary(tokenizer: Any) -> int:
    """How many token ids the tokenizer gives: its vocabulary and its added tokens."""
    return len(tokenizer)
