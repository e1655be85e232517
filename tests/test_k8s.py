"""Kubernetes: the environments its operators give a pod, and the exit code its restart
policy retries.

Pure logic first (environments given as dicts; launch.sh's choices read from its errors),
then two network-namespace "pods" that carry only what an operator injects: PyTorchJob's
direct mode (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: `python -m ddptrain train` in
each pod) and Kubeflow's PET_* variables (`scripts/launch.sh` in each pod). Both train one
2-rank job to the weights of torchrun's 2 ranks on one host; a SIGTERM in a pod ends both
pods with exit 143 after a checkpoint, and the retried pods resume to the same weights.

What a namespace cannot give a pod: a host name that resolves to its own address. So the
pods also get GLOO_SOCKET_IFNAME (and LOCAL_ADDR for launch.sh's agent), which a real pod,
whose name resolves to its one interface, does not need.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_torchrun
from netns import Host, TwoHosts, two_hosts
from safetensors.torch import load_file
from test_elastic import newest, set_pace

from ddptrain.config import ConfigError, TrainingConfig
from ddptrain.launch.cluster import ClusterEnv, read_cluster_env
from ddptrain.train.stop import StopRequest, preempt_exit_code

LAUNCH = REPO / "scripts" / "launch.sh"
# What the training operator puts in pod `job-worker-0` (rank 1) of a PyTorchJob with one
# Master and one Worker replica, in direct mode (no torchrun in the container).
PYTORCHJOB = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0",
              "MASTER_PORT": "23456", "PYTHONUNBUFFERED": "0",
              "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
# Volcano's pytorch plugin, worker 2 of a job with one master and three workers (its env
# and svc plugins add VC_TASK_INDEX and the task host lists).
VOLCANO = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0.job",
           "MASTER_PORT": "23456", "VC_TASK_INDEX": "2", "VK_TASK_INDEX": "2",
           "VC_MASTER_HOSTS": "job-master-0.job", "VC_WORKER_NUM": "3"}


# --- pure logic -------------------------------------------------------------------------


def test_a_pytorchjob_pod_in_direct_mode_is_one_rank_alone_on_its_host() -> None:
    env = read_cluster_env(PYTORCHJOB)
    assert env == ClusterEnv(1, 0, 2, "direct", "job-master-0", 23456, local_world_size=1)


def test_volcanos_pytorch_plugin_is_read_and_named() -> None:
    env = read_cluster_env(VOLCANO)
    assert (env.rank, env.local_rank, env.world_size, env.source) == (3, 0, 4, "volcano")
    assert (env.master_addr, env.master_port, env.local_world_size) == (
        "job-master-0.job", 23456, 1)


def test_the_master_pod_of_one_replica_is_a_single_rank() -> None:
    env = read_cluster_env({"RANK": "0", "WORLD_SIZE": "1"})  # no address needed for one
    assert (env.rank, env.world_size, env.source) == (0, 1, "direct")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({**PYTORCHJOB, "RANK": "2"}, "RANK must be in 0..1 (one process per pod"),
        ({**PYTORCHJOB, "WORLD_SIZE": "two"}, "WORLD_SIZE='two', which is not a whole number"),
        ({k: v for k, v in PYTORCHJOB.items() if k != "MASTER_PORT"},
         "without LOCAL_RANK (one process per pod) but MASTER_PORT is not set"),
        ({**PYTORCHJOB, "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
        ({"WORLD_SIZE": "2"}, "but not RANK, LOCAL_RANK"),
        ({**PYTORCHJOB, "SLURM_STEP_NUM_TASKS": "4"}, "one of SLURM_STEP_NUM_TASKS=4 tasks"),
    ],
)
def test_a_wrong_pod_environment_is_one_line_with_the_fix(env: dict[str, str], needle: str
                                                          ) -> None:
    with pytest.raises(ConfigError) as err:
        read_cluster_env(env)
    assert needle in str(err.value), str(err.value)


def test_a_preemption_exits_143_on_kubernetes_and_75_elsewhere() -> None:
    assert preempt_exit_code(None, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) == 143
    assert preempt_exit_code(None, {}) == 75
    assert preempt_exit_code(99, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) == 99
    assert preempt_exit_code(99, {}) == 99


def test_the_stop_error_carries_the_chosen_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert StopRequest().error(7, saved=True).exit_code == 143
    assert StopRequest(12).error(7, saved=True).exit_code == 12
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert StopRequest().error(7, saved=True).exit_code == 75
    interrupted = StopRequest(12)
    interrupted.reason = "SIGINT"
    assert interrupted.error(7, saved=True).exit_code == 130  # Ctrl-C keeps its code


@pytest.mark.parametrize("code", [0, 256, -1])
def test_an_exit_code_outside_1_to_255_is_refused(code: int) -> None:
    with pytest.raises(ConfigError, match=f"--preempt_exit_code {code} is invalid"):
        TrainingConfig(preempt_exit_code=code).validate()


def _launch(env: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("PET_", "SLURM_")) and k not in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NNODES",
                "NODE_RANK", "NPROC_PER_NODE", "RDZV_ID", "MAX_RESTARTS", "JOIN_TIMEOUT")}
    return subprocess.run(["bash", str(LAUNCH), "--epochs", "1"], cwd=tmp, text=True,
                          capture_output=True, timeout=20,
                          env={**base, "PYTHON": sys.executable, **env})


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        # PET_NNODES=2 is a two-node job, not a private --standalone one on every pod.
        ({"PET_NNODES": "2", "PET_MASTER_ADDR": "10.0.0.1"}, "NNODES=2 needs NODE_RANK"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "0"}, "MASTER_ADDR=127.0.0.1, a loopback"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "10.0.0.1"},
         "NODE_RANK=2: use 0..1"),
        ({"PET_NNODES": "1:3", "PET_RDZV_ENDPOINT": "localhost:29400"},
         "RDZV_ENDPOINT=localhost"),
        ({"PET_NNODES": "3:1"}, "MIN:MAX with MIN <= MAX"),
        ({"PET_NPROC_PER_NODE": "x"}, "NPROC_PER_NODE=x is not a whole number"),
        ({"JOIN_TIMEOUT": "soon"}, "JOIN_TIMEOUT=soon is not a whole number"),
    ],
)
def test_launch_sh_reads_kubeflows_pet_variables(env: dict[str, str], needle: str,
                                                 tmp_path: Path) -> None:
    res = _launch(env, tmp_path)
    assert res.returncode == 2 and needle in res.stderr, res.stderr
    assert res.stderr.startswith("launch.sh: error:"), res.stderr


def logging_python(tmp: Path, then: str | None = None) -> Path:
    """An interpreter for launch.sh's PYTHON that writes its arguments (torchrun's, as
    launch.sh gives them) one a line into `<tmp>/argv-<pid>`, then runs `then` with them
    (nothing when None)."""
    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "python"
    run = f'exec "{then}" "$@"' if then else "exit 0"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp}/argv-$$"\n{run}\n')
    script.chmod(0o755)
    return script


def torchrun_argv(tmp: Path) -> list[list[str]]:
    return [f.read_text().splitlines() for f in sorted(tmp.glob("argv-*"))]


@pytest.mark.parametrize(("env", "endpoint"), [
    ({"PET_MASTER_PORT": "23456"}, "10.0.0.1:23456"),  # the operator's Service port
    ({}, "10.0.0.1:29500"),  # torchrun's default when the operator gives none
    ({"PET_MASTER_PORT": "23456", "MASTER_PORT": "24000"}, "10.0.0.1:24000"),  # set wins
])
def test_launch_sh_gives_torchrun_the_operators_rendezvous_port(
    env: dict[str, str], endpoint: str, tmp_path: Path
) -> None:
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "10.0.0.1", **env}
    res = _launch({**pet, "PYTHON": str(logging_python(tmp_path))}, tmp_path)
    assert res.returncode == 0, res.stderr
    [argv] = torchrun_argv(tmp_path)
    assert argv[:2] == ["-m", "ddptrain.launch.torchrun"], argv
    assert f"--rdzv_endpoint={endpoint}" in argv and "--nnodes=2" in argv, argv


@pytest.mark.parametrize(
    ("args", "env", "conf"),
    [
        (["--timeout_s", "20"], {}, "join_timeout=20,last_call_timeout=10,read_timeout=20"),
        (["--timeout_s=2.5"], {}, "join_timeout=3,last_call_timeout=3,read_timeout=3"),
        ([], {}, "join_timeout=40,last_call_timeout=10,read_timeout=40"),  # 600 s default
        (["--timeout_s", "20"], {"JOIN_TIMEOUT": "300"},
         "join_timeout=300,last_call_timeout=10,read_timeout=300"),
    ],
)
def test_rendezvous_waits_follow_the_runs_timeout(args: list[str], env: dict[str, str],
                                                  conf: str) -> None:
    script = f'source "{REPO}/scripts/rdzv.sh"; rdzv_timeouts "$@"; ' \
             'echo "$TORCH_DISABLE_SHARE_RDZV_TCP_STORE"'
    res = subprocess.run(["bash", "-c", script, "rdzv", *args], text=True,
                         capture_output=True, env={"PATH": os.environ["PATH"], **env})
    assert res.stdout.split() == [conf, "1"], res.stderr


# --- two pods on two network namespaces --------------------------------------------------

TRAIN = ["--dataset", "breast_cancer", "--model", "test_elastic:paced_mlp", "--epochs", "1",
         "--batch_size", "8", "--seed", "5", "--log_interval", "5", "--save_every_steps", "4",
         "--timeout_s", "60"]
STEPS = 29  # 455 training samples, 16 a step on 2 ranks


@pytest.fixture(scope="module")
def pods() -> Iterator[TwoHosts]:
    with two_hosts(f"{os.getpid()}k") as pair:
        yield pair


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """torchrun with 2 ranks on one host, the same training."""
    tmp = tmp_path_factory.mktemp("ref")
    res = run_torchrun(2, ["train", *TRAIN, "--model_args", f"pace={tmp / 'no-pace'}",
                           "--output_dir", str(tmp / "run")], tmp)
    assert res.returncode == 0, res.stderr[-4000:]
    return load_file(str(tmp / "run" / "model.safetensors"))


def pod_env(host: Host, injected: dict[str, str]) -> dict[str, str]:
    """A pod's environment: the machine's (PATH, PYTHONPATH), less every launcher variable,
    plus what the operator injects and what every pod has."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "NNODES", "NODE_RANK",
            "NPROC_PER_NODE", "RDZV_ID", "MAX_RESTARTS", "JOIN_TIMEOUT", "LOCAL_ADDR")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("SLURM_", "PET_"))}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO / "tests"), env.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1", "KUBERNETES_SERVICE_HOST": "10.96.0.1",
            "GLOO_SOCKET_IFNAME": host.iface, **injected}


