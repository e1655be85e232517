"""A real one-node Slurm cluster (munged, slurmctld, slurmd) living in a temporary directory.

Every daemon gets its own ports, sockets, state and log files under the directory, so the
cluster touches nothing of the machine's own Slurm or munge set-up; `SlurmCluster.env`
points the client commands (sbatch, squeue, scontrol) at it. Daemons are stopped by the
PIDs their pidfiles hold.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "sinfo", "scancel")


def missing_tools() -> list[str]:
    return [t for t in (*DAEMONS, *CLIENTS) if shutil.which(t) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """Start with `start()`, stop with `stop()` (safe to call after a failed start)."""

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root = root
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.pidfiles = {
            "munged": root / "munge" / "munged.pid",
            "slurmctld": root / "slurmctld.pid",
            "slurmd": root / "slurmd.pid",
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        """This process's environment, pointed at the cluster's config."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    # ------------------------------------------------------------------ start / stop
    def start(self, timeout: float = 30.0) -> None:
        self._write_files()
        self._spawn(
            [
                "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={self.root / 'munge' / 'munge.key'}",
                f"--pid-file={self.pidfiles['munged']}",
                f"--log-file={self.root / 'munge' / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
            "munged",
        )
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged socket")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._wait(lambda: self._ok(["scontrol", "ping"], "UP"), timeout, "slurmctld")
        self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", self.node], "slurmd")
        self._wait(self._node_idle, timeout, f"node {self.node} idle in sinfo")

    def stop(self) -> None:
        # Jobs first: their slurmstepd processes outlive slurmd by design.
        if self._pid("slurmctld") is not None:
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).strip():
                self.run("scancel", "--user=root", check=False)
                time.sleep(0.3)
        # Reverse order: slurmd first, so that it does not report a lost controller.
        for name in reversed(DAEMONS):
            pid = self._pid(name)
            if pid is not None:
                owned = [p for p in self.procs if p.pid == pid]
                _kill(pid, owned[0] if owned else None)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Last resort: any process still holding a file of this cluster (a step daemon
        # of a job that did not end) is ours to end.
        for pid in _holders(self.root):
            _kill(pid, None, timeout=5)

    def run(self, *args: str, check: bool = True) -> str:
        out = subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=30
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr}")
        return out.stdout

    # ------------------------------------------------------------------ jobs
    def sbatch(
        self, script: Path, args: list[str], env: Mapping[str, str] | None = None,
        opts: list[str] | None = None, cwd: Path | None = None,
    ) -> int:
        full_env = {**self.env, **(env or {})}
        out = subprocess.run(
            ["sbatch", "--parsable", *(opts or []), str(script), *args],
            env=full_env, capture_output=True, text=True, timeout=30, cwd=cwd, check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed: {out.stderr}")
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (empty once Slurm has forgotten the job)."""
        text = self.run("scontrol", "show", "-o", "job", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_state(
        self, job_id: int, states: tuple[str, ...], timeout: float
    ) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout}s: {info}")

    # ------------------------------------------------------------------ internals
    def _write_files(self) -> None:
        munge = self.root / "munge"
        for d in (munge, self.root / "state", self.root / "spool", self.root / "log"):
            d.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        ctld_port, slurmd_port = free_port(), free_port()
        log = self.root / "log"
        self.conf.write_text(
            f"""\
ClusterName=ddptest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
StateSaveLocation={self.root / 'state'}
SlurmdSpoolDir={self.root / 'spool'}
SlurmctldPidFile={self.pidfiles['slurmctld']}
SlurmdPidFile={self.pidfiles['slurmd']}
SlurmctldLogFile={log / 'slurmctld.log'}
SlurmdLogFile={log / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = (self.root / "log" / f"{name}.out").open("wb")
        self.procs.append(
            subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def _pid(self, name: str) -> int | None:
        try:
            return int(self.pidfiles[name].read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _ok(self, cmd: list[str], needle: str) -> bool:
        try:
            out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return out.returncode == 0 and needle in out.stdout

    def _node_idle(self) -> bool:
        return self._ok(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"], "idle")

    def _wait(self, ready: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():  # type: ignore[operator]
                return
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited early: {self._logs()}")
            time.sleep(0.2)
        raise TimeoutError(f"{what} not ready after {timeout}s: {self._logs()}")

    def _logs(self) -> str:
        parts = []
        for path in [*sorted((self.root / "log").glob("*")), self.root / "munge" / "munged.log"]:
            if path.is_file():
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)


def _kill(pid: int, child: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; a child of ours is reaped, not polled."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if child is not None:
        try:
            child.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _holders(root: Path) -> list[int]:
    """PIDs of processes other than this one with an open file or cwd under `root`."""
    found = []
    prefix = str(root)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            links = [entry / "cwd", *(entry / "fd").iterdir()]
            if any(os.readlink(link).startswith(prefix) for link in links):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
