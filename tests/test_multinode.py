"""Two nodes for real: `scripts/launch.sh` on two network hosts (namespaces joined by a veth).

Proves that the c10d rendezvous and gloo work across hosts that reach each other only
over a network interface, that the two-node job trains to exactly the weights of the same
job on one node with two processes, and that `ddptrain doctor` sees both hosts. Then the
faults: under MAX_RESTARTS=3 a permanent partition (iptables DROP) and a host that dies
without a word (its traffic dropped, then every process SIGKILLed) end both launchers
within --timeout_s + 60 s, and a node that crashed and is started again with the README's
command rejoins, both nodes resuming from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from netns import Host, TwoHosts, two_hosts
from safetensors.torch import load_file
from test_elastic import crash, newest, set_pace

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "scripts" / "launch.sh"
TRAIN = ["--dataset", "breast_cancer", "--epochs", "3", "--batch_size", "16", "--seed", "5",
         "--log_interval", "1000"]

pytestmark = pytest.mark.slow


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NNODES",
            "NODE_RANK", "NPROC_PER_NODE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "TORCHELASTIC_RUN_ID", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MAX_RESTARTS",
            "JOIN_TIMEOUT", "RDZV_ID", "LOCAL_ADDR", "KUBERNETES_SERVICE_HOST")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "PET_"))}
    env["PYTHONPATH"] = os.pathsep.join(  # the paced model of test_elastic
        filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, **extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    with two_hosts() as pair:
        yield pair


def start_two_nodes(
    pair: TwoHosts, args: list[str], tmp: Path, command: str = "train", tag: str = "node",
    nproc: int = 1, **extra: str,
) -> list[subprocess.Popen[str]]:
    """launch.sh on both hosts at once, NNODES=2, `nproc` ranks each (logs in
    tmp/TAGN.log)."""
    port = extra.pop("port", None) or str(free_port())  # each namespace has its own ports
    return [start_node(pair, node, args, tmp, port, command, f"{tag}{node}", nproc, **extra)
            for node in range(2)]


def start_node(pair: TwoHosts, node: int, args: list[str], tmp: Path, port: str,
               command: str = "train", log_name: str = "", nproc: int = 1, **extra: str
               ) -> subprocess.Popen[str]:
    host = pair.hosts[node]
    env = clean_env(
        NNODES="2", NPROC_PER_NODE=str(nproc), NODE_RANK=str(node),
        MASTER_ADDR=pair.hosts[0].addr, MASTER_PORT=port, RDZV_ID=f"test{port}",
        LOCAL_ADDR=host.addr, GLOO_SOCKET_IFNAME=host.iface, COMMAND=command, **extra,
    )
    node_args = [a.replace("{node}", str(node)) for a in args]
    with (tmp / f"{log_name or f'node{node}'}.log").open("w") as log:
        return pair.popen(host, ["bash", str(LAUNCH), *node_args], env, cwd=tmp,
                          stdout=log, stderr=subprocess.STDOUT)


def run_two_nodes(
    pair: TwoHosts, args: list[str], tmp: Path, command: str = "train", timeout: float = 150,
    nproc: int = 1,
) -> list[subprocess.CompletedProcess[str]]:
    """launch.sh on both hosts at once, NNODES=2, `nproc` ranks each; returns both
    results."""
    procs = start_two_nodes(pair, args, tmp, command, nproc=nproc)
    results = []
    for node, proc in enumerate(procs):
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        out = (tmp / f"node{node}.log").read_text()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return results


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model.safetensors"))


@pytest.mark.heavy
def test_two_hosts_train_like_one_node_with_two_ranks(hosts: TwoHosts, tmp_path: Path) -> None:
    nodes = run_two_nodes(hosts, [*TRAIN, "--output_dir", str(tmp_path / "node{node}")],
                          tmp_path)
    for node, res in enumerate(nodes):
        assert res.returncode == 0, f"node {node}:\n{res.stdout[-4000:]}"
    # c10d numbers nodes in the order of their addresses: 10.77.0.1 holds rank 0, which
    # alone writes the run directory.
    two = tmp_path / "node0"
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2
    assert not (tmp_path / "node1" / "model.safetensors").exists()

    ref = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "ddptrain", "train", *TRAIN, "--output_dir", str(tmp_path / "one")],
        env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=150,
    )
    assert ref.returncode == 0, ref.stderr[-4000:]
    got, want = _weights(two), _weights(tmp_path / "one")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_doctor_sees_both_hosts(hosts: TwoHosts, tmp_path: Path) -> None:
    nodes = run_two_nodes(hosts, ["--timeout_s", "30", "--sizes", "4K,1M"], tmp_path,
                          command="doctor")
    for node, res in enumerate(nodes):
        assert res.returncode == 0, f"node {node}:\n{res.stdout[-4000:]}"
    report = nodes[0].stdout
    assert "ranks      2 on 2 host(s)" in report, report
    for node, host in enumerate(hosts.hosts):
        assert f"rank   {node}" in report and f"addr {host.addr}" in report, report
    assert f"interface  {hosts.hosts[0].iface} ({hosts.hosts[0].addr})" in report, report
    assert "GB/s" in report and "ok: all 2 ranks reached each other" in report, report
    print(report)  # the measured figures, with -s


# --- a host gone for good, and a host that comes back ------------------------------------

TIMEOUT_S = 10
PACED = ["--dataset", "breast_cancer", "--model", "test_elastic:paced_mlp", "--epochs", "2",
         "--batch_size", "8", "--seed", "5", "--log_interval", "5", "--save_every_steps", "2"]


def cut_off(host: Host) -> None:
    """Every packet in or out of the host's interface dropped: no reset, no answer."""
    for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
        subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-A", chain, flag,
                        host.iface, "-j", "DROP"], check=True, capture_output=True)


