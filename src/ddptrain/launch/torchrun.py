"""torchrun, with ddptrain's report of a failed job: `ddprun` (the console script), or
`python -m ddptrain.launch.torchrun`, takes torchrun's flags and runs torchrun's own agent
(`scripts/launch.sh` starts jobs through it).

    ddprun --standalone --nproc_per_node=2 -m ddptrain train ...

Plain torchrun ends every failed job with its own 30-line `ChildFailedError` traceback
after the ranks' lines, and reports any failure as exit 1. Here a rank that exits with a
code has said why itself (ddptrain's one line, or the user's traceback): nothing follows
it, and the job exits with that rank's code. The root cause is the first rank to fail on
its own: torchrun's own pick goes by whole seconds, so a rank its agent stopped (exit 75,
143 or SIGTERM) or one that lost that peer (3) may tie with it and come first. A
rank killed by a signal says nothing, so this says it, in one line, and exits 128 + the
signal's number (137 for SIGKILL, the out-of-memory killer's). A rank SIGKILLed after
another had failed was torchrun's own kill, of a rank still running 30 s after its
SIGTERM (one stalled in its own code, whose peers lost it): stopped, not the cause, and
the job's code is its peers' 3. The root cause's own line, which each rank leaves in
torchrun's error file, is said again last where a rank the job stopped spoke after it
(`last_word`): the line a user reads last is the cause's. torchrun's start-up banner
and agent warnings are left out too; set LOGLEVEL (torchrun's own variable) to see them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

from ddptrain.launch.signals import SAY_LAST, STOPPED, note_exit

# torchrun's modules log through loggers of these names (`elastic.utils.logging`)
AGENT_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


def stopped(code: int) -> bool:
    """Whether a rank ended so because the job stopped it (the agent's SIGTERM, or a peer
    it waited on gone), not of itself."""
    return code in STOPPED or code == -signal.SIGTERM


def stopped_by_job(failures: dict[int, Any], rank: int) -> bool:
    """Whether rank `rank` of torchrun's `failures` (global rank -> ProcessFailure) ended
    so because the job stopped it: a `stopped` code, or SIGKILL seen after another rank
    had failed. That SIGKILL is torchrun's own, sent to the ranks still running 30 s
    after its SIGTERM: a rank stalled in its own code, whose peers lost it and ended
    first (3). The out-of-memory killer's comes first, its peers noticing after."""
    failure = failures[rank]
    code = int(failure.exitcode)
    if stopped(code):
        return True
    return code == -signal.SIGKILL and any(
        other.timestamp < failure.timestamp for r, other in failures.items() if r != rank)


def root_cause(failures: dict[int, Any], first: int) -> int:
    """The rank that failed on its own, of torchrun's `failures` (global rank ->
    ProcessFailure): torchrun's `first` unless it is one the job stopped while another
    failed of itself (the earliest of those); `first` when every rank was stopped."""
    own = [r for r in failures if not stopped_by_job(failures, r)]
    if not own or first in own:
        return first
    return min(own, key=lambda r: (failures[r].timestamp, r))


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


def last_word(failures: dict[int, Any], cause: int) -> str | None:
    """The root cause's own `ddptrain:` line (each rank leaves its line in torchrun's error
    file, `cli._tell_agent`), to say again last where a rank the job stopped said its own
    line (stopped, or lost its peer), likely after it; None where none did, or where the
    cause itself was stopped (every rank then says the same)."""
    def said(rank: int) -> str:
        message = getattr(failures[rank], "message", "")
        return message if isinstance(message, str) and message.startswith("ddptrain: ") else ""

    if not said(cause) or stopped_by_job(failures, cause):
        return None
    if not any(said(r) and stopped_by_job(failures, r) for r in failures if r != cause):
        return None
    return said(cause)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if "LOGLEVEL" not in os.environ:
        for name in list(logging.Logger.manager.loggerDict):
            if name.startswith(AGENT_LOGGERS):
                logging.getLogger(name).setLevel(logging.ERROR + 1)
    os.environ[SAY_LAST] = "1"  # the workers leave their line for `last_word`
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        first, _ = exc.get_first_failure()
        cause = root_cause(exc.failures, first)
        line, code = failure_report(exc.failures, cause)
        if not stopped_by_job(exc.failures, cause):
            note_exit(code, cause=True)  # over what a rank this job stopped noted
        if line is None:
            line = last_word(exc.failures, cause)
        if line is not None:
            sys.stderr.write(line + "\n")
        return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
