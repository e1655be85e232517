"""Two network hosts on one machine: network namespaces joined by a veth pair.

Each namespace has its own loopback, its own port space and one end of the veth with a
private address (10.77.0.1/24 and 10.77.0.2/24), so processes started in them talk
over a real network interface, as two hosts on one switch would. Names carry this
process's pid, so concurrent test sessions do not collide; `remove()` ends whatever still
runs inside and deletes both namespaces (the veth goes with them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import pytest

SUBNET = "10.77.0"


@dataclass
class Host:
    netns: str
    iface: str
    addr: str


@dataclass
class TwoHosts:
    tag: str = field(default_factory=lambda: str(os.getpid()))
    hosts: list[Host] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Interface names are limited to 15 characters.
        self.hosts = [
            Host(f"ddpt{self.tag}n{i}", f"vd{self.tag}n{i}"[:15], f"{SUBNET}.{i + 1}")
            for i in range(2)
        ]

    def create(self) -> None:
        a, b = self.hosts
        for h in self.hosts:
            _ip("netns", "add", h.netns)
        _ip("link", "add", a.iface, "type", "veth", "peer", "name", b.iface)
        for h in self.hosts:
            _ip("link", "set", h.iface, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.iface)
            _ip("-n", h.netns, "link", "set", h.iface, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")

    def remove(self) -> None:
        for h in self.hosts:
            pids = subprocess.run(
                ["ip", "netns", "pids", h.netns], capture_output=True, text=True, check=False
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True, check=False)
        # A veth end left in the root namespace by a half-done create() goes too.
        subprocess.run(["ip", "link", "del", self.hosts[0].iface], capture_output=True,
                       check=False)

    def popen(
        self, host: Host, cmd: Sequence[str], env: Mapping[str, str], **kwargs: object
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", host.netns, *cmd], env=dict(env), text=True, **kwargs
        )


@contextlib.contextmanager
def two_hosts(tag: str | None = None) -> Iterator[TwoHosts]:
    """Two namespace hosts for a test (skipped where namespaces cannot be made), removed
    with every process in them afterwards."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    pair = TwoHosts() if tag is None else TwoHosts(tag=tag)
    try:
        pair.create()
        yield pair
    finally:
        pair.remove()


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"ddpt{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
