"""Built-in models (MLP, MiniResNet; GPT in `ddptrain.gpt`) and `create_model`.

Making a model and wrapping it for the ranks are separate steps (`create_model`, then the
strategy's `setup_module`), so checkpoints always hold the plain module's state (no
`module.` prefix) and loading happens before wrapping.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddptrain.config import TrainingConfig
from ddptrain.data import DataBundle
from ddptrain.errors import ConfigError
from ddptrain.models.gpt import DEFAULT_N_HEAD, DEFAULT_N_LAYER
from ddptrain.models.hf import build_hf, hf_dir, is_hf_ref
from ddptrain.models.nets import MLP, MiniResNet
from ddptrain.plugins import call_factory


def build_model(
    config: TrainingConfig, data: DataBundle, outputs: int | None, device: torch.device,
    task: str | None = None, model: nn.Module | Callable[[], nn.Module] | None = None,
) -> nn.Module:
    """The model as a run builds it, seeded, on `device`: the user's module (an instance,
    or a factory of one) or `--model` for the task's head of `outputs`."""
    torch.manual_seed(config.seed)
    if isinstance(model, nn.Module):
        built = model
    elif model is not None:
        built = model()
    else:
        built = create_model(config, data, outputs, device, task=task)
    built = built.to(device)
    if config.channels_last:
        built = built.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return built


# The built-in GPT's --model_args: a mixture of experts in each block (`models.moe`).
GPT_ARGS = ("experts", "top_k")


def model_name(config: TrainingConfig, data: DataBundle) -> str:
    """The built-in model `--model auto` means for this data, or `--model` itself."""
    if config.model != "auto":
        return config.model
    return "gpt" if data.facts.vocab_size else "miniresnet" if data.is_image else "mlp"


@dataclass(frozen=True)
class ModelShape:
    """What the layout checks (`parallel.resolve.check_model_layout`) read of the model a
    config names, before it is built: its name, the built-in GPT's heads and blocks, a
    Hugging Face model's directory (its config.json)."""

    name: str
    heads: int
    blocks: int
    hf_directory: Path | None


def model_shape(config: TrainingConfig, data: DataBundle) -> ModelShape:
    name = model_name(config, data)
    return ModelShape(name, DEFAULT_N_HEAD, DEFAULT_N_LAYER,
                      hf_dir(name) if is_hf_ref(name) else None)


def create_model(
    config: TrainingConfig, data: DataBundle, outputs: int | None, device: torch.device,
    task: str | None = None,
) -> nn.Module:
    """Build the model for the data's shape and the task's `outputs` (the width of the
    head), and move it to `device` (DDP does not move it). `task`: the task's name, which
    picks a Hugging Face model's head (`hf:DIR`)."""
    name = model_name(config, data)
    if is_hf_ref(name):
        model = build_hf(name, config.model_args, task, outputs, device, config.seed)
    elif ":" in name:
        model = call_factory(
            name, "model", config, config.model_args, {**data.facts.as_kwargs(), "outputs": outputs}
        )
        if not isinstance(model, nn.Module):
            raise ConfigError(f"--model {name!r} returned {type(model).__name__}, not nn.Module")
    else:
        takes = GPT_ARGS if name == "gpt" else ()
        stray = {k: v for k, v in config.model_args.items() if k not in takes}
        if stray:
            given = " ".join(f"{k}={v}" for k, v in stray.items())
            also = f" but {', '.join(takes)} (a mixture of experts)" if takes else ""
            raise ConfigError(
                f"--model {name} takes no --model_args{also} (given: {given}): a built-in "
                "model's size is --width (and --block_size); --model_args are for a "
                "module:fn or hf:DIR model"
            )
        model = _built_in_held(name, config, data, _outputs(name, outputs), device)
    if config.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model.to(device)


def _outputs(name: str, outputs: int | None) -> int:
    if outputs is None:
        raise ConfigError(
            f"--model {name} needs to know how many outputs its head has, and neither the "
            "task nor the data says: pass --num_classes, or use --model module:fn"
        )
    return outputs


def _built_in_held(name: str, config: TrainingConfig, data: DataBundle, outputs: int,
                   device: torch.device) -> nn.Module:
    """The built-in model on `device`; one too large for this host refused before it is
    allocated (counted on the meta device: no memory, no random draws), one that does not
    fit the device refused as it is."""
    with torch.device("meta"):
        count = sum(p.numel() for p in _builtin(name, config, data, outputs).parameters())
    host = _host_bytes()
    if host is not None and 4 * count > host:
        raise ConfigError(
            f"--width {config.width} gives --model {name} {count:,} parameters "
            f"({4 * count / 2**30:,.0f} GiB in float32), more than this host's memory "
            f"({host / 2**30:,.0f} GiB) holds: lower --width"
        )
    try:
        return _builtin(name, config, data, outputs).to(device)
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        if not isinstance(exc, torch.OutOfMemoryError) and "can't allocate memory" not in str(
                exc):
            raise
        raise ConfigError(
            f"--width {config.width} gives --model {name} {count:,} parameters "
            f"({4 * count / 2**30:,.1f} GiB in float32), which {device} cannot allocate: "
            "lower --width"
        ) from None


def _host_bytes() -> int | None:
    """This host's memory, or None where it cannot be told."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host
        return None


def _builtin(name: str, config: TrainingConfig, data: DataBundle, outputs: int) -> nn.Module:
    shape = data.input_shape
    if name == "gpt":
        if data.facts.vocab_size is None or len(shape) != 1:
            raise ConfigError(
                f"--model gpt needs token windows (a vocabulary and (T,) samples) but --dataset "
                f"{config.dataset!r} gives samples of shape {shape}: use --dataset chars"
            )
        from ddptrain.models.gpt import build_gpt

        moe = {k: v for k, v in config.model_args.items() if k in GPT_ARGS}
        if moe and config.pp > 1:
            raise ConfigError("--model gpt with experts under --pp is not supported yet: "
                              "train a mixture of experts under ddp, zero, fsdp or --tp")
        if moe and config.sequence_parallel:
            raise ConfigError("--sequence_parallel with the built-in GPT's experts is not "
                              "supported: drop --sequence_parallel (--tp still splits them)")
        try:
            return build_gpt(outputs, shape[0], config.width, **{
                k: int(v) for k, v in moe.items()})
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"--model gpt: {exc}") from None
    if name == "miniresnet":
        if not data.is_image:
            raise ConfigError(
                f"--model miniresnet needs images (C, H, W) but --dataset {config.dataset!r} "
                f"gives samples of shape {shape}: use --model mlp"
            )
        if config.in_channels is not None and config.in_channels != shape[0]:
            raise ConfigError(
                f"--in_channels {config.in_channels} does not match the data's {shape[0]} "
                "channels: drop the flag or fix the data"
            )
        return MiniResNet(shape[0], outputs, config.width)
    if not shape:
        raise ConfigError(
            f"--model mlp needs tensor samples but --dataset {config.dataset!r} yields dicts: "
            "bring a model with --model module:fn"
        )
    return MLP(math.prod(shape), outputs, config.width)
