"""What a page generated from the code (docs/reference/flags.md, commands.md) shares: it is
written only when it differs, and `--check` says whether the committed one is current."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write(page: Path, text: str) -> bool:
    """Write `text` to `page` when it differs; whether it changed."""
    if page.exists() and page.read_text() == text:
        return False
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    return True


def main(argv: list[str] | None, doc: str, page: Path, render: Callable[[], str],
         script: str, more: str = "") -> int:
    """The generator's command line: write `page` from `render()`, or (`--check`) exit 1
    when the committed page differs. `more`: what the lines add, e.g. a count."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when the committed page differs from the generated one")
    args = parser.parse_args(argv)
    name = page.relative_to(ROOT)
    if args.check:
        if not page.exists() or page.read_text() != render():
            print(f"{name} is out of date: run python scripts/{script}")
            return 1
        print(f"{name} is up to date{more}")
        return 0
    print(f"{'wrote' if write(page, render()) else 'unchanged'} {name}{more}")
    return 0
