"""The layout of a job: how many ranks each way of parallelism takes, as one value.

    world size = pp x dp_replicate x dp_shard x cp x tp        (ep borrows dp x cp ranks)

`Layout.of(config, world_size)` reads the degrees from the flags; every question the code
asks of them is answered here, once: whether the model is split across ranks
(`splits_model`), how many ranks train on different data (`data_parallel`), the name the
plan, the summary and `ddptrain doctor` print (`name`). Whether the degrees fit the world
size, the strategy and the model is checked before the process group
(`parallel.mesh.plan_mesh`, `parallel.resolve`); the device mesh is built from the value
(`parallel.mesh.build_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddptrain.config_sections import ParallelSection

# the mesh's dimensions, outermost first (`parallel.mesh` says why this order)
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert groups of this many data-parallel (x cp) ranks (`parallel.ep`)

    @classmethod
    def of(cls, config: ParallelSection, world_size: int | None = None) -> Layout:
        """The layout `config`'s flags ask of `world_size` ranks (unknown: as many as the
        fixed degrees take, one data-parallel shard); a world the degrees do not divide
        keeps its remainder out of `dp_shard` (`parallel.mesh.plan_mesh` refuses it)."""
        fixed = config.dp_replicate * config.cp * config.tp * config.pp
        shard = max(1, world_size // fixed) if world_size is not None else 1
        return cls(pp=config.pp, dp_replicate=config.dp_replicate, dp_shard=shard,
                   cp=config.cp, tp=config.tp, ep=config.ep)

    @property
    def mesh_shape(self) -> tuple[int, int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def data_parallel(self) -> int:
        """Ranks that train on different data: replicas x shards (the ranks that split
        a model, by layers or by stages, share their batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def token_ranks(self) -> int:
        """Ranks that hold other tokens of the global batch: the data-parallel ones, each
        with its cp peers (other slices of the same rows). Expert groups are made of them."""
        return self.data_parallel * self.cp

    @property
    def model_split(self) -> int:
        """Into how many parts each replica's model is split: tp x pp."""
        return self.tp * self.pp

    @property
    def splits_model(self) -> bool:
        """Whether ranks hold parts of the model (--tp, --pp), not whole replicas."""
        return self.model_split > 1

    @property
    def plain(self) -> bool:
        """Data parallelism alone (ddp, zero, fsdp over every rank): no mesh needed."""
        return self.pp == self.dp_replicate == self.cp == self.tp == 1

    @property
    def needs_mesh(self) -> bool:
        """Whether the job needs a device mesh: any dimension but data parallelism over
        every rank, or experts spread over groups of the data-parallel ranks."""
        return not self.plain or self.ep > 1

    def describe(self) -> str:
        """Every mesh dimension with its degree: `pp 1 x dp_replicate 1 x dp_shard 2 x tp 2`."""
        return " x ".join(f"{d} {n}" for d, n in zip(MESH_DIMS, self.mesh_shape, strict=True))

    def name(self, strategy: str) -> str:
        """What the plan prints for `strategy` on this layout: the dimensions above 1
        (`fsdp; dp_shard 2 x tp 2`), under ddp, which a split model takes only without
        data parallelism, the dimensions alone (`tp 2`), and where the experts live
        (`ddp; ep 2 over dp`)."""
        experts = f"; ep {self.ep} over {'dp x cp' if self.cp > 1 else 'dp'}" if self.ep > 1 else ""
        if self.plain:
            return strategy + experts
        dims = " x ".join(d for d in self.describe().split(" x ") if not d.endswith(" 1"))
        if strategy == "ddp" and self.data_parallel == 1:
            return dims + experts
        return f"{strategy}; {dims}{experts}"
