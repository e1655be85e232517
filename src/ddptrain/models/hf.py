"""`--model hf:DIR`: a Hugging Face model from a local `save_pretrained` directory.

    ddptrain train --model hf:models/gpt2-small --dataset mymod:tokens --lr 3e-5

The `AutoModelFor...` class comes from the task (lm: `AutoModelForCausalLM`,
classification: `AutoModelForSequenceClassification` with `num_labels` from the data) or
from `--model_args auto_class=AutoModelForTokenClassification`; the other `--model_args`
go to `from_pretrained`. Nothing is downloaded (`local_files_only`). On the meta device
(fsdp's skeleton, the checks made before the process group) the model is built from its
config alone, without reading a weight.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddptrain.errors import ConfigError, few
from ddptrain.files import sums_damage

log = logging.getLogger("ddptrain")

PREFIX = "hf:"
# The class each task's head needs, when --model_args auto_class does not name one.
TASK_CLASSES = {
    "lm": "AutoModelForCausalLM",
    "classification": "AutoModelForSequenceClassification",
}


def is_hf_ref(name: str) -> bool:
    return name.startswith(PREFIX)


def hf_dir(name: str) -> Path:
    return Path(name[len(PREFIX):])


def build_hf(
    name: str, args: dict[str, Any], task: str | None, outputs: int | None,
    device: torch.device,
) -> nn.Module:
    """The model in `hf:DIR` for `task`: pretrained weights, or (on the meta device) only
    the structure they fill."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the run's own lines say what happens
    directory = hf_dir(name)
    damage = sums_damage(directory)
    if damage is not None:
        raise ConfigError(f"--model {name}: {str(directory)!r} is damaged: {damage}: export "
                          "it again, or give another directory")
    kwargs = dict(args)
    # A directory's own Python code (`auto_map`) runs only when the user names it:
    # never transformers' interactive [y/N] question, which a rank cannot answer.
    trust = kwargs.pop("trust_remote_code", False) is True
    class_name = kwargs.pop("auto_class", None) or TASK_CLASSES.get(task or "")
    if class_name is None:
        raise ConfigError(
            f"--model {name}: which Hugging Face head does --task {task} need? name it with "
            "--model_args auto_class=AutoModelFor... (e.g. AutoModelForTokenClassification)"
        )
    cls = getattr(transformers, str(class_name), None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ConfigError(
            f"--model_args auto_class={class_name} is not a transformers AutoModel class: "
            "use e.g. AutoModelForCausalLM or AutoModelForSequenceClassification"
        )
    if class_name == "AutoModelForSequenceClassification" and outputs is not None:
        kwargs.setdefault("num_labels", outputs)
    try:
        config = transformers.AutoConfig.from_pretrained(
            directory, local_files_only=True, trust_remote_code=trust, **kwargs
        )
        _check_vocabulary(name, config, task, outputs)
        if device.type == "meta":
            return cls.from_config(  # type: ignore[no-any-return,unused-ignore]
                config, trust_remote_code=trust
            )
        with _quiet(transformers):  # its multi-line load report: one line of ours instead
            model, info = cls.from_pretrained(
                directory, config=config, local_files_only=True, trust_remote_code=trust,
                output_loading_info=True,
            )
        _report_loading(name, str(class_name), info)
    except ConfigError:
        raise
    except Exception as exc:
        text = str(exc).strip()
        if "trust_remote_code" in text:
            raise ConfigError(
                f"--model {name}: {str(directory)!r} holds its own Python code (auto_map in "
                "its config.json), which ddptrain runs only when asked: add --model_args "
                "trust_remote_code=true if you trust that directory"
            ) from None
        reason = text.splitlines()[0][:240] if text else type(exc).__name__
        raise ConfigError(
            f"--model {name}: {class_name} cannot be built from {str(directory)!r}: {reason}"
        ) from None
    return model  # type: ignore[no-any-return,unused-ignore]


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    before = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(before)


def _report_loading(name: str, class_name: str, info: dict[str, Any]) -> None:
    """What the directory's weights did not fill, and what of them went unused, as one
    line (a head the task adds starts fresh: expected)."""
    fresh, unused = list(info.get("missing_keys") or []), list(info.get("unexpected_keys") or [])
    if fresh:
        log.info("--model %s: %s starts %d tensor(s) fresh (%s)", name, class_name,
                 len(fresh), few(sorted(fresh)))
    if unused:
        log.warning("--model %s: %s leaves %d tensor(s) of the directory unused (%s): is "
                    "this the head the task needs?", name, class_name, len(unused),
                    few(sorted(unused)))


def _check_vocabulary(name: str, config: Any, task: str | None, outputs: int | None) -> None:
    vocab = getattr(config, "vocab_size", None)
    if task == "lm" and outputs is not None and isinstance(vocab, int) and outputs > vocab:
        raise ConfigError(
            f"--model {name} knows {vocab} tokens but the data has {outputs}: tokenize the "
            "data with the model's own tokenizer"
        )


def is_hf_model(module: nn.Module) -> bool:
    """Whether `module` is a transformers model (it can `save_pretrained`)."""
    import sys

    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(module, transformers.PreTrainedModel)
