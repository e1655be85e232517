"""The device mesh: how the ranks of a job are laid out over the ways of parallelism.

    world size = pp x dp_replicate x dp_shard x cp x tp

`plan_mesh` reads the degrees from the config and checks them against the world size
before any process group starts (one `ConfigError` line each); `attach_mesh` builds the
`DeviceMesh` once the group is up and gives it to the run's `DistributedContext`, with this
rank's data-parallel coordinates, which the data, the loss scale and the metric sums use.
It is the job's one mesh: every other group is one of its submeshes (`fsdp_mesh`,
`tp_mesh`, `pp_mesh`, `cp_mesh`), or made from them (`ep_mesh`: the data-parallel ranks
flattened, then cut into expert groups; under cp, FSDP shards over `dp_shard x cp`
flattened).

The dimensions run from the outermost to the innermost, and ranks next to each other in
the innermost dimension are neighbours in the launcher's numbering (torchrun and Slurm
number a node's processes together). So tensor parallelism, which talks at every layer,
stays inside a node (`LOCAL_WORLD_SIZE` ranks) when `tp` divides it, and so do the cp
ranks' all-to-alls (4 a layer) next to it; under HSDP the FSDP shards (`dp_shard x cp x
tp` ranks) do too, and only the replicas' gradient all-reduce crosses
nodes. Pipeline stages are the outermost dimension: a stage sends one activation per
micro-batch to the next, the least traffic of all, so stages may sit on different nodes.

    torchrun --nproc_per_node=4 -m ddptrain train --strategy fsdp --dp_replicate 2 ...  # HSDP 2x2
    torchrun --nproc_per_node=4 -m ddptrain train --strategy fsdp --tp 2 ...            # FSDP x TP
    torchrun --nproc_per_node=4 -m ddptrain train --strategy fsdp --pp 2 ...            # FSDP x PP
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ddptrain.config import TrainingConfig
from ddptrain.config_sections import ParallelSection
from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError
from ddptrain.layout import MESH_DIMS as DIMS
from ddptrain.layout import Layout

log = logging.getLogger("ddptrain")
EP_DIMS = ("dp_mod_ep", "ep")  # `ep_mesh`'s dimensions
# (the job's mesh, its expert groups) by the mesh's id and ep: made once
_EP_MESHES: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh]] = {}


def plan_mesh(
    config: TrainingConfig, world_size: int, local_world_size: int | None = None
) -> Layout:
    """The layout of `world_size` ranks the config asks for, or a ConfigError naming the
    numbers that do not fit. Called before any process group starts."""
    r, t, p, c = config.dp_replicate, config.tp, config.pp, config.cp
    if config.tp_plan and t == 1:
        raise ConfigError(
            f"--tp_plan {config.tp_plan!r} is a tensor-parallel plan and --tp is 1: add "
            "--tp 2 (or more), or drop the flag"
        )
    if config.sequence_parallel and (t == 1 or config.tp_plan):
        raise ConfigError(
            "--sequence_parallel splits the built-in GPT's norms over the tp ranks and "
            + (f"--tp_plan {config.tp_plan!r} is a plan of its own: drop the flag, or have "
               "the plan split them" if config.tp_plan else "--tp is 1: add --tp 2 (or more), "
               "or drop the flag")
        )
    fixed = r * c * t * p
    if world_size % fixed:
        raise ConfigError(
            f"world size {world_size} is not dp_replicate {r} x data-parallel shards x "
            f"cp {c} x tp {t} x pp {p}: {r} x {c} x {t} x {p} = {fixed} does not divide "
            f"{world_size} ranks; choose degrees whose product divides the world size"
        )
    if c > 1 and config.block_size % c:
        raise ConfigError(
            f"--cp {c} does not divide --block_size {config.block_size}: each of the {c} "
            "ranks takes an equal slice of every sequence; choose a multiple of --cp"
        )
    if c > 1 and config.sequence_parallel:
        raise ConfigError(
            f"--cp {c} with --sequence_parallel: both split the sequence, and only one may; "
            "drop --sequence_parallel (--cp already splits the norms' activations)"
        )
    if c > 1 and (t > 1 or p > 1) and config.strategy != "fsdp":
        raise ConfigError(
            f"--cp {c} with --tp {t} --pp {p} needs --strategy fsdp, which averages the "
            "gradients over the data-parallel and cp ranks: add --strategy fsdp"
        )
    layout = Layout.of(config, world_size)
    held = layout.token_ranks
    if held % layout.ep:
        what = "data-parallel x cp" if c > 1 else "data-parallel"
        raise ConfigError(
            f"--ep {layout.ep} does not divide the {held} {what} ranks of {world_size}: an "
            f"expert group is {layout.ep} of them; choose --ep among the divisors of {held}, "
            "or a world size it divides"
        )
    _check_pipeline(config)
    if r > 1 and config.strategy != "fsdp":
        raise ConfigError(
            f"--dp_replicate {r} is HSDP, replicas of an FSDP-sharded model, and --strategy "
            f"is {config.strategy!r}: add --strategy fsdp, or drop --dp_replicate"
        )
    for flag, degree, name in (("tp", t, "TP"), ("pp", p, "PP")):
        if degree > 1 and config.strategy == "zero":
            raise ConfigError(
                f"--{flag} {degree} with --strategy zero is unsupported: use --strategy fsdp "
                f"(FSDP x {name}), or ddp when {flag} takes every rank"
            )
        if degree > 1 and config.strategy == "ddp" and layout.data_parallel > 1:
            raise ConfigError(
                f"--{flag} {degree} on {world_size} ranks leaves {layout.data_parallel} "
                f"data-parallel ranks, and --strategy ddp does not compose with it: add "
                f"--strategy fsdp (FSDP x {name}), or run --{flag} {world_size}"
            )
    local = local_world_size or world_size
    inner = t * c * (layout.dp_shard if r > 1 else 1)
    if not layout.plain and local % inner:
        what = "cp x tp" if r == 1 else "dp_shard x cp x tp"
        log.warning(
            "%s = %d ranks does not divide the %d ranks of a node: those groups cross nodes, "
            "and their collectives run at network speed", what, inner, local,
        )
    return layout


def _check_pipeline(config: TrainingConfig) -> None:
    """The pipeline flags: one line each for those that cannot run (or would be ignored)."""
    p = config.pp
    if p == 1:
        for flag in ("pp_microbatches", "pp_split"):
            if getattr(config, flag) is not None:
                raise ConfigError(
                    f"--{flag} is a pipeline setting and --pp is 1: add --pp 2 (or more), "
                    "or drop the flag"
                )
        return
    if config.sequence_parallel:
        raise ConfigError(
            f"--sequence_parallel with --pp {p}: the stages pass whole sequences to each "
            "other; drop --sequence_parallel (--tp still splits the layers)"
        )
    micro = pipeline_microbatches(config)
    if config.batch_size % micro:
        raise ConfigError(
            f"--pp_microbatches {micro} does not divide --batch_size {config.batch_size}: "
            "each batch is cut into that many equal micro-batches; choose a divisor"
        )
    if config.pp_schedule == "1f1b" and micro < p:
        raise ConfigError(
            f"--pp_schedule 1f1b needs at least as many micro-batches as stages: "
            f"--pp_microbatches {micro} < --pp {p}; raise it, or use --pp_schedule gpipe"
        )


def pipeline_microbatches(config: ParallelSection) -> int:
    """The micro-batches a batch is cut into under --pp (default: one per stage)."""
    return config.pp_microbatches or config.pp


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The job's DeviceMesh (collective: every rank builds it, after the process group)."""
    return init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=DIMS)


