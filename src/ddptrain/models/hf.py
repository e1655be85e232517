"""`--model hf:DIR`: a Hugging Face model from a local `save_pretrained` directory.

    ddptrain train --model hf:models/gpt2-small --dataset mymod:tokens --lr 3e-5

The `AutoModelFor...` class comes from the task (lm: `AutoModelForCausalLM`,
classification: `AutoModelForSequenceClassification` with `num_labels` from the data) or
from `--model_args auto_class=AutoModelForTokenClassification`; the other `--model_args`
go to `from_pretrained`. Nothing is downloaded (`local_files_only`). On the meta device
(the skeleton fsdp, tp and pp shard, the checks made before the process group) the model
is built from its config alone, without reading a weight: each rank then reads the slices
it holds (`checkpoint.init.fill_pretrained`).

What the directory lacks (a head the task adds) starts from `start_values`, which depend
on the seed and the tensor's name only: the same whether the model was loaded whole or
built on meta and filled per rank.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ddptrain.errors import ConfigError, few
from ddptrain.files import sums_damage
from ddptrain.log import quietly
from ddptrain.models.hf_moe import adopt_experts

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
    device: torch.device, seed: int = 0,
) -> nn.Module:
    """`_build_hf`, with the lines of torchao (which transformers imports as it builds a
    model, where it is installed: kernels built for other machines) and of torch's pytree
    (deprecations) held back."""
    return cast(nn.Module, quietly(lambda: _build_hf(name, args, task, outputs, device, seed)))


def _build_hf(
    name: str, args: dict[str, Any], task: str | None, outputs: int | None,
    device: torch.device, seed: int = 0,
) -> nn.Module:
    """The model in `hf:DIR` for `task`: pretrained weights (what the directory lacks from
    `start_values`), or (on the meta device) only the structure they fill; the directory's
    checksums are checked by the ranks that read it (its config and index here, before
    they are read). Its own code (`auto_map`) runs only with `trust_remote_code` in `args`,
    which a later command takes from a run's stored config only when named again
    (`train.inference.source_config`)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the run's own lines say what happens
    directory = hf_dir(name)
    # on the meta device the files read here (config, index) alone: the weights' by the
    # ranks that read them (`checkpoint.init.fill_pretrained`)
    damage = sums_damage(directory, weights=device.type != "meta")
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
            with torch.device("meta"):  # a 70B skeleton allocates nothing, whoever asks
                skeleton = cls.from_config(config, trust_remote_code=trust)
            adopt_experts(skeleton)  # `--ep` spreads its batched experts (`models.hf_moe`)
            return skeleton  # type: ignore[no-any-return,unused-ignore]
        with _quiet(transformers):  # its multi-line load report: one line of ours instead
            model, info = cls.from_pretrained(
                directory, config=config, local_files_only=True, trust_remote_code=trust,
                output_loading_info=True,
            )
        report_loading(name, str(class_name), info["missing_keys"], info["unexpected_keys"])
        with torch.no_grad():
            for key, value in start_values(model, info["missing_keys"], seed).items():
                owner, _, leaf = key.rpartition(".")
                getattr(model.get_submodule(owner), leaf).copy_(value)
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
    adopt_experts(model)
    return model  # type: ignore[no-any-return,unused-ignore]


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    before = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(before)


def report_loading(name: str, class_name: str, fresh: list[str], unused: list[str]) -> None:
    """What the directory's weights did not fill, and what of them went unused, as one
    line (a head the task adds starts fresh: expected)."""
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


def renames_weights(model: nn.Module) -> bool:
    """Whether transformers renames or fuses this model's weights between its files and
    its modules (some mixtures of experts): its own `from_pretrained` and
    `save_pretrained` then read and write them."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return bool(get_model_conversion_mapping(cast(Any, model), add_legacy=False))


def start_values(root: nn.Module, names: Iterable[str], seed: int) -> dict[str, torch.Tensor]:
    """Whole host values for the tensors `names` of the Hugging Face model `root` (loaded,
    or its structure on the meta device) that its directory does not hold: a head the
    task adds, the buffers its modules compute as they are built (rotary frequencies).
    Each owning module's twin on the host is initialised by the model's own
    `_init_weights`, seeded by the seed and the module's name: the same values whatever
    the layout, and nothing else of the model allocated."""
    owners: dict[str, list[str]] = {}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        owners.setdefault(owner, []).append(leaf)
    values: dict[str, torch.Tensor] = {}
    for owner, leaves in sorted(owners.items()):
        twin = copy.deepcopy(root.get_submodule(owner)).to_empty(device="cpu")
        for tensor in [*twin.parameters(), *twin.buffers()]:
            tensor.__dict__.pop("_is_hf_initialized", None)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed + zlib.crc32(owner.encode()))
            root._init_weights(twin)  # type: ignore[operator]
        for leaf in leaves:
            values[f"{owner}.{leaf}" if owner else leaf] = getattr(twin, leaf).detach()
    return values
