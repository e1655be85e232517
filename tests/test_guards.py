"""Guarantees that small mutants of the code once slipped past, or that only the slow tier
guarded, each checked here in the fast tier, in one process: collectives between ranks run on
threads (`thread_ranks.threaded_ranks`, torch's threaded process group) or on a one-rank gloo
group. Each test names the mutant it was seen to fail on; `scripts/mutants.py` plants them
(`make mutants`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from thread_ranks import threaded_ranks
from torch import nn

from ddptrain.cli import main
from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.errors import ConfigError

CPU = torch.device("cpu")


def _ctx(rank: int, world: int = 2) -> DistributedContext:
    return DistributedContext(rank, rank, world, CPU, backend="threaded")


# ---------------------------------------------------------------- the checkpoint's fields
def test_a_value_changed_inside_a_list_of_a_checkpoints_fields_is_damage() -> None:
    """The checksum of a checkpoint's non-tensor fields covers every value of a list or
    tuple in them, not only its length (mutant: `fields_text` of a list its length)."""
    from ddptrain.checkpoint.integrity import checksums, payload_damage

    state = {"model": {"w": torch.ones(3)},
             "config": {"skip_steps": ["3-5", "9"], "mix": ["a=1", "b=2"]},
             "progress": {"step": 12, "history": [0.5, 0.25, (7, "x")]}}
    payload = {**state, "checksums": checksums(state)}
    assert payload_damage(payload) is None
    for change in (lambda p: p["config"]["skip_steps"].__setitem__(1, "8"),
                   lambda p: p["config"]["mix"].__setitem__(0, "a=9"),
                   lambda p: p["progress"]["history"].__setitem__(0, 0.75),
                   lambda p: p["progress"]["history"].__setitem__(2, (7, "y"))):
        changed = {**payload, "config": json.loads(json.dumps(payload["config"])),
                   "progress": {**payload["progress"],
                                "history": list(payload["progress"]["history"])}}
        change(changed)
        assert payload_damage(changed) == (
            "a field other than the tensors (progress, schedule, RNG state or config) does "
            "not match its checksum"), changed


# ---------------------------------------------------------------- the hang line's number
def test_a_hang_record_numbers_the_collective_it_failed_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's record names the collective that failed by its number on its group: the
    last one the flight recorder saw completed, plus one (mutant: the last completed
    itself). Three all-reduces complete on a one-rank gloo group; the fourth fails."""
    import ddptrain.observe.hang as hang
    from ddptrain.observe.hang import POSITION, report, write_record

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        for _ in range(3):
            dist.all_reduce(torch.ones(1), group=group)
        name = dist.distributed_c10d._get_process_group_name(group)
        # the recorder as a hung collective leaves it: those before it completed, and it
        # not (gloo's refusal below is over at once, and would count as completed)
        dump = hang._recorder()
        done = dump["pg_status"][name]["last_completed_collective"]
        monkeypatch.setattr(hang, "_recorder", lambda: dump)
        POSITION.update(run_dir=str(tmp_path), progress=SimpleNamespace(step=7, epoch=0))
        with pytest.raises(RuntimeError) as failed:  # gloo refuses it: a failed collective
            dist.all_reduce(torch.ones(1), op=dist.ReduceOp.BAND, group=group)
        path = write_record(failed.value, rank=0, world_size=2)
    finally:
        POSITION.update(run_dir=None, progress=None)
        dist.destroy_process_group()
    assert path is not None
    record = json.loads(path.read_text())
    assert (record["op"], record["group"], record["seq"]) == ("all_reduce", name, done + 1)
    assert record["last_done"].startswith(f"all_reduce #{done} at "), record["last_done"]
    line = report({0: record}, 2)[1]
    group_is = "the default group" if name == "0" else f"group {name}"
    assert line.startswith(f"rank 1 did not reach all_reduce #{done + 1} of {group_is} "
                           f"(after step 7), which rank 0 waited in at {__file__}:"), line


