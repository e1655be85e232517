"""Rank-aware logging: rank 0 speaks at INFO, other ranks only warn; every line says its rank."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

LOGGER_NAME = "ddptrain"


def setup_logging(rank: int) -> logging.Logger:
    """Configure the `ddptrain` logger for this rank (idempotent)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger


def quietly(importer: Callable[[], Any]) -> Any:
    """What `importer` imports, with the logs of torchao's import (kernels this machine
    has no use for) and torch's pytree (its deprecations) held back."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        return importer()
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
