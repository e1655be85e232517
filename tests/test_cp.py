"""`--cp`: each sequence split over the cp ranks (Ulysses). Attention over the slices
equals attention over the whole sequence, forward and backward; a cp run equals one
process with the same global batch, alone and composed with fsdp, HSDP, tp, pp and ep;
a killed cp run resumes bitwise, and its step resumes without cp."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import run_cli, run_torchrun
from procs import assert_bitwise, checkpoint_steps, sigkill_after_checkpoint, weights
from thread_ranks import threaded_ranks
from torch.nn import functional as F

from ddptrain.data.pack import IGNORE, document_mask
from ddptrain.parallel.cp import ContextParallel

# SGD with momentum and clipping (a wrong gradient scale is not hidden), 2-step accumulation
GPT = dict(dataset="chars", model="gpt", width=32, block_size=32, epochs=1, optimizer="sgd",
           lr=0.05, momentum=0.9, max_grad_norm=1.0, grad_accum_steps=2, seed=3,
           log_interval=5, use_amp=False, save_every=0, val_fraction=0.05,
           tensorboard=False, curves=False)
FLOOR = 1e-6  # 1.2e-7 to 1.8e-7 measured: the fp32 floor of these runs


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# ---------------------------------------------------------------- one rank's slices
def test_a_rank_takes_its_slice_of_every_row_with_global_positions_and_aligned_labels() -> None:
    ids = torch.arange(16).view(2, 8)
    split = ContextParallel(None, 1, 2)
    x, y = split.shard(ids, ids + 100)  # a pair: targets aligned already
    assert torch.equal(x, ids[:, 4:]) and torch.equal(y, ids[:, 4:] + 100)
    assert torch.equal(split.positions(4, x.device), torch.arange(4, 8))
    split.shift = True  # a Hugging Face batch: labels are the inputs, shifted as cut
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
    got, labels = split.shard({"input_ids": ids, "labels": ids, "position_ids": packed,
                               "attention_mask": torch.ones_like(ids)}, ids)
    assert set(got) == {"input_ids", "position_ids"}  # the labels scored, not the model's
    assert torch.equal(got["position_ids"], packed[:, 4:])
    assert labels.tolist() == [[5, 6, 7, IGNORE], [13, 14, 15, IGNORE]]
    got, _ = ContextParallel(None, 0, 2).shard({"input_ids": ids}, None)
    assert torch.equal(got["position_ids"], torch.arange(4).expand(2, 4))



def test_a_model_whose_attention_never_came_to_the_cp_ranks_is_refused() -> None:
    """A Hugging Face model whose attention bypasses transformers' interface would train
    each rank on its slice alone: its second batch is refused in one line."""
    from ddptrain.errors import ConfigError

    split = ContextParallel(None, 0, 2)
    split.verify = True
    ids = torch.zeros(2, 8, dtype=torch.long)
    split.shard(ids, ids)
    with pytest.raises(ConfigError, match="does not go through transformers' attention"):
        split.shard(ids, ids)


def _sliced_attention(rank: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      w: torch.Tensor, positions: torch.Tensor | None, cp: int) -> Any:
    split = ContextParallel(dist.group.WORLD, rank, cp)
    n = q.size(2) // cp
    cut = slice(rank * n, (rank + 1) * n)
    mine = [z[:, :, cut].detach().clone().requires_grad_() for z in (q, k, v)]
    if positions is not None:
        split.shard({"input_ids": positions, "position_ids": positions}, None)
    y = split.attention(*mine)
    (y * w[:, :, cut]).sum().backward()
    return [y.detach(), *(z.grad for z in mine)]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_over_the_ranks_slices_is_attention_over_the_whole_sequence(
    cp: int, packed: bool
) -> None:
    """The ranks' outputs and the gradients of their slices of q, k and v, put together,
    are the whole sequence's (causal, or within each packed document), to the bit."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 3, requires_grad=True) for _ in range(3))
    w = torch.randn(2, 4, 8, 3)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]]) \
        if packed else None
    mask = None if positions is None else document_mask(positions)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    (y * w).sum().backward()
    ranks = threaded_ranks(cp, _sliced_attention, q, k, v, w, positions, cp)
    for i, whole in enumerate((y.detach(), q.grad, k.grad, v.grad)):
        assert torch.equal(torch.cat([r[i] for r in ranks], dim=2), whole), i


