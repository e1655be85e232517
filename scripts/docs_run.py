"""Run the documentation: every shell and python block of README.md and docs/**/*.md that can
run on a CPU machine runs, and fails the check when it fails.

Every fenced ```bash / ```sh / ```console / ```python block is first checked as
scripts/docs_check.py checks it (syntax, and every ddptrain/ddprun command's flags against
the real parsers). Then each block runs, unless the line before its fence says why it
cannot (a GPU, a cluster, Slurm, Kubernetes, Ray, the network, a long run):

    <!-- docs: no-run (needs a GPU) -->

A page's blocks run in order, in one scratch directory of its own (a later block may use
what an earlier one wrote), as a reader in a clone of the repository would run them: the
directory links the repository's `.venv`, `scripts/`, `examples/` and `bench/`, the venv's
bin/ is first on PATH, and the directory is on PYTHONPATH (as `python` finds modules in the
current directory). A shell block runs under `bash -e -o pipefail`; a python block whose
first line names a file (`# mypkg/tasks.py: ...`) is written there and run as
`python mypkg/tasks.py`, any other one as a script. Each block has a timeout; a block
that fails (or fails its check) ends its page: the blocks after it are not run.
```text and unlabelled blocks are output, never run.

    python scripts/docs_run.py                  # README.md and docs/, from the repo root
    python scripts/docs_run.py FILE.md ...      # those pages
    python scripts/docs_run.py --list           # how each block is classified, nothing run

Prints one line a block run and `docs: N blocks run, M checked only (REASON K, ...)`;
exits 1 naming the page and line of every block that failed or whose check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_check
from docs_check import ROOT, Block, _rel

# what the docs name by a relative path, linked into each page's scratch directory
LINKED = ("scripts", "examples", "bench")
# `# mypkg/tasks.py` or `# train_mine.py: how to run it`: the file a python block is
NAMED_FILE = re.compile(r"^#\s*(?P<path>[A-Za-z0-9_./-]+\.py)\b")
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
TAIL_LINES = 25  # of a failed block's output


@dataclass
class Outcome:
    run: int = 0
    checked_only: Counter[str] = field(default_factory=Counter)  # reason -> blocks
    failures: list[str] = field(default_factory=list)


def scratch_env(scratch: Path, venv: Path) -> dict[str, str]:
    """The environment of a page's blocks: this venv first on PATH, no distributed
    variables of an enclosing job, nothing fetched from the network."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(scratch), env.get("PYTHONPATH")]))
    env.update(MPLBACKEND="Agg", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WANDB_MODE="offline")
    return env


def make_scratch(parent: Path, venv: Path) -> Path:
    scratch = Path(tempfile.mkdtemp(prefix="page-", dir=parent))
    (scratch / ".venv").symlink_to(venv)
    for name in LINKED:
        if (ROOT / name).exists():
            (scratch / name).symlink_to(ROOT / name)
    return scratch


def command_of(block: Block, scratch: Path, holder: Path) -> list[str]:
    """The command that runs the block in `scratch`; scripts that are not the page's own
    files go to `holder`, outside it."""
    script = holder / f"block-{block.line}"
    if block.lang == "shell":
        script.write_text(block.text + "\n")
        return ["bash", "-e", "-o", "pipefail", str(script)]
    first = block.text.lstrip().splitlines()[0] if block.text.strip() else ""
    named = NAMED_FILE.match(first)
    if named:
        path = scratch / named.group("path")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.text + "\n")
        return [sys.executable, named.group("path")]
    script.with_suffix(".py").write_text(block.text + "\n")
    return [sys.executable, str(script.with_suffix(".py"))]


