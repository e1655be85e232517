"""Tensor parallelism composed with the rest of a run, on real gloo groups of 2 ranks:

1. `--tp 2` with gradient accumulation (half the batch, 2 micro-steps: the same global
   batch) ends with the weights of plain training on one process; under bf16 autocast it
   ends close to plain bf16 training; with `--sequence_parallel` (the norms split by
   sequence) it equals plain training, alone and as FSDP x TP on 4 ranks.
2. Its start-up is fsdp's meta-device one: the module is built on the meta device, and
   while it is split, sharded and filled no rank's module ever holds the whole model; it
   starts from the whole-model seeded weights, bitwise.
3. `ddptrain doctor --parameters N --tp T --dp_replicate R --world_size W` prints the
   layout's bytes per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_cli
from dist_utils import run_ranks
from metaplug import _Watch, held_bytes
from nd_workers import GLOBAL_BATCH, GPT, fit_in_group, fit_runs
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.data.sources import load_data
from ddptrain.launch.process_group import setup_distributed, teardown_distributed
from ddptrain.models.gpt import build_gpt
from ddptrain.train.plan import resolve
from ddptrain.train.trainer import Trainer


def _max_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(ref)  # the module's own names
    return max(float((got[k].float() - v.float()).abs().max()) for k, v in ref.items())


def _mean_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return float(torch.cat([(got[k].float() - v.float()).flatten() for k, v in ref.items()])
                 .abs().mean())


PLAIN = {**GPT, "batch_size": GLOBAL_BATCH}
BF16 = {"amp_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 2-rank group (starting one is much of a test's time), for each rank: the
    set-up of a --tp 2 trainer watched (`watch_setup`), then two --tp 2 runs:
    accumulation (half the batch, 2 micro-steps), bf16 autocast, sequence parallelism."""
    tmp = tmp_path_factory.mktemp("tp2")
    watched = {**GPT, "tp": 2, "batch_size": 8, "output_dir": str(tmp / "watched")}
    runs = [
        {**GPT, "tp": 2, "batch_size": GLOBAL_BATCH // 2, "grad_accum_steps": 2,
         "output_dir": str(tmp / "tp_accum")},
        {**PLAIN, **BF16, "tp": 2, "output_dir": str(tmp / "tp_bf16")},
        {**PLAIN, "tp": 2, "sequence_parallel": True, "output_dir": str(tmp / "tp_sp")},
    ]
    ranks = run_ranks(watched_ranks, 2, tmp, watched, runs)
    return [{**r, "dir": tmp, "watched": watched} for r in ranks]


