"""The routers' balancing loss of the global micro-batch (`--moe_aux_scope global`, the
default; `ddptrain.train.routing`): N data-parallel ranks train as one process given
the whole global micro-batch.

One process (fast tier): the ranks' parts of the loss (`models.moe.global_balance`, the
counts all-reduced, each rank's own probability sums) sum to the loss of the whole
micro-batch, and so do their gradients, in the layer and through `Routing.add` (the
all-reduce stood in for, shards of unequal counts); each rank's own loss (`local`) does
not. 2 ranks (slow tier): ddp and `--ep 2` (SGD with momentum, clipping, 2-step
accumulation, the default `--moe_aux_weight`) end within 1e-6 of one process of the
global batch, and their rows log its `router_aux`; `--moe_aux_scope local` does not.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddptrain.models.moe import Balance, MoE, global_balance
from ddptrain.train.routing import AUX, Routing
from ddptrain.train.tasks import Score

GPT = dict(dataset="chars", model="gpt", model_args={"experts": 4, "top_k": 2}, width=32,
           block_size=16, seed=3, optimizer="sgd", lr=0.2, momentum=0.9, max_grad_norm=1.0,
           tensorboard=False, curves=False, synthetic_size=128, log_interval=1, epochs=1,
           grad_accum_steps=2)


def _mixture() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(MoE(width=8, hidden=16, experts=4, top_k=2) for _ in range(2)))


def _layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _lasts(layers: list[MoE]) -> list[Balance]:
    lasts = [layer.last for layer in layers]
    assert all(last is not None for last in lasts)
    return lasts  # type: ignore[return-value]


def _router_grads(model: nn.Module) -> list[torch.Tensor]:
    grads = [m.router.weight.grad for m in _layers(model)]
    assert all(g is not None for g in grads)
    return [g.clone() for g in grads if g is not None]


def test_the_ranks_parts_sum_to_the_whole_micro_batchs_loss_and_gradient() -> None:
    """A layer on 7 + 13 tokens (two ranks' shares) against the same layer on all 20:
    `global_balance` of the summed counts and each share's probability sums adds up to
    the whole batch's loss, the router's gradients too; the shares' own losses do not."""
    (layer,) = _layers(_mixture()[:1])
    x = torch.randn(20, 8)
    layer(x)
    (whole,) = _lasts([layer])
    whole.loss.backward()
    (want,) = _router_grads(layer)
    layer.router.weight.grad = None

    shares = []
    for part in (x[:7], x[7:]):
        layer(part)
        shares += _lasts([layer])
    counts = shares[0].counts + shares[1].counts
    assert torch.equal(counts, whole.counts)
    a, b = (global_balance(counts, s.prob_sums, layer.top_k) for s in shares)
    (a + b).backward()
    torch.testing.assert_close(a + b, whole.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(_router_grads(layer)[0], want, rtol=0, atol=1e-7)
    # each share balanced on its own is another loss (the `local` scope's)
    own = (7 * shares[0].loss + 13 * shares[1].loss) / 20
    assert abs(float(own.detach()) - float(whole.loss.detach())) > 1e-4


class _Stand(Routing):
    """A rank's routing whose all-reduce returns the ranks' sum (given)."""

    total: torch.Tensor

    def _all_reduce(self, buf: torch.Tensor) -> torch.Tensor:
        return self.total.clone()


def _score(count: int) -> Score:
    return Score(torch.zeros(()), torch.tensor(count), {}, 1)


def test_routing_adds_each_ranks_part_weighted_by_the_global_count() -> None:
    """Two ranks of 2 mixtures each (batches of 3 and 5 sequences of 4 tokens, counts 12
    and 20) through `Routing.add` with the all-reduce stood in for: the added losses
    and their router gradients sum to one process's on all 8 sequences (count 32), and
    so do the logged `router_aux` sums; each rank balancing its own tokens does not."""
    one = _mixture()
    ranks = [copy.deepcopy(one), copy.deepcopy(one)]
    x = torch.randn(8, 4, 8)
    weight = 0.5
    one(x)
    single = Routing.of(one, weight)  # one process: nothing to all-reduce
    assert single is not None and not single.spread
    want_score = _score(32)
    want = single.add(want_score)
    want.backward()
    shares = [(x[:3], 12), (x[3:], 20)]
    for model, (part, _) in zip(ranks, shares, strict=True):
        model(part)
    layers = [_layers(model) for model in ranks]
    # what the all-reduce gives every rank: each layer's slots, and the count, summed
    total = torch.cat([*(a.counts + b.counts for a, b in zip(*map(_lasts, layers),
                                                              strict=True)),
                       torch.tensor([32])])
    got, logged, own = [], [], []
    for mixtures, (_, count) in zip(layers, shares, strict=True):
        routing = _Stand(mixtures, weight, spread=True)
        routing.total = total
        score = _score(count)
        got.append(routing.add(score))
        logged.append(float(score.metrics[AUX]))
        own.append(float(Routing(mixtures, weight).add(_score(count)).detach()))
    (got[0] + got[1]).backward()
    torch.testing.assert_close(got[0] + got[1], want, rtol=0, atol=1e-5)
    grads = [a + b for a, b in zip(*map(_router_grads, ranks), strict=True)]
    for a, b in zip(grads, _router_grads(one), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert sum(logged) == pytest.approx(float(want_score.metrics[AUX]), abs=1e-5)
    # the rows' expert counts stay each rank's own, summed at the sync
    assert float(want_score.metrics["experts.0.0"]) == sum(
        float(last.counts[0]) for last in (_lasts(mixtures)[0] for mixtures in layers))
    assert abs(sum(own) - float(want.detach())) > 1e-4  # each rank balancing its own


def test_a_scope_is_global_or_local() -> None:
    with pytest.raises(ValueError, match="moe_aux_scope 'world'"):
        Routing.of(_mixture(), 0.01, "world")


def _rows(run: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "train" and AUX in r]


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.slow
def test_two_ranks_balance_as_one_process_of_the_global_batch(tmp_path: Path) -> None:
    """2 gloo ranks of 8 sequences against one process of 16, 2-step accumulation, SGD
    with momentum and clipping, `--moe_aux_weight 0.01`: ddp and `--ep 2` end within
    1e-6 of one process (2e-7 measured: the fp32 floor), their rows counting its tokens
    per expert and logging its `router_aux`; the `local` scope, each rank balancing its
    own 8, ends measurably apart (3e-2 measured)."""
    from dist_utils import run_ranks
    from nd_workers import fit_runs

    def run(name: str, **fields: Any) -> dict[str, Any]:
        return {**GPT, "batch_size": 8, "output_dir": str(tmp_path / name), **fields}

    ddp, local, ep = run_ranks(fit_runs, 2, tmp_path, [
        run("ddp"), run("local", moe_aux_scope="local"), run("ep", ep=2),
    ])[0]
    one = run_ranks(fit_runs, 1, tmp_path, [run("one", batch_size=16)])[0][0]
    assert ep["summary"]["layout"] == "ddp; ep 2 over dp"
    apart = {name: _largest_difference(got["weights"], one["weights"])
             for name, got in (("ddp", ddp), ("ep", ep), ("local", local))}
    print("largest weight difference from one process:", apart)
    assert apart["ddp"] <= 1e-6 and apart["ep"] <= 1e-6, apart
    assert apart["local"] > 1e-4, apart
    want = _rows(tmp_path / "one")
    assert len(want) > 10
    for name in ("ddp", "ep"):
        rows = _rows(tmp_path / name)
        assert [r["expert_tokens"] for r in rows] == [r["expert_tokens"] for r in want]
        assert [r[AUX] for r in rows] == pytest.approx([r[AUX] for r in want], abs=1e-5)
