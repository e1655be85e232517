"""Which parts of the model train, and which recompute their activations: applied to the
user's module before a strategy wraps or shards it, so every strategy sees the same.

    ddptrain train --model gpt --dataset chars --freeze 'embed.*' --activation_checkpointing

`--freeze GLOB ...` turns `requires_grad` off for the parameters whose names (the user
module's own, whatever the strategy) match: DDP then leaves them out of its buckets, FSDP2
out of its reduce-scatter, and the optimizer never sees them. `--activation_checkpointing`
recomputes each repeated block's forward in backward (non-reentrant
`torch.utils.checkpoint`, which restores the RNG state, so dropout draws the same masks):
the blocks are the ones fsdp shards one by one (`fsdp_blocks`, or `--fsdp_wrap`).
`--activation_checkpointing selective` keeps, inside each block, the outputs of the ops
that cost the most to run again (matmuls, attention: `KEPT`) and recomputes only the cheap
ones between them (norms, activations, residual adds), as torchtitan's per-op policy
does: most of block checkpointing's saving on the element-wise tensors, little of its
recompute. The
block's `forward` is replaced on the instance, not the block wrapped in another module,
so parameter names, checkpoints and FSDP's hooks around the block stay as they are.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ddptrain.errors import ConfigError
from ddptrain.parallel.fsdp import fsdp_blocks


def matches(names: Iterable[str], patterns: Iterable[str], flag: str) -> dict[str, list[str]]:
    """The names each glob pattern matches (`*` crosses dots: `encoder.*` is all of the
    encoder). A pattern that matches nothing is a ConfigError naming a few names."""
    names = list(names)
    found = {p: [n for n in names if fnmatch.fnmatchcase(n, p)] for p in patterns}
    missing = [p for p, hits in found.items() if not hits]
    if missing:
        shown = ", ".join(names[:6]) + (f" ... ({len(names)} in all)" if len(names) > 6 else "")
        raise ConfigError(
            f"--{flag} {' '.join(repr(p) for p in missing)} matches no parameter of this "
            f"model: the names look like {shown}"
        )
    return found


def freeze(module: nn.Module, patterns: list[str]) -> int:
    """Stop training the parameters whose names match; returns how many elements are
    frozen. Tied parameters match under any of their names."""
    if not patterns:
        return 0
    named = list(module.named_parameters(remove_duplicate=False))
    hits = {n for names in matches([n for n, _ in named], patterns, "freeze").values()
            for n in names}
    if all(name in hits for name, _ in named):
        raise ConfigError(
            f"--freeze {' '.join(patterns)} freezes every parameter: nothing would train; "
            "leave some out of the patterns (to evaluate the weights as they are: "
            "ddptrain evaluate, or --lr 0)"
        )
    frozen: dict[int, nn.Parameter] = {}
    for name, p in named:
        if name in hits:
            p.requires_grad_(False)
            frozen[id(p)] = p
    return sum(p.numel() for p in frozen.values())


_aten = torch.ops.aten
# The ops whose outputs `selective` keeps: the expensive ones to run again.
KEPT = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
})


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT else CheckpointPolicy.PREFER_RECOMPUTE


def _selective() -> Any:
    return create_selective_checkpoint_contexts(_keep_expensive)


def checkpoint_activations(
    module: nn.Module, wrap: str | None, mode: str = "block"
) -> list[nn.Module]:
    """Make each repeated block recompute its activations in backward, all of them
    (`block`) or the cheap ops' (`selective`); returns the blocks."""
    blocks = fsdp_blocks(module, wrap)
    if not blocks:
        raise ConfigError(
            "--activation_checkpointing finds no repeated blocks in this model: name their "
            "class with --fsdp_wrap (e.g. --fsdp_wrap Block), or drop the flag"
        )
    for block in blocks:
        # Instance attribute: nn.Module.__call__ (and FSDP's hooks around it) call it.
        if mode == "selective":
            block.forward = functools.partial(
                checkpoint, block.forward, use_reentrant=False, context_fn=_selective
            )
        else:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return blocks


def to_float8(module: nn.Module, recipe: str, fsdp: bool) -> list[str]:
    """`--float8`: swap the linear layers for torchao's `Float8Linear` (same parameters,
    same state-dict names: checkpoints stay interchangeable with bf16 runs); returns the
    names converted. Left in higher precision: a linear whose sides are not multiples of
    16 (float8 matmuls need them) and one whose weight is shared (a head tied to the
    embedding). Under fsdp with tensorwise scaling, the all-gather sends float8."""
    import dataclasses

    from ddptrain.log import quietly

    float8 = quietly(lambda: __import__("torchao.float8", fromlist=["Float8LinearConfig"]))
    Float8LinearConfig, convert_to_float8_training = (
        float8.Float8LinearConfig, float8.convert_to_float8_training)
    config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    shared = {id(p) for p, n in _uses(module).items() if n > 1}
    chosen: list[str] = []

    def fits(layer: nn.Module, name: str) -> bool:
        ok = (isinstance(layer, nn.Linear) and layer.in_features % 16 == 0
              and layer.out_features % 16 == 0 and id(layer.weight) not in shared)
        if ok:
            chosen.append(name)
        return ok

    convert_to_float8_training(module, config=config, module_filter_fn=fits)
    if not chosen:
        raise ConfigError(
            f"--float8 {recipe} finds no linear layer to convert in this model (float8 "
            "matmuls need sides that are multiples of 16); drop --float8"
        )
    return chosen


def _uses(module: nn.Module) -> dict[nn.Parameter, int]:
    """How many modules hold each parameter (2 for a tied embedding and head)."""
    uses: dict[nn.Parameter, int] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            uses[p] = uses.get(p, 0) + 1
    return uses
