"""Check the commands in the documentation against the real parsers, without running them.

Every fenced ```bash / ```sh / ```console / ```python block of README.md and docs/**/*.md is
read (a ```console block's commands are its `$ ` lines; ```text and unlabelled blocks are
output, never read). In the shell blocks each command (backslash continuations joined, `#`
comments dropped, split at `|`, `&&`, `||` and `;`) that runs ddptrain is found:

    ddptrain COMMAND ...            python -m ddptrain COMMAND ...
    ddprun [launcher flags] -m ddptrain COMMAND ...      (torchrun ... -m ddptrain, too)
    [COMMAND=NAME] scripts/launch.sh ...     [COMMAND=NAME] sbatch [...] scripts/slurm/*.sbatch ...

and each of its flags must be one the command's own parser defines (`ddptrain train`:
`config_cli.build_parser()`; `plan`, `doctor`, `ray`, `export`, `evaluate`, ...: theirs in
`ddptrain.cli`, with the train flags that evaluate, predict and ray pass on), spelled in full;
a launcher's flags must be torchrun's. Values are not checked (the docs write placeholders:
`hf:DIR`, `N`). Every shell block must pass `bash -n`, every python block must parse, and
the keywords of a `fit(...)` call must be fields of `TrainingConfig` or `fit`'s own
parameters.

A block that cannot run on a CPU machine (scripts/docs_run.py runs the others) says why on
the line before its fence, and is checked here all the same:

    <!-- docs: no-run (needs a GPU) -->

    python scripts/docs_check.py                 # README.md and docs/, from the repo root
    python scripts/docs_check.py FILE.md ...     # those files

Prints the count of blocks and commands checked; exits 1 with one line per wrong flag.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)```+\s*([A-Za-z0-9_+-]*)")
SHELL = {"bash", "sh", "shell", "console"}
# a command whose flags, besides its own, are ddptrain train's (the rest it passes on)
PASSES_TRAIN_FLAGS = {"evaluate", "predict", "ray"}
FLAG = re.compile(r"^--?[A-Za-z][A-Za-z0-9_-]*$")
# `<!-- docs: no-run (REASON) -->` on the line before a fence: the block is checked, not run
MARK = re.compile(r"^\s*<!--\s*docs:\s*no-run\s*\((?P<reason>[^()]*\S[^()]*)\)\s*-->\s*$")
ANY_MARK = re.compile(r"^\s*<!--\s*docs:")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str  # "shell" or "python"
    text: str
    no_run: str | None = None  # why it is not run (its marker's reason), or None: it runs


@dataclass
class Report:
    blocks: int = 0
    shell_blocks: int = 0
    python_blocks: int = 0
    commands: int = 0
    by_command: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def blocks(path: Path, errors: list[str] | None = None) -> Iterator[Block]:
    """The fenced bash/sh/console/python blocks of a markdown file, each with the reason of
    the `<!-- docs: no-run (...) -->` marker on the line before it. A `<!-- docs:` comment
    that is not such a marker, or a marker that stands before no such block, is an error
    (appended to `errors`)."""
    lines = path.read_text().splitlines()
    marked: tuple[int, str] | None = None  # (line, reason) of a marker waiting for its fence
    i = 0
    while i < len(lines):
        if ANY_MARK.match(lines[i]):
            m = MARK.match(lines[i])
            if m is None and errors is not None:
                errors.append(f"{_rel(path)}:{i + 1}: not a marker: write "
                              "<!-- docs: no-run (REASON) -->")
            if m is not None:
                marked = (i + 1, " ".join(m.group("reason").split()))
            i += 1
            continue
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip() and marked and errors is not None:
                errors.append(f"{_rel(path)}:{marked[0]}: the no-run marker is not on the "
                              "line before a fence")
                marked = None
            i += 1
            continue
        indent, lang = len(m.group(1)), m.group(2).lower()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].lstrip().startswith("```"):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        reason = marked[1] if marked else None
        if lang in SHELL or lang == "python":
            text = "\n".join(_console_commands(body) if lang == "console" else body)
            yield Block(path, start, "python" if lang == "python" else "shell", text, reason)
        elif marked and errors is not None:
            errors.append(f"{_rel(path)}:{marked[0]}: a no-run marker before a {lang or 'plain'} "
                          "block, which is never run")
        marked = None


def _console_commands(body: list[str]) -> list[str]:
    """A console block's commands: its `$ ` lines (and their continuations), the prompt
    cut; the output between them becomes blank lines, so that line numbers hold."""
    out, continued = [], False
    for line in body:
        if line.startswith("$ ") or continued:
            command = line[2:] if line.startswith("$ ") and not continued else line
            out.append(command)
            continued = command.rstrip().endswith("\\")
        else:
            out.append("")
    return out


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(offset of the first line, the line with backslash continuations joined)."""
    joined, first = "", 0
    for n, line in enumerate(text.splitlines()):
        if not joined:
            first = n
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        yield first, joined + line
        joined = ""
    if joined:
        yield first, joined


