"""Elastic membership for real: one of two hosts leaves a torchrun job and comes back.

Two network namespaces joined by a veth stand in for two hosts; both run a torchrun agent
with `--nnodes=1:2` against one c10d rendezvous and write one `--output_dir` (shared
storage in a cluster, the same path here). Host B crashes mid-run (every process on it
SIGKILLed: its agent and its worker), host A's worker loses its peer, A's agent restarts
its worker at world size 1, which resumes from the newest checkpoint; then B's agent is
started again, A's agent sees a node waiting, stops its worker after a checkpoint and
both continue at world size 2 to the end. `--global_batch_size` keeps every optimizer
step the same on 1 and 2 ranks, so the run ends with the weights and the metrics of an
uninterrupted single-process run.

Two settings make the rejoin work with torch 2.13:

- `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`. By default the rank-0 agent shares its own
  TCPStore with the workers, and `DynamicRendezvousHandler.next_rendezvous` writes
  `MASTER_ADDR`/`MASTER_PORT` into the round's store only when that agent has no bootstrap
  info yet (or has just become rank 0). Host A's agent, rank 0 throughout, wrote them in
  round 0 only; B's new agent, rank 1 of round 2, waits for `/torch.rendezvous.<id>.2/
  MASTER_ADDR`, A's waits for B's `torchelastic/role_info/1`, and both time out after
  60 s. (Were that fixed, ddptrain's workers would still miss each other in the shared
  store: they key it by their own `TORCHELASTIC_RESTART_COUNT`, 1 on A and 0 on the new B;
  see pytorch/pytorch#135712.) Without sharing, rank 0's agent publishes its address and
  a free port in every round and the workers' rank 0 hosts their store.
Nothing else is needed: a node that joins later resumes like a restarted worker (its
job's rendezvous id is recorded in the run directory), and rank 0 decides which
checkpoint every rank loads.

c10d's warning "The hostname of the client socket cannot be retrieved. err=-3" is a failed
reverse lookup inside a namespace without DNS, and harmless: nodes are named by
`--local_addr`, not by host name.

The training is paced by a file the test writes (seconds each training forward sleeps),
so that no phase ends before the test has seen it; the pace changes no number.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import BIN, child_env
from netns import Host, TwoHosts, unavailable
from safetensors.torch import load_file
from torch import nn

pytestmark = pytest.mark.slow

RDZV_PORT = 29555  # each namespace has its own port space: host A's is free
EPOCHS = 4
STEPS = EPOCHS * 29  # breast_cancer: 455 training samples, 16 per optimizer step
TRAIN = [
    "--dataset", "breast_cancer", "--model", "test_elastic:paced_mlp",
    "--epochs", str(EPOCHS), "--global_batch_size", "16", "--batch_size", "8", "--seed", "5",
    "--save_every_steps", "2", "--log_interval", "5", "--timeout_s", "30",
]


# --- the paced model, imported by the workers as `test_elastic:paced_mlp` -------------


class _Paced(nn.Module):
    def __init__(self, features: int, classes: int, pace: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, classes))
        self.pace = Path(pace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with contextlib.suppress(OSError, ValueError):
                time.sleep(float(self.pace.read_text()))
        return self.net(x)


def paced_mlp(config: object, input_shape: tuple[int, ...], num_classes: int,
              pace: str = "") -> nn.Module:
    """An MLP whose training forward sleeps the seconds written in the file `pace`."""
    return _Paced(input_shape[0], num_classes, pace)


# --- the job -----------------------------------------------------------------------------


def set_pace(path: Path, seconds: float) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(seconds))
    os.replace(tmp, path)  # the workers never read half a number


def agent_cmd(pair: TwoHosts, host: Host, out: Path, pace: Path) -> list[str]:
    is_host = int(host is pair.hosts[0])
    return [
        str(BIN / "torchrun"), "--nnodes=1:2", "--nproc_per_node=1", "--max_restarts=5",
        "--monitor_interval=1", "--rdzv_backend=c10d",
        f"--rdzv_endpoint={pair.hosts[0].addr}:{RDZV_PORT}", f"--rdzv_id=elastic{pair.tag}",
        # A dead node's heartbeat expires after 1 s x 5 instead of 5 s x 3.
        f"--rdzv_conf=is_host={is_host},last_call_timeout=1,join_timeout=60,"
        "keep_alive_interval=1,keep_alive_max_attempt=5",
        f"--local_addr={host.addr}",
        "-m", "ddptrain", "train", *TRAIN, "--model_args", f"pace={pace}",
        "--output_dir", str(out),
    ]


def start_agent(pair: TwoHosts, host: Host, out: Path, pace: Path, log: Path
                ) -> subprocess.Popen[str]:
    env = child_env({"GLOO_SOCKET_IFNAME": host.iface, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    with log.open("w") as f:
        return pair.popen(host, agent_cmd(pair, host, out, pace), env, cwd=out.parent,
                          stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def crash(host: Host) -> None:
    """The host goes away: every process in its namespace SIGKILLed (agent and workers)."""
    for _ in range(50):
        pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True,
                              text=True, check=False).stdout.split()
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.05)
    raise AssertionError(f"processes in {host.netns} survive SIGKILL")


def checkpoints(ckpt_dir: Path) -> list[tuple[int, int]]:
    """(step, world size that wrote it) of every step checkpoint, in step order."""
    found = []
    for path in sorted(ckpt_dir.glob("step_*.pt")):
        with contextlib.suppress(Exception):  # one being renamed into place: next poll
            payload = torch.load(path, map_location="cpu", weights_only=True)
            found.append((int(payload["step"]), int(payload["world_size"])))
    return found


def newest(ckpt_dir: Path) -> tuple[int, int]:
    """(step, world size) of the newest step checkpoint, (0, 0) before the first."""
    paths = sorted(ckpt_dir.glob("step_*.pt"))
    for path in reversed(paths):
        with contextlib.suppress(Exception):
            payload = torch.load(path, map_location="cpu", weights_only=True)
            return int(payload["step"]), int(payload["world_size"])
    return 0, 0


def wait_for(what: str, done: Callable[[], bool], agents: dict[str, subprocess.Popen[str]],
             logs: dict[str, Path], limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if done():
            return
        for name, proc in agents.items():
            assert proc.poll() is None, (
                f"agent {name} exited ({proc.returncode}) before {what}:\n"
                + logs[name].read_text()[-4000:]
            )
        time.sleep(0.1)
    tails = "\n".join(f"--- {n}\n{p.read_text()[-3000:]}" for n, p in logs.items())
    raise AssertionError(f"no {what} within {limit}s\n{tails}")


def world_sizes_logged(log: str) -> list[int]:
    """The world size of every plan rank 0 logged, in order (one per start of workers)."""
    return [int(n) for n in re.findall(r"^world size\s+(\d+)", log, flags=re.M)]


def squeeze(values: list[int]) -> list[int]:
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.heavy
def test_host_leaves_and_rejoins_elastic_job(tmp_path: Path) -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    out, pace, ckpt = tmp_path / "run", tmp_path / "pace", tmp_path / "run" / "checkpoints"
    out.mkdir()
    pair = TwoHosts()
    a, b = pair.hosts
    logs = {"A": tmp_path / "a.log", "B": tmp_path / "b1.log"}
    agents: dict[str, subprocess.Popen[str]] = {}
    started = time.monotonic()
    try:
        pair.create()
        set_pace(pace, 0.1)  # 0.1 s a micro-batch: 116 steps would take 12 s at 2 ranks
        agents["A"] = start_agent(pair, a, out, pace, logs["A"])
        agents["B"] = start_agent(pair, b, out, pace, logs["B"])

        # Both hosts train together.
        wait_for("checkpoint at step 4 on 2 ranks",
                 lambda: newest(ckpt)[0] >= 4 and newest(ckpt)[1] == 2, agents, logs)
        t_two = time.monotonic() - started

        # Host B leaves: its agent and worker die at once. Host A goes on alone, slowly
        # (0.4 s a step at 1 rank), so it cannot finish before B is back.
        set_pace(pace, 0.2)
        crash(b)
        agents.pop("B").wait(timeout=10)
        left_at = newest(ckpt)[0]
        wait_for("checkpoint on 1 rank",
                 lambda: newest(ckpt)[1] == 1 and newest(ckpt)[0] >= left_at + 2,
                 agents, logs)
        t_one = time.monotonic() - started

        # Host B comes back and joins; A's agent restarts its worker into a world of 2.
        logs["B"] = tmp_path / "b2.log"
        agents["B"] = start_agent(pair, b, out, pace, logs["B"])
        wait_for("checkpoint on 2 ranks after the rejoin",
                 lambda: newest(ckpt)[1] == 2 and newest(ckpt)[0] > left_at + 2,
                 agents, logs)
        t_back = time.monotonic() - started
        set_pace(pace, 0)  # the rest at full speed

        for name, proc in agents.items():
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"agent {name} still runs 60 s after the rejoin:\n"
                                     + logs[name].read_text()[-4000:]) from None
            assert rc == 0, f"agent {name} exited {rc}:\n{logs[name].read_text()[-4000:]}"
        t_end = time.monotonic() - started
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        pair.remove()
    print(f"2 ranks at {t_two:.1f}s, 1 rank at {t_one:.1f}s, 2 again at {t_back:.1f}s, "
          f"done at {t_end:.1f}s")

    # Every step checkpoint says which world wrote it: 2, then 1 (host A alone), then 2.
    written = checkpoints(ckpt)
    assert {*range(2, STEPS + 1, 2), STEPS} <= {s for s, _ in written}, written
    assert squeeze([w for _, w in written]) == [2, 1, 2], written
    assert sum(w == 1 for _, w in written) >= 2, written  # A trained on alone
    # Rank 0 (host A, the lower address) started three worker groups: 2, 1, then 2 ranks,
    # the second and third resuming from the newest checkpoint.
    log_a = logs["A"].read_text()
    assert world_sizes_logged(log_a) == [2, 1, 2], log_a[-6000:]
    assert len(re.findall(r"resumed from \S+/checkpoints/", log_a)) == 2, log_a[-6000:]

    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["epochs"], summary["steps"]) == (2, EPOCHS, STEPS)
    assert summary["samples"] == EPOCHS * 455, summary

    # The same run, uninterrupted, in one process: the same steps, metrics and weights.
    ref = tmp_path / "ref"
    done = subprocess.run(
        [sys.executable, "-m", "ddptrain", "train", *TRAIN,
         "--model_args", f"pace={tmp_path / 'no-pace'}", "--output_dir", str(ref)],
        cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got, want = rows(out), rows(ref)
    assert [(r["split"], r["epoch"], r["step"], r["samples"]) for r in got] == [
        (r["split"], r["epoch"], r["step"], r["samples"]) for r in want]
    for g, w in zip(got, want, strict=True):
        for field in ("loss", "accuracy", "lr"):
            if field in w:
                assert g[field] == pytest.approx(w[field], rel=1e-4, abs=1e-6), (g, w)
    elastic, single = load_file(str(out / "model.safetensors")), load_file(
        str(ref / "model.safetensors"))
    assert elastic.keys() == single.keys()
    for name in single:
        # 2 ranks add the two halves of a step's gradient in another order than 1 rank
        # accumulating them: equal to float32 rounding, not bitwise.
        torch.testing.assert_close(elastic[name], single[name], rtol=1e-5, atol=1e-6)
