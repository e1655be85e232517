"""Chats rendered with the tokenizer's own chat template, trained on the replies alone.

    ddptrain train --model hf:models/llama-tiny --dataset chat:data/chats.jsonl --pack

A row is `{"messages": [{"role": "user", "content": "..."}, ...]}` (roles `system`,
`user`, `assistant`, `tool`), or `{"prompt": ..., "completion": ...}`: two strings (joined
as they are, no template, the end-of-sequence token after the completion) or two lists
of messages (the prompt's and the completion's turns, rendered as one chat).

Labels are -100 on every token but an assistant reply's: the system prompt, the user's
and tools' turns and the template's own markup (role headers, the prompt before a reply)
are read but not trained on. A reply's tokens are the ones the template writes between
rendering the chat up to that reply with its generation prompt (`messages[:i]`,
`add_generation_prompt=True`) and rendering it with the reply (`messages[:i + 1]`): the
reply's text and whatever the template closes it with (its end-of-turn or
end-of-sequence token), which a model must learn to write to stop. Those two renderings
are compared as text, and a token is the reply's when its characters (the fast
tokenizer's offsets) lie inside that stretch, so a tokenizer that merges characters across
the boundary never shifts a label. A template whose rendering of the earlier turns
changes once later turns follow (one that drops past reasoning, say) cannot be split so,
and its rows are set aside with that reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ddptrain.data.pack import IGNORE

ROLES = ("system", "user", "assistant", "tool")
ASSISTANT = "assistant"


class BadRow(ValueError):
    """A row that cannot be trained on; the message is the reason a warning names."""


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` as a list of `{"role", "content"}` dicts with known roles (`BadRow` when
    not)."""
    if not isinstance(messages, list) or not messages:
        raise BadRow("'messages' is not a list of messages")
    for message in messages:
        if not isinstance(message, Mapping) or "role" not in message:
            raise BadRow("a message without a 'role'")
        if message["role"] not in ROLES:
            raise BadRow(f"unknown role {message['role']!r}")
        if not isinstance(message.get("content"), str):
            raise BadRow(f"a {message['role']} message whose 'content' is not text")
    if not any(m["role"] == ASSISTANT for m in messages):
        raise BadRow("no assistant reply to train on")
    return [dict(m) for m in messages]


def encode_row(tokenizer: Any, row: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's `(input_ids, labels)` (`BadRow` when it cannot be used)."""
    if "messages" in row:
        return encode_chat(tokenizer, check_messages(row["messages"]))
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return encode_pair(tokenizer, prompt, completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            if not any(isinstance(m, Mapping) and m.get("role") == ASSISTANT
                       for m in completion):
                raise BadRow("a 'completion' without an assistant reply")
            messages = check_messages([*prompt, *completion])
            return encode_chat(tokenizer, messages, train_from=len(prompt))
        raise BadRow("'prompt' and 'completion' are neither two strings nor two lists of "
                     "messages")
    raise BadRow("no 'messages' (nor 'prompt' and 'completion')")


def _render(tokenizer: Any, messages: list[dict[str, Any]], prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt
        )
    except Exception as exc:  # the template's own raise_exception(...) or a Jinja error
        raise BadRow(f"the chat template refuses it: {str(exc).strip()[:120]}") from None
    return str(text)


def encode_chat(tokenizer: Any, messages: list[dict[str, Any]], train_from: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`messages` rendered and tokenized, labels on the assistant replies at or after
    `train_from` only (see the module's text)."""
    text = _render(tokenizer, messages, prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != ASSISTANT or i < train_from:
            continue
        before = _render(tokenizer, messages[:i], prompt=True) if i else ""
        upto = _render(tokenizer, messages[:i + 1], prompt=False)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise BadRow("the chat template renders earlier turns differently once later "
                         "ones follow, so the replies cannot be told apart")
        spans.append((len(before), len(upto)))
    return _labelled(tokenizer, text, spans)


def encode_pair(tokenizer: Any, prompt: str, completion: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompt` + `completion` as plain text, the end-of-sequence token after it; labels on
    the completion and that token."""
    ids, labels = _labelled(tokenizer, prompt + completion,
                            [(len(prompt), len(prompt) + len(completion))])
    eos = torch.tensor([tokenizer.eos_token_id])
    return torch.cat([ids, eos]), torch.cat([labels, eos])


def _labelled(tokenizer: Any, text: str, spans: list[tuple[int, int]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`text`'s token ids, and labels that keep the ids of the tokens whose characters
    lie inside one of `spans` (-100 elsewhere)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    for j, (start, end) in enumerate(encoded["offset_mapping"]):
        if end > start and any(a <= start and end <= b for a, b in spans):
            labels[j] = ids[j]
    return ids, labels