def simple_commands(line: str) -> list[list[str]]:
    """The line's commands as words, split at | && || ; (comments dropped)."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = list(lexer)
    except ValueError:  # an unclosed quote: prose in a code block
        return []
    out: list[list[str]] = [[]]
    for w in words:
        if w and set(w) <= set(";&|"):
            out.append([])
        else:
            out[-1].append(w)
    return [c for c in out if c]


@contextlib.contextmanager
def _captured_parsers() -> Iterator[list[argparse.ArgumentParser]]:
    """Make every ErrorParser stop at its first parse, handing itself over."""
    from ddptrain.config_cli import ErrorParser

    seen: list[argparse.ArgumentParser] = []

    class Caught(Exception):
        pass

    def catch(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        seen.append(self)
        raise Caught

    saved = ErrorParser.parse_args, ErrorParser.parse_known_args
    ErrorParser.parse_args = catch  # type: ignore[method-assign,assignment]
    ErrorParser.parse_known_args = catch  # type: ignore[method-assign,assignment]
    try:
        yield seen
    except Caught:
        pass
    finally:
        ErrorParser.parse_args, ErrorParser.parse_known_args = saved  # type: ignore[method-assign]


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each `ddptrain` command's own parser, as the command builds it: the command is
    called and stopped at its first parse, before it does anything."""
    from ddptrain.cli import COMMANDS

    parsers = {}
    for name, run in COMMANDS.items():
        with _captured_parsers() as seen:
            run(["SOURCE"])
        if not seen:
            raise RuntimeError(f"ddptrain {name}: no parser seen")
        parsers[name] = seen[0]
    return parsers


def launcher_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def _flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("-") and w != "-"
            and FLAG.match(w.split("=", 1)[0])]