def heal(host: Host) -> None:
    with contextlib.suppress(OSError):
        subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-F"],
                       capture_output=True, check=False)


def wait_checkpoint(ckpt: Path, step: int, procs: list[subprocess.Popen[str]], tmp: Path,
                    limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while newest(ckpt)[0] < step:
        for node, proc in enumerate(procs):
            assert proc.poll() is None, (tmp / f"node{node}.log").read_text()[-4000:]
        assert time.monotonic() < deadline, f"no checkpoint at step {step} in {limit}s"
        time.sleep(0.1)


@pytest.mark.heavy
@pytest.mark.parametrize("fault", ["partition", "host_dies"])
def test_a_host_gone_for_good_ends_both_launchers_within_the_timeout(
    hosts: TwoHosts, fault: str, tmp_path: Path
) -> None:
    if shutil.which("iptables") is None:
        pytest.skip("no iptables (apt-get install iptables)")
    pace, run = tmp_path / "pace", tmp_path / "run"
    set_pace(pace, 0.1)  # 2 epochs would take minutes: the fault comes first
    args = [*PACED, "--timeout_s", str(TIMEOUT_S), "--model_args", f"pace={pace}",
            "--output_dir", str(run)]
    procs = start_two_nodes(hosts, args, tmp_path, MAX_RESTARTS="3")
    try:
        wait_checkpoint(run / "checkpoints", 4, procs, tmp_path)
        cut_off(hosts.hosts[1])
        cut = time.monotonic()
        if fault == "host_dies":
            crash(hosts.hosts[1])  # its sockets' last words never leave the host
        ended = []
        for node, proc in enumerate(procs):
            try:
                proc.wait(timeout=TIMEOUT_S + 60 - (time.monotonic() - cut))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"node {node}'s launcher outlived --timeout_s + 60 s:\n"
                    + (tmp_path / f"node{node}.log").read_text()[-4000:]) from None
            ended.append(time.monotonic() - cut)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        heal(hosts.hosts[1])
    print(f"{fault}: launchers ended {ended[0]:.1f}s and {ended[1]:.1f}s after the cut "
          f"(--timeout_s {TIMEOUT_S})")
    assert procs[0].returncode != 0  # the survivor did not pretend to finish
    assert newest(run / "checkpoints")[0] >= 4  # what was trained is on disk


@pytest.mark.heavy
def test_a_crashed_node_started_again_rejoins_and_both_resume(
    hosts: TwoHosts, tmp_path: Path
) -> None:
    # The README's sequence: both nodes run the same launch.sh command with MAX_RESTARTS=3
    # into shared storage; node 1 crashes; its command, run again, rejoins.
    pace, run = tmp_path / "pace", tmp_path / "run"
    set_pace(pace, 0.05)
    args = [*PACED, "--timeout_s", "60", "--model_args", f"pace={pace}",
            "--output_dir", str(run)]
    port = str(free_port())
    procs = start_two_nodes(hosts, args, tmp_path, port=port, MAX_RESTARTS="3")
    try:
        wait_checkpoint(run / "checkpoints", 4, procs, tmp_path)
        crash(hosts.hosts[1])
        procs[1].wait(timeout=10)
        left_at = newest(run / "checkpoints")[0]
        set_pace(pace, 0)
        procs[1] = start_node(hosts, 1, args, tmp_path, port, log_name="again1",
                              MAX_RESTARTS="3")
        for node, proc in enumerate(procs):
            try:
                proc.wait(timeout=150)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"node {node} still runs after the rejoin") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    log0, log1 = (tmp_path / "node0.log").read_text(), (tmp_path / "again1.log").read_text()
    assert [p.returncode for p in procs] == [0, 0], log0[-3000:] + log1[-3000:]
    assert "DistStoreError" not in log0 + log1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2 * 29, summary
    assert "resumed from" in log0 and left_at >= 4, log0[-4000:]
