"""What differs at run time between the ways the model is spread over the ranks: one small
interface, one class for each, none built on another (`ddp.DDP`, with `zero`'s optimizer
under `--strategy zero`; `fsdp.FSDP`, which also runs a model tp split; `pp.Pipeline`,
which shards its stages with an `FSDP` of its own). What is done to the module before,
in one order for all, is `parallelize`'s.

The trainer never asks which strategy runs. It hands `build_module` a way to build the
model, calls `setup_module` (the last of `parallelize`'s passes) and `build_optimizer`
once (and `compile` under `--compile`),
runs each micro-batch through `forward_backward` (a plain forward, or a pipeline's
schedule), uses `clip_grad_norm` / `nonfinite_flags` on the optimizer step, `forward` and
`share_buffers` to evaluate, and moves state in and out through `full_state` /
`sharded_state` / `load_state`.

| strategy | parameters | gradients | optimizer state | what |
| --- | --- | --- | --- | --- |
| `Strategy` (world size 1) | full | full | full | the bare module |
| `ddp` | full | full, all-reduced | full | `DistributedDataParallel` |
| `zero` | full | full, all-reduced | 1/N | `ZeroRedundancyOptimizer`: ZeRO-1 |
| `fsdp` | 1/N | 1/N, reduce-scattered | 1/N | `fully_shard`: ZeRO-3 (or ZeRO-2) |

State leaves a strategy in one form whatever the strategy: the user module's own
parameter names, and the optimizer state keyed by those names (torch's
`get_optimizer_state_dict` layout). So a checkpoint written under one strategy and world
size loads under another.

    ddptrain train --strategy fsdp ...   # under torchrun, 2+ processes
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext

State = dict[str, Any]
# The optimizer class and its arguments: each strategy builds the optimizer its own way.
OptimizerSpec = tuple[type[torch.optim.Optimizer], dict[str, Any]]
# A context that does nothing, reusable: the step enters one or two per micro-batch.
NO_CONTEXT = contextlib.nullcontext()
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)
# The scaled loss of a forward's output, to run backward from: `loss(output, rows)`, `rows`
# None for the whole micro-batch, or (a pipeline's last stage, a micro-batch at a time)
# the rows of the batch `output` holds, rows past the batch's end being padding.
BatchLoss = Callable[[Any, "torch.Tensor | None"], torch.Tensor]
# The forward's precision: a new autocast context per call.
Autocast = Callable[[], AbstractContextManager[Any]]
# Builds the model, seeded, with its tensors on the device it is given (the meta device
# included): the same weights on every rank and every call.
ModelBuilder = Callable[[torch.device], nn.Module]
# Set (True) on a model built on the meta device whose weights its builder reads into each
# rank's part after `setup_module` (a Hugging Face directory, per rank): fsdp, tp and pp
# then allocate the parts and fill nothing, and rank 0 builds no whole template.
FILLED_BY_BUILDER = "ddptrain_filled_by_builder"


class Strategy:
    """World size 1: the bare module; every method is the plain single-process one."""

    name = "single process"
    even_forwards = False  # must every rank run the same number of forward passes?
    _full_load = StateDictOptions()  # a whole state loads as it is into a whole module

    def __init__(
        self, ctx: DistributedContext, config: TrainingConfig,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        # param_dtype: the autocast dtype, which fsdp casts the gathered parameters to.
        self.ctx, self.config, self.param_dtype = ctx, config, param_dtype
        self._found_inf = torch.zeros(1, device=ctx.device)
        self._one = torch.ones(1, device=ctx.device)

    # ------------------------------------------------------------------ setup
    def build_module(self, build: ModelBuilder) -> nn.Module:
        """The module this rank trains, before `setup_module`: whole, on this rank's
        device (fsdp builds it on the meta device instead)."""
        return build(self.ctx.device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The model the training step calls (a wrapper of `module`, or itself)."""
        return module

    def compile(self, model: Any) -> Any:
        """`--compile`: the model the training step calls, compiled. The wrapper is
        compiled, so DDP's buckets still overlap with backward; the plain module
        (checkpoints, evaluation) keeps its own parameter names."""
        return torch.compile(model)

    def build_optimizer(
        self, module: nn.Module, spec: OptimizerSpec, groups: list[dict[str, Any]] | None = None
    ) -> torch.optim.Optimizer:
        """The optimizer `spec` names over `groups` (param groups, each with its own
        settings), or over every trainable parameter of `module`."""
        cls, kwargs = spec
        trainable = [p for p in module.parameters() if p.requires_grad]
        groups = one_kind_per_group(groups or [{"params": trainable}])
        return cls(groups, **{**fused_where_it_can(cls, groups, kwargs), **kwargs})

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """An optimizer the user built over the module's parameters, made this strategy's
        (zero shards its state; every other strategy uses it as it is)."""
        return optimizer

    # ------------------------------------------------------------------ step
    def no_backward_sync(self, model: nn.Module, skip: bool) -> AbstractContextManager[Any]:
        """Inside, backward only accumulates gradients locally (when `skip`)."""
        return NO_CONTEXT

    def forward_backward(
        self, call: Callable[[nn.Module, Any], Any], model: nn.Module, inputs: Any,
        loss: BatchLoss, sync: bool, autocast: Autocast,
    ) -> None:
        """One micro-batch forward and backward: the forward under `autocast`, backward
        from `loss(output, None)`. Gradients are reduced over the ranks only when `sync`
        (the accumulation window's last micro-batch)."""
        with self.no_backward_sync(model, skip=not sync):
            with autocast():
                out = call(model, inputs)
            loss(out, None).backward()

    def forward(self, call: Callable[[nn.Module, Any], Any], module: nn.Module, inputs: Any) -> Any:
        """Forward only (evaluation): the model's output for `inputs`, or None on a rank
        that holds no output (a pipeline's earlier stages)."""
        return call(module, inputs)

    def share_buffers(self, module: nn.Module) -> None:
        """Collective. Before evaluation: every rank's buffers (batch norm's running
        statistics) as rank 0's, so each rank scores its shard with the same model."""
        if self.ctx.distributed:
            for buf in module.buffers():
                dist.broadcast(buf, src=0)

    def finish_gradients(self) -> None:
        """Once the window's last backward is done, before clipping and the step."""

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm; returns the norm before clipping."""
        return nn.utils.clip_grad_norm_(params, max_norm)

    # Whether ranks hold different gradients (shards), so that their non-finite flags
    # must be combined; under DDP every rank holds the same all-reduced ones.
    flags_differ = False

    def nonfinite_flags(self, params: list[nn.Parameter]) -> torch.Tensor:
        """1.0 on the device when any rank holds a non-finite gradient, else 0.0: the
        same flag on every rank, a tensor of its own (no host read). GradScaler's fused
        check (with a scale of 1, which leaves the values as they are) costs a few µs
        where a norm costs tens; where `flags_differ` the flags are all-reduced (one
        rank's inf is everyone's). `train.stepping` folds that all-reduce into the one of
        the window's count where there is one."""
        flag = self.nonfinite_flag(params).clone()
        if self.flags_differ and self.ctx.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def nonfinite_flag(self, params: list[nn.Parameter]) -> torch.Tensor:
        """1.0 on the device when this rank holds a non-finite gradient, else 0.0; no
        host read."""
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        self._found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, self._one)
        return self._found_inf

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The torch optimizer that steps this rank's parameters, the one that takes the
        non-finite flag (`train.stepping`): `optimizer` itself, or zero's local one."""
        return optimizer

    # ------------------------------------------------------------------ state
    def layout_state(self) -> State:
        """What the strategy itself needs, beyond weights and optimizer state, to go on
        bit for bit after a resume (kept in the checkpoint's meta); most need nothing."""
        return {}

    def resume_module(self, model: nn.Module, module: nn.Module, saved: State) -> nn.Module:
        """Collective. Once a checkpoint is loaded: the model the step calls from now on,
        given the `layout_state` saved with it (`model` itself unless it must change)."""
        return model

    def full_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        """Collective. The whole model and optimizer state, on rank 0 (maybe empty elsewhere)."""
        init_optimizer_state(optimizer)
        return module.state_dict(), get_optimizer_state_dict(module, optimizer)

    def model_state(self, module: nn.Module) -> State:
        """Collective. The whole model state with the user module's names, on rank 0."""
        return module.state_dict()

    def export_state(self, module: nn.Module) -> State:
        """Collective. This rank's part of the model state, under the user module's names,
        as it holds it (DTensors where it is sharded; a pipeline stage's own tensors):
        `checkpoint.streamed` makes each tensor whole where it is written."""
        self.share_buffers(module)
        return get_model_state_dict(module)

    def ties(self, module: nn.Module) -> list[list[str]]:
        """Groups of names that are one tensor (a tied embedding and head), first name first."""
        return tie_groups(module)

    def sharded_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        """What this rank writes into (and loads from) a DCP checkpoint. Tensors every
        rank holds alike are written once; DCP reshards on load."""
        init_optimizer_state(optimizer)
        return get_state_dict(module, optimizer)

    def load_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, model: State, optim: State,
        full: bool,
    ) -> None:
        """Load a state from `full_state` (every rank holds all of it) or `sharded_state`."""
        optim = named_optimizer_state(optim, module)
        init_optimizer_state(optimizer)
        if not full:
            set_state_dict(module, optimizer, model_state_dict=model, optim_state_dict=optim)
            return
        set_model_state_dict(module, model, options=self._full_load)
        set_optimizer_state_dict(module, optimizer, optim, options=self._full_load)

    def rank_bytes(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of parameters, gradients (as they are once materialised) and optimizer
        state this rank holds."""
        params = sum(nbytes(p) for p in module.parameters())
        grads = sum(nbytes(p) for p in module.parameters() if p.requires_grad)
        return {"params": params, "grads": grads, "optimizer": state_bytes(optimizer.state)}


def by_layout(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The parameters with a gradient, grouped by how the gradient is laid out (tp-split
    ones on data-parallel x tp, whole ones on data-parallel alone, plain tensors): torch's
    fused norms and scalings take one layout at a time."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = (g.device_mesh.mesh_dim_names, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def squared_norm(groups: list[list[nn.Parameter]], device: torch.device) -> torch.Tensor:
    """The squared global norm of the groups' gradients (a 0-d float tensor): each group's
    norm reduced over its own mesh, then summed."""
    squares = []
    for group in groups:
        norm = nn.utils.get_total_norm([p.grad for p in group if p.grad is not None])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.float().square())
    return torch.stack(squares).sum() if squares else torch.zeros((), device=device)


def clip_by_layout(groups: list[list[nn.Parameter]], max_norm: float,
                   device: torch.device) -> torch.Tensor:
    """Clip the gradients of `groups` (`by_layout`) to the global norm `max_norm`; returns
    the norm before clipping."""
    total = squared_norm(groups, device).sqrt()
    for group in groups:
        nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def named_optimizer_state(optim: State, module: nn.Module) -> State:
    """An optimizer state keyed by parameter names. A torch `Optimizer.state_dict()`
    (integer ids, the order the optimizer was built in: the trainable parameters) is
    converted; one keyed by names is returned as it is."""
    groups = optim.get("param_groups", [])
    if not groups or all(isinstance(p, str) for g in groups for p in g["params"]):
        return optim
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    return {
        "state": {names[i]: s for i, s in optim.get("state", {}).items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups],
    }


def fused_where_it_can(
    cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """`fused=True` for torch's AdamW, Adam and SGD where their fused step runs (one
    kernel per group of tensors, and a step skipped on the device given the non-finite
    flag: `train.stepping`), unless the spec chose an implementation; SGD's fused step has
    no DTensor rule (sharded parameters), Adam's has."""
    if "fused" in kwargs or "foreach" in kwargs:
        return {}
    params = [p for g in groups for p in g["params"]]
    if any(p.device.type not in ("cpu", "cuda") or not p.is_floating_point() for p in params):
        return {}
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        return {"fused": True}
    dampened = kwargs.get("dampening") or any(g.get("dampening") for g in groups)
    if cls is torch.optim.SGD and not dampened and not any(isinstance(p, DTensor) for p in params):
        return {"fused": True}
    return {}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Materialise a lazily created optimizer state (Adam's moments appear at the first
    step), so a checkpoint has tensors of the right shape to load into, before torch's
    state-dict functions do it their way: a step of zero gradients at a learning rate of
    0, which allocates a gradient per parameter and runs the whole step (seconds per 100M
    parameters on a CPU). torch's SGD with momentum, Adam and AdamW get the zeros their
    first step creates, without the step; any other optimizer takes that step."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):
        return
    if zero_state(optimizer):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def zero_state(optimizer: torch.optim.Optimizer) -> bool:
    """The state torch's SGD (with momentum), Adam or AdamW creates at its first step,
    as zeros (the step count 0: no step was taken), made without the step; False for
    any other optimizer or setting."""
    kind = type(optimizer)
    groups = optimizer.param_groups
    if kind is torch.optim.SGD and all(g["momentum"] != 0 and not g.get("dampening")
                                       for g in groups):  # dampened: the first step differs
        for g in groups:
            for p in g["params"]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return True
    if kind not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for g in groups:
        on_device = g.get("capturable") or g.get("fused")
        for p in g["params"]:
            state = optimizer.state[p]
            state["step"] = (
                torch.zeros((), dtype=torch.float32 if g.get("fused") else scalar,
                            device=p.device)
                if on_device else torch.tensor(0.0, dtype=scalar)
            )
            moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if g.get("amsgrad") else (
                "exp_avg", "exp_avg_sq")
            for name in moments:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return True


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """An optimizer param group's settings, without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor on the CPU (the copy a save makes anyway, made once)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {key: to_cpu(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(value) for value in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(value) for value in obj)
    return obj


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` under each of its names."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def tie_groups(module: nn.Module) -> list[list[str]]:
    """Groups of names that are one tensor of `module` (a tied embedding and head)."""
    return [names for names, _ in tensors_by_identity(module) if len(names) > 1]


def copy_whole(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole value `full` into `target`: all of it, or this rank's slice of it
    (a DTensor's shard, each rank cutting its own)."""
    if isinstance(target, DTensor):
        from torch.distributed.tensor import distribute_tensor

        mine = distribute_tensor(full.to(target.device), target.device_mesh, target.placements,
                                 src_data_rank=None)
        target.to_local().copy_(mine.to_local())
    else:
        target.copy_(full)


