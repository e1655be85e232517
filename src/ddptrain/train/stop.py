"""Requests to stop early: SIGTERM, SIGINT (Ctrl-C), and a torchrun agent that died.

None of them stops a rank on the spot: each sets a flag that rides on the next metric
all-reduce, so every rank stops after the same optimizer step, writes a checkpoint and
exits with the code of the request (SIGTERM and a lost agent: `--preempt_exit_code`, by
default 143 on Kubernetes and 75 elsewhere; 130 for SIGINT). A second Ctrl-C interrupts at
once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from ddptrain.errors import Interrupted, Preempted, TrainingStopped, preempt_exit_code

log = logging.getLogger("ddptrain")
AGENT_POLL_S = 1.0  # how often a torchrun worker checks that its agent still lives


class StopRequest:
    """Catches the signals while training runs (`with StopRequest() as stop:`)."""

    def __init__(self, exit_code: int | None = None) -> None:
        self.preempt_exit_code = preempt_exit_code(exit_code)
        self.requested = False
        self.reason = "SIGTERM"
        self._previous: dict[int, Any] = {}
        self._done = threading.Event()

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            threading.Thread(target=self._watch_agent, args=(os.getppid(),), daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            if self.requested and self.reason == "SIGINT":
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            self.reason = "SIGINT"
        self.requested = True

    def _watch_agent(self, agent: int) -> None:
        # A worker whose torchrun agent was SIGKILLed is re-parented: nobody would stop
        # it, and a restarted job would write the same run directory beside it.
        while not self._done.wait(AGENT_POLL_S):
            if os.getppid() != agent:
                log.warning("the torchrun agent (pid %d) is gone: stopping at the next "
                            "agreed step, after a checkpoint", agent)
                self.reason = "a lost torchrun agent"
                self.requested = True
                return

    def error(self, step: int, saved: bool) -> TrainingStopped:
        what = "after a checkpoint" if saved else "without a checkpoint (the step was skipped)"
        text = f"stopped by {self.reason} at step {step} {what}"
        if self.reason == "SIGINT":
            return Interrupted(text)
        stopped = Preempted(text)
        stopped.exit_code = self.preempt_exit_code
        return stopped
