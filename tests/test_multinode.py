"""Two nodes for real: `scripts/launch.sh` on two network hosts (namespaces joined by a veth).

Proves that the c10d rendezvous and gloo work across hosts that reach each other only
over a network interface, that the two-node job trains to exactly the weights of the same
job on one node with two processes, and that `ddptrain doctor` sees both hosts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from netns import TwoHosts, unavailable
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "scripts" / "launch.sh"
TRAIN = ["--dataset", "breast_cancer", "--epochs", "3", "--batch_size", "16", "--seed", "5",
         "--log_interval", "1000"]

pytestmark = pytest.mark.slow


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NNODES",
            "NODE_RANK", "NPROC_PER_NODE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "TORCHELASTIC_RUN_ID", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, **extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    pair = TwoHosts()
    try:
        pair.create()
        yield pair
    finally:
        pair.remove()


def run_two_nodes(
    pair: TwoHosts, args: list[str], tmp: Path, command: str = "train", timeout: float = 150
) -> list[subprocess.CompletedProcess[str]]:
    """launch.sh on both hosts at once, NNODES=2, one rank each; returns both results."""
    port = str(free_port())  # each namespace has its own ports; any free one will do
    procs = []
    for node, host in enumerate(pair.hosts):
        env = clean_env(
            NNODES="2", NPROC_PER_NODE="1", NODE_RANK=str(node),
            MASTER_ADDR=pair.hosts[0].addr, MASTER_PORT=port, RDZV_ID=f"test{port}",
            LOCAL_ADDR=host.addr, GLOO_SOCKET_IFNAME=host.iface, COMMAND=command,
        )
        node_args = [a.replace("{node}", str(node)) for a in args]
        log = (tmp / f"node{node}.log").open("w")
        procs.append(pair.popen(host, ["bash", str(LAUNCH), *node_args], env, cwd=tmp,
                                stdout=log, stderr=subprocess.STDOUT))
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