def test_the_hang_line_names_ddptrains_code_by_its_package_not_a_folder_name(
    tmp_path: Path,
) -> None:
    """`ddptrain/...` is ddptrain's own code: a file of the imported package, by its real
    path. A user's module in a folder named `ddptrain` (a checkout's, say) keeps its
    path, in a `StallWatch` note and in the report a peer writes from it."""
    import importlib.util

    import ddptrain.observe.hang as hang
    from ddptrain.checkpoint.schema import Progress

    package = Path(hang.__file__).resolve().parent.parent
    assert hang._short(str(package / "train" / "metrics.py")) == "ddptrain/train/metrics.py"
    linked = tmp_path / "linked"
    linked.symlink_to(package)  # the package reached through a link: still its own
    assert hang._short(str(linked / "observe" / "hang.py")) == "ddptrain/observe/hang.py"
    mine = tmp_path / "work" / "ddptrain" / "mine.py"
    mine.parent.mkdir(parents=True)
    mine.write_text("import time\n\n\ndef stuck(seconds):\n    time.sleep(seconds)\n")
    for path in (str(mine), "/opt/ddptrain/lib/x.py", "<frozen importlib._bootstrap>"):
        assert hang._short(path) == path
    spec = importlib.util.spec_from_file_location("mine", mine)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    progress = Progress()
    progress.step = 3
    hang.POSITION.update(run_dir=str(tmp_path), progress=progress)
    try:
        with hang.StallWatch(tmp_path, rank=1, world_size=2, timeout_s=0.4):  # after 0.2 s
            module.stuck(0.6)
    finally:
        hang.POSITION.update(run_dir=None, progress=None)
    noted = json.loads((tmp_path / "hang" / "stalled1.json").read_text())
    assert noted["where"] == f"{mine}:5 (stuck)", noted
    (tmp_path / "hang" / "rank0.json").write_text(json.dumps({
        "rank": 0, "world_size": 2, "host": "node1", "step": 3, "op": "all_reduce",
        "group": "0", "seq": 9, "where": "ddptrain/train/metrics.py:135 (reduce_snapshots)",
        "error": "timeout"}))
    line = hang.culprit_line(tmp_path, 2, rank=0, wait_s=0)
    assert line is not None and f"rank 1 has been in {mine}:5 (stuck) since step 3" in line


# ---------------------------------------------------------------- one rank's NaN
def _combined_flag(rank: int, bad: tuple[bool, bool]) -> tuple[float, list[float]]:
    from ddptrain.parallel.base import Strategy
    from ddptrain.train.stepping import rescale_to_global_count

    ctx = _ctx(rank)
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([float("nan") if bad[rank] else 1.0, 2.0])
    strategy = Strategy(ctx, TrainingConfig())
    own = strategy.nonfinite_flag([p]).clone()  # this rank's flag alone
    trainer = SimpleNamespace(ctx=ctx, nominal=8.0, params=[p])
    tokens = torch.tensor([3.0 + rank])  # 3 and 4 tokens: 7 in all, against 8 nominal
    flag = rescale_to_global_count(trainer, tokens, own)  # type: ignore[arg-type]
    assert flag is not None
    return float(flag), p.grad.tolist()


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank() -> None:
    """A language model's step under fsdp (the dynamic token-count path): each rank's
    non-finite flag rides in the all-reduce of the window's count, and one rank's NaN
    is every rank's (mutant: the summed flags compared with `> 1`, so it takes two)."""
    for bad, want in (((True, False), 1.0), ((False, True), 1.0), ((True, True), 1.0),
                      ((False, False), 0.0)):
        got = threaded_ranks(2, _combined_flag, bad)
        assert [flag for flag, _ in got] == [want, want], bad
    # the gradients rescaled from the nominal count to the true one, 8 / 7
    for _, grad in threaded_ranks(2, _combined_flag, (False, False)):
        assert grad == pytest.approx([8 / 7, 16 / 7])


# ---------------------------------------------------------------- rollback target
def test_a_spike_rolls_back_to_the_checkpoint_before_its_first_step_not_at_it(
    tmp_path: Path,
) -> None:
    """The checkpoint a spike rolls back to is the newest taken before its first step; one
    written at that very step holds the spike's update and is discarded with the later
    ones (mutant: `<= first`, which picks the checkpoint about to be removed)."""
    from ddptrain.checkpoint.manager import discard_from, newest_before

    for step in (2, 4, 6):
        (tmp_path / f"step_{step:09d}.pt").write_bytes(b"x")
    from ddptrain.checkpoint.dcp import META

    (tmp_path / f"step_{5:09d}").mkdir()  # a DCP step directory, whole
    for name in (".metadata", META):
        (tmp_path / f"step_{5:09d}" / name).write_bytes(b"x")
    for first, want in ((6, "step_000000005"), (5, "step_000000004.pt"),
                        (4, "step_000000002.pt"), (3, "step_000000002.pt")):
        found = newest_before(tmp_path, first)
        assert found is not None and found.name == want, (first, found)
    assert newest_before(tmp_path, 2) is None  # nothing before a spike at step 2
    kept = newest_before(tmp_path, 4)
    assert kept is not None
    discard_from(tmp_path, 4, kept)
    assert kept.exists() and sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_000000002.pt"]


