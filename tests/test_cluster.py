"""Launcher detection from the environment alone (no processes, environment given as a dict)."""

from __future__ import annotations

import os

import pytest

from ddptrain.config import ConfigError
from ddptrain.launch.cluster import ClusterEnv, parse_nodelist, read_cluster_env

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500"}
# What srun puts in the environment of task 3 of a 4-task step over two nodes.
SRUN = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0",
        "SLURM_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]"}
# The batch script of the same job: no step, the job's first task.
BATCH = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
         "SLURM_NTASKS": "4", "SLURM_NODELIST": "gpu[07-08]"}


@pytest.fixture(autouse=True)
def _no_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    # Node lists are expanded by our parser here, whatever Slurm this machine has.
    monkeypatch.setattr("ddptrain.launch.cluster.shutil.which", lambda name: None)


def test_nothing_set_is_a_single_process() -> None:
    assert read_cluster_env({}) == ClusterEnv(0, 0, 1, "single")


def test_torchrun_identity() -> None:
    env = read_cluster_env(TORCHRUN)
    assert (env.rank, env.local_rank, env.world_size, env.source) == (3, 1, 4, "torchrun")
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)


def test_torchrun_inside_a_slurm_job_wins() -> None:
    # sbatch -> srun -> torchrun: the worker sees both; SLURM_* describe the torchrun agent.
    env = read_cluster_env({**SRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2",
                            **TORCHRUN, "TORCHELASTIC_RUN_ID": "4242"})
    assert (env.rank, env.world_size, env.source) == (3, 4, "torchrun")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RANK": "0"}, "you set RANK=0 but not LOCAL_RANK, WORLD_SIZE"),
        ({**TORCHRUN, "WORLD_SIZE": "four"}, "WORLD_SIZE='four', which is not a whole number"),
        ({**TORCHRUN, "RANK": "4"}, "RANK must be in 0..3"),
        ({**TORCHRUN, "LOCAL_RANK": "5"}, "LOCAL_RANK must be in 0..RANK"),
        ({**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0", "LOCAL_RANK": "0"}, "at least 1"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR is not set"),
    ],
)
def test_torchrun_misconfiguration_says_what_to_do(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        read_cluster_env(env)


def test_hand_set_world_size_in_an_srun_task_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        read_cluster_env({**SRUN, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "8",
                          "MASTER_ADDR": "gpu07", "MASTER_PORT": "29500"})
    message = str(err.value)
    assert "you set WORLD_SIZE=8" in message and "SLURM_STEP_NUM_TASKS=4" in message
    assert "unset RANK, LOCAL_RANK and WORLD_SIZE" in message


def test_srun_task_without_torchrun() -> None:
    env = read_cluster_env(SRUN)
    assert (env.rank, env.local_rank, env.world_size, env.source) == (3, 1, 4, "slurm")
    assert env.nodes == ("gpu07", "gpu08")
    assert env.master_addr == "gpu07"  # the first host of the step
    assert env.master_port == read_cluster_env({**SRUN, "SLURM_PROCID": "0"}).master_port


def test_srun_port_is_derived_from_the_job_id() -> None:
    ports = {read_cluster_env({**SRUN, "SLURM_JOB_ID": str(j)}).master_port for j in range(50)}
    assert len(ports) == 50
    assert all(1024 < p < 32768 for p in ports)  # below the ephemeral range


def test_srun_respects_an_explicit_master() -> None:
    env = read_cluster_env({**SRUN, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "23456"})
    assert (env.master_addr, env.master_port) == ("10.1.1.1", 23456)


def test_export_rendezvous_sets_only_what_is_missing() -> None:
    environ: dict[str, str] = {"MASTER_PORT": "1234"}
    read_cluster_env(SRUN).export_rendezvous(environ)
    assert environ == {"MASTER_ADDR": "gpu07", "MASTER_PORT": "1234"}
    single: dict[str, str] = {}
    read_cluster_env({}).export_rendezvous(single)
    assert single == {}


def test_reading_the_environment_does_not_write_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in SRUN.items():
        monkeypatch.setenv(key, value)
    assert read_cluster_env().world_size == 4
    assert "MASTER_ADDR" not in os.environ


def test_sbatch_with_one_task_is_a_single_process() -> None:
    env = read_cluster_env({**BATCH, "SLURM_NTASKS": "1", "SLURM_NODELIST": "gpu07"})
    assert (env.rank, env.world_size) == (0, 1)


def test_batch_script_of_a_multi_task_job_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        read_cluster_env(BATCH)
    message = str(err.value)
    # "you set X, the scheduler says Y, do Z"
    assert "SLURM_NTASKS=4" in message and "batch script" in message and "srun" in message


def test_inconsistent_slurm_variables_are_refused() -> None:
    with pytest.raises(ConfigError, match="SLURM_PROCID=7 but the step has"):
        read_cluster_env({**SRUN, "SLURM_PROCID": "7"})
    with pytest.raises(ConfigError, match="not a whole number"):
        read_cluster_env({**SRUN, "SLURM_LOCALID": "x"})


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ("node1",)),
        ("node[01-03,07],gpu5", ("node01", "node02", "node03", "node07", "gpu5")),
        ("a[8-10]-ib", ("a8-ib", "a9-ib", "a10-ib")),
        ("x1,y2", ("x1", "y2")),
    ],
)
def test_parse_nodelist(nodelist: str, hosts: tuple[str, ...]) -> None:
    assert parse_nodelist(nodelist) == hosts


def test_names_stay_importable_from_distributed() -> None:
    from ddptrain.launch import cluster
    from ddptrain.launch import process_group as distributed

    assert distributed.ClusterEnv is cluster.ClusterEnv
    assert distributed.read_cluster_env is cluster.read_cluster_env
