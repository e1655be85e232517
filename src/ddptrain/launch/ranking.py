"""How `ddptrain plan` ranks what fits (the cost model its docstring states) and the
table it prints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddptrain.parallel.memory import human_bytes

if TYPE_CHECKING:
    from ddptrain.launch.planner import Candidate, Model, Planned


def cost(c: Candidate, model: Model, world: int, args: Any,
         card: tuple[float, float, float, float]) -> tuple[float, float, float]:
    """Predicted seconds a step, tokens/s a GPU and MFU (the module's docstring)."""
    _, peak, intra, inter = card
    layout = c.layout(world)
    dp = layout.data_parallel
    sequences = c.micro * c.accum * dp
    flops = model.flops_per_sequence * sequences
    # block recompute runs each forward again (a third of a step's FLOPs); selective only
    # the cheap element-wise ops between the matmuls, not counted
    compute = flops * (4 / 3 if c.recompute == "block" else 1) / (world * peak * args.mfu)
    # a pipeline's bubble: 1F1B over pp micro-batches idles each stage pp - 1 of 2pp - 1
    compute *= (2 * c.pp - 1) / c.pp
    weights = 2 * model.parameters / layout.model_split  # bf16 bytes tp and pp leave a rank
    crosses_nodes = args.nodes > 1 and c.dp_replicate == 1 and world // c.pp > args.gpus_per_node
    bandwidth = (inter if crosses_nodes else intra) * 1e9
    held = dp * c.cp  # the ranks that average gradients (and fsdp shards over)
    share = (held - 1) / held if held > 1 else 0.0
    # fsdp gathers the weights in each micro-step's forward and backward (resharded after
    # forward), reduce-scatters once a step (no sync while accumulating); inside a
    # pipeline's stage they stay gathered through the step
    gathers = 2 * (c.accum if c.pp == 1 else 1)
    traffic = ((gathers + 1) if c.strategy == "fsdp" else 2) * weights * share
    if c.dp_replicate > 1:  # HSDP: shards inside a node, the replicas' all-reduce across
        traffic = 3 * weights * share
        across = 2 * weights / (held // c.dp_replicate) * (c.dp_replicate - 1) / c.dp_replicate
        data = max(traffic / (intra * 1e9), across / (inter * 1e9))
    else:
        data = traffic / bandwidth
    activation = 2 * c.micro * args.block_size * model.width / c.cp  # bf16 bytes, a slice
    tensor = (4 * model.layers * activation * 2 * (c.tp - 1) / c.tp / (intra * 1e9) * c.accum
              if c.tp > 1 else 0.0)
    # Ulysses: q, k, v and the output each all-to-all'd forward, and their gradients back
    context = (8 * model.layers * activation / c.tp * (c.cp - 1) / c.cp / (intra * 1e9)
               * c.accum if c.cp > 1 else 0.0)
    # a stage's activations forward and their gradients back, each micro-step, between
    # nodes where the stages are (pp is the mesh's outermost dimension)
    stages = (2 * activation * c.accum / ((inter if args.nodes > 1 else intra) * 1e9)
              if c.pp > 1 else 0.0)
    step = max(compute, data) + tensor + context + stages + calls(c, model, gathers) * getattr(
        args, "latency_s", 2e-5)
    return step, sequences * args.block_size / step / world, flops / (step * world * peak)


def calls(c: Candidate, model: Model, gathers: int) -> int:
    """Collectives a rank launches a step, each paying the link's latency: fsdp's gathers
    and reduce-scatter for each of its units (the blocks and the root), ddp's bucket
    all-reduces (25 MB of fp32 gradients each), tp's four a block a micro-step, cp's
    eight, a pipeline's sends and receives."""
    units = model.layers + 1
    data = units * (gathers + 1) if c.strategy == "fsdp" else -(-4 * model.parameters // 25e6)
    tensor = 4 * model.layers * c.accum if c.tp > 1 else 0
    context = 8 * model.layers * c.accum if c.cp > 1 else 0
    return int(data + tensor + context + (4 * c.accum * c.pp if c.pp > 1 else 0))


def table(planned: list[Planned], args: Any, world: int, batch: int,
          card: tuple[float, float, float, float], seconds: float) -> str:
    lines = [f"ddptrain plan: {args.model} on {args.nodes} x {args.gpus_per_node} {args.gpu} "
             f"({card[0]:g} GiB, {args.margin:.0%} kept free), {batch} sequences of "
             f"{args.block_size} tokens a step; memory measured on fake ranks "
             f"({seconds:.0f} s)", "",
             "| # | layout | micro x accum | a rank's peak (params/grads/optim/act/other) | "
             "step (s) | tokens/s a GPU | MFU |", "|---|---|---|---|---:|---:|---:|"]
    for i, p in enumerate(planned, 1):
        m = p.memory
        rest = m["total"] - m["params"] - m["grads"] - m["optimizer"] - m["activations"]
        parts = "/".join(human_bytes(v) for v in (m["params"], m["grads"], m["optimizer"],
                                                  m["activations"], max(rest, 0)))
        lines.append(f"| {i} | {p.name} | {p.candidate.micro} x {p.candidate.accum} | "
                     f"{'' if p.whole else '~'}{human_bytes(m['total'])} ({parts}) | "
                     f"{p.step_s:.3g} | "
                     f"{p.tokens_per_gpu_s:,.0f} | {p.mfu:.0%} |")
    best = planned[0].candidate
    launch = (f"torchrun --nnodes {args.nodes} --nproc_per_node {args.gpus_per_node} "
              f"-m ddptrain train --model {args.model} --block_size {args.block_size} "
              + (f"--width {args.width} " if args.model == "gpt" else "")
              + " ".join(best.flags()) + " --use_amp --amp_dtype bfloat16")
    if not all(p.whole for p in planned):
        lines.append("~ extrapolated from copies of a few blocks a stage; the first choice "
                     "measured at the model's depth")
    return "\n".join([*lines, "", "first choice (add your --dataset):", f"  {launch}", "",
                      "not modelled: pipeline schedules but 1F1B, pp with tp, kernels' "
                      "efficiency by shape, network congestion, stragglers"])

