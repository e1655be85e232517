"""`ddptrain doctor`: its arithmetic, one process, two local ranks, and a rank that never comes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddptrain.launch.doctor import bus_bandwidth, choose_interface, parse_size

DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in DIST_VARS and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def doctor(args: list[str], cwd: Path, env: dict[str, str] | None = None,
           torchrun: int = 0) -> subprocess.CompletedProcess[str]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={torchrun}"] if torchrun else [sys.executable])
    return subprocess.run([*launcher, "-m", "ddptrain", "doctor", *args], cwd=cwd,
                          env=env or clean_env(), capture_output=True, text=True, timeout=120)


def test_bus_bandwidth_uses_the_ring_factor() -> None:
    # 1 GB in 1 s on 4 ranks: each link carries 2(n-1)/n = 1.5 GB.
    assert bus_bandwidth(10**9, 1.0, 4) == pytest.approx(1.5)
    assert bus_bandwidth(10**9, 1.0, 2) == pytest.approx(1.0)


def test_parse_size() -> None:
    assert [parse_size(s) for s in ("4K", "1M", "16mb", "1024")] == [4096, 1 << 20, 16 << 20,
                                                                      1024]
    for bad in ("1", "x", "4Q", "-4K"):
        with pytest.raises(ValueError, match="--sizes"):
            parse_size(bad)


def test_interface_from_the_backend_variable_or_the_route() -> None:
    told = choose_interface({"GLOO_SOCKET_IFNAME": "lo"}, "10.9.9.9")
    assert (told.name, told.address) == ("lo", "127.0.0.1")
    assert "GLOO_SOCKET_IFNAME=lo" in told.why
    routed = choose_interface({}, "127.0.0.1")
    assert (routed.name, routed.address) == ("lo", "127.0.0.1")
    assert choose_interface({}, None).name is None


def test_single_process_skips_the_collective(tmp_path: Path) -> None:
    res = doctor([], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "world size 1" in res.stdout
    assert "all-reduce skipped" in res.stdout
    assert re.search(r"backends   gloo=yes", res.stdout)


@pytest.mark.slow
def test_two_local_ranks_report_identity_and_bandwidth(tmp_path: Path) -> None:
    res = doctor(["--sizes", "4K,1M", "--iters", "5"], tmp_path, torchrun=2)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "launcher   torchrun: world size 2" in out
    assert "ranks      2 on 1 host(s)" in out
    pids = re.findall(r"rank +(\d) +local +(\d) .* pid (\d+) ", out)
    assert [(r, lr) for r, lr, _ in pids] == [("0", "0"), ("1", "1")]
    assert pids[0][2] != pids[1][2]
    rows = re.findall(r"(4 KiB|1 MiB) +([\d.]+) us +([\d.]+) GB/s +([\d.]+) GB/s", out)
    assert [r[0] for r in rows] == ["4 KiB", "1 MiB"], out
    for _, latency, algbw, busbw in rows:
        assert float(latency) > 0
        assert float(busbw) == pytest.approx(float(algbw), abs=1e-3)  # 2(n-1)/n = 1 for n=2
    print(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_missing_rank_fails_within_the_timeout_with_one_line(tmp_path: Path) -> None:
    # Rank 0 of 2, and rank 1 is never started.
    env = clean_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(_free_port()))
    # no wall-clock bound (a loaded machine takes its time to import torch): a hang would
    # meet `doctor`'s own subprocess timeout, and the line says which timeout ended it
    res = doctor(["--timeout_s", "2"], tmp_path, env=env)
    assert res.returncode == 1, res.stderr
    errors = [line for line in res.stderr.splitlines() if "ddptrain doctor: error:" in line]
    assert len(errors) == 1, res.stderr
    assert "not all 2 ranks were reachable within --timeout_s 2" in errors[0]
    assert "Traceback" not in res.stderr


def test_bad_flag_is_one_line_exit_2(tmp_path: Path) -> None:
    res = doctor(["--sizes", "big"], tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip().startswith("ddptrain: error: --sizes 'big' is invalid")


def test_loopback_host_name_warning_on_multi_node_gloo() -> None:
    from ddptrain.launch.cluster import ClusterEnv
    from ddptrain.launch.doctor import _loopback_warning

    two_nodes = ClusterEnv(0, 0, 4, "torchrun", "10.0.0.1", 29500)
    env = {"LOCAL_WORLD_SIZE": "2"}
    loopback = socket.gethostbyname(socket.gethostname()).startswith("127.")
    warning = _loopback_warning(two_nodes, env)
    assert (warning is not None) == loopback
    if warning:
        assert "GLOO_SOCKET_IFNAME" in warning
    # Told which interface, or all ranks on one node: nothing to warn about.
    assert _loopback_warning(two_nodes, {**env, "GLOO_SOCKET_IFNAME": "eth0"}) is None
    assert _loopback_warning(two_nodes, {"LOCAL_WORLD_SIZE": "4"}) is None
