"""The passes in their one order (`ddptrain.parallel.parallelize`), strategies that differ
only at run time (none inherits another), and one device mesh built in one place."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import torch
from torch import nn

import ddptrain.parallel as parallel
from ddptrain.config import TrainingConfig
from ddptrain.context import DistributedContext
from ddptrain.parallel.base import Strategy
from ddptrain.parallel.parallelize import PASSES, applied, parallelize

PACKAGE = Path(parallel.__file__).resolve().parents[1]


def _strategy_classes(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each class defined in `sources` whose bases name a strategy: its bases."""
    names = {"Strategy", *(c.__name__ for c in _subclasses(Strategy))}
    found: dict[str, list[str]] = {}
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                if any(b in names for b in bases):
                    found[f"{module}.{node.name}"] = bases
    return found


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def _inheriting(sources: dict[str, str]) -> list[str]:
    return [f"{name}({', '.join(bases)})" for name, bases in _strategy_classes(sources).items()
            if bases != ["Strategy"]]


def test_no_strategy_inherits_another() -> None:
    import ddptrain.parallel.pp  # noqa: F401  (every strategy imported)

    sources = {p.stem: p.read_text() for p in (PACKAGE / "parallel").glob("*.py")}
    classes = _strategy_classes(sources)
    assert {"ddp.DDP", "fsdp.FSDP", "pp.Pipeline"} <= set(classes)
    assert not _inheriting(sources)
    # seen red: a strategy built on another is found
    planted = {"planted": "class Sharded(FSDP):\n    pass\n"}
    assert _inheriting(planted) == ["planted.Sharded(FSDP)"]


MESH_BUILDERS = re.compile(r"\binit_device_mesh\(|\bDeviceMesh\(")


def _mesh_builders(sources: dict[str, str]) -> list[str]:
    return [f"{name}:{n}" for name, text in sources.items()
            for n, line in enumerate(text.splitlines(), 1)
            if MESH_BUILDERS.search(line.split("#")[0])]


def test_the_device_mesh_is_built_in_one_place() -> None:
    sources = {str(p.relative_to(PACKAGE)): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert [b.split(":")[0] for b in _mesh_builders(sources)] == ["parallel/mesh.py"]
    planted = {"ep.py": "    mesh = init_device_mesh('cpu', (2, 2))\n"}
    assert _mesh_builders(planted) == ["ep.py:1"]


def test_the_passes_run_in_their_written_order() -> None:
    assert [p.name for p in PASSES] == [
        "freeze", "float8", "tp", "cp", "ep", "activation checkpointing"]
    plain = TrainingConfig()
    assert applied(plain, 1) == ["strategy"]
    every = TrainingConfig(freeze=["embed.*"], tp=2, cp=2, ep=2,
                           activation_checkpointing="block", compile=True, strategy="fsdp")
    assert applied(every, 8, float8="tensorwise") == [
        "freeze", "float8", "tp", "cp", "ep", "activation checkpointing", "strategy",
        "compile"]


def test_parallelize_applies_the_passes_then_the_strategy() -> None:
    from ddptrain.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32))
    config = TrainingConfig(freeze=["wte.*"], activation_checkpointing="block")
    ctx = DistributedContext(0, 0, 1, torch.device("cpu"))
    wrapped, frozen = parallelize(model, Strategy(ctx, config), config, ctx)
    assert wrapped is model  # one process: the bare module
    assert frozen == model.wte.weight.numel()
    assert not model.wte.weight.requires_grad
    # each block recomputes: its forward replaced on the instance, names unchanged
    assert all(not inspect.ismethod(b.forward) for b in model.blocks)
    assert all(isinstance(b, nn.Module) for b in model.blocks)


def test_fsdp_never_makes_a_tied_embedding_a_unit_of_its_own() -> None:
    """A GPT whose tied embedding holds most of its weights (a large vocabulary, narrow
    blocks): the embeddings are the biggest group of one class, but the token embedding's
    weight is the head's too, and FSDP shards a tensor in one unit only."""
    from ddptrain.models.gpt import build_gpt
    from ddptrain.parallel.fsdp import fsdp_blocks

    with torch.device("meta"):
        gpt = build_gpt(32000, 64, 128)
    units = fsdp_blocks(gpt, None)
    assert gpt.wte not in units and gpt.lm_head.weight is gpt.wte.weight
