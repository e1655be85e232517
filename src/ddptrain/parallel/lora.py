"""`--lora_rank R`: low-rank adapters (LoRA) trained on a frozen model, through peft.

    ddptrain train --model hf:models/llama --dataset mymod:tokens --lora_rank 8 --strategy fsdp

peft's `inject_adapter_in_model` wraps each targeted linear of the bare module in place
(before a strategy wraps or shards it, like `--freeze`): the layer's own weights become
`NAME.base_layer.*` and stay frozen, and `NAME.lora_A.default.weight` (R x in) and
`NAME.lora_B.default.weight` (out x R, zeros at the start) train; the layer computes
`base(x) + (alpha / R) * B(A(dropout(x)))`. Only the adapters have gradients, are reduced
and have optimizer state. The targets are the linears inside the model's repeated blocks
(its attention and MLP projections; embeddings and the output head stay as they are), or
the modules whose names match `--lora_targets GLOB ...`.

A checkpoint holds the module as it trains (base and adapters), so a resume is the run
itself. At the end a run writes `adapter/` (peft's adapter directory:
`adapter_config.json` and `adapter_model.safetensors`, loadable with
`PeftModel.from_pretrained` over the base model) and, in `model.safetensors` (and `hf/`),
the weights merged under the base model's own names (`merged`): a plain model, which
`ddptrain evaluate` and any loader of the base architecture read as it is. A checkpoint
given to `evaluate` is merged the same way, and so is one given to `ddptrain export`
(`checkpoint.export.stored_lora`: the spec from its stored config and tensors), whose
`--adapter_only` writes the adapter directory instead.
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddptrain.errors import ConfigError
from ddptrain.log import quietly
from ddptrain.parallel.base import nbytes

ADAPTER = "default"  # peft's name for the one adapter
BASE = ".base_layer"
KINDS = ("lora_A", "lora_B")


def is_adapter(name: str) -> bool:
    return any(f".{kind}." in name for kind in KINDS)


def base_name(name: str) -> str:
    """The name a wrapped layer's own tensor has in the plain model."""
    return name.replace(BASE + ".", ".")


