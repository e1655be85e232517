"""torchrun, with ddptrain's report of a failed job: `python -m ddptrain.launch.torchrun`
takes torchrun's flags and runs torchrun's own agent (`scripts/launch.sh` starts jobs
through it).

    python -m ddptrain.launch.torchrun --standalone --nproc_per_node=2 -m ddptrain train ...

Plain torchrun ends every failed job with its own 30-line `ChildFailedError` traceback
after the ranks' lines, and reports any failure as exit 1. Here a rank that exits with a
code has said why itself (ddptrain's one line, or the user's traceback): nothing follows
it, and the job exits with that rank's code (torchrun's root cause: the first to fail). A
rank killed by a signal says nothing, so this says it, in one line, and exits 128 + the
signal's number (137 for SIGKILL, the out-of-memory killer's). torchrun's start-up banner
and agent warnings are left out too; set LOGLEVEL (torchrun's own variable) to see them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

# torchrun's modules log through loggers of these names (`elastic.utils.logging`)
AGENT_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


def failure_report(failures: dict[int, Any], first: int) -> tuple[str | None, int]:
    """The line to print (None: the rank said it) and the exit code, for torchrun's
    `failures` (global rank -> ProcessFailure) whose root cause is rank `first`."""
    failure = failures[first]
    code = int(failure.exitcode)
    if code >= 0:
        return None, code
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = " (often the out-of-memory killer)" if -code == signal.SIGKILL else ""
    others = len(failures) - 1
    line = (f"ddptrain: error: rank {first} (pid {failure.pid}) was killed by {name}{why}"
            + (f"; the job stopped its {others} other failed rank(s)" if others else "")
            + "; restart the job with --resume_from auto")
    return line, 128 - code


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if "LOGLEVEL" not in os.environ:
        for name in list(logging.Logger.manager.loggerDict):
            if name.startswith(AGENT_LOGGERS):
                logging.getLogger(name).setLevel(logging.ERROR + 1)
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        first, _ = exc.get_first_failure()
        line, code = failure_report(exc.failures, first)
        if line is not None:
            sys.stderr.write(line + "\n")
        return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
