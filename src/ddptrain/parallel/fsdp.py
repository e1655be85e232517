"""`--strategy fsdp`: FSDP2 (`fully_shard`), parameters, gradients and optimizer state
sharded over the ranks (ZeRO-3), and the choice of the blocks it shards one by one.

The same strategy runs a model that tensor parallelism split (`--tp`, split by the
`parallel.tp` pass first): FSDP x TP, HSDP x TP, and TP alone, where no data-parallel
rank is left to shard over and nothing is wrapped.
"""

from __future__ import annotations

import logging
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
    set_model_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError
from ddptrain.layout import Layout
from ddptrain.parallel.base import (
    FILLED_BY_BUILDER,
    FULL_STATE,
    NO_CONTEXT,
    ModelBuilder,
    State,
    Strategy,
    by_layout,
    clip_by_layout,
    count_parameters,
    init_optimizer_state,
    tensors_by_identity,
)
from ddptrain.parallel.ep import expert_layers
from ddptrain.parallel.mesh import ep_mesh, fsdp_mesh

log = logging.getLogger("ddptrain")


class FSDP(Strategy):
    """FSDP2: `fully_shard` on each block and on the root. Parameters, gradients and
    optimizer state are sharded; a block's parameters are all-gathered for its forward
    and backward and freed after (`--no-reshard_after_forward` keeps them from forward
    to backward: ZeRO-2 memory, one all-gather fewer).

    Start-up, as torchtitan does it: every rank builds the model on the meta device (its
    structure, no memory), shards it, then allocates only its own shards (`to_empty`).
    Rank 0 alone builds the seeded model in host memory as the template, whose tensors
    are then broadcast one at a time, each rank keeping its slice: the weights are those
    the other strategies start from, and no rank's device ever holds the whole model. A
    model marked `FILLED_BY_BUILDER` (a Hugging Face directory) has no template: each rank
    reads its own shards from the files after `setup_module`. A model handed over already
    built (`fit(model=instance)`) cannot be rebuilt on meta: it
    is moved to the device whole and sharded there.

    A model split by tensor parallelism starts the same way: built on the meta device,
    split (by the `parallel.tp` pass) and sharded, then allocated and filled. When tp
    takes every rank there is nothing to shard: no FSDP (its hooks would run in every
    step for nothing); the split parameters are DTensors on the tp mesh and the whole
    ones (norms, embeddings) plain tensors, equal on every tp rank."""

    flags_differ = True  # each rank checks its own shards of the gradients

    even_forwards = True  # every forward all-gathers: ranks must call it alike
    _full_load = StateDictOptions(full_state_dict=True)  # each rank keeps its shard of it
    _from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)

    @property
    def shards_data(self) -> bool:
        """Whether there are data-parallel (or cp) ranks to shard over. `--strategy fsdp`
        shards whatever their number; a model split by tp or pp wraps nothing in FSDP
        without them, whose hooks would run in every step for nothing."""
        return self.ctx.grad_world > 1 or self.layout.plain

    def __init__(
        self, ctx: DistributedContext, config: TrainingConfig,
        param_dtype: torch.dtype | None = None,
        units: Callable[[nn.Module], list[nn.Module]] | None = None,
    ) -> None:
        super().__init__(ctx, config, param_dtype)
        self.layout = Layout.of(config, ctx.world_size)
        self.name = "tp" if self.layout.tp > 1 else "fsdp"
        # the modules sharded one by one before the root (default: `fsdp_blocks`)
        self._units = units or (lambda module: fsdp_blocks(module, config.fsdp_wrap))
        self._on_meta = False  # was the module built on the meta device?
        self._template: nn.Module | None = None  # rank 0's seeded copy, in host memory
        self._blocks: list[nn.Module] = []

    def build_module(self, build: ModelBuilder) -> nn.Module:
        try:
            with torch.device("meta"):  # tensors a model makes without naming a device
                module = build(torch.device("meta"))
        except Exception as exc:
            # Construction that reads values (`.item()`, numpy) has none on meta; a real
            # mistake (a bad --model) fails again in the build below, and is reported.
            log.info("fsdp: the model cannot be built on the meta device (%s); built whole "
                     "on each rank, then sharded", exc)
            return build(self.ctx.device)
        if not _all_meta(module):
            # A model that keeps tensors outside its parameters and buffers, or puts
            # them on a device of its own choosing: those could not be filled in later.
            log.info("fsdp: the model keeps tensors outside its parameters and buffers; "
                     "built whole on each rank, then sharded")
            return build(self.ctx.device)
        self._on_meta = True
        if self.ctx.is_main and not getattr(module, FILLED_BY_BUILDER, False):
            with torch.random.fork_rng(devices=[]):  # every rank's generator stays alike
                self._template = build(torch.device("cpu"))
        return module

    def setup_module(self, module: nn.Module) -> nn.Module:
        blocks = self._units(module)
        self._root, self._blocks = module, blocks
        if not self.shards_data:  # tp (or pp) takes every rank: nothing to shard
            if self._on_meta:
                ties = [names for names, t in tensors_by_identity(module)
                        if len(names) > 1 and isinstance(t, nn.Parameter)]
                self._materialise(module)
                retie(module, ties)
            return module
        kwargs: dict[str, Any] = {"reshard_after_forward": self.config.reshard_after_forward}
        mesh = fsdp_mesh(self.ctx)
        if mesh is not None:
            # Only the data-parallel dimensions: 2-D under HSDP (--dp_replicate), where
            # each replica's ranks shard the model and the replicas all-reduce gradients;
            # under tensor parallelism the tp ranks hold different shards already.
            kwargs["mesh"] = mesh
        if self.param_dtype is not None:
            # Compute in the low precision, reduce gradients and keep the master weights
            # in fp32; autocast stays on for the ops it keeps in fp32 (losses, norms).
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.param_dtype, reduce_dtype=torch.float32
            )
        if self.config.fsdp_cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        if self.config.ep > 1:
            self._shard_experts(module, kwargs)
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(module, **kwargs)
        if self._on_meta:
            self._materialise(module)
        log.debug("fsdp: %d blocks sharded, plus the root", len(blocks))
        return module

    def _shard_experts(self, module: nn.Module, kwargs: dict[str, Any]) -> None:
        """`--ep`: each layer's experts (spread over their group by the `parallel.ep`
        pass) sharded over the ranks that hold the same ones (`dp_mod_ep`), in a unit of
        their own: the layer's other modules (the router) get theirs, on every rank. Each
        expert's gradient arrives summed over its group's tokens; the reduce-scatter
        sums it over `dp_mod_ep` and divides by every data-parallel (x cp) rank."""
        replicas = ep_mesh(self.ctx, self.config.ep)["dp_mod_ep"]
        for _, layer in expert_layers(module):
            for child in layer.children():
                if count_parameters(child):
                    fully_shard(child, **kwargs)
            unit = fully_shard(layer, **{**kwargs, "mesh": replicas})
            unit.set_gradient_divide_factor(float(self.ctx.grad_world))
            # gloo has no pre-scaled sum: a sum, then the division. Not for a lone holder,
            # whose gradient torch 2.13 would divide twice that way.
            unit.set_force_sum_reduction_for_comms(replicas.size() > 1)

    @torch.no_grad()
    def _materialise(self, module: nn.Module) -> None:
        """Allocate this rank's shards and the buffers, and fill them from rank 0's
        template. Collective."""
        device = self.ctx.device
        # Under --fsdp_cpu_offload the shards live in host memory and FSDP moves each to
        # the device for its compute; buffers are not FSDP's and stay on the device.
        module.to_empty(device=torch.device("cpu") if self.config.fsdp_cpu_offload else device)
        for mod in module.modules():
            for key, buf in mod._buffers.items():
                if buf is not None and buf.device != device:
                    mod._buffers[key] = buf.to(device)
        if getattr(module, FILLED_BY_BUILDER, False):
            return
        template, self._template = self._template, None
        full = template.state_dict() if template is not None else {}
        # One tensor at a time: rank 0 broadcasts it, each rank copies its slice.
        set_model_state_dict(module, full, options=self._from_rank0)
        del full
        # Buffers outside the state dict (a causal mask, position ids) come from rank 0.
        mine = dict(module.named_buffers())
        for name in _non_persistent(module):
            if template is not None:
                mine[name].copy_(template.get_buffer(name))
            dist.broadcast(mine[name], src=0)

    def compile(self, model: Any) -> Any:
        # Each block's forward is compiled in place, as torchtitan does: FSDP's gathers
        # stay around the compiled code, the blocks (alike) share their compilations,
        # and every parameter keeps its name.
        for block in self._blocks or [self._root]:
            block.forward = torch.compile(block.forward)
        return model

    def no_backward_sync(self, model: nn.Module, skip: bool) -> AbstractContextManager[Any]:
        if self.shards_data:
            self._root.set_requires_gradient_sync(not skip)  # type: ignore[operator]
        return NO_CONTEXT

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        if self.layout.tp > 1 or self.config.ep > 1:
            # tp's DTensors and the plain (or fsdp-sharded) rest; the experts' gradients
            # lie on a mesh of their own
            return clip_by_layout(by_layout(params), max_norm, self.ctx.device)
        # Each rank holds a shard of every gradient: the norm of the sharded gradients
        # is a DTensor whose full value is the global norm.
        grads = [p.grad for p in params if p.grad is not None]
        norm = nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def full_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        init_optimizer_state(optimizer)
        optim = get_optimizer_state_dict(module, optimizer, options=FULL_STATE)
        return self.model_state(module), optim

    def model_state(self, module: nn.Module) -> State:
        state = get_model_state_dict(module, options=FULL_STATE)
        # Gathering copies each name's tensor apart; tied parameters (a language model's
        # embedding and output head) are one tensor again, so export stores them once.
        first: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            kept = first.setdefault(id(p), name)
            if kept != name and kept in state and name in state:
                state[name] = state[kept]
        return state

    def sharded_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[State, State]:
        # Buffers (BatchNorm statistics) are not sharded and FSDP does not keep them in
        # step: each rank's drift apart in training. DCP writes one copy of a replicated
        # tensor, so make it rank 0's, the copy evaluation and export use.
        self.share_buffers(module)
        return super().sharded_state(module, optimizer)


