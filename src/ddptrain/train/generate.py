"""Replies to chat prompts, generated greedily by a trained model: `ddptrain predict` with a
`chat:` dataset and a `.jsonl` output.

    ddptrain predict runs/sft --dataset chat:data/prompts.jsonl --output replies.jsonl
    torchrun --standalone --nproc_per_node=2 -m ddptrain predict runs/sft \\
        --dataset chat:data/prompts.jsonl --output replies.jsonl --max_new_tokens 128

A prompt is a row `{"messages": [...]}` (the chat so far, rendered with the tokenizer's
chat template and its generation prompt; a chat that ends with an assistant reply is
answered anew from the turns before that reply), or `{"prompt": ...}`: a string, tokenized
as it is (no template, as training reads a prompt/completion pair), or a list of
messages; a `completion` beside it is ignored. Every row of every file is a prompt, in
the files' order; rows that cannot be used are set aside and named in one warning line.

Decoding is greedy (the most likely token at each step, no sampling), so a model gives
the same reply on any world size. Each step runs the whole sequence through the model
(no key/value cache): any model that returns logits `(B, T, V)` generates, the built-in
GPT as well as a Hugging Face one, at the cost of time quadratic in the reply's length.
A reply ends at the tokenizer's end-of-sequence token, at the end-of-turn token its chat
template closes a reply with, after `--max_new_tokens` tokens, or when the sequence fills
`--block_size` (the context the model trained on); the stop token is not part of it.
Rank r answers prompts r, r+N, ...; rank 0 writes one line per prompt,
`{"index": i, "prompt": ..., "reply": "..."}`, in the prompts' order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data import ModelCall
from ddptrain.data.bundle import DataBundle, DataFacts
from ddptrain.data.chat import ASSISTANT, ROLES
from ddptrain.data.rowfiles import Rows, files_of
from ddptrain.data.tokenizer import load_tokenizer, tokenizer_ref, vocabulary
from ddptrain.errors import ConfigError
from ddptrain.train.precision import Precision
from ddptrain.train.predict import ReplyWriter, write_rounds

MAX_NEW_TOKENS = 64  # a reply's length when --max_new_tokens is not given
Step = Callable[[torch.Tensor], torch.Tensor]  # ids (1, T) -> logits (1, T, V)


def wants_replies(config: TrainingConfig, output: Path) -> bool:
    """Whether `predict` generates replies: a `chat:` dataset written to `.jsonl`."""
    return config.dataset.startswith("chat:") and output.suffix == ".jsonl"


@dataclass(frozen=True)
class Prompt:
    """One prompt: as the row gave it (for the output), and its token ids."""

    shown: Any
    ids: list[int]


class Prompts(Dataset):
    """The prompts of a `chat:` dataset, in the files' order, and the tokenizer that reads
    them and the replies. A sample is the prompt's ids (what the data's facts are read
    from: the model is built as the run built it)."""

    def __init__(self, prompts: Sequence[Prompt], tokenizer: Any) -> None:
        self.prompts, self.tokenizer = list(prompts), tokenizer
        self.vocab_size = vocabulary(tokenizer)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.prompts[i].ids, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}


def prompt_data(config: TrainingConfig) -> DataBundle:
    """The prompts of `--dataset chat:PATH` as a bundle whose facts are those a chat run's
    data has (so the model is rebuilt as it trained); its train and val are the prompts."""
    _, _, spec = config.dataset.partition(":")
    tokenizer = load_tokenizer(tokenizer_ref(config.tokenizer, config.model, config.dataset))
    rows = Rows(config.dataset)
    found: list[Prompt] = []
    for where, row in rows.read(files_of(spec, config.dataset)):
        try:
            found.append(encode_prompt(tokenizer, row, config.block_size))
        except ValueError as reason:
            rows.reject(where, str(reason))
    rows.report(len(found), "prompts")
    prompts = Prompts(found, tokenizer)
    block = config.block_size
    facts = DataFacts((block,), (block,), False, None, prompts.vocab_size, True)
    return DataBundle(prompts, prompts, facts)


def encode_prompt(tokenizer: Any, row: Mapping[str, Any], block_size: int) -> Prompt:
    """A row's prompt and its ids (`ValueError`, with the reason, for a row that is none)."""
    if "messages" in row:
        shown: Any = _prompt_turns(row["messages"])
    elif "prompt" in row:
        shown = row["prompt"]
        if isinstance(shown, list):
            shown = _prompt_turns(shown)
        elif not isinstance(shown, str) or not shown:
            raise ValueError("'prompt' is neither text nor a list of messages")
    else:
        raise ValueError("no 'messages' (nor 'prompt')")
    if isinstance(shown, str):
        text = shown
    else:
        if tokenizer.chat_template is None:
            raise ValueError("a chat, and the tokenizer has no chat template")
        try:
            text = str(tokenizer.apply_chat_template(shown, tokenize=False,
                                                     add_generation_prompt=True))
        except Exception as exc:  # the template's own raise_exception(...) or a Jinja error
            raise ValueError(f"the chat template refuses it: {str(exc).strip()[:120]}") from None
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids or len(ids) >= block_size:
        raise ValueError(f"{len(ids)} tokens, which leave no room for a reply in "
                         f"--block_size {block_size}")
    return Prompt(shown, ids)