def tensors_by_identity(module: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The module's tensors, each once, with all of its names (a tied one has several)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in named_tensors(module).items():
        groups.setdefault(id(t), ([], t))[0].append(name)
    return list(groups.values())


# The tensors torchao's NF4Tensor (`--lora_quantize nf4`) stores a weight in: 4 bits a
# weight, an int8 scale per block of 64, the scales' own factors and mean.
NF4_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


def nbytes(t: torch.Tensor) -> int:
    """The bytes `t` holds on this rank: a DTensor's local part, an NF4 weight's 4-bit
    storage (not its size dequantized)."""
    local = local_tensor(t)
    if all(hasattr(local, part) for part in NF4_PARTS):
        return sum(nbytes(getattr(local, part)) for part in NF4_PARTS)
    return local.numel() * local.element_size()


def state_bytes(state: Any) -> int:
    return sum(
        nbytes(v) for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    )


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def one_kind_per_group(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Optimizer parameter groups split so that each holds DTensors of one mesh or plain
    tensors alone (same settings): torch's foreach and fused steps, its defaults on a GPU,
    take one kind of tensor at a time."""
    out: list[dict[str, Any]] = []
    for group in groups:
        kinds: dict[Any, list[nn.Parameter]] = {}
        for p in group["params"]:
            kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        out.extend({**group, "params": params} for params in kinds.values())
    return out
