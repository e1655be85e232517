"""`--pp P`: pipeline parallelism, the model's layers cut into stages held by P ranks in
turn, composed with FSDP over the data-parallel ranks (FSDP x PP) and with tensor
parallelism inside each stage (`--tp`: the layers split first, by `tp.tensor_parallel`);
with neither data parallelism nor tp, the stages are plain modules.

    torchrun --nproc_per_node=2 -m ddptrain train --dataset chars --pp 2
    torchrun --nproc_per_node=4 -m ddptrain train --dataset chars --pp 2 --tp 2
    torchrun --nproc_per_node=4 -m ddptrain train --dataset chars --pp 2 --strategy fsdp \\
        --pp_schedule interleaved1f1b --pp_microbatches 4

Each batch is cut into `--pp_microbatches` equal micro-batches that flow through the stages
(`torch.distributed.pipelining`: `--pp_schedule gpipe`, `1f1b`, or `interleaved1f1b`, where
each rank holds two stages, r and r + P). The last stage scores each micro-batch with the
task's summed loss, scaled as every other strategy scales it, so one pipelined step
equals one step on the whole batch. An epoch's short last batch is padded to the full
batch with copies of its first row, which the loss leaves out: every step has the same
shapes, and the stages exchange them once.

The built-in GPT is cut into units (the embeddings, each block, the final norm with the
head), split evenly over the stages. The head's weight is tied to the token embedding:
the first stage holds it as `wte.weight`, the last as `lm_head.weight`; their gradients
are summed between them before the optimizer step, so they stay equal, and the
optimizer's state of either is saved under the whole model's name, `wte.weight`.

Any other model gives its split: `--pp_split package.module:fn`, where
`fn(model, stage, stages)` returns the stage's module, built from the model's own
submodules (not copies): its forward takes the previous stage's output (stage 0: the
batch's inputs) and returns the next stage's input
(the last: the model's output).

A rank keeps only its stages' parameters, under the model's own names: the checkpoint's
DCP directory is the whole model's, whichever layout wrote or reads it, and the export
gathers the stages' parts on rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.batch import Output, parse_output
from ddptrain.errors import ConfigError
from ddptrain.parallel.base import (
    FILLED_BY_BUILDER,
    FULL_STATE,
    NO_CONTEXT,
    Autocast,
    BatchLoss,
    ModelBuilder,
    State,
    Strategy,
    by_layout,
    copy_whole,
    init_optimizer_state,
    local_tensor,
    named_tensors,
    squared_norm,
    tensors_by_identity,
    to_cpu,
)
from ddptrain.parallel.cp import of as context_of
from ddptrain.parallel.fsdp import FSDP, fsdp_blocks
from ddptrain.parallel.mesh import DIMS, pipeline_microbatches, pp_mesh
from ddptrain.parallel.pp_hf import HFDecoderStage, check_hf_stages, is_hf_decoder
from ddptrain.parallel.tp_hf import read_hf_config
from ddptrain.plugins import load_ref

log = logging.getLogger("ddptrain")
SCHEDULES = {
    "gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B,
}
_GATHERED = StateDictOptions(full_state_dict=True)  # each stage's tensors whole on its ranks


class Pipeline(Strategy):
    """Pipeline stages over the mesh's `pp` dimension, each stage sharded by FSDP over the
    data-parallel dimensions (`self.shards`, an `FSDP` of its own); without data-parallel
    ranks there is nothing to shard, and a stage's parameters stay as they are, plain
    tensors or tp's DTensors (no FSDP hook runs in its steps).

    Start-up is fsdp's where the model allows it: built on the meta device, cut into
    stages, each rank's stages sharded, and only then allocated and filled from rank 0's
    seeded template in host memory, so no rank's device ever holds more than its stages
    and the weights are those of a whole-model start."""

    name = "pp"
    flags_differ = True  # each rank checks the gradients of its own stages
    even_forwards = True
    _full_load = StateDictOptions(full_state_dict=True)  # each rank keeps its stages' part

    def __init__(
        self, ctx: DistributedContext, config: TrainingConfig,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(ctx, config, param_dtype)
        # Autocast alone sets the compute precision, as in plain training: FSDP keeps its
        # gathered parameters in fp32 (a stage's micro-batches then round as one batch).
        self.shards = FSDP(ctx, config, None, units=self._units)

    def build_module(self, build: ModelBuilder) -> nn.Module:
        return self.shards.build_module(build)

    def setup_module(self, module: nn.Module) -> nn.Module:
        mesh = pp_mesh(self.ctx)
        assert mesh is not None, "Pipeline runs on a mesh with a pp dimension"
        p, rank = mesh.size(), mesh.get_local_rank()
        per_rank = 2 if self.config.pp_schedule == "interleaved1f1b" else 1
        stages = p * per_rank
        mine = [rank + i * p for i in range(per_rank)]
        split = stage_split(module, self.config)
        views = [split(module, s, stages) for s in mine]
        # A tensor under several names (a tied embedding and head) is named in the
        # optimizer's state by its first name in the whole model; each stage keeps it
        # under the name its own modules give it.
        first = {id(p): name for name, p in module.named_parameters()}
        whole = tensors_by_identity(module)  # on meta: what the template will fill
        self._ties = [names for names, _ in whole if len(names) > 1]  # for `model_state`
        _keep_only(module, views)
        self._canonical = {
            name: first[id(p)] for name, p in module.named_parameters() if first[id(p)] != name
        }
        on_meta, self.shards._on_meta = self.shards._on_meta, False  # filled below
        self.views = [self.shards.setup_module(view) for view in views]
        if on_meta:
            self._fill(module, whole)
        group = mesh.get_group()
        self._pp_group = group
        # A tensor several stages hold (the tied embedding): shapes of this rank's shard,
        # this rank's copies by their names in the whole model, and those another stage
        # counts in the norm. Found once: the step only reads them.
        self.shared, owner = _shared_parameters(module, group, self._canonical)
        named = {self._canonical.get(n, n): p for n, p in module.named_parameters()}
        self._copies = {n: named.get(n) for n in self.shared}
        self._not_counted = {id(named[n]) for n, r in owner.items() if r != rank and n in named}
        self.stages = [
            PipelineStage(view, s, stages, self.ctx.device, group=group)
            for view, s in zip(self.views, mine, strict=True)
        ]
        self.micro = pipeline_microbatches(self.config)
        cls = SCHEDULES[self.config.pp_schedule]
        try:
            if per_rank == 1:
                self.schedule: Any = cls(self.stages[0], self.micro, loss_fn=self._loss,
                                         scale_grads=False)
            else:
                self.schedule = cls(self.stages, self.micro, loss_fn=self._loss,
                                    scale_grads=False)
        except ValueError as exc:
            raise ConfigError(
                f"--pp_schedule {self.config.pp_schedule} with {self.micro} micro-batches "
                f"over {stages} stages: {exc}; choose another --pp_microbatches"
            ) from exc
        self.is_last = mine[-1] == stages - 1
        self._stage_loss: BatchLoss | None = None
        log.debug("pp: stages %s of %d, %d micro-batches", mine, stages, self.micro)
        return module

    def _units(self, module: nn.Module) -> list[nn.Module]:
        # A stage's blocks, however few: the search for repeated blocks wants two or more.
        blocks = getattr(module, "blocks", None)
        if isinstance(blocks, nn.ModuleList) and not self.config.fsdp_wrap:
            return list(blocks)
        return fsdp_blocks(module, self.config.fsdp_wrap)

    @torch.no_grad()
    def _fill(self, module: nn.Module, whole: list[tuple[list[str], torch.Tensor]]) -> None:
        """Allocate this rank's stages (their shards) and fill them from rank 0's seeded
        template, one tensor at a time: rank 0 broadcasts each tensor of the whole model
        once, and the ranks that hold it keep their slice. Collective."""
        for view in self.views:
            view.to_empty(device=self.ctx.device)
        if getattr(module, FILLED_BY_BUILDER, False):
            return
        template, self.shards._template = self.shards._template, None
        source = named_tensors(template) if template is not None else {}
        held = named_tensors(module)
        for names, meta in whole:
            full = (source[names[0]].detach().to(self.ctx.device) if template is not None
                    else torch.empty(meta.shape, dtype=meta.dtype, device=self.ctx.device))
            dist.broadcast(full, src=0)
            for name in names:
                if name in held:
                    copy_whole(held[name], full)

    # ------------------------------------------------------------------ step
    def no_backward_sync(self, model: nn.Module, skip: bool) -> AbstractContextManager[Any]:
        return NO_CONTEXT  # each schedule step reduces its stages' gradients itself

    def compile(self, model: Any) -> Any:
        raise ConfigError("--compile with --pp is unsupported: drop one of them")

    def forward_backward(
        self, call: Any, model: nn.Module, inputs: Any, loss: BatchLoss, sync: bool,
        autocast: Autocast,
    ) -> None:
        """One batch through the pipeline's schedule, forward and backward, under
        `autocast`: `loss(output, rows)` is called on the last stage for each of its
        micro-batches, `rows` their rows in `inputs` (a CPU tensor, read without waiting
        for the device). Each schedule step reduces its stages' gradients (`sync` or not)."""
        padded, rows = self._pad(inputs)
        self._stage_loss = loss
        try:
            with autocast():
                self.schedule.step(padded, target=rows if self.is_last else None,
                                   return_outputs=False)
        finally:
            self._stage_loss = None

    def share_buffers(self, module: nn.Module) -> None:
        """The stages hold different buffers: each keeps its own."""

    def _loss(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # Evaluation asks too, and so does the stages' shape inference before a schedule's
        # first step (train or eval: each switch infers again), on made-up outputs: a
        # zero with the output's graph, counted nowhere.
        if self._stage_loss is None or not self._ready():
            return output.sum() * 0.0
        return self._stage_loss(output, rows)

    def _ready(self) -> bool:
        """Whether the schedule has inferred the stages' shapes for backward (torch keeps
        it in the schedule: one flag for one stage a rank, one for several)."""
        flag = getattr(self.schedule, "_stage_backward_initialized", None)
        if flag is None:
            flag = getattr(self.schedule, "_stages_backward_initialized", True)
        return bool(flag)

    def forward(self, call: Any, module: nn.Module, inputs: Any) -> Output | None:
        """Forward only (evaluation): the model's output on the last stage, None on the
        others."""
        padded, rows = self._pad(inputs)
        out = self.schedule.eval(padded, target=rows if self.is_last else None)
        if not self.is_last:
            return None
        return parse_output(out[: inputs.shape[0]])

    def _pad(self, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(inputs, torch.Tensor):
            raise ConfigError(
                f"--pp passes one tensor from stage to stage, and the batches' inputs are "
                f"a {type(inputs).__name__}: give the model one input tensor"
            )
        n, full = inputs.shape[0], self.config.batch_size
        rows = torch.arange(max(n, full))
        if n >= full:
            return inputs, rows
        pad = inputs[:1].expand(full - n, *inputs.shape[1:])
        return torch.cat([inputs, pad]), rows

    def finish_gradients(self) -> None:
        """The gradients of a parameter held by several stages (a tied embedding and head)
        are summed between them, so its copies take the same step."""
        if not self.shared:
            return
        flat = []
        for name, (shape, dtype) in self.shared.items():
            p = self._copies[name]
            grad = local_tensor(p.grad) if p is not None and p.grad is not None else None
            flat.append(grad.reshape(-1) if grad is not None
                        else torch.zeros(shape, dtype=dtype, device=self.ctx.device).reshape(-1))
        buf = torch.cat(flat)
        dist.all_reduce(buf, group=self._pp_group)
        offset = 0
        for name, (shape, _) in self.shared.items():
            size = int(torch.Size(shape).numel())
            p = self._copies[name]
            if p is not None and p.grad is not None:
                local_tensor(p.grad).copy_(buf[offset:offset + size].view(shape))
            offset += size

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The global norm: each stage's (over its data-parallel and tp shards), summed over
        the stages; a parameter several stages hold counts once (on the first of them)."""
        groups = by_layout(params)
        counted = [[p for p in g if id(p) not in self._not_counted] for g in groups]
        square = squared_norm([g for g in counted if g], self.ctx.device).reshape(1)
        dist.all_reduce(square, group=self._pp_group)
        total = square.sqrt().squeeze()
        for group in groups:
            nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    # ------------------------------------------------------------------ state
    def full_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        init_optimizer_state(optimizer)
        optim = get_optimizer_state_dict(module, optimizer, options=FULL_STATE)
        return self.model_state(module), optim

    def sharded_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        model, optim = super().sharded_state(module, optimizer)  # no buffer shared: stages
        return model, _renamed(optim, self._canonical)

    def load_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, model: State, optim: State,
        full: bool,
    ) -> None:
        back = {whole: mine for mine, whole in self._canonical.items()}
        super().load_state(module, optimizer, model, _renamed(optim, back), full)

    def ties(self, module: nn.Module) -> list[list[str]]:
        return self._ties  # a copy on each stage that holds it, kept equal

    def model_state(self, module: nn.Module) -> State:
        """Collective. Each stage's tensors gathered over its data-parallel ranks, then the
        stages' parts joined on rank 0."""
        state = to_cpu(get_model_state_dict(module, options=_GATHERED))
        mesh = self.ctx.mesh
        first_of_stage = all(
            mesh.get_local_rank(d) == 0 for d in DIMS if d != "pp"
        )
        if not first_of_stage:
            return {}
        parts: list[Any] | None = [None] * mesh.size(0) if self.ctx.is_main else None
        dist.gather_object(state, parts, group=self._pp_group, group_dst=0)
        if parts is None:
            return {}
        whole: State = {}
        for part in parts:
            whole.update(part)
        # A tied tensor (the embedding and the head) was a copy on each of its stages, kept
        # equal: one tensor under all of its names again, as other layouts export it.
        for names in self._ties:
            held = [n for n in names if n in whole]
            for name in held[1:]:
                if torch.equal(whole[name], whole[held[0]]):
                    whole[name] = whole[held[0]]
        return whole


def check_stages(config: Any, model: str, blocks: int, hf_directory: Path | None) -> None:
    """Before the process group: a model ddptrain cannot split without `--pp_split`, or
    more stages than the built-in GPT (of `blocks` blocks) or the Hugging Face model in
    `hf_directory` (`--model hf:DIR`, read from its config.json) has units, is one line."""
    stages = config.pp * (2 if config.pp_schedule == "interleaved1f1b" else 1)
    if hf_directory is not None:
        hf = read_hf_config(hf_directory)
        if hf is not None:
            check_hf_stages(hf, stages, f"--model {model}")
        return
    if model != "gpt":
        raise ConfigError(
            f"--pp {config.pp}: ddptrain splits the built-in GPT and Llama-style Hugging "
            f"Face models, and this run's model is {model!r}: give --pp_split "
            "package.module:fn, fn(model, stage, stages) returning the stage's module"
        )
    _gpt_units(blocks, stages)


def _gpt_units(blocks: int, stages: int) -> int:
    units = blocks + 2
    if units < stages:
        raise ConfigError(
            f"the GPT has {blocks} blocks, {units} units with its embeddings and head, and "
            f"--pp asks for {stages} stages: use at most {units} stages"
        )
    return units


def stage_split(module: nn.Module, config: Any) -> Callable[[nn.Module, int, int], nn.Module]:
    """`--pp_split` when given, the built-in GPT's split for the built-in GPT, a
    Llama-style Hugging Face model's (`pp_hf`); any other model without a split is a
    ConfigError."""
    if config.pp_split:
        fn = load_ref(config.pp_split, "pp_split")
        if not callable(fn):
            raise ConfigError(
                f"--pp_split {config.pp_split!r} is not a function: give fn(model, stage, "
                "stages) returning the stage's module"
            )
        return fn
    if _is_gpt(module):
        return GPTStage
    if is_hf_decoder(module):
        return HFDecoderStage
    raise ConfigError(
        f"--pp {config.pp}: ddptrain splits the built-in GPT and Llama-style Hugging Face "
        f"models, and this model is a "
        f"{type(module).__name__}: give --pp_split package.module:fn, fn(model, stage, "
        "stages) returning the stage's module"
    )


class GPTStage(nn.Module):
    """One stage of the built-in GPT: its share of the units (the embeddings, each block,
    the final norm and head), split evenly over the stages; it refers to the model's own
    modules."""

    def __init__(self, model: nn.Module, stage: int, stages: int) -> None:
        super().__init__()
        blocks = list(model.blocks)  # type: ignore[arg-type]
        units = _gpt_units(len(blocks), stages)
        lo, hi = stage * units // stages, (stage + 1) * units // stages
        self.first, self.last = lo == 0, hi == units
        self.blocks = nn.ModuleList(blocks[max(lo - 1, 0):min(hi - 1, len(blocks))])
        if self.first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
        self.split = context_of(model)  # --cp: the slice's positions are its rank's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            t = x.size(1)
            pos = (torch.arange(t, device=x.device) if self.split is None
                   else self.split.positions(t, x.device))
            x = self.drop(self.wte(x) + self.wpe(pos))  # type: ignore[operator]
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))  # type: ignore[operator]
        return x