def _prompt_turns(messages: Any) -> list[dict[str, Any]]:
    """The turns a reply answers: the messages, less a last assistant reply."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("the messages are not a list of messages")
    for m in messages:
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise ValueError("a message without a known 'role'")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"a {m['role']} message whose 'content' is not text")
    turns = [dict(m) for m in messages]
    if turns[-1]["role"] == ASSISTANT:
        turns.pop()
    if not turns:
        raise ValueError("no turn before the assistant's reply")
    return turns


def stop_ids(tokenizer: Any, module: nn.Module | None = None) -> set[int]:
    """The tokens that end a reply: the end-of-sequence token, the special token the chat
    template closes an assistant turn with (`<|eot_id|>`, `<|im_end|>`, ...), and those a
    Hugging Face model's generation config names."""
    stops = {int(tokenizer.eos_token_id)}
    special = set(tokenizer.all_special_ids) | {
        i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(token, "special", False)}
    closing = _template_closing(tokenizer)
    if closing:
        ids = tokenizer(closing, add_special_tokens=False)["input_ids"]
        first = next((int(i) for i in ids if i in special), None)
        if first is not None:
            stops.add(first)
    generation = getattr(module, "generation_config", None)
    named = getattr(generation, "eos_token_id", None)
    stops |= {int(i) for i in (named if isinstance(named, list) else [named]) if i is not None}
    return stops


def _template_closing(tokenizer: Any) -> str:
    """What the chat template writes after an assistant reply's text ("" when it cannot
    be told: no template, or one that refuses the probe)."""
    if tokenizer.chat_template is None:
        return ""
    mark = "\x00reply\x00"
    chat = [{"role": "user", "content": "hi"}, {"role": ASSISTANT, "content": mark}]
    try:
        text = str(tokenizer.apply_chat_template(chat, tokenize=False))
    except Exception:  # a template that wants other turns: the end-of-sequence token stops
        return ""
    at = text.rfind(mark)
    return text[at + len(mark):] if at >= 0 else ""


@torch.no_grad()
def greedy(step: Step, prompt: Sequence[int], max_new_tokens: int, stops: Collection[int],
           limit: int) -> list[int]:
    """The reply's ids: at each step the most likely next token of the whole sequence so
    far, until a stop token (left out), `max_new_tokens` tokens, or `limit` in all."""
    ids = list(prompt)
    reply: list[int] = []
    while len(reply) < max_new_tokens and len(ids) < limit:
        logits = step(torch.tensor([ids], dtype=torch.long))
        token = int(logits[0, -1].argmax())
        if token in stops:
            break
        reply.append(token)
        ids.append(token)
    return reply


def model_step(module: nn.Module, device: torch.device, precision: Precision) -> Step:
    """One forward pass of `module` over a sequence of ids: its logits."""
    call = ModelCall(module)

    def step(ids: torch.Tensor) -> torch.Tensor:
        with precision.autocast():
            out = call(module, {"input_ids": ids.to(device)})
        if out.prediction is None:
            raise ConfigError("the model returned a loss but no logits: generating replies "
                              "needs a model that returns its logits")
        return out.prediction.float()

    return step


def reply_text(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True)).strip()


@torch.no_grad()
def generate_replies(
    module: nn.Module, prompts: Prompts, config: TrainingConfig, precision: Precision,
    ctx: DistributedContext, output: Path, max_new_tokens: int, overwrite: bool = False,
) -> int:
    """Write the reply to every prompt to `output` (rank 0), in the prompts' order;
    returns the number of prompts. Collective."""
    module.eval()
    step = model_step(module, ctx.device, precision)
    stops = stop_ids(prompts.tokenizer, module)
    n, world, size = len(prompts), ctx.world_size, config.batch_size
    mine = list(range(ctx.rank, n, world))
    # Rank 0's shard is the longest: every rank runs its rounds.
    rounds = math.ceil(math.ceil(n / world) / size)

    def round_of(k: int) -> list[tuple[Any, str]]:
        done = []
        for i in mine[k * size:(k + 1) * size]:
            prompt = prompts.prompts[i]
            ids = greedy(step, prompt.ids, max_new_tokens, stops, config.block_size)
            done.append((prompt.shown, reply_text(prompts.tokenizer, ids)))
        return done

    write_rounds(rounds, lambda k: round_of(k) or None,
                 lambda: ReplyWriter(output, n, overwrite), output, ctx)
    return n


def check_max_new_tokens(value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"--max_new_tokens {value!r} is invalid: give a whole number of "
                          "tokens, 1 or more")
