"""mkdocs hooks (mkdocs.yml `hooks:`): regenerate the reference pages from the code before
each build, so the site's docs/reference/flags.md is always `TrainingConfig`'s and
docs/reference/commands.md always the commands' parsers'."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_commands
import flag_reference


def on_pre_build(config: Any, **kwargs: Any) -> None:
    flag_reference.write()
    docs_commands.write()