def attach_mesh(ctx: DistributedContext, layout: Layout | None) -> DistributedContext:
    """`ctx` with the mesh of `layout` (the strategy's, planned once by `plan_mesh`) and
    this rank's data-parallel coordinates; `ctx` itself for data parallelism alone (None).
    Collective under an n-D layout."""
    if not ctx.distributed or ctx.mesh is not None or layout is None or not layout.needs_mesh:
        return ctx
    mesh = build_mesh(layout, ctx.device.type)
    replica, shard = mesh.get_local_rank("dp_replicate"), mesh.get_local_rank("dp_shard")
    data = (replica * layout.dp_shard + shard, layout.data_parallel)
    return dataclasses.replace(ctx, mesh=mesh, data_parallel=data, context_parallel=layout.cp)


def ep_mesh(ctx: DistributedContext, ep: int) -> DeviceMesh:
    """The ranks that hold other tokens (data-parallel x cp) laid out as `dp_mod_ep x ep`
    (`parallel.ep`): an expert group is `ep` of them next to each other; `dp_mod_ep` the
    ranks that hold the same experts. Made from the job's mesh once, then reused."""
    assert ctx.mesh is not None, "expert parallelism runs on the job's mesh"
    found = _EP_MESHES.get((id(ctx.mesh), ep))
    if found is None or found[0] is not ctx.mesh:
        dp = _flat_dp(ctx.mesh)
        found = (ctx.mesh, dp._unflatten(0, (dp.size() // ep, ep), EP_DIMS))
        _EP_MESHES[(id(ctx.mesh), ep)] = found
    return found[1]


def _flat_dp(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel and cp dimensions as one (torch caches a flatten: made once)."""
    return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")


def _flat(mesh: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
    """The dimensions `dims` of `mesh` that hold more than one rank, as one (a flatten
    torch caches by name; the first of them where none does)."""
    wide = tuple(d for d in dims if mesh[d].size() > 1) or dims[:1]
    if len(wide) == 1:
        return mesh[wide[0]]
    return mesh[wide]._flatten("dp" if wide == ("dp_replicate", "dp_shard") else "_".join(wide))


def data_group(ctx: DistributedContext) -> Any:
    """The process group of the ranks that hold other tokens of the global batch (those
    of this rank's pipeline stage and tensor-parallel index: `dp_replicate x dp_shard x
    cp`); None: every rank, a job without a mesh."""
    if ctx.mesh is None:
        return None
    return _flat(ctx.mesh, ("dp_replicate", "dp_shard", "cp")).get_group()


def fsdp_mesh(ctx: DistributedContext) -> DeviceMesh | None:
    """The mesh FSDP shards over: the data-parallel dimensions (2-D under HSDP: replicas
    all-reduce, shards reduce-scatter), the cp ranks' joined to the shards' (they hold
    the same weights and average their gradients); None: every rank (FSDP's default)."""
    if ctx.mesh is None:
        return None
    shards = _flat(ctx.mesh, ("dp_shard", "cp"))
    if ctx.mesh.size(DIMS.index("dp_replicate")) > 1:
        (name,) = shards.mesh_dim_names or ("dp_shard",)
        return ctx.mesh["dp_replicate", name]
    return shards


def cp_mesh(ctx: DistributedContext) -> DeviceMesh | None:
    """The mesh of the ranks that split each sequence; None without context parallelism."""
    if ctx.mesh is None or ctx.mesh.size(DIMS.index("cp")) == 1:
        return None
    return ctx.mesh["cp"]


def pp_mesh(ctx: DistributedContext) -> DeviceMesh | None:
    """The mesh of the ranks that hold a model's stages in turn; None without pipelining."""
    if ctx.mesh is None or ctx.mesh.size(DIMS.index("pp")) == 1:
        return None
    return ctx.mesh["pp"]


def tp_mesh(ctx: DistributedContext) -> DeviceMesh | None:
    """The mesh of the ranks that split each layer; None without tensor parallelism."""
    if ctx.mesh is None or ctx.mesh.size(DIMS.index("tp")) == 1:
        return None
    return ctx.mesh["tp"]
