"""`ddptrain plan`: the layouts and micro-batches a model fits on a cluster, fastest first.

All of it before a single GPU is allocated:

    ddptrain plan --model hf:examples/llama-70b --nodes 8 --gpus_per_node 8 --gpu H100 \\
        --block_size 4096 --global_batch_size 512

Each candidate is a layout that divides the world (`--strategy` ddp, zero, fsdp; HSDP with
a replica a node; `--tp` inside a node, dividing the heads; `--pp` stages; `--ep` dividing
the experts; for sequences of `LONG_CONTEXT` tokens or more, `--cp` 2, 4, 8 inside a node,
with tp dividing the heads) and a micro-batch that keeps the global batch (micro-batch x
accumulation x data-parallel ranks), without activation checkpointing, then where a larger
micro-batch fits only so, with its selective and block modes. Its memory per rank is
measured, not estimated: one training step of the layout runs on fake ranks
(`train.probe.fake_step`: the real passes, strategy and optimizer, on tensors without
data), and a candidate whose peak passes the card's memory less `--margin` (the allocator,
NCCL's buffers) is dropped. For each layout and mode the largest micro-batch that fits is
kept (fewer, larger steps), found from the peaks at 1 and 2 sequences (each sequence adds
its activations) and then measured. A Hugging Face model deeper than 8 blocks is measured
at 3 and 4 and extrapolated to its depth (`measure`): a 70B Llama on 64 ranks plans in
about 2 minutes on 2 CPU cores.

What fits is ranked by a stated cost model: the step's FLOPs (counted as MFU counts them,
`observe.flops`; a third more under block recompute) at `--mfu` of the card's dense bf16
peak; the data-parallel traffic (ddp's all-reduce of the gradients, fsdp's all-gathers of
the weights in each micro-step's forward and backward and one reduce-scatter of the
gradients a step, in bf16 under autocast; by formula: `fake_step` counts the calls and
bytes, the test of the probe checks them against torch's flight recorder) over the network
between nodes, or the links inside one (`GPUS`), overlapped with compute; tensor
parallelism's four all-reduces of a layer's activations per micro-step, inside a node, not
overlapped; context parallelism's eight all-to-alls of a layer's q, k, v and output slices
(forward and backward) per micro-step, the same; a pipeline's (`--pp` 2, 4, 8 dividing the
blocks, fsdp inside each stage, pp micro-batches a micro-step) bubble, each stage idle
pp - 1 of 1F1B's 2pp - 1 slots, and its activations sent on and their gradients back; and
`--latency_us` for each collective call (`ranking.calls`). Not modelled: other schedules,
pp with tp, kernels' efficiency by shape, network congestion, stragglers. The memory is
measured with the CPU's kernels, whose temporaries (attention's among them) may differ from
a GPU's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Literal

from ddptrain.config_cli import ErrorParser, parse_pair
from ddptrain.errors import ConfigError
from ddptrain.launch.ranking import cost, table

# card: (memory GiB, dense bf16 FLOP/s, GB/s inside a node, GB/s a GPU between nodes); the
# links' one-way bandwidths (NVLink, Infinity Fabric, PCIe; 400/200 Gb/s networks)
GPUS: dict[str, tuple[float, float, float, float]] = {
    "H100": (80, 989e12, 450, 50), "H200": (141, 989e12, 450, 50),
    "A100": (80, 312e12, 300, 25), "L40S": (48, 362e12, 32, 25),
    "MI300X": (192, 1307e12, 448, 50),
}
GIB = 2**30
RECOMPUTE = ("off", "selective", "block")  # tried in this order, each where it still helps
# A deep model's memory is measured at two depths (repeated blocks) and extrapolated to
# its own: each block adds the same bytes (its weights, gradients, optimizer state and
# saved activations) once the peak falls at the same moment of the step at both depths,
# which a kind that shrinks from one to the next says it does not (a 2-block model may
# peak while it all-gathers, a 3-block one in backward): then one block deeper. The test
# of the plan checks the extrapolation against a measurement at full depth.
SHALLOW = 3  # the first of the two depths
# Sequences this long or longer are also planned split over cp ranks: below it a
# sequence's activations are rarely what does not fit, and the candidates double
LONG_CONTEXT = 8192


Strategy = Literal["ddp", "zero", "fsdp"]


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    dp_replicate: int
    tp: int
    ep: int
    micro: int  # sequences a rank a micro-step (under --pp, cut into pp micro-batches)
    accum: int  # micro-steps a step
    recompute: str = "off"  # --activation_checkpointing: off, selective, block
    pp: int = 1
    cp: int = 1

    def layout(self, world: int) -> Any:
        """Its `ddptrain.layout.Layout` over `world` ranks."""
        from ddptrain.config_sections import ParallelSection
        from ddptrain.layout import Layout

        return Layout.of(ParallelSection(strategy=self.strategy, dp_replicate=self.dp_replicate,
                                         tp=self.tp, ep=self.ep, pp=self.pp, cp=self.cp), world)

    def flags(self) -> list[str]:
        out = ["--strategy", self.strategy]
        for flag, value in (("dp_replicate", self.dp_replicate), ("tp", self.tp),
                            ("cp", self.cp), ("pp", self.pp), ("ep", self.ep)):
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
    whole: bool = True  # measured at the model's depth (not extrapolated: `measure`)


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
    parser.add_argument("--latency_us", type=float, default=20.0,
                        help="microseconds each collective call costs beyond its bytes")
    parser.add_argument("--mfu", type=float, default=0.4,
                        help="the share of the bf16 peak the step's compute is assumed to reach")
    parser.add_argument("--top", type=int, default=5)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.latency_s = args.latency_us * 1e-6
    card = _card(args)
    world = args.nodes * args.gpus_per_node
    if world < 1 or args.gpus_per_node < 1:
        raise ConfigError("--nodes and --gpus_per_node must be 1 or more")
    batch = args.global_batch_size or 8 * world
    model = _model(args)
    started = time.perf_counter()
    planned, over = plan(args, model, world, batch, card)
    if not planned:
        raise ConfigError(nothing_fits(over, card[0], args.margin))
    print(table(planned[: args.top], args, world, batch, card, time.perf_counter() - started))
    return 0


@dataclass(frozen=True)
class Model:
    """What the plan reads of a model: how to build it (on any device; `depth` repeated
    blocks of its own, for a Hugging Face model, else None: all of them), its heads, its
    experts, and its parameter count."""

    build: Any  # build(device, depth=None) -> nn.Module
    heads: int
    kv_heads: int
    experts: int
    parameters: int
    flops_per_sequence: float
    width: int  # the hidden width
    layers: int
    deep: bool = False  # whether `build` takes a depth (its memory is measured at two)
    blocks: str | None = None  # its repeated blocks' class, as --fsdp_wrap names it


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
    from ddptrain.observe.flops import count_flops

    model_args = dict(parse_pair(text) for text in args.model_args)
    return lm_model(args.model, model_args, args.vocab_size, args.block_size, args.width,
                    count_flops)


def lm_model(name: str, model_args: dict[str, Any], vocab_size: int, block_size: int,
             width: int, count_flops: Any) -> Model:
    """The plan's view of language model `name` (gpt, hf:DIR), built on the meta device."""
    import torch

    from ddptrain.parallel.fsdp import fsdp_blocks

    if name == "gpt":
        from ddptrain.models.gpt import build_gpt

        moe = {k: int(v) for k, v in model_args.items() if k in ("experts", "top_k")}

        def build(device: torch.device, depth: int | None = None) -> Any:
            with torch.device(device):
                return build_gpt(vocab_size, block_size, width, **moe)
    elif name.startswith("hf:"):
        from ddptrain.models.hf import build_hf

        def build(device: torch.device, depth: int | None = None) -> Any:
            more = {} if depth is None else {"num_hidden_layers": depth}
            module = build_hf(name, {**model_args, **more}, "lm", None, torch.device("meta"))
            return module if device.type == "meta" else module.to_empty(device=device)
    else:
        raise ConfigError(f"--model {name!r}: plan takes gpt or hf:DIR")
    shadow = build(torch.device("meta"))
    conf = getattr(shadow, "config", None)
    heads = int(getattr(conf, "num_attention_heads", 0) or getattr(conf, "n_head", 0) or 1)
    kv = int(getattr(conf, "num_key_value_heads", 0) or heads)
    experts = int(next((getattr(conf, f) for f in ("num_local_experts", "num_experts",
                                                   "experts") if getattr(conf, f, 0)), 0))
    hidden = int(getattr(conf, "hidden_size", 0) or getattr(conf, "n_embd", 0) or width)
    layers = int(getattr(conf, "num_hidden_layers", 0) or getattr(conf, "n_layer", 0) or 1)
    tokens = torch.zeros(1, block_size, dtype=torch.long, device="meta")
    # the blocks of the whole model: a shallow copy's embeddings may outweigh its few
    # blocks, and the blocks are found by weight (`parallel.fsdp.fsdp_blocks`)
    blocks = ",".join(sorted({type(m).__name__ for m in fsdp_blocks(shadow, None)})) or None
    return Model(build, heads, kv, experts, sum(p.numel() for p in shadow.parameters()),
                 count_flops(shadow, tokens), hidden, layers,
                 deep=name.startswith("hf:") and layers > 2 * SHALLOW + 2, blocks=blocks)