def start_pods(pair: TwoHosts, mode: str, args: list[str], tmp: Path, tag: str
               ) -> list[subprocess.Popen[str]]:
    master = pair.hosts[0].addr
    procs = []
    for index, host in enumerate(pair.hosts):
        if mode == "direct":
            injected = {"RANK": str(index), "WORLD_SIZE": "2", "MASTER_ADDR": master,
                        "MASTER_PORT": "23456", "PYTHONUNBUFFERED": "0"}
            cmd = [sys.executable, "-m", "ddptrain", "train", *args]
        else:
            injected = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1",
                        "PET_NODE_RANK": str(index), "PET_MASTER_ADDR": master,
                        "PET_MASTER_PORT": "23456",
                        "PYTHON": str(logging_python(tmp / f"{tag}-pod{index}", sys.executable)),
                        "LOCAL_ADDR": host.addr}
            cmd = ["bash", str(LAUNCH), *args]
        with (tmp / f"{tag}-pod{index}.log").open("w") as log:
            procs.append(pair.popen(host, cmd, pod_env(host, injected), cwd=tmp,
                                    stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen[str]], tmp: Path, tag: str, timeout: float = 150
             ) -> list[int]:
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{tag}: a pod still runs:\n{logs(tmp, tag)}") from None
    return codes