def _is_gpt(module: nn.Module) -> bool:
    return all(hasattr(module, n) for n in ("wte", "wpe", "drop", "blocks", "ln_f", "lm_head"))


def _keep_only(module: nn.Module, views: list[nn.Module]) -> None:
    """Drop from `module` the parameters and buffers of every submodule no view holds:
    the rank keeps its stages' tensors under the model's own names (a tied tensor only
    under the names of the modules its stage holds)."""
    held = {id(m) for v in views for m in v.modules()}
    for mod in module.modules():
        if id(mod) not in held:
            mod._parameters.clear()
            mod._buffers.clear()


def _shared_parameters(
    module: nn.Module, group: dist.ProcessGroup, canonical: dict[str, str]
) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, int]]:
    """The parameters more than one stage holds, by their names in the whole model: the
    shape and dtype of this rank's shard of each, and the first pp rank that holds it.
    Collective (pp group)."""
    mine = {
        canonical.get(n, n): (tuple(local_tensor(p).shape), p.dtype)
        for n, p in module.named_parameters()
    }
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    holders: dict[str, list[int]] = {}
    for rank, held in enumerate(every):
        for name in held:
            holders.setdefault(name, []).append(rank)
    shared = sorted(n for n, ranks in holders.items() if len(ranks) > 1)
    shapes = {n: every[holders[n][0]][n] for n in shared}
    return shapes, {n: holders[n][0] for n in shared}


def _renamed(optim: State, names: dict[str, str]) -> State:
    """An optimizer state keyed by parameter names, with `names` renamed."""
    if not names:
        return optim
    return {
        **optim,
        "state": {names.get(k, k): v for k, v in optim.get("state", {}).items()},
        "param_groups": [
            {**g, "params": [names.get(p, p) for p in g["params"]]}
            for g in optim.get("param_groups", [])
        ],
    }