def watched_ranks(rank: int, watched: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    ctx = setup_distributed(TrainingConfig(**watched).validate())
    clean = False
    try:
        result = {"setup": watch_setup(ctx, watched), "fits": fit_in_group(ctx, runs)}
        clean = True
    finally:
        teardown_distributed(clean)
    return result


@pytest.fixture
def plain(plain_gpt: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain training on one process, the whole global batch: fp32, then bf16."""
    return [plain_gpt(), plain_gpt(**BF16)]


@pytest.mark.slow
@pytest.mark.heavy
def test_tp2_with_accumulation_equals_plain_and_under_bf16_stays_close(
    tp2: list[dict[str, Any]], plain: list[dict[str, Any]],
) -> None:
    ref, ref_bf16 = plain
    accum, tp_bf16, _ = tp2[0]["fits"]

    assert _max_diff(accum["weights"], ref["weights"]) <= 1e-5
    assert accum["summary"]["samples"] == ref["summary"]["samples"]
    assert accum["summary"]["val_loss"] == pytest.approx(ref["summary"]["val_loss"], abs=1e-5)

    # bf16 is not bitwise across layouts: a split layer adds its partial products in
    # another order, so a rounding may differ by one bf16 ulp (2^-8 relative). Measured
    # over these 5 steps: weights 1.4e-3 and loss 1.1e-3 apart. 1e-2 leaves 7x margin and
    # is below what bf16 copies of the weights (fsdp's policy) already move: 4.8e-2.
    assert tp_bf16["summary"]["samples"] == ref_bf16["summary"]["samples"]
    gap = abs(tp_bf16["summary"]["val_loss"] - ref_bf16["summary"]["val_loss"])
    assert gap <= 1e-2, gap
    near = _max_diff(tp_bf16["weights"], ref_bf16["weights"])
    assert near <= 1e-2, near
    # ...and it did train in bf16: nearer plain bf16 than plain fp32, over all weights (the
    # largest single gap is one weight's rounding and says nothing). Measured: the mean
    # |dw| is 2.8e-6 from plain bf16 and 9.7e-6 from plain fp32.
    assert 2 * _mean_diff(tp_bf16["weights"], ref_bf16["weights"]) < _mean_diff(
        tp_bf16["weights"], ref["weights"])


@pytest.mark.slow
@pytest.mark.heavy
def test_tp2_with_sequence_parallel_equals_plain(
    tp2: list[dict[str, Any]], plain: list[dict[str, Any]],
) -> None:
    ref, sp = plain[0], tp2[0]["fits"][2]
    assert _max_diff(sp["weights"], ref["weights"]) <= 1e-5
    assert sp["summary"]["val_loss"] == pytest.approx(ref["summary"]["val_loss"], abs=1e-5)
    # Split norms hold whole weights on each tp rank (replicated DTensors): same bytes.
    assert sp["bytes"] == tp2[0]["fits"][0]["bytes"]


@pytest.mark.slow
@pytest.mark.heavy
def test_fsdp_x_tp_with_sequence_parallel_and_accumulation_on_4_ranks_equals_plain(
    tmp_path: Path, plain: list[dict[str, Any]],
) -> None:
    """2 data-parallel ranks x tp 2, batch 32 and 2 micro-steps: the same global batch;
    the split norms are sharded by fsdp too (2-D), and the start is on the meta device."""
    run = {**GPT, "strategy": "fsdp", "tp": 2, "sequence_parallel": True,
           "batch_size": GLOBAL_BATCH // 4, "grad_accum_steps": 2,
           "output_dir": str(tmp_path / "fsdp_tp_sp")}
    got = run_ranks(fit_runs, 4, tmp_path, [run])[0][0]
    ref = plain[0]
    assert _max_diff(got["weights"], ref["weights"]) <= 1e-5
    assert got["summary"]["samples"] == ref["summary"]["samples"]
    assert got["summary"]["val_loss"] == pytest.approx(ref["summary"]["val_loss"], abs=1e-5)


@pytest.mark.parametrize(("fields", "message"), [
    ({"sequence_parallel": True}, "--sequence_parallel splits the built-in GPT's norms over "
                                  "the tp ranks and --tp is 1: add --tp 2"),
    ({"sequence_parallel": True, "tp": 2, "tp_plan": "mypkg.plans:tp"},
     "--tp_plan 'mypkg.plans:tp' is a plan of its own: drop the flag"),
])
def test_sequence_parallel_without_the_gpt_plan_is_refused_before_the_group(
    fields: dict[str, Any], message: str,
) -> None:
    from ddptrain.errors import ConfigError
    from ddptrain.parallel import resolve_strategy

    config = TrainingConfig(**{"output_dir": "/tmp/unused", **fields}).validate()
    with pytest.raises(ConfigError, match=message):
        resolve_strategy(config, 2, "cpu")


@pytest.mark.slow
def test_sequence_parallel_over_tokens_tp_does_not_divide_is_one_line_exit_2(
    tmp_path: Path,
) -> None:
    """Rank 0 of a 2-rank job: refused before it meets its peers (none runs; the port is
    closed), the directory untouched."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    res = run_cli(["train", "--dataset", "chars", "--block_size", "63", "--tp", "2",
                   "--sequence_parallel", "--output_dir", str(tmp_path / "run")], tmp_path,
                  env=env, timeout=180)
    assert res.returncode == 2, res.stderr
    assert [x for x in res.stderr.splitlines() if x.strip()] == [
        "ddptrain: error: --sequence_parallel splits the GPT's 63 tokens over --tp 2 ranks: "
        "choose a --block_size that tp divides, or drop the flag"
    ], res.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- meta-device start
