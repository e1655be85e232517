"""What a user did wrong, and how a run ends when it does not end well, with the exit
code each way gets.

| code | meaning |
| --- | --- |
| 2 | bad input (config, environment, data, checkpoint; a run that does not fit its device's |
|   | memory): one `ddptrain: error:` line |
| 3 | lost contact with the other ranks (a peer died or hung past --timeout_s; NCCL aborted) |
| 4 | training diverged: --max_bad_steps optimizer steps in a row had non-finite gradients |
| 71 | a DataLoader worker died (killed by a signal: the out-of-memory killer, a kill), |
|    | or Ray's memory monitor killed a Ray worker |
| 74 | a checkpoint, or mid-run the run's log, could not be written; the last checkpoint is intact |
| 75 | stopped by SIGTERM after writing a checkpoint (at start-up: at once); resume with auto |
| 130 | stopped by SIGINT (Ctrl-C) after writing a checkpoint |
| 143 | the same as 75 inside a Kubernetes pod, whose restart policy retries 128-255 only |

`ddptrain.fit` raises torch's errors that end a run as the types here, with the line the
command line prints (`launch.failures`): `UnusedParameters` (2), `WorkerLost` (71),
`PeerLost` (3); out of memory as `observe.oom.OutOfMemory` (2).

A rank that lost contact exits 3 s after its line (`cli.PEER_LOST_LINGER_S`), so that
torchrun sees the rank that failed end first and names it, with its code, as the cause.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

EXIT_USAGE = 2
EXIT_PEER_LOST = 3
EXIT_DIVERGED = 4
EXIT_WORKER_LOST = 71  # EX_OSERR: the operating system took a process of ours
EXIT_IO = 74  # EX_IOERR
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later", which is what a requeue does
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT
# 128 + SIGTERM, what a shell reports for a process SIGTERM ended. Kubernetes' `ExitCode`
# restart policy (PyTorchJob, JobSet) retries exit codes 128-255 and counts 1-127 as a
# permanent failure, so 75 would end a preempted job there for good.
EXIT_PREEMPTED_K8S = 143


def preempt_exit_code(chosen: int | None, environ: Mapping[str, str] | None = None) -> int:
    """The code a SIGTERM stop exits with: the one chosen, else 143 inside a Kubernetes pod
    (every container gets KUBERNETES_SERVICE_HOST), else 75."""
    if chosen is not None:
        return chosen
    environ = os.environ if environ is None else environ
    return EXIT_PREEMPTED_K8S if environ.get("KUBERNETES_SERVICE_HOST") else EXIT_PREEMPTED


class ConfigError(ValueError):
    """A setting, a dataset, a model or a task the user chose is wrong; the message names
    it and says what to do."""


class UnusedParameters(ConfigError):
    """DDP's reducer: the model left parameters out of the loss on a step, or gave one its
    gradient twice; the message says which flag to pass."""


class TrainingStopped(Exception):
    """Training stopped early on purpose; `exit_code` tells the launcher why."""

    exit_code = 1
    said_as = "stopped"  # the command line's word before the message: `ddptrain: stopped: ...`


class Preempted(TrainingStopped):
    """SIGTERM arrived; every rank finished its step and a checkpoint was written."""

    exit_code = EXIT_PREEMPTED


class Interrupted(TrainingStopped):
    """SIGINT (Ctrl-C) arrived; handled like SIGTERM: an agreed stop and a checkpoint."""

    exit_code = EXIT_INTERRUPTED


class Diverged(TrainingStopped):
    """Too many consecutive optimizer steps had non-finite gradients."""

    exit_code = EXIT_DIVERGED


class WorkerLost(TrainingStopped):
    """A DataLoader worker died: killed by a signal (the out-of-memory killer, a kill)."""

    exit_code = EXIT_WORKER_LOST
    said_as = "error"
    alone = True  # this rank's own failure: its peers' lines say so (`observe.hang`)


class PeerLost(TrainingStopped):
    """A collective or the rendezvous store failed: a peer died, hung past --timeout_s, or
    the network failed; the message names the rank(s) that did not reach it, if known."""

    exit_code = EXIT_PEER_LOST
    said_as = "error"

    def __init__(self, message: str, found_at: float = 0.0) -> None:
        super().__init__(message)
        self.found_at = found_at  # when this rank found its peers lost (monotonic seconds)
        self.told = False  # its line already said, as it was found (`launch.failures`)


def few(items: list[str], n: int = 4) -> str:
    """The first `n` of `items` for a message, and how many more there are."""
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more