def fsdp_blocks(module: nn.Module, wrap: str | None) -> list[nn.Module]:
    """The modules FSDP shards one by one (each is all-gathered as a unit).

    `--fsdp_wrap A,B`: every submodule whose class is named A or B. Otherwise the repeated
    blocks: starting at the root, a module whose children of one class (not a container
    such as `nn.Sequential`) hold at least half of its parameters gives those children (a
    GPT's blocks, an MLP's layers, a ResNet's residual blocks); else the search goes on
    into its biggest child."""
    if wrap:
        names = {n.strip() for n in wrap.split(",") if n.strip()}
        found = [m for m in module.modules() if type(m).__name__ in names and m is not module]
        if not found:
            present = sorted({type(m).__name__ for m in module.modules()})
            raise ConfigError(
                f"--fsdp_wrap {wrap!r} matches no module of this model: choose among "
                f"{', '.join(present[:12])}"
            )
        return found
    # A module holding a tensor another module holds too (a token embedding tied to the
    # head) is no unit of its own: FSDP shards a tensor in one unit only.
    owners: dict[int, int] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    tied = {k for k, n in owners.items() if n > 1}
    node = module
    while True:
        total = count_parameters(node)
        children = [c for c in node.children() if count_parameters(c)]
        if not children or not total:
            return []
        by_class: dict[type, list[nn.Module]] = {}
        for child in children:
            if any(id(p) in tied for p in child.parameters()):
                continue
            if not isinstance(child, _CONTAINERS):  # a Sequential is a list, not a block
                by_class.setdefault(type(child), []).append(child)
        if by_class:
            group = max(by_class.values(), key=lambda g: sum(count_parameters(c) for c in g))
            if len(group) >= 2 and 2 * sum(count_parameters(c) for c in group) >= total:
                return group
        biggest = max(children, key=count_parameters)
        if 2 * count_parameters(biggest) < total:
            return []
        node = biggest


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _all_meta(module: nn.Module) -> bool:
    """Whether every tensor of `module` is a meta parameter or buffer: nothing that a
    state dict and `to_empty` would not reach."""
    if any(not t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return False
    return not any(
        isinstance(v, torch.Tensor) for m in module.modules() for v in vars(m).values()
    )


def _non_persistent(module: nn.Module) -> list[str]:
    """Names of the buffers `state_dict` leaves out."""
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, mod in module.named_modules()
        for name in mod._non_persistent_buffers_set
        if mod._buffers.get(name) is not None
    ]


def retie(module: nn.Module, ties: list[list[str]]) -> None:
    """Each group of names one parameter again: `to_empty` makes a parameter tied on the
    meta device (an embedding and its head) a tensor of its own under each name."""
    for names in ties:
        first = module.get_parameter(names[0])
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, first)