def candidates(model: Model, nodes: int, per_node: int, batch: int,
               block_size: int = 0) -> list[Candidate]:
    """Every layout of `nodes x per_node` ranks the dimensions' rules allow, each with the
    micro-batches that keep `batch` sequences a step (largest first). Sequences of
    `LONG_CONTEXT` tokens or more are also split over cp ranks inside a node."""
    world = nodes * per_node
    out = []
    stages = [1] + [p for p in (2, 4, 8) if world % p == 0 and model.layers % p == 0
                    and model.layers >= 2 * p]
    splits = [1] + [c for c in (2, 4, 8) if block_size >= LONG_CONTEXT and block_size % c == 0]
    for tp, pp, cp in [(t, 1, c) for t in range(1, per_node + 1) for c in splits
                       if per_node % (t * c) == 0] + [(1, p, 1) for p in stages[1:]]:
        if model.heads % (tp * cp) or model.kv_heads % tp:
            continue
        dp = Candidate("fsdp", 1, tp, 1, 1, 1, pp=pp, cp=cp).layout(world).data_parallel
        if batch % dp:
            continue
        if pp > 1:  # stages sharded over their data-parallel ranks (`parallel.pp`)
            layouts: list[tuple[Strategy, int]] = [("fsdp", 1)]
        else:
            layouts = ([("ddp", 1), ("zero", 1)] if tp == 1 else [("ddp", 1)]
                       if dp == cp == 1 else [])
            layouts += [("fsdp", 1)] if dp * cp > 1 else []
            layouts += [("fsdp", nodes)] if nodes > 1 and dp % nodes == 0 and dp > nodes \
                else []
        eps = [1] + [e for e in range(2, dp + 1) if model.experts and dp % e == 0
                     and model.experts % e == 0 and pp == 1]
        for (strategy, replicate), ep in [(lay, e) for lay in layouts for e in eps]:
            if ep > 1 and strategy not in ("fsdp",):
                continue
            per_rank = batch // dp
            # under --pp a rank's micro-batch is cut into pp pipeline micro-batches
            micros = [m for m in (2**i for i in range(16)) if m <= per_rank
                      and per_rank % m == 0 and m % pp == 0]
            out += [Candidate(strategy, replicate, tp, ep, m, per_rank // m, pp=pp, cp=cp)
                    for m in reversed(micros)]
    return out


def plan(args: Any, model: Model, world: int, batch: int,
         card: tuple[float, float, float, float]) -> tuple[list[Planned], list[Planned]]:
    """The candidates that fit, fastest first, and those measured over the budget.

    For each layout and recompute mode, the largest micro-batch that fits: a rank's peak
    grows by the same bytes with each sequence of the micro-batch (its activations), so
    the peaks at 1 and 2 sequences place the largest that fits, which is then measured
    itself (and the next smaller where it does not fit after all). A mode that recomputes
    is planned only where it fits a larger micro-batch than the modes before it."""
    budget = card[0] * GIB * (1 - args.margin)
    fits: list[Planned] = []
    over: list[Planned] = []
    layouts: dict[tuple[str, int, int, int, int, int], list[Candidate]] = {}
    for c in candidates(model, args.nodes, args.gpus_per_node, batch, args.block_size):
        layouts.setdefault((c.strategy, c.dp_replicate, c.tp, c.ep, c.pp, c.cp), []).append(c)
    for options in layouts.values():
        options = sorted(options, key=lambda c: c.micro)
        best = 0  # the largest micro-batch a lighter mode fits
        for mode in RECOMPUTE:
            if best == options[-1].micro:
                break  # the whole batch of a rank fits: recomputing buys nothing
            try:
                found, smallest = _largest(args, model, world, card, budget, options, mode,
                                           over)
            except ConfigError:
                if mode == "off":
                    raise
                break  # no repeated blocks to recompute
            if found is not None and found.candidate.micro > best:
                fits.append(found)
                best = found.candidate.micro
            if smallest["total"] - smallest["activations"] > budget:
                break  # over without a single activation: recomputing cannot fit it
    ranked = sorted(fits, key=lambda p: p.step_s)
    if not all(p.whole for p in ranked[:1]):
        ranked = _first_measured_whole(args, model, world, budget, ranked, over)
    return ranked, over


def _first_measured_whole(args: Any, model: Model, world: int, budget: float,
                          ranked: list[Planned], over: list[Planned]) -> list[Planned]:
    """`ranked` (extrapolated), its first that fits measured again at the model's depth
    (those before it that did not, moved to `over`): the first choice is measured, the
    rest stay estimates."""
    whole = dataclasses.replace(model, deep=False)
    for i, planned in enumerate(ranked):
        memory = measure(args, whole, world, planned.candidate)
        checked = dataclasses.replace(planned, memory=memory, whole=True)
        if memory["total"] <= budget:
            return [checked, *ranked[i + 1:]]
        over.append(checked)
    return []


def _largest(args: Any, model: Model, world: int, card: tuple[float, float, float, float],
             budget: float, options: list[Candidate], mode: str,
             over: list[Planned]) -> tuple[Planned | None, dict[str, int]]:
    """The largest micro-batch of `options` (one layout, smallest micro first) that fits
    `budget` in `mode`, measured, and the smallest's figures; those measured over the
    budget go to `over`."""
    measured: dict[int, Planned] = {}

    def at(c: Candidate) -> Planned:
        if c.micro not in measured:
            c = dataclasses.replace(c, recompute=mode)
            memory = measure(args, model, world, c)
            measured[c.micro] = found = Planned(c, _name(c, world), memory,
                                                *cost(c, model, world, args, card),
                                                whole=not extrapolated(model, c))
            if memory["total"] > budget:
                over.append(found)
        return measured[c.micro]

    first = at(options[0])
    if first.memory["total"] > budget:
        return None, first.memory
    guess = options[0]
    if len(options) > 1:
        grows = at(options[1]).memory["total"] - first.memory["total"]
        room = budget - first.memory["total"]
        guess = max((c for c in options if (c.micro - options[0].micro) * max(grows, 0)
                     <= room), key=lambda c: c.micro)
    for c in reversed(options[: options.index(guess) + 1]):
        if at(c).memory["total"] <= budget:
            return at(c), first.memory
    return None, first.memory


def measure(args: Any, model: Model, world: int, c: Candidate) -> dict[str, int]:
    """A rank's peak by kind in one step of candidate `c`, on fake ranks (`fake_step`;
    under --pp the first stage's rank and the last's, the larger); a deep model's from
    two shallow copies (`SHALLOW` blocks a stage, then one more), extrapolated to its
    depth."""
    from ddptrain.config import TrainingConfig
    from ddptrain.train.probe import fake_step, pipeline_ranks

    config = TrainingConfig(
        strategy=c.strategy, dp_replicate=c.dp_replicate, tp=c.tp, ep=c.ep, pp=c.pp, cp=c.cp,
        optimizer=args.optimizer, use_amp=getattr(args, "use_amp", True),
        amp_dtype=getattr(args, "amp_dtype", "bfloat16"),
        batch_size=c.micro, grad_accum_steps=c.accum, block_size=args.block_size,
        activation_checkpointing=c.recompute,  # type: ignore[arg-type]
        fsdp_wrap=model.blocks if c.strategy == "fsdp" or c.recompute != "off" else None,
    )
    ranks = pipeline_ranks(config, world)

    def at(depth: int | None) -> dict[str, int]:
        steps = [fake_step(config, world, rank, args.gpus_per_node,
                           lambda device: model.build(device, depth), c.micro,
                           args.block_size, 32) for rank in {ranks[0], ranks[-1]}]
        return dict(max(steps, key=lambda figures: figures["total"]))

    if not extrapolated(model, c):
        return at(None)
    depth = SHALLOW
    low, high = at(depth * c.pp), at((depth + 1) * c.pp)
    for _ in range(3):  # a kind that shrinks with depth: the peak's moment moved
        if settled(low, high):
            break
        depth, low, high = depth + 1, high, at((depth + 2) * c.pp)
    return deepen(low, high, model.layers // c.pp - depth)


def extrapolated(model: Model, c: Candidate) -> bool:
    """Whether `measure` extrapolates candidate `c`'s figures from shallow copies."""
    return model.deep and model.layers // c.pp > 2 * SHALLOW + 2


def settled(low: dict[str, int], high: dict[str, int]) -> bool:
    """Whether one block more added bytes of every kind (at the peak and as backward
    begins) and took none: the same moments, one block apart."""
    return all(high[k] >= low[k] - 0.01 * low["total"] for k in low)


# what `fake_step` reports by kind (and `turn_` the same kinds as backward begins)
KINDS = ("params", "buffers", "grads", "activations", "temporaries", "communication",
         "optimizer", "other", "total")


def deepen(low: dict[str, int], high: dict[str, int], blocks: int) -> dict[str, int]:
    """The figures of a model `blocks` blocks deeper than `high`, from those of one block
    less (`low`): each grows by what the last block added. The peak is the largest of a
    step's moments, and the one that grows fastest with depth (backward beginning: every
    block's activations saved) may not be the largest yet at a shallow depth: it is
    extrapolated on its own, and the larger of the two taken. Both are bytes held at
    once, so the figure is at most a transient short of the peak (a few % at 70B: the
    plan's first choice is then measured whole)."""

    def grown(name: str) -> int:
        a, b = low[name], high[name]
        return round(b + blocks * max(0, b - a))

    peak = {k: grown(k) for k in low}
    if peak["turn_total"] > peak["total"]:
        peak.update({k: peak[f"turn_{k}"] for k in KINDS})
    return peak


def _name(c: Candidate, world: int) -> str:
    name = c.layout(world).name(c.strategy)
    return name + (f", {c.recompute} recompute" if c.recompute != "off" else "")


def nothing_fits(over: list[Planned], memory: float, margin: float) -> str:
    if not over:
        return ("no layout divides this world for this model: change --nodes, "
                "--gpus_per_node or --global_batch_size")
    closest = min(over, key=lambda p: p.memory["total"])
    need = closest.memory["total"] / (1 - margin) / GIB
    return (f"nothing fits {memory:g} GiB a rank: the closest is {closest.name}, micro-batch "
            f"{closest.candidate.micro}, which needs {need:.1f} GiB; use more GPUs, a "
            "larger card, or a shorter --block_size")


__all__ = ["GPUS", "Candidate", "candidates", "lm_model", "main", "nothing_fits", "plan"]
