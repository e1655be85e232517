"""`--oom_backoff`: an out-of-memory in the first optimizer steps halves the micro-batch
and doubles the accumulation, instead of ending the run.

While armed (the first `ARMED_STEPS` optimizer steps this process takes, a resume's
included: it may run on another device), an out-of-memory in a micro-step's forward or
backward is caught, and the ranks agree on it (an all-reduce of one flag) before any of
them can enter a collective that an out-of-memory rank would never join:

- ddp, zero: every micro-step runs with the gradient reduction held back (DDP's
  `no_sync`), so its forward and backward hold no collective; the flag is agreed at its
  end, and the window's gradients are reduced explicitly after its last one, as DDP's
  reducer does (each multiplied by 1 / world size, then summed).
- fsdp: the forward and backward gather parameters and reduce-scatter gradients, unit
  by unit. Each of those collectives goes through a wrapper of FSDP's own (its custom
  all-gather and reduce-scatter) that agrees on the flag first: a rank that ran out of
  memory, anywhere between two collectives, meets the others at their next agreement,
  and they raise there instead of entering the collective. FSDP's iteration state is
  then reset (`reset_iter_state`, and the whole gradients it keeps dropped). Its
  reductions are FSDP's own, unchanged.

When some rank ran out of memory, every rank drops the partial step (its metric sums and
gradients; nothing was stepped), puts back the random state the window started with,
divides --batch_size by its smallest factor (halves it when even) and multiplies
--grad_accum_steps by the same, and runs the same window again from its first sample: the
global batch, the data order and the positions (global samples) stay as they were. The run
then goes on as one started at the smaller micro-batch; config.yaml and every checkpoint
record the new values. A micro-batch of 1 sample that runs out of memory is the usual
out-of-memory error. Past the armed steps the loop is the plain one (FSDP's own
collectives back): no extra collective, no host read.

The layouts whose forward or backward hold other collectives (tp, pp, ep, HSDP's
replicas, SyncBatchNorm, a mixture of experts' global balancing loss) cannot be agreed on
this way: an out-of-memory on one rank there would leave the others blocked inside one.
They are refused, as are an iterable dataset (a window cannot be read again), --drop_last
(a smaller micro-batch drops fewer samples: another epoch) and --static_graph.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddptrain.data import Micro
from ddptrain.errors import ConfigError
from ddptrain.observe.oom import is_out_of_memory
from ddptrain.train.forward import forward_backward
from ddptrain.train.metrics import MetricSums

if TYPE_CHECKING:
    from ddptrain.config import TrainingConfig
    from ddptrain.train.trainer import Trainer

log = logging.getLogger("ddptrain")

ARMED_STEPS = 3  # optimizer steps (of this process) during which an out-of-memory backs off
STRATEGIES = ("single process", "ddp", "zero", "fsdp")  # each on a plain data-parallel layout


class BackedOff(Exception):
    """Every rank dropped the window: run it again from its first sample."""


class PeerOutOfMemory(Exception):
    """Another rank ran out of memory: agreed before an FSDP collective, not entered."""


def refuse_unsupported(
    config: TrainingConfig, strategy: str, iterable: bool, routed_globally: bool = False
) -> None:
    """A `ConfigError` for a run `--oom_backoff` cannot keep exact and the ranks agreed
    (see `unsupported`)."""
    if not config.oom_backoff:
        return
    why = unsupported(config, strategy, iterable, routed_globally)
    if why is not None:
        raise ConfigError(f"--oom_backoff is unsupported with {why}")


def unsupported(
    config: TrainingConfig, strategy: str, iterable: bool, routed_globally: bool = False
) -> str | None:
    """Why a backoff could not be exact or the ranks agree on it in this run, or None.
    `strategy`: the strategy's name (`StrategyChoice.name`: `single process` at world size
    1); `iterable`: the training set is an IterableDataset; `routed_globally`: a mixture
    of experts whose balancing loss all-reduces its counts in every micro-step
    (`--moe_aux_scope global` on 2+ data-parallel ranks)."""
    split = [f"--{name} {getattr(config, name)}" for name in ("tp", "pp", "ep", "dp_replicate")
             if getattr(config, name, 1) > 1]
    why = None
    if split or strategy not in STRATEGIES:
        what = ", ".join(split) or f"--strategy {strategy}"
        why = (f"{what}: the forward and backward hold collectives of their own, so an "
               "out-of-memory on one rank would leave the others waiting in one; use "
               "--strategy ddp, zero or fsdp alone, or lower --batch_size by hand")
    elif routed_globally:
        why = ("--moe_aux_scope global: each micro-step's balancing loss is a collective; "
               "use --moe_aux_scope local")
    elif config.sync_bn and strategy != "single process":
        why = "--sync_bn: SyncBatchNorm's forward is a collective; lower --batch_size by hand"
    elif config.static_graph:
        why = ("--static_graph: the smaller micro-batches accumulate, which DDP breaks on "
               "under a static graph; use --find_unused_parameters instead")
    elif iterable:
        why = ("an iterable dataset: the window that ran out of memory cannot be read again; "
               "lower --batch_size by hand")
    elif config.drop_last:
        why = ("--drop_last: a smaller micro-batch drops fewer samples, which changes the "
               "epoch; drop --drop_last or lower --batch_size by hand")
    return why


def smaller(batch_size: int) -> int:
    """The next micro-batch: `batch_size` over its smallest factor (half, when even), so
    that the accumulation times the same factor keeps the global batch."""
    factor = next(f for f in range(2, batch_size + 1) if batch_size % f == 0)
    return batch_size // factor


class Backoff:
    """The armed steps of one rank: their micro-steps, agreement and gradient reduction."""

    def __init__(self, trainer: Trainer) -> None:
        self.steps_left = ARMED_STEPS if trainer.config.oom_backoff else 0
        self._flag = torch.zeros(1, device=trainer.ctx.device)
        self._rng: tuple[torch.Tensor, torch.Tensor | None] | None = None  # at the window start
        self.backoffs = 0
        distributed = trainer.ctx.distributed and self.armed
        # fsdp: its units, whose collectives agree first while armed; ddp: no_sync, then
        # an explicit reduction
        units = _fsdp_units(trainer.module) if distributed else []
        self._root = trainer.module if trainer.module in units else None
        self._explicit = distributed and not units
        wired = [(unit, _agreeing(unit, self)) for unit in units]
        self._units = [(unit, comms) for unit, comms in wired if comms is not None]

    @property
    def armed(self) -> bool:
        return self.steps_left > 0

    def micro_step(self, trainer: Trainer, batch: Any, micro: Micro, sums: MetricSums) -> Any:
        """`forward_backward` of one micro-batch (ddp: without its gradient collective;
        fsdp: each collective agreed on first), an out-of-memory caught, then agreed on by
        every rank: raises `BackedOff` when some rank ran out of memory (the window
        dropped, the micro-batch made smaller)."""
        device = trainer.ctx.device
        if self._rng is None:
            cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
            self._rng = (torch.get_rng_state(), cuda)
        inputs = None
        failed = agreed = False
        try:
            inputs = forward_backward(
                trainer, batch, micro, sums, sync=False if self._explicit else None
            )
        except PeerOutOfMemory:
            failed = agreed = True  # at an FSDP collective: every rank knows
        except RuntimeError as exc:
            if not is_out_of_memory(exc) or trainer.config.batch_size == 1:
                raise  # 1 sample: nothing to halve, the usual error
            failed = True  # the exception (and the activations its frames hold) let go
        if trainer.ctx.distributed and not agreed:
            failed = self.agree(failed)
        if failed:
            self._back_off(trainer, sums)
            raise BackedOff
        return inputs

    def agree(self, failed: bool) -> bool:
        """Whether some rank ran out of memory (collective: one all-reduce of a flag)."""
        self._flag.fill_(float(failed))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag.item())

    def window_done(self, trainer: Trainer) -> None:
        """The window's last micro-step is done on every rank: reduce its gradients
        (ddp; FSDP reduce-scattered them in the backward)."""
        self._rng = None
        if self._explicit:
            reduce_gradients(trainer.params, trainer.ctx.world_size, trainer.ctx.device)

    def stepped(self) -> None:
        self._rng = None
        self.steps_left = max(0, self.steps_left - 1)
        if not self.armed:  # FSDP's own collectives back, without an agreement
            for unit, (gather, scatter) in self._units:
                unit.set_custom_all_gather(gather.inner)
                unit.set_custom_reduce_scatter(scatter.inner)
            self._units = []

    def _back_off(self, trainer: Trainer, sums: MetricSums) -> None:
        cfg, ctx = trainer.config, trainer.ctx
        if self._root is not None:  # FSDP's gathers, reductions and accumulated grads
            self._root.reset_iter_state()  # type: ignore[operator]
            _drop_unsharded_grads(self._root)
        trainer.verdicts.settle(trainer.progress)  # the step before's window is folded
        sums.hold()  # the partial window set aside, and dropped
        sums.fold(keep=False)
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.module.zero_grad(set_to_none=True)
        if self._rng is not None:
            cpu, cuda = self._rng
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, ctx.device)
        self._rng = None
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        old = cfg.batch_size
        cfg.batch_size = smaller(old)
        cfg.grad_accum_steps *= old // cfg.batch_size
        self.backoffs += 1
        if ctx.is_main:
            global_batch = cfg.batch_size * cfg.grad_accum_steps * ctx.data_world
            log.info(
                "out of memory at micro-batch %d: now %d x accumulation %d, the same global "
                "batch of %d (step %d again from its first sample)", old, cfg.batch_size,
                cfg.grad_accum_steps, global_batch, trainer.progress.step + 1,
            )
            record_config(cfg)


def record_config(cfg: TrainingConfig) -> None:
    """config.yaml with the new --batch_size and --grad_accum_steps (a checkpoint's meta
    takes them from the config)."""
    from ddptrain.config_cli import dump_yaml

    path = cfg.run_dir / "config.yaml"
    if path.exists():
        dump_yaml(cfg, path)


@torch.no_grad()
def reduce_gradients(
    params: list[torch.nn.Parameter], world_size: int, device: torch.device
) -> None:
    """Gradients accumulated without DDP's reduction, made the mean over the ranks as
    its reducer makes it: each multiplied by 1 / world size, then summed. A parameter
    without a gradient on some rank (unused there) gets zeros for it; one used on no rank
    keeps none. Collective: one all-reduce of which ranks hold each gradient, then one per
    gradient, in place."""
    held = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                        device=device)
    dist.all_reduce(held)
    for p, anywhere in zip(params, held.tolist(), strict=True):
        if not anywhere:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.mul_(1.0 / world_size)
        dist.all_reduce(p.grad)


# ---------------------------------------------------------------------- fsdp
def _fsdp_units(module: torch.nn.Module) -> list[Any]:
    """The modules `fully_shard` made FSDP units (the root among them), if any."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _agreeing(unit: Any, backoff: Backoff) -> tuple[Any, Any] | None:
    """Make `unit`'s all-gather and reduce-scatter agree on the flag before each call;
    returns the wrappers (each holding FSDP's own comm as `inner`), or None for a unit
    without parameters of its own (it makes no collective)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    groups = unit._get_fsdp_state()._fsdp_param_groups
    if not groups:
        return None
    group = groups[0]

    class AgreedAllGather(_Agreed, AllGather):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: Any, async_op: bool = False) -> Any:
            self.first()
            return self.inner(output_tensor=output_tensor, input_tensor=input_tensor,
                              group=group, async_op=async_op)

    class AgreedReduceScatter(_Agreed, ReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: Any, op: Any, async_op: bool = False) -> Any:
            self.first()
            return self.inner(output_tensor=output_tensor, input_tensor=input_tensor,
                              group=group, op=op, async_op=async_op)

    gather = AgreedAllGather(group._all_gather_comm, backoff)
    scatter = AgreedReduceScatter(group._reduce_scatter_comm, backoff)
    unit.set_custom_all_gather(gather)
    unit.set_custom_reduce_scatter(scatter)
    return gather, scatter


def _drop_unsharded_grads(root: torch.nn.Module) -> None:
    """The whole gradients a broken-off backward left on FSDP's unsharded parameters
    (and those accumulated under no_sync), which `reset_iter_state` keeps: a backward
    would add the next ones to them."""
    for unit in _fsdp_units(root):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                param.unsharded_accumulated_grad = None
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


class _Agreed:
    """FSDP's comm `inner`, whose collective waits for the ranks' agreement that none ran
    out of memory (`PeerOutOfMemory` when one did)."""

    def __init__(self, inner: Any, backoff: Backoff) -> None:
        self.inner, self.backoff = inner, backoff

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def first(self) -> None:
        if self.backoff.agree(False):
            raise PeerOutOfMemory
