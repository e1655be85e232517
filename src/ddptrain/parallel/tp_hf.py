"""Tensor-parallel plans for Hugging Face `transformers` models (`--model hf:DIR --tp T`).

    torchrun --nproc_per_node=2 -m ddptrain train --model hf:models/tiny-llama --tp 2 ...

Llama-style models (Llama, Mistral, Qwen2 and the others whose config carries a
`base_model_tp_plan` of plain `colwise`/`rowwise` entries): that description is applied
to the base model with torch's `ColwiseParallel`/`RowwiseParallel` (local outputs), so
q, k, v and the MLP's widening projections are split by columns, the attention's and
the MLP's narrowing projections by rows (one all-reduce each). Their attention reshapes
to `-1` heads, so each rank computes its `heads / T` query and `kv_heads / T` key-value
heads (grouped-query attention keeps its ratio); `T` must divide both.

GPT-2: its projections are `Conv1D` (a Linear's weight transposed) and q, k, v come from
one fused projection (all q heads, then all k, then all v), as in the built-in GPT: that
projection is split by columns and its output gathered, each rank takes its own heads of
q, k and v from it (the gathered output's gradient summed over the tp ranks), and the
output projection is split by rows; the MLP is split Megatron-style.

Embeddings, norms and the language-model head stay whole on every tp rank (tied weights
stay tied), sharded by FSDP over the data-parallel ranks; the state keeps the model's own
names.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from ddptrain.errors import ConfigError
from ddptrain.parallel.lora import tp_plan_with_adapters

# transformers' names for the two splits its plans describe that torch's styles are.
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
# Entries for whole-model parts that may stay whole here (replicated on the tp ranks).
KEPT_WHOLE = {"embedding_rowwise", "colwise_gather_output", "gather"}


def hf_tp_plan(module: nn.Module, tp: int) -> Callable[[nn.Module, DeviceMesh], Any] | None:
    """The plan for a transformers model (GPT-2, or one whose config describes its own
    tensor-parallel split), after `check_hf_config`; None for any other model."""
    import sys

    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(module, transformers.PreTrainedModel):
        return None
    config = module.config
    if not check_hf_config(config, tp, type(module).__name__):
        return None
    if config.model_type == "gpt2":
        return parallelize_gpt2
    plan = {name: STYLES[style]() for name, style in config.base_model_tp_plan.items()
            if style in STYLES}
    return partial(_parallelize_base, plan=plan)


def check_hf_config(config: Any, tp: int, what: str) -> bool:
    """Whether ddptrain has a plan for the model of this transformers config (`what`
    names the model); a ConfigError when its heads do not split over `tp` ranks or its
    own plan has a split ddptrain cannot apply. Needs the config only: checked before
    the process group starts."""
    if getattr(config, "model_type", None) == "gpt2":
        _check_divides(tp, config, ("n_head",), what)
        return True
    described = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not described:
        return False
    unknown = {k: v for k, v in described.items() if v not in STYLES and v not in KEPT_WHOLE}
    if unknown:
        name, style = next(iter(unknown.items()))
        raise ConfigError(
            f"--tp {tp}: {what}'s tensor-parallel plan splits {name} as {style!r}, which "
            "ddptrain does not apply (only colwise/rowwise): give --tp_plan package.module:fn"
        )
    _check_divides(tp, config, ("num_attention_heads", "num_key_value_heads"), what)
    return True


def check_hf_dir(name: str, directory: Path, tp: int) -> None:
    """`check_hf_config` for `--model hf:DIR` (`name`), from its config.json alone; a
    directory that cannot be read is left to the model's build to report."""
    config = read_hf_config(directory)
    if config is not None:
        check_hf_config(config, tp, f"--model {name}")


def read_hf_config(directory: Path) -> Any | None:
    """The transformers config in `directory` (its config.json alone), for the checks made
    before the process group; None when it cannot be read (the model's build reports
    that)."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception:
        return None


def _check_divides(tp: int, config: Any, fields: tuple[str, ...], what: str) -> None:
    counts = {f: getattr(config, f, None) for f in fields}
    bad = {f: n for f, n in counts.items() if isinstance(n, int) and n % tp}
    if bad:
        numbers = ", ".join(f"{f} {n}" for f, n in counts.items() if isinstance(n, int))
        raise ConfigError(
            f"--tp {tp} does not divide the attention heads of {what} ({numbers}): choose a "
            "tp that divides them"
        )


def _parallelize_base(model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> None:
    """The model's own description, applied to its base model (the names it uses)."""
    base = model.base_model
    parallelize_module(base, mesh, tp_plan_with_adapters(base, plan))  # type: ignore[arg-type]


def parallelize_gpt2(model: nn.Module, mesh: DeviceMesh) -> None:
    """GPT-2's plan (see the module's docstring)."""
    tp, rank = mesh.size(), mesh.get_local_rank()
    for block in model.base_model.h:  # type: ignore[union-attr]
        attn = block.attn
        parallelize_module(block, mesh, tp_plan_with_adapters(block, {
            "attn.c_attn": Conv1DParallel(colwise=True, output=Replicate(), partial_grad=True),
            "attn.c_proj": Conv1DParallel(colwise=False),
            "mlp.c_fc": Conv1DParallel(colwise=True),
            "mlp.c_proj": Conv1DParallel(colwise=False),
        }))
        width = int(attn.split_size) // tp
        attn.c_attn.register_forward_hook(partial(_own_heads, start=rank * width, width=width))
        attn.split_size = width  # q, k, v of this rank's heads


def _own_heads(
    module: nn.Module, args: Any, output: torch.Tensor, start: int, width: int
) -> torch.Tensor:
    """This rank's heads of the gathered q, k and v (each `width * tp` wide)."""
    q, k, v = output.chunk(3, dim=-1)
    return torch.cat([t[..., start:start + width] for t in (q, k, v)], dim=-1)


class Conv1DParallel(ParallelStyle):
    """transformers' `Conv1D` (`x @ weight + bias`, weight `(in, out)`) split by columns
    (the output features: replicated input, output sharded on its last dimension unless
    `output` says otherwise) or by rows (the input features: input sharded on its last
    dimension, output summed over the ranks). Outputs are local tensors; `partial_grad`:
    each rank uses its own part of a gathered output, so the output's gradient is each
    rank's share of it, summed over the ranks in backward (a reduce-scatter)."""

    def __init__(
        self, *, colwise: bool, output: Placement | None = None, partial_grad: bool = False
    ) -> None:
        super().__init__()
        self.colwise = colwise
        self.partial_grad = partial_grad
        self.input = Replicate() if colwise else Shard(-1)
        self.output = output or (Shard(-1) if colwise else Replicate())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition, self._prepare_input, self._prepare_output
        )

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for key, param in list(module.named_parameters(recurse=False)):
            if key == "weight":
                placement: Placement = Shard(1) if self.colwise else Shard(0)
            else:  # the bias: split with the outputs, or added once after the sum
                placement = Shard(0) if self.colwise else Replicate()
            module.register_parameter(key, nn.Parameter(
                distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad
            ))

    def _prepare_input(self, module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input], run_check=False)
        return (x, *inputs[1:])

    def _prepare_output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
        if output.placements != (self.output,):
            output = output.redistribute(placements=[self.output])
        return output.to_local(grad_placements=[Partial()] if self.partial_grad else None)
