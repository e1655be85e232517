"""The documentation cannot go stale: every command line in README.md and docs/ names flags
the real parsers define (scripts/docs_check.py), and the blocks that can run on CPU run
(scripts/docs_run.py: `make docs-run` runs the whole docs in CI; here, a tiny tree), the
flag reference is what `TrainingConfig` generates (scripts/flag_reference.py), the command
reference what the commands' parsers print (scripts/docs_commands.py), every exit code has
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


@pytest.fixture(scope="module")
def docs_run() -> ModuleType:
    return _script("docs_run")


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


def test_the_command_reference_lists_every_command_as_its_parser_prints_it() -> None:
    from ddptrain.cli import COMMANDS

    docs_commands = _script("docs_commands")
    page = (DOCS / "reference" / "commands.md").read_text()
    assert page == docs_commands.render(), (
        "docs/reference/commands.md is out of date: run python scripts/docs_commands.py")
    sections = {name: (description, usage) for name, description, usage, _
                in docs_commands.sections()}
    assert list(sections) == list(COMMANDS)
    for name in COMMANDS:
        description, usage = sections[name]
        assert f"## `ddptrain {name}`" in page, name
        assert usage.startswith(f"usage: ddptrain {name} ") and usage in page, name
        assert description and description in page, name
    parsers = _script("docs_check").command_parsers()
    for name in COMMANDS.keys() - {"train"}:  # train's flags are flags.md's
        section = page.split(f"## `ddptrain {name}`\n")[1].split("\n## ")[0]
        for option in parsers[name]._option_string_actions:
            assert option in ("-h", "--help") or f"`{option}" in section, (name, option)


def test_every_exit_code_has_its_entry() -> None:
    from ddptrain import errors

    codes = (DOCS / "reference" / "exit-codes.md").read_text()
    for name in dir(errors):
        if name.startswith("EXIT_"):
            assert f"| {getattr(errors, name)} |" in codes, name


def test_blocks_are_marked_and_console_prompts_read(docs_check: ModuleType,
                                                    tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n<!-- docs: no-run (needs a GPU) -->\n```bash\nnvidia-smi\n```\n\n"
        "```console\n$ ddptrain train --epochs 1\ndone: 1 epochs\n```\n\n"
        "<!-- docs: no-run () -->\n```python\npass\n```\n\n"
        "<!-- docs: no-run (output) -->\n```text\nout\n```\n\n"
        "```bash\nif then fi\n```\n"
    )
    errors: list[str] = []
    found = list(docs_check.blocks(page, errors))
    assert [(b.line, b.lang, b.no_run) for b in found] == [
        (4, "shell", "needs a GPU"), (8, "shell", None), (14, "python", None), (23, "shell", None)]
    assert found[1].text == "ddptrain train --epochs 1\n", found[1].text  # the output dropped
    assert errors == [f"{page}:13: not a marker: write <!-- docs: no-run (REASON) -->",
                      f"{page}:18: a no-run marker before a text block, which is never run"]
    report = docs_check.check([page])
    assert any(e.startswith(f"{page}:24: shell block does not parse") for e in report.errors), (
        report.errors)


def test_the_runner_fails_on_a_renamed_flag_and_a_failing_block(
        docs_run: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The runner on a tiny tree: a copy of a how-to page with a flag renamed, and a page
    whose python block fails after a block that uses the page's earlier one."""
    steer = tmp_path / "steer.md"
    text = (DOCS / "how-to" / "steer.md").read_text()
    assert text.count("--early_stopping 3") == 1
    steer.write_text(text.replace("--early_stopping 3", "--early_stop 3"))
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```bash\necho one > made.txt\n```\n\n"
        "```python\nfrom pathlib import Path\n\nassert Path('made.txt').read_text() == 'one\\n'\n"
        "print('the earlier block ran here')\n```\n\n"
        "```python\nraise SystemExit('this block fails')\n```\n\n"
        "```bash\necho never\n```\n\n"
        "<!-- docs: no-run (needs a GPU) -->\n```bash\nnvidia-smi\n```\n"
    )
    assert docs_run.main([str(steer), str(page)]) == 1
    out = capsys.readouterr().out
    fence = 1 + text.splitlines().index("```bash")  # steer.md's first block
    assert f"{steer}:{fence + 1}: ddptrain train: unknown flag --early_stop" in out, out
    assert f"{steer}:{fence}: not run: its check failed" in out, out
    assert f"not run: the block at {steer}:{fence} failed" in out, out  # the page's others
    assert f"{page}:14: the python block failed: exit 1" in out, out
    assert "this block fails" in out, out  # the end of its output
    assert f"{page}:18: not run: the block at {page}:14 failed" in out, out
    assert "never" not in out.replace("echo never", ""), out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("docs: 3 blocks run, 1 checked only (needs a GPU 1); "), summary


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


def test_the_python_api_page_documents_every_exported_name() -> None:
    """docs/reference/api.md renders each name of `ddptrain.__all__` from its docstring
    (mkdocstrings), so a name added to the API without its entry fails."""
    import ddptrain

    page = (DOCS / "reference" / "api.md").read_text()
    documented = {line.split()[1].rsplit(".", 1)[1] for line in page.splitlines()
                  if line.startswith("::: ")}
    assert documented == set(ddptrain.__all__)