def watch_setup(ctx: DistributedContext, overrides: dict[str, Any]) -> dict[str, Any]:
    """Build a trainer (`--tp`, `--pp`) from a factory of the built-in GPT (as `fit(model=fn)`) and
    report: whether the training module the factory first built (the one the strategy
    sets up) was on the meta device, the peak bytes it held while the trainer was built
    (sampled after every tensor operation), and the gathered initial weights."""
    config = TrainingConfig(**overrides).validate()
    data = load_data(config)
    watch = _Watch()
    built: list[nn.Module] = []
    on_meta: list[bool] = []

    def factory() -> nn.Module:
        model = build_gpt(data.facts.vocab_size or 0, config.block_size, config.width)
        if not built:  # the training module; rank 0 builds its template after it
            built.append(model)
            on_meta.append(all(t.is_meta for t in [*model.parameters(), *model.buffers()]))
            watch.module = model
        return model

    with watch:
        trainer = Trainer(resolve(config, data, ctx.world_size, ctx.device), ctx, module=factory)
    watch.sample()
    state = trainer.strategy.model_state(trainer.module)  # collective
    return {
        "on_meta": on_meta[0], "peak": watch.peak, "samples": watch.samples,
        "held": held_bytes(trainer.module), "same": built[0] is trainer.module,
        "fsdp": sum(isinstance(m, FSDPModule) for m in trainer.module.modules()),
        "dtensors": sum(isinstance(p, DTensor) for p in trainer.module.parameters()),
        "tied": len(list(trainer.module.named_parameters(remove_duplicate=False)))
        > len(list(trainer.module.parameters())),  # a tensor under two names
        "kinds": [{type(p).__name__ for p in g["params"]} for g in trainer.optimizer.param_groups],
        "state": {k: v.detach().clone() for k, v in state.items()},
    }


@pytest.mark.slow
@pytest.mark.heavy
def test_tp_starts_on_the_meta_device_and_no_rank_ever_holds_the_whole_model(
    tp2: list[dict[str, Any]],
) -> None:
    ranks = [r["setup"] for r in tp2]
    config = TrainingConfig(**tp2[0]["watched"]).validate()
    torch.manual_seed(config.seed)  # the seeded whole-model start of every other layout
    whole = build_gpt(load_data(config).facts.vocab_size or 0, config.block_size, config.width)
    whole_bytes = held_bytes(whole)
    for rank, r in enumerate(ranks):
        assert r["on_meta"] and r["same"], rank
        assert r["samples"] > 50, r["samples"]  # the watch saw the set-up's operations
        # Each rank's blocks are split in two; embeddings and norms stay whole (~55%).
        assert 0 < r["held"] <= r["peak"] <= 0.65 * whole_bytes, (rank, r["peak"], whole_bytes)
        # tp takes every rank: no FSDP over one rank; the blocks' linears are DTensors, the
        # rest plain, and the head is still the embedding's own tensor after the start
        assert r["fsdp"] == 0 and r["dtensors"] == 16 and r["tied"], r
        # ...and each optimizer group holds one kind, as torch's foreach steps need
        assert sorted(len(k) for k in r["kinds"]) == [1] * len(r["kinds"]) == [1] * 4, r
    expected = whole.state_dict()
    got = ranks[0]["state"]
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_each_optimizer_group_holds_one_kind_of_tensor(tmp_path: Path) -> None:
    """tp alone leaves the whole parameters plain beside the split DTensors; torch's
    foreach steps (its default on a GPU) refuse a group that mixes them, so the groups
    are split by kind, with their settings."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ddptrain.parallel.base import one_kind_per_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        split = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
        whole, bias = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        for p in (split, whole, bias):
            p.grad = torch.ones_like(p)
        mixed = [{"params": [split, whole], "weight_decay": 0.1}, {"params": [bias]}]
        with pytest.raises(RuntimeError, match=r"got mixed torch\.Tensor and DTensor"):
            torch.optim.SGD(mixed, lr=0.1, momentum=0.9, foreach=True).step()
        groups = one_kind_per_group(mixed)
        assert [(g["params"], g.get("weight_decay")) for g in groups] == [
            ([split], 0.1), ([whole], 0.1), ([bias], 0)]  # (SGD filled in its default)
        torch.optim.SGD(groups, lr=0.1, momentum=0.9, foreach=True).step()
    finally:
        dist.destroy_process_group()


def head_split_ranks(rank: int) -> dict[str, Any]:
    """One forward and backward of a small GPT split by `parallelize_gpt` over 2 ranks,
    its collectives counted, beside the whole model's."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from ddptrain.models.gpt import GPT as BuiltinGPT
    from ddptrain.models.gpt import GPTConfig
    from ddptrain.parallel.tp import parallelize_gpt

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        whole = BuiltinGPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=4, n_embd=16))
        split = copy.deepcopy(whole)
        parallelize_gpt(split, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        tokens = torch.randint(0, 16, (3, 8))
        whole(tokens).square().sum().backward()
        with CommDebugMode() as comm:
            out = split(tokens)
            out.square().sum().backward()
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for n, p in split.named_parameters()}
        gaps = {n: float((grads[n] - p.grad).abs().max()) for n, p in whole.named_parameters()}
        return {"counts": {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()},
                "out": float((out - whole(tokens)).abs().max().detach()), "grads": gaps}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gpt_attention_is_split_by_whole_heads_with_one_all_reduce_each_way(
    tmp_path: Path,
) -> None:
    """The fused q/k/v projection is laid out head by head, so tp splits it by rows into
    whole heads: a layer costs Megatron's one all-reduce forward (after each row-split
    projection) and one backward (before each column-split one), and no activation is
    all-gathered. Output and every gradient are the whole model's."""
    for rank in run_ranks(head_split_ranks, 2, tmp_path):
        assert rank["out"] <= 1e-5, rank
        assert max(rank["grads"].values()) <= 1e-5, rank["grads"]
        # 2 layers x (attention, MLP) x (forward, backward)
        assert rank["counts"] == {"all_reduce": 8}, rank["counts"]


