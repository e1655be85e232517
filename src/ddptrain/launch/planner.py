"""`ddptrain plan`: which layouts and micro-batches a model fits on a cluster, and which of
them should run fastest, before a single GPU is allocated.

    ddptrain plan --model hf:models/llama-70b --nodes 8 --gpus_per_node 8 --gpu H100 \\
        --block_size 4096 --global_batch_size 512

Each candidate is a layout that divides the world (`--strategy` ddp, zero, fsdp; HSDP with
a replica a node; `--tp` inside a node, dividing the heads; `--ep` dividing the experts)
and a micro-batch that keeps the global batch (micro-batch x accumulation x data-parallel
ranks), without activation checkpointing, then where that does not fit with its selective
and block modes. Its memory per rank is measured, not estimated: one training step of the layout
runs on fake ranks (`train.probe.fake_step`: the real passes, strategy and optimizer, on
tensors without data), and a candidate whose peak passes the card's memory less
`--margin` (the allocator, NCCL's buffers) is dropped. For each layout and mode the
largest micro-batch that fits is kept (fewer, larger steps).

What fits is ranked by a stated cost model: the step's FLOPs (counted as MFU counts them,
`observe.flops`; a third more under block recompute) at `--mfu` of the card's dense bf16
peak; the data-parallel traffic
(ddp's all-reduce of the gradients, fsdp's two all-gathers of the weights and one
reduce-scatter of the gradients, in bf16 under autocast) over the network between nodes,
or the links inside one (`GPUS`), overlapped with compute; tensor parallelism's four
all-reduces of a layer's activations per micro-step, inside a node, not overlapped. Not
modelled: pipeline parallelism (not planned yet), kernels' efficiency by shape, network
congestion, stragglers.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal

from ddptrain.config_cli import ErrorParser, parse_pair
from ddptrain.errors import ConfigError
from ddptrain.parallel.memory import human_bytes

# card: (memory GiB, dense bf16 FLOP/s, GB/s inside a node, GB/s a GPU between nodes); the
# links' one-way bandwidths (NVLink, Infinity Fabric, PCIe; 400/200 Gb/s networks)
GPUS: dict[str, tuple[float, float, float, float]] = {
    "H100": (80, 989e12, 450, 50), "H200": (141, 989e12, 450, 50),
    "A100": (80, 312e12, 300, 25), "L40S": (48, 362e12, 32, 25),
    "MI300X": (192, 1307e12, 448, 50),
}
GIB = 2**30
RECOMPUTE = ("off", "selective", "block")  # tried in this order, each where it still helps


Strategy = Literal["ddp", "zero", "fsdp"]


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    dp_replicate: int
    tp: int
    ep: int
    micro: int  # sequences a rank a micro-step
    accum: int  # micro-steps a step
    recompute: str = "off"  # --activation_checkpointing: off, selective, block

    def flags(self) -> list[str]:
        out = ["--strategy", self.strategy]
        for flag, value in (("dp_replicate", self.dp_replicate), ("tp", self.tp),
                            ("ep", self.ep)):
            if value > 1:
                out += [f"--{flag}", str(value)]
        if self.recompute != "off":
            out += ["--activation_checkpointing", self.recompute]
        return [*out, "--batch_size", str(self.micro), "--grad_accum_steps", str(self.accum)]


@dataclass
class Planned:
    candidate: Candidate
    name: str
    memory: dict[str, int]
    step_s: float
    tokens_per_gpu_s: float
    mfu: float


def build_parser() -> ErrorParser:
    parser = ErrorParser(prog="ddptrain plan", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="gpt", help="gpt | hf:DIR (its config.json: no "
                        "weights are read)")
    parser.add_argument("--model_args", nargs="*", default=[], metavar="KEY=VALUE",
                        help="as `ddptrain train` takes them (gpt: experts=E top_k=K)")
    parser.add_argument("--width", type=int, default=64, help="--model gpt's width")
    parser.add_argument("--vocab_size", type=int, default=32000, help="--model gpt's vocabulary")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus_per_node", type=int, default=8)
    parser.add_argument("--gpu", default="H100", help=f"one of {', '.join(GPUS)}, or give "
                        "--gpu_memory (and the figures below) for another card")
    parser.add_argument("--gpu_memory", type=float, default=None, metavar="GIB")
    parser.add_argument("--peak_tflops", type=float, default=None, help="dense bf16 peak")
    parser.add_argument("--intra_gbps", type=float, default=None,
                        help="GB/s one way between the GPUs of a node")
    parser.add_argument("--inter_gbps", type=float, default=None,
                        help="GB/s one way a GPU between nodes")
    parser.add_argument("--block_size", type=int, default=2048, help="tokens a sequence")
    parser.add_argument("--global_batch_size", type=int, default=None,
                        help="sequences a step over all ranks (default: 8 a GPU)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--margin", type=float, default=0.1,
                        help="the share of memory kept free (allocator, NCCL buffers)")
    parser.add_argument("--mfu", type=float, default=0.4,
                        help="the share of the bf16 peak the step's compute is assumed to reach")
    parser.add_argument("--top", type=int, default=5)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    card = _card(args)
    world = args.nodes * args.gpus_per_node
    if world < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus_per_node must be 1 or more")
    batch = args.global_batch_size or 8 * world
    model = _model(args)
    started = time.perf_counter()
    planned, over = plan(args, model, world, batch, card)
    if not planned:
        raise ConfigError(_nothing_fits(over, card[0], args.margin))
    print(table(planned[: args.top], args, world, batch, card, time.perf_counter() - started))
    return 0


@dataclass(frozen=True)
class Model:
    """What the plan reads of a model: how to build it (on any device), its heads, its
    experts, and its parameter count."""

    build: Any
    heads: int
    kv_heads: int
    experts: int
    parameters: int
    flops_per_sequence: float
    width: int  # the hidden width
    layers: int


def _card(args: Any) -> tuple[float, float, float, float]:
    known = GPUS.get(args.gpu)
    if known is None and args.gpu_memory is None:
        raise ConfigError(f"--gpu {args.gpu!r} is not in ddptrain's table ({', '.join(GPUS)}): "
                          "give --gpu_memory GIB (and --peak_tflops, --intra_gbps, "
                          "--inter_gbps) for it")
    memory, peak, intra, inter = known or (0.0, 0.0, 0.0, 0.0)
    return (args.gpu_memory or memory, (args.peak_tflops or 0) * 1e12 or peak or 989e12,
            args.intra_gbps or intra or 100.0, args.inter_gbps or inter or 25.0)


def _model(args: Any) -> Model:
    import torch

    from ddptrain.observe.flops import count_flops

    model_args = dict(parse_pair(text) for text in args.model_args)
    if args.model == "gpt":
        from ddptrain.models.gpt import build_gpt

        moe = {k: int(v) for k, v in model_args.items() if k in ("experts", "top_k")}

        def build(device: torch.device) -> Any:
            with torch.device(device):
                return build_gpt(args.vocab_size, args.block_size, args.width, **moe)
    elif args.model.startswith("hf:"):
        from ddptrain.models.hf import build_hf

        def build(device: torch.device) -> Any:
            module = build_hf(args.model, model_args, "lm", None, torch.device("meta"))
            return module if device.type == "meta" else module.to_empty(device=device)
    else:
        raise ConfigError(f"--model {args.model!r}: plan takes gpt or hf:DIR")
    shadow = build(torch.device("meta"))
    conf = getattr(shadow, "config", None)
    heads = int(getattr(conf, "num_attention_heads", 0) or getattr(conf, "n_head", 0) or 1)
    kv = int(getattr(conf, "num_key_value_heads", 0) or heads)
    experts = int(next((getattr(conf, f) for f in ("num_local_experts", "num_experts",
                                                   "experts") if getattr(conf, f, 0)), 0))
    width = int(getattr(conf, "hidden_size", 0) or getattr(conf, "n_embd", 0) or args.width)
    layers = int(getattr(conf, "num_hidden_layers", 0) or getattr(conf, "n_layer", 0) or 1)
    tokens = torch.zeros(1, args.block_size, dtype=torch.long, device="meta")
    return Model(build, heads, kv, experts, sum(p.numel() for p in shadow.parameters()),
                 count_flops(shadow, tokens), width, layers)


def candidates(model: Model, nodes: int, per_node: int, batch: int) -> list[Candidate]:
    """Every layout of `nodes x per_node` ranks the dimensions' rules allow, each with the
    micro-batches that keep `batch` sequences a step (largest first)."""
    world = nodes * per_node
    out = []
    for tp in [t for t in range(1, per_node + 1) if per_node % t == 0]:
        if model.heads % tp or model.kv_heads % tp:
            continue
        dp = world // tp
        if batch % dp:
            continue
        layouts: list[tuple[Strategy, int]] = (
            [("ddp", 1), ("zero", 1)] if tp == 1 else [("ddp", 1)] if dp == 1 else [])
        layouts += [("fsdp", 1)] if dp > 1 else []
        layouts += [("fsdp", nodes)] if nodes > 1 and dp % nodes == 0 and dp > nodes else []
        eps = [1] + [e for e in range(2, dp + 1) if model.experts and dp % e == 0
                     and model.experts % e == 0]
        for (strategy, replicate), ep in [(lay, e) for lay in layouts for e in eps]:
            if ep > 1 and strategy not in ("fsdp",):
                continue
            per_rank = batch // dp
            micros = [m for m in (2**i for i in range(16)) if m <= per_rank and per_rank % m == 0]
            out += [Candidate(strategy, replicate, tp, ep, m, per_rank // m)
                    for m in reversed(micros)]
    return out


def plan(args: Any, model: Model, world: int, batch: int,
         card: tuple[float, float, float, float]) -> tuple[list[Planned], list[Planned]]:
    """The candidates that fit, fastest first, and those measured over the budget."""
    from ddptrain.config import TrainingConfig
    from ddptrain.layout import Layout
    from ddptrain.train.probe import fake_step

    budget = card[0] * GIB * (1 - args.margin)
    fits: dict[tuple[tuple[str, int, int, int], str], Planned] = {}
    over: list[Planned] = []
    for base in candidates(model, args.nodes, args.gpus_per_node, batch):
        layout = (base.strategy, base.dp_replicate, base.tp, base.ep)
        for mode in RECOMPUTE:
            c = dataclasses.replace(base, recompute=mode)
            if (layout, mode) in fits:
                continue  # a larger micro-batch of this layout and mode fits already
            if mode != "off" and (layout, "off") in fits:
                continue  # fits without recomputing: at no larger micro-batch is it faster
            config = TrainingConfig(
                strategy=c.strategy, dp_replicate=c.dp_replicate, tp=c.tp, ep=c.ep,
                optimizer=args.optimizer, use_amp=True, amp_dtype="bfloat16",
                batch_size=c.micro, grad_accum_steps=c.accum, block_size=args.block_size,
                activation_checkpointing=mode,  # type: ignore[arg-type]
            )
            try:
                memory = fake_step(config, world, 0, args.gpus_per_node, model.build,
                                   c.micro, args.block_size, 32)
            except ConfigError:
                if mode == "off":
                    raise
                continue  # no repeated blocks to recompute
            name = Layout.of(config, world).name(c.strategy)
            name += f", {mode} recompute" if mode != "off" else ""
            found = Planned(c, name, memory, *cost(c, model, world, args, card))
            if memory["total"] <= budget:
                fits[(layout, mode)] = found
            else:
                over.append(found)
    return sorted(fits.values(), key=lambda p: p.step_s), over


def cost(c: Candidate, model: Model, world: int, args: Any,
         card: tuple[float, float, float, float]) -> tuple[float, float, float]:
    """Predicted seconds a step, tokens/s a GPU and MFU (the module's docstring)."""
    _, peak, intra, inter = card
    dp = world // c.tp
    sequences = c.micro * c.accum * dp
    flops = model.flops_per_sequence * sequences
    # block recompute runs each forward again (a third of a step's FLOPs); selective only
    # the cheap element-wise ops between the matmuls, not counted
    compute = flops * (4 / 3 if c.recompute == "block" else 1) / (world * peak * args.mfu)
    weights = 2 * model.parameters / c.tp  # bf16 bytes of a tp shard
    crosses_nodes = args.nodes > 1 and c.dp_replicate == 1
    bandwidth = (inter if crosses_nodes else intra) * 1e9
    share = (dp - 1) / dp if dp > 1 else 0.0
    traffic = (3 if c.strategy == "fsdp" else 2) * weights * share
    if c.dp_replicate > 1:  # HSDP: shards inside a node, the replicas' all-reduce across
        traffic = 3 * weights * share
        across = 2 * weights / (dp // c.dp_replicate) * (c.dp_replicate - 1) / c.dp_replicate
        data = max(traffic / (intra * 1e9), across / (inter * 1e9))
    else:
        data = traffic / bandwidth
    activation = 2 * c.micro * args.block_size * model.width  # bf16 bytes
    tensor = (4 * model.layers * activation * 2 * (c.tp - 1) / c.tp / (intra * 1e9) * c.accum
              if c.tp > 1 else 0.0)
    step = max(compute, data) + tensor
    return step, sequences * args.block_size / step / world, flops / (step * world * peak)


def table(planned: list[Planned], args: Any, world: int, batch: int,
          card: tuple[float, float, float, float], seconds: float) -> str:
    lines = [f"ddptrain plan: {args.model} on {args.nodes} x {args.gpus_per_node} {args.gpu} "
             f"({card[0]:g} GiB, {args.margin:.0%} kept free), {batch} sequences of "
             f"{args.block_size} tokens a step; memory measured on fake ranks "
             f"({seconds:.0f} s)", "",
             "| # | layout | micro x accum | a rank's peak (params/grads/optim/act/other) | "
             "step (ms) | tokens/s a GPU | MFU |", "|---|---|---|---|---:|---:|---:|"]
    for i, p in enumerate(planned, 1):
        m = p.memory
        rest = m["total"] - m["params"] - m["grads"] - m["optimizer"] - m["activations"]
        parts = "/".join(human_bytes(v) for v in (m["params"], m["grads"], m["optimizer"],
                                                  m["activations"], max(rest, 0)))
        lines.append(f"| {i} | {p.name} | {p.candidate.micro} x {p.candidate.accum} | "
                     f"{human_bytes(m['total'])} ({parts}) | {p.step_s * 1e3:.3g} | "
                     f"{p.tokens_per_gpu_s:,.0f} | {p.mfu:.0%} |")
    best = planned[0].candidate
    launch = (f"torchrun --nnodes {args.nodes} --nproc_per_node {args.gpus_per_node} "
              f"-m ddptrain train --model {args.model} --block_size {args.block_size} "
              + (f"--width {args.width} " if args.model == "gpt" else "")
              + " ".join(best.flags()) + " --use_amp --amp_dtype bfloat16")
    return "\n".join([*lines, "", "first choice (add your --dataset):", f"  {launch}", "",
                      "not modelled: pipeline parallelism (not planned yet), kernels' "
                      "efficiency by shape, network congestion, stragglers"])


def _nothing_fits(over: list[Planned], memory: float, margin: float) -> str:
    if not over:
        return ("no layout divides this world for this model: change --nodes, "
                "--gpus_per_node or --global_batch_size")
    closest = min(over, key=lambda p: p.memory["total"])
    need = closest.memory["total"] / (1 - margin) / GIB
    return (f"nothing fits {memory:g} GiB a rank: the closest is {closest.name}, micro-batch "
            f"{closest.candidate.micro}, which needs {need:.1f} GiB; use more GPUs, a "
            "larger card, or a shorter --block_size")


__all__ = ["GPUS", "Candidate", "candidates", "main", "plan"]