# ---------------------------------------------------------------- stored code
_CODE = {"dataset": "mypkg.data:build", "mix": ["mypkg:part=1", "digits=1"],
         "val": ["extra=mypkg:held_out"], "collate": "mypkg:collate", "model": "mypkg:net",
         "task": "mypkg:task"}


@pytest.mark.parametrize("field", sorted(_CODE))
def test_each_stored_field_that_names_code_runs_only_when_named_again(
    field: str, tmp_path: Path
) -> None:
    """Every field evaluate and predict use that can name code (`module:fn`) is one of
    the code fields: a stored value is refused unless the command names it again or
    trusts the checkpoint (mutant: `task` left out of `CODE_FIELDS`)."""
    from ddptrain.config_values import CODE_FIELDS, names_code
    from ddptrain.train.inference import Source, source_config

    value = _CODE[field]
    assert field in CODE_FIELDS and names_code(field, value)
    data = {} if field in ("dataset", "mix") else {"dataset": "digits"}
    stored = Source({**data, field: value}, tmp_path / "model.safetensors")
    flag = f"--{field} {' '.join(value) if isinstance(value, list) else value}"
    with pytest.raises(ConfigError, match=f"names code to import and run \\({flag}\\)"):
        source_config(stored)
    named = source_config(stored, [f"--{field}", *([value] if isinstance(value, str) else value)])
    assert getattr(named, field) == value
    assert getattr(source_config(stored, trust_code=True), field) == value


_PLANTED_TASK = """\
from pathlib import Path

Path(__file__).with_name("imported").touch()


def task(config):
    Path(__file__).with_name("called").touch()
    return "classification"
"""


def test_a_stored_task_function_is_not_imported_by_evaluate_or_predict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A downloaded run whose config stores `task: planted:task`, shipped with its
    `planted.py`: evaluate and predict say so in one line and import none of it."""
    import sys

    import yaml

    folder = tmp_path / "downloaded"
    (folder / "run").mkdir(parents=True)
    (folder / "planted.py").write_text(_PLANTED_TASK)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(folder)
    monkeypatch.delitem(sys.modules, "planted", raising=False)
    (folder / "run" / "config.yaml").write_text(yaml.safe_dump(
        {"dataset": "digits", "model": "mlp", "task": "planted:task"}))
    (folder / "run" / "model.safetensors").write_bytes(b"")  # never read: refused before
    says = ("names code to import and run (--task planted:task); ddptrain runs only code "
            "your command names: give --task planted:task again if you trust it, or add "
            "--trust_checkpoint_code")
    for command in (["evaluate", "run"], ["predict", "run", "--output", "p.npy"]):
        capsys.readouterr()
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert not (folder / "imported").exists() and not (folder / "called").exists()
    assert "planted" not in sys.modules and not (folder / "p.npy").exists()


# ---------------------------------------------------------------- experts over two ranks
def _moe_net(experts: int = 4) -> nn.Module:
    from ddptrain.models.moe import MoE

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(16, 16)
            self.moe = MoE(16, 32, experts, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.moe(self.inp(x))

    torch.manual_seed(0)
    return Net()


def _inputs() -> torch.Tensor:
    return torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(1))


def _exchange(rank: int, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's 2 of the 4 experts; its tokens exchanged with the other rank's."""
    net = _moe_net()
    net.load_state_dict(state)
    moe: Any = net.moe
    for leaf in moe.expert_weights:
        whole = getattr(moe, leaf).detach()
        setattr(moe, leaf, nn.Parameter(whole[2 * rank : 2 * rank + 2].clone()))
    moe.ep_group = dist.group.WORLD
    out = net(_inputs()[rank])
    out.square().sum().backward()
    return {"out": out.detach(), **{k: p.grad for k, p in net.named_parameters()}}


