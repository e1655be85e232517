"""SIGTERM and SIGINT outside the training loop: while a run starts (torch loading, the
data, the process group, the model, a resume) or after it trained.

Inside the loop `train.stop.StopRequest` turns them into an agreed stop after a
checkpoint. Outside it there is nothing to save, so the process stops at once: the
signal raises `StoppedOutsideTraining` in the main thread, which unwinds the start as a
failed start does (the run directory is given back as it was, the process group is torn
down without waiting for peers) and the run ends with one line and the code of the
signal: 75 for SIGTERM (a requeue restarts the job; 143 in a Kubernetes pod), 130 for
SIGINT.

No torch here: the handlers go in before torch is imported, which takes seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from ddptrain.errors import (
    EXIT_INTERRUPTED,
    EXIT_PEER_LOST,
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_K8S,
    preempt_exit_code,
)


class StoppedOutsideTraining(KeyboardInterrupt):
    """A SIGTERM or SIGINT outside the training loop. A KeyboardInterrupt, as Ctrl-C is,
    so that no `except Exception` on its way takes it for an error of the start."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        self.exit_code = EXIT_INTERRUPTED if signum == signal.SIGINT else preempt_exit_code(None)
        super().__init__(
            f"stopped by {name} outside the training loop (while the run started or after "
            "it trained): nothing was left half-written; run the same command with "
            "--resume_from auto to go on (a run that had not trained starts afresh)"
        )


RETRY_S = 0.5


def _again(signum: int, handler: Any) -> None:
    if signal.getsignal(signum) is handler:
        os.kill(os.getpid(), signum)


@contextlib.contextmanager
def stop_at_once_on_signals() -> Iterator[None]:
    """Inside this block, but outside the training loop (which takes them over and gives
    them back), SIGTERM and SIGINT stop this process at once with `StoppedOutsideTraining`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if sys.exc_info()[0] is None:
            raise StoppedOutsideTraining(signum)
        # Code handling an exception (a run ending on an error, which torchrun answers by
        # stopping the other workers; an import trying a fallback) is not cut short: the
        # signal comes again in a moment, while these handlers are still in place.
        timer = threading.Timer(RETRY_S, _again, (signum, handler))
        timer.daemon = True
        timer.start()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT wait for the end of this block (a rank that lost its peers
    writing its record and its line, which torchrun, stopping the other workers, would
    cut short), then take effect as they would have."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    sigs = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum))
                for sig in sigs}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if pending:
            os.kill(os.getpid(), pending[0])


@contextlib.contextmanager
def exit_at_once_on_signals(rank: int) -> Iterator[None]:
    """Around a call that blocks in C++ for up to --timeout_s (the process group's
    rendezvous): Python runs a signal's handler only once that call returns, so a thread
    woken by the signal (`signal.set_wakeup_fd`) says the one line and ends the process
    there. The run directory keeps only its lock (released by the kernel) and empty
    folders; nothing of a run is written before the process group is up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    done = threading.Event()

    def watch() -> None:
        while True:
            got = os.read(read_fd, 1)
            if done.is_set() or not got:
                return
            if got[0] in (signal.SIGTERM, signal.SIGINT):
                stop = StoppedOutsideTraining(got[0])
                prefix = f"[rank {rank}] " if rank else ""
                os.write(2, f"{prefix}ddptrain: stopped: {stop}\n".encode())
                note_exit(stop.exit_code)
                os._exit(stop.exit_code)

    thread = threading.Thread(target=watch, name="ddptrain-signals", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous_fd)
        os.write(write_fd, b"\0")  # wake the thread to end
        thread.join()
        os.close(read_fd)
        os.close(write_fd)


# what a rank ends with when its launcher stops it, or when a peer it waits on has ended:
# never the job's cause while another rank's own failure is known
STOPPED = (EXIT_PREEMPTED, EXIT_PREEMPTED_K8S, EXIT_PEER_LOST)
# set by `ddprun` for its workers: each leaves its one line in torchrun's error file, for the
# launcher to say the root cause's last (`launch.torchrun.last_word`)
SAY_LAST = "DDPTRAIN_SAY_LAST"


def noted_exit(path: str) -> tuple[int, int] | None:
    """The code and restart round in DDPTRAIN_EXIT_FILE `path`; None if none is there."""
    try:
        with open(path) as f:
            words = f.read().split()
        return int(words[0]), int(words[1]) if len(words) > 1 else 0
    except (OSError, ValueError, IndexError):
        return None


def note_exit(code: int, *, cause: bool = False) -> None:
    """Tell a wrapping launcher the job's exit code. torchrun reports a worker's failure as
    1 and, stopped by a signal, reports none; srun gives the highest of its nodes' codes. So
    `scripts/launch.sh` and `scripts/slurm/run.sh` read it from DDPTRAIN_EXIT_FILE, as
    "CODE ROUND" (ROUND: torchrun's restart count). Every rank notes its code, but a stopped one
    (STOPPED) leaves in place a code of this round that is not: that of the rank that
    failed of itself, which is the job's. `cause`: the agent notes the root cause it saw
    over whatever is there."""
    path = os.environ.get("DDPTRAIN_EXIT_FILE")
    if not path:
        return
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    round_ = int(restart) if restart.isdigit() else 0
    noted = noted_exit(path)
    if cause and noted is not None:
        round_ = max(round_, noted[1])  # the agent's environment has no round
    elif code in STOPPED and noted is not None and noted[0] not in STOPPED and noted[1] >= round_:
        return
    # Ranks of several nodes may note at once: each writes its own file and renames it.
    # The file is created new under a name no one could plant a link at beforehand (the
    # folder is often a shared temporary one); renamed over a link, it replaces the link.
    folder, base = os.path.split(os.path.abspath(path))
    with contextlib.suppress(OSError):
        fd, part = tempfile.mkstemp(prefix=f".{base}.{socket.gethostname()}.", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(f"{code} {round_}\n")
            os.replace(part, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(part)