def logs(tmp: Path, tag: str, tail: int = 3000) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-tail:]}"
                     for p in sorted(tmp.glob(f"{tag}-pod*.log")))


def assert_bitwise(run: Path, want: dict[str, torch.Tensor]) -> None:
    got = load_file(str(run / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["direct", "pet"])
def test_two_pods_train_one_job_like_torchrun_on_one_host(
    pods: TwoHosts, reference: dict[str, torch.Tensor], mode: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"  # the shared volume of both pods
    args = [*TRAIN, "--model_args", f"pace={tmp_path / 'no-pace'}", "--output_dir", str(run)]
    codes = wait_all(start_pods(pods, mode, args, tmp_path, mode), tmp_path, mode)
    assert codes == [0, 0], logs(tmp_path, mode)
    if mode == "pet":  # each pod's torchrun met at the operator's Service port, no other
        master = pods.hosts[0].addr
        for index in range(2):
            [argv] = torchrun_argv(tmp_path / f"pet-pod{index}")
            assert f"--rdzv_endpoint={master}:23456" in argv, argv
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    assert_bitwise(run, reference)


@pytest.mark.slow
@pytest.mark.heavy
def test_a_sigterm_in_a_pod_exits_143_after_a_checkpoint_and_the_retry_resumes_exactly(
    pods: TwoHosts, reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    run, pace = tmp_path / "run", tmp_path / "pace"
    args = [*TRAIN, "--model_args", f"pace={pace}", "--output_dir", str(run)]
    set_pace(pace, 0.05)  # 0.05 s a forward: no epoch ends before the signal
    procs = start_pods(pods, "direct", args, tmp_path, "first")
    deadline = time.monotonic() + 90
    while newest(run / "checkpoints")[0] < 8:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs(
            tmp_path, "first")
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)  # the kubelet stops the worker pod
    codes = wait_all(procs, tmp_path, "first", timeout=60)
    assert codes == [143, 143], logs(tmp_path, "first")
    stopped_at, _ = newest(run / "checkpoints")
    assert 8 <= stopped_at < STEPS
    assert f"stopped by SIGTERM at step {stopped_at} after a checkpoint" in logs(
        tmp_path, "first", tail=10**6)

    # The restart policy retries both pods with the manifest's command.
    set_pace(pace, 0)
    codes = wait_all(start_pods(pods, "direct", [*args, "--resume_from", "auto"], tmp_path,
                                "retry"), tmp_path, "retry")
    assert codes == [0, 0], logs(tmp_path, "retry")
    assert re.search(rf"resumed from \S+: epoch \d+ done, step {stopped_at}\b",
                     logs(tmp_path, "retry", tail=10**6)), logs(tmp_path, "retry")
    assert_bitwise(run, reference)