def _linear(module: nn.Module) -> bool:
    """A layer peft's LoRA wraps: a linear, or transformers' Conv1D (GPT-2's)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def targets(module: nn.Module, patterns: list[str], blocks: list[nn.Module]) -> list[str]:
    """The names of the layers to adapt: those matching `patterns` (globs of module
    names), or every linear inside `blocks` (the model's repeated blocks)."""
    if patterns:
        named = {n: m for n, m in module.named_modules() if n}
        chosen: list[str] = []
        for pattern in patterns:
            hits = [n for n in named if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                shown = ", ".join(n for n, m in named.items() if _linear(m))[:300]
                raise ConfigError(f"--lora_targets {pattern!r} matches no module of this "
                                  f"model: its linears are {shown}")
            bad = next((n for n in hits if not _linear(named[n])), None)
            if bad is not None:
                raise ConfigError(f"--lora_targets {pattern!r} matches {bad!r}, a "
                                  f"{type(named[bad]).__name__}: LoRA adapts linear layers; "
                                  "narrow the pattern")
            chosen += [n for n in hits if n not in chosen]
        return chosen
    inside = {id(m) for block in blocks for m in block.modules()}
    found = [n for n, m in module.named_modules() if id(m) in inside and _linear(m)]
    if not found:
        raise ConfigError("--lora_rank: this model has no repeated blocks of linear layers "
                          "to adapt: name the layers with --lora_targets GLOB ...")
    return found


def _peft() -> Any:
    """peft, imported quietly."""
    try:
        return quietly(lambda: __import__("peft"))
    except ImportError:
        raise ConfigError("--lora_rank needs peft: pip install 'ddptrain[lora]'") from None


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of a run: the layers they wrap (plain names), their rank, alpha and
    dropout, which layers store their weight (in, out) (transformers' Conv1D), and the
    base model's directory (`hf:DIR`) when it has one."""

    names: tuple[str, ...]
    rank: int
    alpha: float
    dropout: float = 0.0
    flipped: frozenset[str] = frozenset()
    base: str | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def peft_config(self) -> Any:
        config = _peft().LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
            target_modules=list(self.names), bias="none",
            fan_in_fan_out=bool(self.flipped & set(self.names)),
        )
        config.base_model_name_or_path = self.base
        return config


def lora_spec(module: nn.Module, config: Any) -> LoraSpec | None:
    """The adapters `config` asks of `module` (plain, not yet wrapped), or None."""
    from ddptrain.parallel.fsdp import fsdp_blocks

    if not config.lora_rank:
        return None
    base = config.model[len("hf:"):] if str(config.model).startswith("hf:") else None
    blocks = fsdp_blocks(module, config.fsdp_wrap)
    return LoraSpec(
        names=tuple(targets(module, config.lora_targets, blocks)), rank=config.lora_rank,
        alpha=config.lora_alpha or 2.0 * config.lora_rank, dropout=config.lora_dropout,
        flipped=frozenset(transposed(module)), base=base,
    )


def adapt(module: nn.Module, config: Any) -> LoraSpec | None:
    """`--lora_rank`: `module` (as built, plain) with its adapters, in place; their spec,
    or None without the flag. Every rank's module and fsdp's template alike."""
    spec = lora_spec(module, config)
    if spec is not None:
        add_lora(module, spec)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if is_adapter(name) and not p.is_meta:
                    p.copy_(adapter_start(name, p.shape, p.dtype, config.seed))
    return spec


def adapter_start(name: str, shape: torch.Size, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The value the adapter tensor `name` starts from, on the host: lora_B zeros, lora_A
    drawn as peft draws it (Kaiming-uniform, a = sqrt(5)) from the seed and its name, so
    a model built whole and one built on the meta device and filled per rank start
    alike."""
    if ".lora_B." in name:
        return torch.zeros(shape, dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + zlib.crc32(name.encode()))
        value = torch.empty(shape, dtype=dtype)
        nn.init.kaiming_uniform_(value, a=math.sqrt(5))
    return value


def quantize_base(module: nn.Module, spec: LoraSpec) -> int:
    """`--lora_quantize nf4` (QLoRA): each adapted layer's frozen weight kept in 4-bit
    NormalFloat (torchao's NF4Tensor: blocks of 64 weights, each with a scale, the scales
    quantized in turn), dequantized as the layer computes; returns the bytes it frees.

    The module's state gives these weights dequantized (checkpoints, exports and
    `evaluate` read plain tensors), and a load leaves the quantized ones as they are: a
    resume makes them again, the same, from the run's starting weights, while quantizing
    the dequantized ones again would not give them back bit for bit."""
    to_nf4 = quietly(lambda: __import__("torchao.quantization", fromlist=["to_nf4"]).to_nf4)
    freed = 0
    for name in spec.names:
        layer: Any = module.get_submodule(name).base_layer  # peft's wrapped layer
        weight = layer.weight.detach()
        if weight.numel() % NF4_BLOCK:
            continue  # too small to split into blocks: stays as it is
        scalers = weight.numel() // NF4_BLOCK
        quantized = to_nf4(weight, NF4_BLOCK, math.gcd(scalers, 256))
        layer.weight = nn.Parameter(quantized, requires_grad=False)
        freed += weight.numel() * weight.element_size() - _nf4_bytes(quantized)
        layer._register_state_dict_hook(_dequantized)
        layer._register_load_state_dict_pre_hook(_kept, with_module=True)
    return freed


NF4_BLOCK = 64  # weights per scale (QLoRA's)


def _nf4_bytes(quantized: Any) -> int:
    return nbytes(quantized)


def nf4_freed(module: nn.Module, spec: LoraSpec | None, config: Any) -> int:
    """The bytes `quantize_base` frees on `module` (adapted, its wrapped layers' weights
    plain or already quantized) under `--lora_quantize nf4`, else 0; from the weights'
    shapes alone: what a plan made on the meta device (`--dry_run`) and the run's own
    plan count."""
    if spec is None or config.lora_quantize == "off":
        return 0
    freed = 0
    for name in spec.names:
        layer: Any = module.get_submodule(name).base_layer  # peft's wrapped layer
        n, size = layer.weight.numel(), layer.weight.element_size()
        if n % NF4_BLOCK:
            continue  # left as it is by quantize_base
        scalers = n // NF4_BLOCK
        factors = scalers // math.gcd(scalers, 256)
        # 4 bits a weight, an int8 scale per block, the scales' factors and their mean
        freed += n * size - (n // 2 + scalers + (factors + 1) * size)
    return freed


def _dequantized(layer: Any, state: dict[str, Any], prefix: str, _: Any) -> None:
    state[prefix + "weight"] = layer.weight.get_original_weight()


def _kept(layer: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    if prefix + "weight" in state:
        state[prefix + "weight"] = layer.weight  # copied onto itself: unchanged


def plain_state(state: dict[str, torch.Tensor], module: nn.Module,
                config: Any) -> dict[str, torch.Tensor]:
    """A checkpoint's model state for `module` as the run's config built it plain: a LoRA
    run's adapters merged in (`merged`); any other state as it is."""
    spec = lora_spec(module, config) if any(is_adapter(k) for k in state) else None
    return merged(state, spec) if spec is not None else state


def add_lora(module: nn.Module, spec: LoraSpec) -> None:
    """Wrap the layers of `spec` in LoRA adapters, in place, the rest of `module` frozen."""
    import warnings

    with warnings.catch_warnings():  # peft's note that Conv1D takes fan_in_fan_out
        warnings.simplefilter("ignore")
        _peft().inject_adapter_in_model(spec.peft_config(), module, adapter_name=ADAPTER)


def transposed(module: nn.Module) -> set[str]:
    """The layers whose weight is stored (in, out) (transformers' Conv1D), by their
    plain names."""
    return {n.removesuffix(BASE) for n, m in module.named_modules()
            if type(m).__name__ == "Conv1D"}


def merged(state: dict[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """`state` (a LoRA module's, whole) as the plain model's: each wrapped layer's weight
    plus alpha / rank x B @ A (transposed for a Conv1D), under its own name; the
    adapters themselves dropped. A state without adapters is returned as it is."""
    if not any(is_adapter(k) for k in state):
        return state
    out = {base_name(k): v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if not key.endswith(f".lora_A.{ADAPTER}.weight"):
            continue
        layer = key.removesuffix(f".lora_A.{ADAPTER}.weight")
        b = state[f"{layer}.lora_B.{ADAPTER}.weight"]
        out[f"{layer}.weight"] = merge_one(out[f"{layer}.weight"], state[key], b, layer, spec)
    return out


def merge_one(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: str,
              spec: LoraSpec) -> torch.Tensor:
    """One wrapped layer's weight with its adapters merged in (whole tensors)."""
    delta = (b.float() @ a.float()) * spec.scale
    if layer in spec.flipped:
        delta = delta.T
    return (weight.float() + delta).to(weight.dtype)


def tp_plan_with_adapters(root: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """A tensor-parallel plan (`parallelize_module`'s: module names, `*` for one part)
    for `root` with LoRA-wrapped layers: such a layer's plain `ColwiseParallel` goes to
    its base layer and its `lora_B` (each rank computes its columns: base(x) + B(A(x)),
    with A whole), a plain `RowwiseParallel` to its base layer and its `lora_A` (each
    rank's input columns, reduced; B whole). A replicated A or B gets its full gradient on
    every rank, through the reductions torch makes at the split layers' inputs and
    outputs. Other styles on a wrapped layer are refused with one line."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    wrapped = {n for n, m in root.named_modules() if hasattr(m, "base_layer")}
    if not wrapped:
        return plan
    names = [n for n, _ in root.named_modules() if n]
    out: dict[str, Any] = {}
    for key, style in plan.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, key)
                   and n.count(".") == key.count(".")]  # `*` is one part of a name
        hits = [n for n in matched if n in wrapped]
        if not hits:
            out[key] = style
            continue
        plain_col = (isinstance(style, ColwiseParallel) and style.input_layouts == (Replicate(),)
                     and style.output_layouts == (Shard(-1),) and style.use_local_output)
        plain_row = (isinstance(style, RowwiseParallel)
                     and style.input_layouts == (Shard(-1),)
                     and style.output_layouts == (Replicate(),) and style.use_local_output)
        if not (plain_col or plain_row):
            raise ConfigError(
                f"--lora_rank with --tp: the plan splits {key} with {type(style).__name__} "
                "in a way adapters do not follow (only plain column or row splits do); drop "
                "--lora_targets of that layer, --sequence_parallel, or --tp"
            )
        for name in hits:
            out[f"{name}.base_layer"] = style
            if plain_col:
                out[f"{name}.lora_B.{ADAPTER}"] = ColwiseParallel()
            else:
                out[f"{name}.lora_A.{ADAPTER}"] = RowwiseParallel()
        out.update(dict.fromkeys((n for n in matched if n not in wrapped), style))
    return out
