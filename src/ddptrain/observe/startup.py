"""Where a run's start-up goes, phase by phase, up to its first optimizer step.

    start-up 8.9 s to the first step: imports 3.1, data 0.4, group 1.2, model 0.6, first step 3.6

- `imports`: from the process's own start (Linux: /proc; elsewhere from ddptrain's first
  clock) to the end of the run's imports: the interpreter, ddptrain, torch;
- `data`: the checks before the process group, the dataset loaded and split;
- `group`: the process group and its first collective (the rendezvous with every rank);
- `model`: built, split or sharded, wrapped, the optimizer, a resume's checkpoint loaded;
- `first step`: the loader's first batches, the first forward, backward and optimizer
  step (with `--compile`, its compilation).

Rank 0 logs the line at the first step and summary.json holds the figures (`startup_s`):
the phases that are rank 0's own; a slow rank shows as a long `group` on the others.
"""

from __future__ import annotations

import os
import time

_CLOCKS_MADE = 0  # the first clock in a process counts from the process's start


def process_age() -> float:
    """Seconds since this process started (Linux: /proc), 0.0 where that is unknown."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started)


class Phases:
    """Seconds per start-up phase, each marked as it ends; the first phase of the
    process's first clock counts from the process's start (`from_process_start`)."""

    def __init__(self, from_process_start: bool = True) -> None:
        global _CLOCKS_MADE
        first = from_process_start and not _CLOCKS_MADE
        _CLOCKS_MADE += 1
        self._last = time.perf_counter() - (process_age() if first else 0.0)
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._last, 3)
        self._last = now

    def line(self) -> str:
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.seconds.items())
        return f"start-up {sum(self.seconds.values()):.1f} s to the first step: {parts}"