def test_a_state_with_the_earlier_fused_rows_loads_head_by_head() -> None:
    """A state saved when the projection was `c_attn` (rows: all q heads, all k, all v)
    loads into today's head-by-head `qkv` as the same function."""
    from ddptrain.models.gpt import GPT as BuiltinGPT
    from ddptrain.models.gpt import GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=4, n_embd=16)
    model, other = BuiltinGPT(config), BuiltinGPT(config)
    state = model.state_dict()
    for kind in ("weight", "bias"):  # back to the earlier layout and name
        rows = state.pop(f"blocks.0.attn.qkv.{kind}")
        state[f"blocks.0.attn.c_attn.{kind}"] = rows.unflatten(0, (4, 3, 4)).transpose(
            0, 1).reshape(rows.shape)
    other.load_state_dict(state)
    tokens = torch.randint(0, 16, (2, 8))
    assert torch.equal(other(tokens), model(tokens))
    assert torch.equal(other.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight)


# ---------------------------------------------------------------- bytes per rank
@pytest.mark.parametrize(("flags", "layout", "per_rank"), [
    # 7B parameters, AdamW, fp32: 16 bytes each, split over the ranks that shard a replica
    (["--tp", "2", "--world_size", "8", "--strategy", "fsdp"],
     "fsdp; dp_shard 4 x tp 2 on 8 rank(s)", "= 13.0 GiB per rank"),
    (["--tp", "2", "--dp_replicate", "2", "--world_size", "8", "--strategy", "fsdp"],
     "fsdp; dp_replicate 2 x dp_shard 2 x tp 2 on 8 rank(s)", "= 26.1 GiB per rank"),
    (["--tp", "4", "--world_size", "4"], "tp 4 on 4 rank(s)", "= 26.1 GiB per rank"),
    (["--world_size", "8"], "ddp on 8 rank(s)", "= 104.3 GiB per rank"),
    (["--pp", "2", "--world_size", "8", "--strategy", "fsdp"],
     "fsdp; pp 2 x dp_shard 4 on 8 rank(s)", "= 13.0 GiB per rank"),
    # 6B of the 7B in experts, a quarter of them on each of 4 ranks: 2.5B held, 16 B each
    (["--world_size", "4", "--experts", "6B", "--ep", "4"],
     "ddp; ep 4 over dp on 4 rank(s)", "= 37.3 GiB per rank"),
    # two groups of 2: half of the experts a rank, 4B held
    (["--world_size", "4", "--experts", "6B", "--ep", "2"],
     "ddp; ep 2 over dp on 4 rank(s)", "= 59.6 GiB per rank"),
    # fsdp shards the experts over their group, then over the groups: 1/8 of everything
    (["--world_size", "8", "--experts", "6B", "--ep", "2", "--strategy", "fsdp"],
     "fsdp; ep 2 over dp on 8 rank(s)", "= 13.0 GiB per rank"),
    # the same under --tp 2: the rest 1/8 a rank, the experts 1/4 (the tp ranks alike)
    (["--world_size", "8", "--experts", "6B", "--ep", "2", "--tp", "2", "--strategy", "fsdp"],
     "fsdp; dp_shard 4 x tp 2; ep 2 over dp on 8 rank(s)", "= 24.2 GiB per rank"),
])
def test_doctor_prints_the_layouts_bytes_per_rank(
    flags: list[str], layout: str, per_rank: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ddptrain.launch.doctor import main

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    assert main(["--parameters", "7B", *flags]) == 0  # one process: no collective
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("strategy"))
    ep = flags[flags.index("--ep") + 1] if "--ep" in flags else ""
    experts = f" (6,000,000,000 in experts, spread over {ep} ranks)" if ep else ""
    assert line.startswith(f"strategy   {layout}, 7,000,000,000 parameters{experts}, adamw: "), line
    assert line.endswith(per_rank), line