def test_tokens_sent_to_their_experts_rank_come_back_as_the_whole_layer_computes_them() -> None:
    """`--ep 2`, 2 experts a rank, each rank's tokens sent to the rank of their experts
    and back (all-to-all): the output and every gradient are the whole layer's on the
    same tokens. The rows a rank receives come by source rank; they are regrouped by
    expert before the experts' GEMMs (mutant: left by source rank, `q` and `j` swapped)."""
    whole = _moe_net()
    state = {k: v.clone() for k, v in whole.state_dict().items()}
    got = threaded_ranks(2, _exchange, state)
    x = _inputs()
    outs = [whole(x[r]) for r in range(2)]
    sum(o.square().sum() for o in outs).backward()  # type: ignore[union-attr]
    for rank in range(2):
        torch.testing.assert_close(got[rank]["out"], outs[rank].detach())
        for name, p in whole.named_parameters():
            want = p.grad[2 * rank : 2 * rank + 2] if name.split(".")[-1] in (
                "w_in", "b_in", "w_out", "b_out") else None
            if want is not None:  # this rank's experts: every rank's tokens' gradients
                torch.testing.assert_close(got[rank][name], want, msg=name)
    router = got[0]["moe.router.weight"] + got[1]["moe.router.weight"]
    torch.testing.assert_close(router, whole.moe.router.weight.grad)  # type: ignore[union-attr]


def _ddp_ep_step(rank: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from ddptrain.layout import Layout
    from ddptrain.parallel.base import local_tensor
    from ddptrain.parallel.ddp import DDP
    from ddptrain.parallel.mesh import attach_mesh
    from ddptrain.parallel.parallelize import parallelize

    net = _moe_net()
    net.load_state_dict(state)
    config = TrainingConfig(strategy="ddp", ep=2)
    ctx = attach_mesh(_ctx(rank), Layout.of(config, 2))
    strategy = DDP(ctx, config)
    model, _ = parallelize(net, strategy, config, ctx)
    model(_inputs()[rank]).square().mean().backward()  # this rank's mean
    strategy.finish_gradients()
    return {k: local_tensor(p.grad).clone() for k, p in net.named_parameters()}


def test_ddp_with_expert_parallelism_gives_the_gradients_of_the_global_mean() -> None:
    """`--strategy ddp --ep 2` on 2 ranks: DDP averages the replicated parameters'
    gradients; an expert's gradient arrives summed over the ranks' tokens through the
    all-to-all and is divided by the data-parallel ranks, so every gradient is that of
    the mean loss over both ranks' batches (mutant: the experts' division dropped)."""
    whole = _moe_net()
    state = {k: v.clone() for k, v in whole.state_dict().items()}
    got = threaded_ranks(2, _ddp_ep_step, state)
    x = _inputs()
    (sum(whole(x[r]).square().mean() for r in range(2)) / 2).backward()  # type: ignore[operator]
    for rank in range(2):
        for name, p in whole.named_parameters():
            expert = name.split(".")[-1] in ("w_in", "b_in", "w_out", "b_out")
            want = p.grad[2 * rank : 2 * rank + 2] if expert else p.grad
            torch.testing.assert_close(got[rank][name], want, msg=f"rank {rank} {name}")


# ---------------------------------------------------------------- heads split by tp
def _tp_step(rank: int, state: dict[str, torch.Tensor], ids: torch.Tensor
             ) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ddptrain.parallel.tp import parallelize_gpt

    model = _gpt()
    model.load_state_dict(state)
    parallelize_gpt(model, init_device_mesh("cpu", (2,)))
    logits = model(ids)
    logits.square().mean().backward()
    grads = {k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for k, p in model.named_parameters()}
    return {"logits": logits.detach(), **grads}


def _gpt() -> nn.Module:
    from ddptrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16))


def test_tp_ranks_each_computing_their_heads_equal_the_whole_attention() -> None:
    """`--tp 2` on the built-in GPT: the fused q/k/v projection is laid out head by head,
    so each rank's contiguous half of its rows is two whole heads; the logits and the
    gradients equal the whole model's (mutant: the rows read as all q, then all k, then
    all v, which is the same model whole but a rank's half then mixes heads)."""
    whole = _gpt()
    state = {k: v.clone() for k, v in whole.state_dict().items()}
    ids = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(2))
    got = threaded_ranks(2, _tp_step, state, ids)
    logits = whole(ids)
    logits.square().mean().backward()
    for rank in range(2):
        torch.testing.assert_close(got[rank]["logits"], logits.detach())
        for name, p in whole.named_parameters():
            torch.testing.assert_close(got[rank][name], p.grad, msg=f"rank {rank} {name}")


