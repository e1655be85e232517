"""The package's shape: no import cycles, imports that run downward through the layers, and
no module over 500 lines.

    launch -> train -> observe, checkpoint -> parallel, models -> data -> core

Read from the source (every import, also those inside functions, but not those under
`if TYPE_CHECKING:`), so a cycle shows here before it shows as a partially initialised
module at run time. docs/ARCHITECTURE.md draws the same layers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "ddptrain"

# Each folder's layer; a module may import its own folder and any lower layer.
LAYERS = {
    "core": 0, "data": 1, "models": 2, "parallel": 2, "checkpoint": 3, "observe": 3,
    "train": 4, "launch": 5, "entry": 6,
}
ENTRY = {"api", "api_after", "cli", "__main__"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _runtime_imports(tree: ast.AST) -> list[str]:
    """Every `ddptrain...` module a file imports, skipping `if TYPE_CHECKING:` blocks."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found.extend(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [name for name in found if name.split(".")[0] == "ddptrain"]


def _graph() -> dict[str, set[str]]:
    """module -> modules whose import runs it: the target, and the packages above the
    target that are not already above the importer (Python runs those first)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        mine = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for target in _runtime_imports(ast.parse(path.read_text())):
            if target not in modules:
                continue  # `from pkg import name`: the name, not a module
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and not (mine + ".").startswith(prefix + "."):
                    edges.add(prefix)
        edges.discard(name)
        graph[name] = edges
    return graph


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in ENTRY
                           and (PACKAGE / f"{parts[1]}.py").exists()):
        return "core", LAYERS["core"]
    if len(parts) == 2 and parts[1] in ENTRY:
        return "entry", LAYERS["entry"]
    return parts[1], LAYERS[parts[1]]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_imports_run_downward_through_the_layers() -> None:
    upward = []
    for module, targets in sorted(_graph().items()):
        folder, rank = _layer(module)
        for target in sorted(targets):
            other, other_rank = _layer(target)
            if other != folder and other_rank >= rank:
                upward.append(f"{module} ({folder}) imports {target} ({other})")
    assert not upward, "\n".join(upward)


MOST_LINES = 500  # a module longer than this holds more than one concept: split it


def test_no_module_is_over_500_lines() -> None:
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > MOST_LINES}
    assert not long, long


def test_every_folder_is_a_known_layer() -> None:
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders <= set(LAYERS), f"add {sorted(folders - set(LAYERS))} to LAYERS"


@pytest.mark.parametrize("broken", ["cycle", "upward"])
def test_the_checks_see_what_they_guard(broken: str) -> None:
    graph = {k: set(v) for k, v in _graph().items()}
    if broken == "cycle":
        graph["ddptrain.data.epoch"].add("ddptrain.train.trainer")
        assert _cycle(graph) is not None
    else:
        assert _layer("ddptrain.data.epoch")[1] < _layer("ddptrain.train.trainer")[1]


# Whether a model is split, how many ranks train on different data, and the layout's name
# are asked of one value (`ddptrain.layout.Layout`); written out again elsewhere (`tp > 1 or
# pp > 1`, `tp == 1 and pp == 1`, `world // (tp * pp)`) the answers drift apart.
SPLIT_TEST = re.compile(
    r"\b(tp|pp)\s*[<>=]=?\s*1\s+(or|and)\b.*\b(tp|pp)\s*[<>=]=?\s*1"
    r"|\btp\s*\*\s*[\w.]*\bpp\b|\bpp\s*\*\s*[\w.]*\btp\b"
)


def _split_tests(sources: dict[str, str]) -> list[str]:
    return [f"{name}:{n}: {line.strip()}" for name, text in sources.items()
            for n, line in enumerate(text.splitlines(), 1)
            if SPLIT_TEST.search(line.split("#")[0])]


def test_the_layout_is_asked_of_one_value() -> None:
    sources = {name: path.read_text() for name, path in _modules().items()
               if name != "ddptrain.layout"}
    assert not _split_tests(sources)
    # seen red: each way of writing it out again is found
    for planted in ("if config.tp > 1 or config.pp > 1:", "whole = tp == 1 and self.pp == 1",
                    "ranks = world // (config.tp * config.pp)"):
        assert _split_tests({"planted": planted}), planted


# What kind a checkpoint path is (a `.pt` file, a DCP step directory, a run directory, an
# export) is read in one place, `ddptrain.checkpoint.kind.resolve_checkpoint`; asked of the
# filesystem again elsewhere, the answers drift apart (a link, a torn step directory).
RESOLVER = "ddptrain.checkpoint.kind"
CHECKPOINT_READERS = ("ddptrain.checkpoint", "ddptrain.train.after", "ddptrain.train.inference",
                      "ddptrain.train.predict", "ddptrain.train.resume", "ddptrain.cli")
# (module, the line as written): why it asks whether something other than a checkpoint
# is a directory
NOT_CHECKPOINTS = {
    ("ddptrain.train.predict", "if path.is_dir():"): "predict's --output: a file to write",
    ("ddptrain.cli", "if not args.run_dir.is_dir():"): "diagnose's run directory: hang records",
}


def _directory_asks(sources: dict[str, str]) -> list[str]:
    return [f"{name}:{n}: {line.strip()}" for name, text in sources.items()
            for n, line in enumerate(text.splitlines(), 1)
            if ".is_dir()" in line.split("#")[0]
            and (name, line.strip()) not in NOT_CHECKPOINTS]


def test_a_checkpoint_path_is_resolved_in_one_place() -> None:
    sources = {name: path.read_text() for name, path in _modules().items()
               if name.startswith(CHECKPOINT_READERS) and name != RESOLVER}
    assert not _directory_asks(sources), "ask resolve_checkpoint(path), not the filesystem"
    # seen red: a checkpoint path asked again is found, the allowed lines are not
    planted = {"ddptrain.checkpoint.planted": "    if path.is_dir():\n",
               "ddptrain.train.predict": "    if path.is_dir():\n"}
    assert _directory_asks(planted) == ["ddptrain.checkpoint.planted:1: if path.is_dir():"]
