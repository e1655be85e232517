"""Rank-aware logging: rank 0 speaks at INFO, other ranks only warn; every line says its rank."""

from __future__ import annotations

import logging
import sys

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