class Checker:
    def __init__(self) -> None:
        self.parsers = command_parsers()
        self.options = {name: _options(p) for name, p in self.parsers.items()}
        for name in PASSES_TRAIN_FLAGS:
            self.options[name] |= self.options["train"]
        self.launcher = _options(launcher_parser())
        from ddptrain.api import fit
        from ddptrain.config import TrainingConfig

        self.fit_keywords = {f.name for f in dataclasses.fields(TrainingConfig)} | set(
            inspect.signature(fit).parameters)
        self.report = Report()

    def check_file(self, path: Path) -> list[Block]:
        """Check every block of the page; its blocks, for scripts/docs_run.py."""
        found = list(blocks(path, self.report.errors))
        for block in found:
            self.check_block(block)
        return found

    def check_block(self, block: Block) -> list[str]:
        """Check one block; the errors it added."""
        before = len(self.report.errors)
        self.report.blocks += 1
        if block.lang == "python":
            self.report.python_blocks += 1
            self.check_python(block)
        else:
            self.report.shell_blocks += 1
            self.check_shell_syntax(block)
            for offset, line in logical_lines(block.text):
                for words in simple_commands(line):
                    self.check_command(words, f"{_rel(block.path)}:{block.line + 1 + offset}")
        return self.report.errors[before:]

    def check_shell_syntax(self, block: Block) -> None:
        done = subprocess.run(["bash", "-n"], input=block.text, text=True, capture_output=True)
        if done.returncode != 0:
            # bash: line N: syntax error ...: N counts from the block's first line
            m = re.search(r"line (\d+): (.*)", done.stderr)
            offset, text = (int(m.group(1)), m.group(2)) if m else (1, done.stderr.strip())
            self._fail(f"{_rel(block.path)}:{block.line + offset}",
                       f"shell block does not parse (bash -n): {text}")

    def _fail(self, where: str, text: str) -> None:
        self.report.errors.append(f"{where}: {text}")

    def check_command(self, words: list[str], where: str) -> None:
        env = {}
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value cmd
            key, _, value = words[0].partition("=")
            env[key] = value
            words = words[1:]
        # scripts/launch.sh and the sbatch scripts run `ddptrain $COMMAND` (train by default)
        command = env.get("COMMAND", "train")
        if not words:
            return
        head = Path(words[0]).name
        rest = words[1:]
        if head in ("python", "python3") and rest[:2] == ["-m", "ddptrain"]:
            self.check_ddptrain(rest[2:], where, "python -m ddptrain")
        elif head in ("python", "python3") and rest[:2] == ["-m", "ddptrain.launch.torchrun"]:
            self.check_launcher(rest[2:], where, "python -m ddptrain.launch.torchrun")
        elif head == "ddptrain":
            self.check_ddptrain(rest, where, "ddptrain")
        elif head in ("ddprun", "torchrun"):
            self.check_launcher(rest, where, head)
        elif head == "launch.sh":
            self._count("scripts/launch.sh")
            self.check_flags(rest, self.options.get(command, set()), where,
                             f"scripts/launch.sh ({command})")
        elif head == "sbatch":
            script = next((i for i, w in enumerate(rest) if w.endswith(".sbatch")), None)
            if script is not None:
                self._count("sbatch")
                self.check_flags(rest[script + 1:], self.options.get(command, set()), where,
                                 f"{Path(rest[script]).name} ({command})")

    def _count(self, what: str) -> None:
        self.report.commands += 1
        self.report.by_command[what] = self.report.by_command.get(what, 0) + 1

    def check_launcher(self, words: list[str], where: str, name: str) -> None:
        """Launcher flags up to the script or `-m MODULE`, then that program's."""
        i, own = 0, []
        while i < len(words):
            w = words[i]
            if w == "-m":
                break
            if not w.startswith("-"):
                break  # the training script: its own arguments follow
            own.append(w)
            action = _launcher_takes_value(w, self.launcher)
            i += 2 if action and "=" not in w else 1
        self._count(name)
        self.check_flags(own, self.launcher, where, f"{name} (launcher)")
        if words[i:i + 2] == ["-m", "ddptrain"]:
            self.check_ddptrain(words[i + 2:], where, f"{name} -m ddptrain", count=False)

    def check_ddptrain(self, words: list[str], where: str, name: str, count: bool = True) -> None:
        if not words or words[0].startswith("-"):
            return  # `ddptrain --help`, `--version`
        command = words[0]
        if count:
            self._count(f"ddptrain {command}")
        else:
            self.report.by_command[f"ddptrain {command}"] = (
                self.report.by_command.get(f"ddptrain {command}", 0) + 1)
        if command not in self.options:
            self._fail(where, f"{name} {command}: no such command "
                       f"(one of {', '.join(self.options)})")
            return
        self.check_flags(words[1:], self.options[command], where, f"ddptrain {command}")

    def check_flags(self, words: list[str], options: set[str], where: str, what: str) -> None:
        for flag in _flags(words):
            if flag not in options:
                self._fail(where, f"{what}: unknown flag {flag}")

    def check_python(self, block: Block) -> None:
        try:
            tree = ast.parse(block.text)
        except SyntaxError as exc:
            self._fail(f"{_rel(block.path)}:{block.line + (exc.lineno or 1)}",
                       f"python block does not parse: {exc.msg}")
            return
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called(node) == "fit":
                self.report.by_command["fit(...)"] = self.report.by_command.get("fit(...)", 0) + 1
                for kw in node.keywords:
                    if kw.arg is not None and kw.arg not in self.fit_keywords:
                        self._fail(f"{_rel(block.path)}:{block.line + node.lineno}",
                                   f"fit(): unknown keyword {kw.arg}")


def _called(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _launcher_takes_value(word: str, options: set[str]) -> bool:
    from torch.distributed.run import get_args_parser

    action = get_args_parser()._option_string_actions.get(word.split("=", 1)[0])
    return action is not None and action.nargs != 0


def _rel(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(ROOT))
    return str(path)


def default_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def check(files: list[Path]) -> Report:
    checker = Checker()
    for path in files:
        checker.check_file(path)
    return checker.report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="markdown files (default: "
                        "README.md and docs/**/*.md)")
    args = parser.parse_args(argv)
    files = args.files or default_files()
    report = check(files)
    for error in report.errors:
        print(error)
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(report.by_command.items()))
    print(f"docs_check: {len(files)} files, {report.blocks} blocks ({report.shell_blocks} "
          f"shell, {report.python_blocks} python), {report.commands} commands checked "
          f"({kinds}): {len(report.errors)} wrong")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
