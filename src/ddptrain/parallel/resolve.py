"""The strategy, decided once: which class runs, and what it implies.

`resolve_strategy` is called before any process group starts. It refuses flags that belong
to another strategy (they would be ignored) and says what the plan, the dry run and
`ddptrain doctor` print: the name, the bytes per rank, the checkpoint kind. The trainer
builds the strategy the same choice names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ddptrain.checkpoint_kind import CheckpointKind, checkpoint_kind
from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError
from ddptrain.layout import Layout
from ddptrain.parallel.base import Strategy
from ddptrain.parallel.ddp import DDP
from ddptrain.parallel.fsdp import FSDP
from ddptrain.parallel.memory import device_memory, implied_bytes, largest_models
from ddptrain.parallel.mesh import plan_mesh
from ddptrain.parallel.pp import Pipeline, check_stages
from ddptrain.parallel.tp import check_gpt_split
from ddptrain.parallel.tp_hf import check_hf_dir, read_hf_config

# zero is DDP with its optimizer state sharded (`parallel.zero`); a model split by tp is
# fsdp's to shard, or to leave as it is where tp takes every rank; pp cuts it into stages
STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDP, "zero": DDP, "fsdp": FSDP}
SINGLE = "single process"
# Above this much model + optimizer state, `--checkpoint_format auto` has every ddp rank
# write a part (DCP) instead of rank 0 writing the whole state while the others wait.


@dataclass(frozen=True)
class StrategyChoice:
    """What runs (`name`: ddp, zero, fsdp, or `single process` at world size 1), how it
    checkpoints (`file` or `dcp`), and on how many ranks."""

    name: str
    world_size: int
    checkpoint_kind: CheckpointKind  # from the flags and the world size
    cls: type[Strategy]
    device_bytes: int | None = None  # the memory of one rank's device (None: unknown)
    layout: Layout | None = None  # the degrees of each way of parallelism (None: 1 rank)
    config: TrainingConfig | None = None  # the run's (None: the kind is the one given)

    def rank_bytes(self, parameters: int, slots: int, trained: int | None = None,
                   freed: int = 0, experts: int = 0) -> dict[str, int]:
        """fp32 bytes of parameters, gradients and optimizer state one rank holds, `freed`
        bytes of the parameters fewer (`--lora_quantize`'s 4-bit base) (under
        tp, as if every parameter were split: the whole embeddings and norms are not;
        under pp, as if the stages held alike); `experts` of the parameters are a
        mixture's experts, which `--ep` spreads."""
        layout = self.layout or Layout(dp_shard=self.world_size)
        if layout.ep > 1 and experts:
            # ddp: each rank holds the rest whole and 1/ep of the experts; fsdp shards both
            # over every rank (the experts over their group, then over the groups), but
            # under --tp the tp ranks of a group hold the same experts
            held = (parameters + experts * (layout.tp - 1) if self.name == "fsdp"
                    else parameters - experts + experts // layout.ep)
            parameters, trained = held, held if trained in (None, parameters) else trained
        # fsdp shards over a replica's ranks (HSDP: not across replicas) and their cp
        # peers, tp splits layers, pp gives each rank a stage of them (as if the stages
        # were even).
        split = layout.model_split
        sharded_over = layout.dp_shard * layout.cp * split if self.name == "fsdp" else split
        name = "fsdp" if self.name == "fsdp" or layout.splits_model else self.name
        return implied_bytes(name, sharded_over, parameters, slots, trained, freed)

    @property
    def label(self) -> str:
        """The strategy's name on its layout (`Layout.name`): `fsdp; dp_replicate 2 x
        dp_shard 2`, `tp 2`, `ddp; ep 2 over dp`."""
        return self.name if self.layout is None else self.layout.name(self.name)

    def checkpoint_kind_for(self, parameters: int, slots: int) -> CheckpointKind:
        """The checkpoint kind for a model of `parameters` (`ddptrain.checkpoint_kind`:
        `--checkpoint_format auto` under ddp turns to dcp past a size)."""
        if self.config is None:
            return CheckpointKind(self.checkpoint_kind)
        return checkpoint_kind(self.config, self.world_size, parameters, slots)

    def largest_models(self, slots: int) -> dict[str, int] | None:
        """The most parameters ddp, zero and fsdp each fit on one device of this run."""
        if self.device_bytes is None:
            return None
        return largest_models(self.device_bytes, self.world_size, slots)

    def build(
        self, ctx: DistributedContext, config: TrainingConfig, param_dtype: torch.dtype | None
    ) -> Strategy:
        return self.cls(ctx, config, param_dtype)


def resolve_strategy(
    config: TrainingConfig, world_size: int, device: torch.device | str,
    local_ranks: int | None = None,
) -> StrategyChoice:
    """The strategy of a run of `world_size` ranks on `device` (`local_ranks` of them on
    this host: all unless told), or a ConfigError naming a flag that would be silently
    ignored."""
    device_type = torch.device(device).type
    if config.strategy != "fsdp":
        if config.fsdp_wrap and config.activation_checkpointing == "off":
            _refuse("fsdp_wrap", config.fsdp_wrap, config.strategy)  # else: names AC's blocks
        if not config.reshard_after_forward:
            _refuse("no-reshard_after_forward", None, config.strategy)
        if config.fsdp_cpu_offload:
            _refuse("fsdp_cpu_offload", None, config.strategy)
        if config.static_graph and config.grad_accum_steps > 1:
            # torch's reducer asserts on a static graph's first backward inside no_sync
            # (pytorch/pytorch#143580), and past that would skip the later all-reduces.
            raise ConfigError(
                f"--static_graph with gradient accumulation ({config.grad_accum_steps} "
                "micro-steps a step) is unsupported: DDP breaks on a static graph inside "
                "no_sync; use --find_unused_parameters instead, or no accumulation"
            )
    else:
        for flag in ("find_unused_parameters", "static_graph"):
            if getattr(config, flag):
                raise ConfigError(
                    f"--{flag} is a DDP setting and --strategy is 'fsdp', which needs none "
                    "(it reduces gradients per module): drop the flag, or use --strategy ddp "
                    "or zero"
                )
        if config.fsdp_cpu_offload and (world_size == 1 or device_type != "cuda"):
            where = "one process" if world_size == 1 else "CPU"
            raise ConfigError(
                f"--fsdp_cpu_offload is invalid on {where}: it moves GPU shards of 2+ ranks "
                "into CPU memory, and here the parameters already live there; drop the flag"
            )
    layout = plan_mesh(config, world_size, local_ranks)
    memory = device_memory(device, world_size if local_ranks is None else local_ranks)
    kind = checkpoint_kind(config, world_size)
    if world_size == 1:
        return StrategyChoice(SINGLE, 1, kind, Strategy, memory, config=config)
    if layout.plain or (not layout.splits_model and config.strategy != "fsdp"):
        # (ddp and zero under --cp: replicas over every rank, the cp ranks' among them)
        return StrategyChoice(config.strategy, world_size, kind, STRATEGIES[config.strategy],
                              memory, layout, config)
    # An n-D layout shards parameters into DTensors: its checkpoints are DCP directories.
    cls = Pipeline if layout.pp > 1 else FSDP
    if layout.pp > 1 and kind is CheckpointKind.FILE:
        raise ConfigError(
            f"--checkpoint_format file under --pp {layout.pp}: no rank holds the whole "
            "model, so each writes its stage into a DCP directory; use --checkpoint_format "
            "dcp (or auto)"
        )
    return StrategyChoice(config.strategy, world_size, kind, cls, memory, layout, config)


def _refuse(flag: str, value: object, strategy: str) -> None:
    shown = f"--{flag}" + (f" {value!r}" if value is not None else "")
    raise ConfigError(
        f"{shown} is an fsdp setting and --strategy is {strategy!r}: add --strategy fsdp, "
        "or drop the flag"
    )


def check_model_layout(config: TrainingConfig, shape: Any, tokens: int | None) -> None:
    """Before the process group: the model a config names (`shape`, a
    `models.factory.ModelShape`) against --tp and --pp, where ddptrain's own plans split
    it (no --tp_plan, no --pp_split): the GPT's heads (and under --sequence_parallel its
    `tokens`) divided by tp, a Hugging Face model's config.json, enough units for the
    stages; each mismatch is one line."""
    if config.tp > 1 and config.tp_plan is None:
        if shape.name == "gpt":
            check_gpt_split(config.tp, shape.heads, tokens if config.sequence_parallel else None)
        elif shape.hf_directory is not None:
            check_hf_dir(shape.name, shape.hf_directory, config.tp)
    if config.pp > 1 and config.pp_split is None:
        check_stages(config, shape.name, shape.blocks, shape.hf_directory)
    if config.ep > 1:
        check_experts(config, shape)
    if config.cp > 1:
        check_cp(config, shape)


def check_cp(config: TrainingConfig, shape: Any) -> None:
    """Before the process group: the heads of the built-in GPT or of a Hugging Face model's
    config.json divided by --tp x --cp (a user's module: as its attention is split,
    `parallel.cp`)."""
    cp, tp, heads = config.cp, config.tp, None
    if shape.name == "gpt":
        heads = shape.heads
    elif shape.hf_directory is not None:
        hf = read_hf_config(shape.hf_directory)
        heads = getattr(hf, "num_attention_heads", None) or getattr(hf, "n_head", None)
    if isinstance(heads, int) and heads % (tp * cp):
        raise ConfigError(f"--cp {cp} x --tp {tp} does not divide the {heads} attention heads "
                          "of the model: each cp rank attends with its share of a tp rank's "
                          "heads; choose --cp among the divisors of heads / tp")


# where a Hugging Face config.json counts a mixture's experts (Mixtral; Qwen-MoE;
# DeepSeek)
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def check_experts(config: TrainingConfig, shape: Any) -> None:
    """Before the process group, once: --ep needs a model with experts, as many as ep
    divides (the built-in GPT's --model_args experts=E, a Hugging Face config.json's
    count); what only the built model shows is checked as experts are spread."""
    ep, experts = config.ep, None
    if shape.name == "gpt":
        experts = int(config.model_args.get("experts", 0))
        what = "--model gpt"
    elif shape.hf_directory is not None:
        hf = read_hf_config(shape.hf_directory)
        if hf is None:
            return  # the build reports an unreadable directory
        experts = next((n for f in EXPERT_COUNTS if isinstance(n := getattr(hf, f, None), int)
                        and n > 0), 0)
        what = f"--model {shape.name} ({getattr(hf, 'model_type', 'unknown type')})"
    else:
        return  # a user's module: its layers say (`parallel.ep`)
    if not experts:
        raise ConfigError(f"--ep {ep} needs a mixture of experts and {what} has none: use "
                          "--model gpt --model_args experts=E top_k=K, or a Hugging Face "
                          "mixture whose experts are batched weights (Mixtral, Qwen3-MoE)")
    if experts % ep:
        raise ConfigError(f"--ep {ep} does not divide the {experts} experts of {what}: "
                          f"choose --ep among the divisors of {experts}")