# ---------------------------------------------------------------- a stream's position
def test_a_stateful_stream_in_two_loader_workers_resumes_mid_epoch_where_it_stood() -> None:
    """`--num_workers 2` over a stream with a state: the position saved after a batch is
    each worker's (torchdata's StatefulDataLoader), and a new reader loaded with it
    hands out the rest of the epoch as the uninterrupted one did (mutant: the position
    read from the main process's copy of the stream, which the workers never move)."""
    pytest.importorskip("torchdata")
    from guardplug import StatefulEpochStream

    from ddptrain.data.iterable import IterableBatches

    ctx = DistributedContext(0, 0, 1, CPU)
    config = TrainingConfig(dataset="guardplug:epoch_stream", num_workers=2, batch_size=4)

    def ids(batch: Any) -> list[int]:
        return [int(i) for i in batch[0][:, 0]]

    readers: list[IterableBatches] = []

    def reader() -> IterableBatches:
        readers.append(IterableBatches(StatefulEpochStream(40, 3), config, ctx))
        return readers[-1]

    try:
        whole = [ids(b) for b, _, _ in reader().epoch(1)]
        first = reader()
        it = first.epoch(1)
        head = [ids(next(it)[0]) for _ in range(3)]
        state = first.state_dict()
        it.close()
        assert state is not None
        again = reader()
        again.load_state_dict(state)
        rest = [ids(b) for b, _, _ in again.epoch(1, 3)]
    finally:  # StatefulDataLoader keeps its iterator: its workers go now, failed or not
        for used in readers:
            shutdown = getattr(getattr(used.loader, "_iterator", None), "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
    assert head + rest == whole and len(whole) == 10
    assert sorted(i for batch in whole for i in batch) == list(range(40))


# ---------------------------------------------------------------- tied aliases
def test_a_tied_alias_is_named_under_the_kept_tensors_exported_name() -> None:
    """A tie group's first name is written once; every other name is an alias of the
    name it is written under (a LoRA-wrapped layer's weight under its plain name), in
    that direction (mutant: the alias and the kept name swapped)."""
    from ddptrain.checkpoint.streamed import Catalog, plain_items

    ctx = DistributedContext(0, 0, 1, CPU)
    local = {"wte.weight": torch.ones(3, 2), "head.base_layer.weight": torch.ones(2, 2),
             "mid.weight": torch.ones(2)}
    catalog = Catalog(local, ctx)
    items, aliases = plain_items(catalog, [["wte.weight", "lm_head.weight"],
                                           ["head.base_layer.weight", "out.base_layer.weight"],
                                           ["absent.weight", "mid.weight"]])
    assert [i.name for i in items] == ["wte.weight", "head.weight", "mid.weight"]
    assert aliases == {"lm_head.weight": "wte.weight", "out.weight": "head.weight"}


def _tied_export(rank: int, whole: dict[str, torch.Tensor], out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ddptrain.checkpoint.export import export_streamed
    from ddptrain.checkpoint.streamed import Catalog

    mesh = init_device_mesh("cpu", (2,))
    # as fsdp holds them: each rank its rows of every matrix (the same seeded tensors)
    local = {k: distribute_tensor(v, mesh, [Shard(0)], src_data_rank=None) if v.dim() > 1
             else v for k, v in whole.items()}
    export_streamed(Catalog(local, _ctx(rank)), [["wte.weight", "lm_head.weight"]], out)


def test_two_ranks_export_a_tied_tensor_once_and_its_alias_reads_back_tied(
    tmp_path: Path,
) -> None:
    """A two-rank export (threads) of sharded weights with the embedding tied to the
    head: `model.safetensors` holds the tensor once, under its first name, whole; the
    head reads back as the same tensor."""
    from safetensors import safe_open

    from ddptrain.checkpoint.export import read_safetensors_state

    torch.manual_seed(0)
    whole = {"wte.weight": torch.randn(10, 4), "h.weight": torch.randn(4, 4),
             "h.bias": torch.randn(4)}
    out = tmp_path / "model.safetensors"
    threaded_ranks(2, _tied_export, whole, out)
    with safe_open(str(out), framework="pt") as f:
        assert sorted(f.keys()) == sorted(whole)
        assert f.metadata()["tied:lm_head.weight"] == "wte.weight"
    got = read_safetensors_state(out)
    assert got["lm_head.weight"] is got["wte.weight"]
    for name, value in whole.items():
        assert torch.equal(got[name], value), name


def test_torchs_code_is_told_by_torchs_installed_folder_not_a_folder_named_torch(
    tmp_path: Path,
) -> None:
    """A user's module under a folder named `torch` is the user's code, which the stall note
    and the hang line name; torch's own files (as imported, or by their real path) are not."""
    import torch.nn.functional

    from ddptrain.observe import hang

    mine = tmp_path / "torch" / "mine.py"
    assert not hang._not_ours(str(mine))
    assert hang._not_ours(torch.nn.functional.__file__)
    assert hang._not_ours(str(Path(torch.nn.functional.__file__).resolve()))
