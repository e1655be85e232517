"""The documentation cannot go stale: every command line in README.md and docs/ names flags
the real parsers define (scripts/docs_check.py), the flag reference is what
`TrainingConfig` generates (scripts/flag_reference.py), every command and exit code has
its entry, README.md stays a front door, and every relative link resolves."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def docs_check() -> ModuleType:
    return _script("docs_check")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_every_documented_command_uses_flags_the_parsers_define(docs_check: ModuleType) -> None:
    report = docs_check.check(docs_check.default_files())
    assert report.errors == [], "\n".join(report.errors)
    assert report.blocks >= 30 and report.commands >= 60, report
    for command in ("ddptrain train", "ddptrain export", "ddptrain evaluate", "ddptrain predict",
                    "ddptrain plan", "ddptrain doctor", "ddptrain ray", "ddprun"):
        assert report.by_command.get(command, 0) > 0, (command, report.by_command)


def test_a_renamed_flag_in_a_page_fails_the_check(docs_check: ModuleType, tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```bash\n"
        "ddprun --standalone --nproc_per_node=2 -m ddptrain train --dataset digits \\\n"
        "    --epoch 3 --batch_size 8            # --epochs, renamed\n"
        "ddptrain evaluate runs/x --output m.json --datasett digits\n"
        "ddptrain plan --model gpt --gpus 8\n"
        "NPROC_PER_NODE=2 scripts/launch.sh --epochs 5 --lrate 0.1\n"
        "ddptrain train --epochs 3 | tee log   # right\n"
        "```\n\n```python\nfrom ddptrain import fit\nfit(dataset='digits', epoch=3)\n```\n"
    )
    report = docs_check.check([page])
    assert report.commands == 5, report
    wrong = sorted(e.split(": ", 1)[1] for e in report.errors)
    assert wrong == [
        "ddptrain evaluate: unknown flag --datasett",
        "ddptrain plan: unknown flag --gpus",
        "ddptrain train: unknown flag --epoch",
        "fit(): unknown keyword epoch",
        "scripts/launch.sh (train): unknown flag --lrate",
    ], report.errors
    assert report.errors[0].startswith(f"{page}:4: "), report.errors  # the line it starts on
    assert docs_check.main([str(page)]) == 1


def test_the_flag_reference_lists_every_field_of_the_config_with_its_help() -> None:
    from ddptrain.config import TrainingConfig

    flag_reference = _script("flag_reference")
    page = (DOCS / "reference" / "flags.md").read_text()
    assert page == flag_reference.render(), (
        "docs/reference/flags.md is out of date: run python scripts/flag_reference.py")
    rows = {row[0].strip("`").removeprefix("--"): row for row in flag_reference.rows()}
    for f in dataclasses.fields(TrainingConfig):
        assert f.metadata.get("help", "").strip(), f"{f.name} has no help text"
        assert f.name in rows, f"{f.name} is not in the flag reference"
        assert rows[f.name][4], f.name
        assert re.search(rf"^\| `(--)?{f.name}` \|", page, re.M), f.name
    assert len(rows) == len(dataclasses.fields(TrainingConfig))


def test_every_command_and_exit_code_has_its_entry() -> None:
    from ddptrain import errors
    from ddptrain.cli import COMMANDS

    commands = (DOCS / "reference" / "commands.md").read_text()
    for name in COMMANDS:
        assert f"## `ddptrain {name}`" in commands, name
    codes = (DOCS / "reference" / "exit-codes.md").read_text()
    for name in dir(errors):
        if name.startswith("EXIT_"):
            assert f"| {getattr(errors, name)} |" in codes, name


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, len(lines)
    text = "\n".join(lines)
    for needed in ("make demo", "make test", "docs/index.md"):
        assert needed in text, needed


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not inside code blocks
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s), mailto; an anchor of the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert broken == [], broken