def run_block(block: Block, scratch: Path, holder: Path, timeout: float) -> str | None:
    """Run one block; None, or why it failed (with the end of its output). The block runs
    in a session of its own: whatever it leaves running (a launcher's ranks, on a timeout)
    ends with it."""
    process = subprocess.Popen(
        command_of(block, scratch, holder), cwd=scratch, env=scratch_env(scratch, venv()),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
        why = f"exit {process.returncode}" if process.returncode != 0 else None
    except subprocess.TimeoutExpired:
        _end_session(process.pid)
        output, _ = process.communicate()
        why = f"did not end in {timeout:.0f} s"
    finally:
        _end_session(process.pid)
    return None if why is None else why + _tail(output.decode(errors="replace"))


def _end_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _tail(output: str) -> str:
    lines = output.rstrip().splitlines()[-TAIL_LINES:]
    return "".join(f"\n    | {line}" for line in lines)


def venv() -> Path:
    """The virtual environment this script runs in (the repository's .venv under make)."""
    return Path(sys.prefix)


def run_page(path: Path, checker: docs_check.Checker, outcome: Outcome, parent: Path,
             timeout: float, dry: bool) -> None:
    scratch: Path | None = None
    holder = parent  # (replaced by the page's own before its first block runs)
    failed_at: str | None = None
    for block in docs_check.blocks(path, checker.report.errors):
        where = f"{_rel(path)}:{block.line}"
        errors = checker.check_block(block)
        if block.no_run is not None:
            outcome.checked_only[block.no_run] += 1
            if dry:
                print(f"  {where}  checked only ({block.no_run})", flush=True)
            continue
        if dry:
            print(f"  {where}  runs", flush=True)
            continue
        if failed_at is not None:
            outcome.failures.append(f"{where}: not run: the block at {failed_at} failed")
            continue
        if errors:
            outcome.failures.append(f"{where}: not run: its check failed")
            failed_at = where
            continue
        if scratch is None:
            scratch = make_scratch(parent, venv())
            holder = Path(tempfile.mkdtemp(prefix="blocks-", dir=parent))
        t0 = time.monotonic()
        why = run_block(block, scratch, holder, timeout)
        took = time.monotonic() - t0
        outcome.run += 1
        print(f"  {where}  {'FAILED' if why else 'ran'} in {took:.1f} s", flush=True)
        if why:
            outcome.failures.append(f"{where}: the {block.lang} block failed: {why}")
            failed_at = where


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="markdown files (default: "
                        "README.md and docs/**/*.md)")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds a block may run before it fails (default 180)")
    parser.add_argument("--list", action="store_true",
                        help="print how each block is classified; check, run nothing")
    parser.add_argument("--keep", action="store_true",
                        help="keep the scratch directories (their path is printed)")
    args = parser.parse_args(argv)
    files = args.files or docs_check.default_files()
    checker = docs_check.Checker()
    outcome = Outcome()
    start = time.monotonic()
    parent = Path(tempfile.mkdtemp(prefix="ddptrain-docs-"))
    try:
        for path in files:
            run_page(path, checker, outcome, parent, args.timeout, args.list)
    finally:
        if args.keep:
            print(f"scratch directories kept in {parent}")
        else:
            shutil.rmtree(parent, ignore_errors=True)
    failures = checker.report.errors + outcome.failures
    for failure in failures:
        print(failure)
    kinds: Counter[str] = Counter()  # "a long run: minutes on 2 cores" counts as "a long run"
    for reason, n in outcome.checked_only.items():
        kinds[reason.split(":", 1)[0]] += n
    reasons = ", ".join(f"{kind} {n}" for kind, n in sorted(
        kinds.items(), key=lambda item: (-item[1], item[0])))
    verb = "to run" if args.list else "run"
    print(f"docs: {outcome.run if not args.list else _runnable(checker, outcome)} blocks "
          f"{verb}, {sum(outcome.checked_only.values())} checked only"
          f"{f' ({reasons})' if reasons else ''}; "
          f"{checker.report.commands} commands' flags checked; {len(failures)} failed "
          f"({time.monotonic() - start:.0f} s)")
    return 1 if failures else 0


def _runnable(checker: docs_check.Checker, outcome: Outcome) -> int:
    return checker.report.blocks - sum(outcome.checked_only.values())


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