@pytest.mark.parametrize(("flags", "message"), [
    (["--tp", "2"], "--tp 2 is the layout of a job of several ranks and this doctor runs as "
                    "one process: add --world_size N"),
    (["--tp", "3", "--world_size", "8", "--strategy", "fsdp"],
     "world size 8 is not dp_replicate 1 x data-parallel shards x cp 1 x tp 3 x pp 1"),
    (["--dp_replicate", "2", "--world_size", "4"], "--dp_replicate 2 is HSDP"),
    (["--tp", "0", "--world_size", "4"], "--tp 0 is invalid: use a positive number of ranks"),
    (["--ep", "3", "--world_size", "4"], "--ep 3 does not divide the 4 data-parallel ranks of 4"),
    (["--ep", "2", "--tp", "2", "--world_size", "2", "--strategy", "fsdp"],
     "--ep 2 does not divide the 1 data-parallel ranks of 2"),
    (["--ep", "2", "--world_size", "2", "--strategy", "zero"],
     "--ep 2 runs under --strategy ddp or fsdp"),
    (["--experts", "8B", "--world_size", "2"], "--experts 8B is more than --parameters 7B"),
])
def test_doctor_refuses_a_layout_that_does_not_fit_in_one_line(
    flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ddptrain.errors import ConfigError
    from ddptrain.launch.doctor import main

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        main(["--parameters", "7B", *flags])


def test_the_plan_prints_the_layouts_bytes_per_rank(tmp_path: Path) -> None:
    from ddptrain.parallel import resolve_strategy
    from ddptrain.train import format_plan, make_plan

    config = TrainingConfig(**{**GPT, "strategy": "fsdp", "tp": 2, "dp_replicate": 2,
                               "output_dir": str(tmp_path)}).validate()
    choice = resolve_strategy(config, 8, "cpu")
    plan = make_plan(config, load_data(config), 8, "cpu", "gloo", "fp32", "language model",
                     10**6, choice)
    line = next(x for x in format_plan(plan, config).splitlines() if x.startswith("memory"))
    # SGD with momentum: parameters, gradients, one buffer; 10^6 x 4 bytes over 2 x 2 ranks
    assert line == ("memory          params 976.6 KiB, grads 976.6 KiB, optimizer 976.6 KiB = "
                    "2.9 MiB per rank (fsdp; dp_replicate 2 x dp_shard 2 x tp 2)")