# ---------------------------------------------------------------- refused in one line
@pytest.mark.slow
@pytest.mark.parametrize(("flags", "line"), [
    (["--cp", "2", "--block_size", "33"],
     "ddptrain: error: --cp 2 does not divide --block_size 33: each of the 2 ranks takes an "
     "equal slice of every sequence; choose a multiple of --cp"),
    (["--cp", "8"],
     "ddptrain: error: --cp 8 x --tp 1 does not divide the 4 attention heads of the model: "
     "each cp rank attends with its share of a tp rank's heads; choose --cp among the "
     "divisors of heads / tp"),
])
def test_a_cp_that_does_not_divide_is_one_line_before_the_group(
    tmp_path: Path, flags: list[str], line: str
) -> None:
    """Rank 0 of 8 (no peer runs; the port is closed) refuses before it meets them."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
    res = run_cli(["train", "--dataset", "chars", "--model", "gpt", *flags,
                   "--output_dir", str(tmp_path / "run")], tmp_path, env=env, timeout=180)
    assert res.returncode == 2, res.stderr
    assert [t for t in res.stderr.splitlines() if t.strip()] == [line]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- equal to one process
def _llama(directory: Path) -> str:
    import transformers

    # 4 query heads sharing 2 key-value heads (repeated before the all-to-all)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=20, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0)).save_pretrained(directory)
    return f"hf:{directory}"


@pytest.mark.slow
def test_cp2_equals_one_process_for_the_gpt_a_llama_and_packed_documents(
    tmp_path: Path,
) -> None:
    """2 gloo ranks splitting each sequence against one process of the same batches: the
    GPT (ddp over the cp ranks), a Llama-style model through transformers' attention
    interface (rotary positions from the global ones, labels shifted before the cut),
    and packed documents (each attending within itself across the cut)."""
    from dist_utils import run_ranks
    from nd_workers import fit_runs

    llama = dict(dataset="hfplug:counting", model=_llama(tmp_path / "llama"), epochs=1,
                 optimizer="sgd", lr=0.5, momentum=0.9, max_grad_norm=3.0, log_interval=1,
                 seed=3, tensorboard=False, curves=False, batch_size=16, block_size=16)
    packed = dict(dataset="packplug:documents", pack=True, block_size=32, model="gpt",
                  width=32, epochs=1, optimizer="sgd", lr=0.1, momentum=0.9,
                  max_grad_norm=1.0, num_workers=0, log_interval=1, tensorboard=False,
                  curves=False, batch_size=4)
    runs = {"gpt": {**GPT, "batch_size": 8}, "llama": llama, "packed": packed}

    def out(name: str, run: str, **fields: Any) -> dict[str, Any]:
        return {**runs[run], "output_dir": str(tmp_path / name / run), **fields}

    split = run_ranks(fit_runs, 2, tmp_path, [out("cp", r, cp=2) for r in runs])[0]
    one = run_ranks(fit_runs, 1, tmp_path, [out("one", r) for r in runs])[0]
    apart = {r: _largest_difference(s["weights"], o["weights"])
             for r, s, o in zip(runs, split, one, strict=True)}
    print("largest weight difference from one process:", apart)
    assert all(d <= FLOOR for d in apart.values()), apart
    assert [s["summary"]["layout"] for s in split] == ["cp 2"] * 3


@pytest.mark.slow
@pytest.mark.heavy
def test_cp_composes_with_every_layout_on_four_ranks(tmp_path: Path) -> None:
    """cp 4; cp 2 with fsdp shards, HSDP replicas, tp 2, pp 2; and under --ep 2 (expert
    groups borrowing the cp ranks, the balancing loss over the global batch, ddp and
    fsdp): each equals one process of the same global batch of 8 sequences."""
    from dist_utils import run_ranks
    from nd_workers import fit_runs

    moe = {"model_args": {"experts": 4, "top_k": 2}, "moe_aux_weight": 0.01}
    layouts = {
        "cp 4": dict(cp=4, batch_size=8),
        "fsdp; dp_shard 2 x cp 2": dict(cp=2, strategy="fsdp", batch_size=4),
        "fsdp; dp_replicate 2 x cp 2": dict(cp=2, dp_replicate=2, strategy="fsdp",
                                            batch_size=4),
        "fsdp; cp 2 x tp 2": dict(cp=2, tp=2, strategy="fsdp", batch_size=8),
        "fsdp; pp 2 x cp 2": dict(cp=2, pp=2, strategy="fsdp", batch_size=8),
        "ddp; dp_shard 2 x cp 2; ep 2 over dp x cp": dict(cp=2, ep=2, batch_size=4, **moe),
        "fsdp; dp_shard 2 x cp 2; ep 2 over dp x cp": dict(cp=2, ep=2, strategy="fsdp",
                                                           batch_size=4, **moe),
    }

    def run(name: str, **fields: Any) -> dict[str, Any]:
        return {**GPT, "output_dir": str(tmp_path / name), **fields}

    split = run_ranks(fit_runs, 4, tmp_path,
                      [run(f"l{i}", **f) for i, f in enumerate(layouts.values())])[0]
    dense, mixture = run_ranks(fit_runs, 1, tmp_path, [run("one", batch_size=8),
                                                       run("moe", batch_size=8, **moe)])[0]
    apart = {}
    for (name, fields), got in zip(layouts.items(), split, strict=True):
        assert got["summary"]["layout"] == name
        one = mixture if "ep" in fields else dense
        apart[name] = _largest_difference(got["weights"], one["weights"])
    print("largest weight difference from one process:", apart)
    assert all(d <= FLOOR for d in apart.values()), apart


# ---------------------------------------------------------------- kill and resume
@pytest.mark.slow
@pytest.mark.heavy
def test_a_killed_cp_run_resumes_bitwise_and_its_step_resumes_without_cp(
    tmp_path: Path,
) -> None:
    """cp 2 on 2 ranks, SIGKILLed mid-epoch: `--resume_from auto` ends on the uninterrupted
    run's weights, bitwise. Its step-20 checkpoint resumed on one process, and on 2 ranks
    of plain data parallelism (half the batch each), ends where the cp run did."""
    job = ["train", "--dataset", "chars", "--model", "gpt", "--width", "32", "--block_size",
           "32", "--epochs", "1", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
           "--max_grad_norm", "1", "--grad_accum_steps", "2", "--seed", "3", "--batch_size",
           "8", "--log_interval", "5", "--no-use_amp", "--save_every_steps", "10",
           "--val_fraction", "0.05", "--no-tensorboard"]
    reference = tmp_path / "reference"
    done = run_torchrun(2, [*job, "--cp", "2", "--output_dir", str(reference)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    sigkill_after_checkpoint(2, [*job, "--cp", "2"], run, tmp_path, 30)
    resumed = run_torchrun(2, [*job, "--cp", "2", "--output_dir", str(run),
                               "--resume_from", "auto"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise(weights(run), weights(reference))

    step = checkpoint_steps(reference / "checkpoints")[20]
    alone = run_cli([*job, "--output_dir", str(tmp_path / "alone"), "--resume_from",
                     str(step)], tmp_path, timeout=600)
    assert alone.returncode == 0, alone.stderr[-3000:]
    data = run_torchrun(2, [*job, "--batch_size", "4", "--output_dir", str(tmp_path / "dp"),
                            "--resume_from", str(step)], cwd=tmp_path)
    assert data.returncode == 0, data.stderr[-3000:]
    for other in ("alone", "dp"):
        apart = _largest_difference(weights(tmp_path / other), weights(reference))
        assert apart <= FLOOR, (other, apart)




def test_a_rank_holds_about_half_the_activations_under_cp2() -> None:
    """The step measured on fake ranks (`ddptrain plan`'s): a rank's activations under
    cp 2 are about half a data-parallel rank's at the same micro-batch (0.53 measured: the
    attention's whole-sequence slices of a rank's heads, and the logits' slice, the same
    share; cp 4: 0.27), its weights the same, and its step calls the all-to-alls."""
    from ddptrain.config import TrainingConfig
    from ddptrain.models.gpt import build_gpt
    from ddptrain.train.probe import fake_step

    figures = {}
    for cp in (1, 2):
        config = TrainingConfig(output_dir="/tmp/unused", cp=cp, block_size=1024,
                                use_amp=False).validate()
        figures[cp] = fake_step(config, 4, 0, 4, lambda device: build_gpt(64, 1024, 64),
                                2, 1024, 64)
    print({cp: f["activations"] for cp, f in figures.items()})
    assert figures[2]["params"] == figures[1]["params"]
    share = figures[2]["activations"] / figures[1]["activations"]
    assert 0.45 < share < 0.58, share
    assert "all_to_all" in figures[2].collectives and "all_to_all" not in figures[1].collectives
