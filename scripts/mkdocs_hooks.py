"""mkdocs hooks (mkdocs.yml `hooks:`): regenerate the flag reference from the code before
each build, so the site's docs/reference/flags.md is always `TrainingConfig`'s."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flag_reference


def on_pre_build(config: Any, **kwargs: Any) -> None:
    flag_reference.write()
