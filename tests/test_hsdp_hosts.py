"""HSDP across two hosts for real: `--strategy fsdp --dp_replicate 2` on two network hosts
(namespaces joined by a veth pair, tests/netns.py) of 2 ranks each, started on each by
scripts/launch.sh as one two-node torchrun job.

Every rank writes down, from its own parameters' device mesh (tests/meshplug.py, the
optimizer a user could name), the ranks of its FSDP shard group and of its replica group,
and the host it runs on: the shards stay inside a host, the replicas span both. The job
ends with the weights of the same job on one host (4 ranks, standalone) and of plain
training on one process with the whole global batch.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from nd_workers import fit_runs
from netns import TwoHosts, two_hosts
from safetensors.torch import load_file
from test_multinode import LAUNCH, clean_env, run_two_nodes

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

# The built-in GPT on 530 windows of 64 characters, a global batch of 128 (32 on each of
# 4 ranks): 5 optimizer steps of SGD with momentum, clipped at a norm some steps exceed,
# so a gradient reduced over the wrong ranks, or a wrong norm, changes the weights.
GPT = ["--dataset", "chars", "--block_size", "64", "--width", "64", "--epochs", "1",
       "--lr", "0.5", "--momentum", "0.9", "--max_grad_norm", "1.9", "--seed", "3",
       "--log_interval", "1000", "--optimizer", "meshplug:recording_sgd"]
HSDP = [*GPT, "--strategy", "fsdp", "--dp_replicate", "2", "--batch_size", "32"]


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    with two_hosts(f"{os.getpid()}h") as pair:
        yield pair


def _records(directory: Path) -> dict[int, dict[str, Any]]:
    found = [json.loads(p.read_text()) for p in directory.glob("rank*.json")]
    return {r["rank"]: r for r in found}


def test_hsdp_on_two_hosts_shards_inside_each_and_trains_like_one_host(
    hosts: TwoHosts, tmp_path: Path
) -> None:
    where = tmp_path / "where"
    nodes = run_two_nodes(hosts, [*HSDP, "--optimizer_args", f"record={where}",
                                  "--output_dir", str(tmp_path / "node{node}")],
                          tmp_path, nproc=2)
    for node, res in enumerate(nodes):
        assert res.returncode == 0, f"node {node}:\n{res.stdout[-4000:]}"
    two = tmp_path / "node0"  # rank 0 is on 10.77.0.1 and alone writes the run directory
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["strategy"] == "fsdp", summary

    # The layout, as each rank's parameters have it: 2 ranks on each host; a shard group
    # is 2 ranks of one host, a replica group one rank of each host.
    ranks = _records(where)
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    host = {r: tuple(rec["host"]) for r, rec in ranks.items()}
    assert sorted(host.values()) == sorted([(h.iface,) for h in hosts.hosts] * 2), host
    for r, rec in ranks.items():
        shard, replica = rec["groups"]["dp_shard"], rec["groups"]["dp_replicate"]
        assert len(shard) == 2 and {host[s] for s in shard} == {host[r]}, (r, rec, host)
        assert len(replica) == 2 and len({host[p] for p in replica}) == 2, (r, rec, host)

    # The same job on one host: 4 ranks, standalone.
    one = subprocess.run(
        ["bash", str(LAUNCH), *HSDP, "--optimizer_args", f"record={tmp_path / 'one-where'}",
         "--output_dir", str(tmp_path / "one")],
        env=clean_env(NPROC_PER_NODE="4"), cwd=tmp_path, capture_output=True, text=True,
        timeout=150,
    )
    assert one.returncode == 0, one.stderr[-4000:]
    # Plain training: one process, the whole global batch of 128.
    plain = fit_runs(0, [{
        "dataset": "chars", "block_size": 64, "width": 64, "epochs": 1, "lr": 0.5,
        "momentum": 0.9, "max_grad_norm": 1.9, "seed": 3, "log_interval": 1000,
        "optimizer": "meshplug:recording_sgd",
        "optimizer_args": {"record": str(tmp_path / "plain-where")},
        "batch_size": 128, "output_dir": str(tmp_path / "plain"),
    }])[0]["weights"]
    got = load_file(str(two / "model.safetensors"))
    for name, want in (("one host", load_file(str(tmp_path / "one" / "model.safetensors"))),
                       ("plain", plain)):
        # model.safetensors keeps one name of tied weights (the GPT's wte and lm_head).
        assert len(got) > 10 and set(got) <= set(want), (name, sorted(got), sorted(want))
        for key, value in got.items():
            torch.testing.assert_close(value, want[key], atol=1e-5, rtol=0, msg=f"{name} {key}")
