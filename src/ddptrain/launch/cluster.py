"""Who this process is in the job: torchrun, then a pod started directly by a Kubernetes
operator, then Slurm's srun, then a plain single process.

    torchrun --standalone --nproc_per_node=2 -m ddptrain train     # torchrun sets RANK, ...
    srun --ntasks=4 python -m ddptrain train                       # Slurm sets SLURM_PROCID, ...
    ddptrain train                                                 # none: world size 1

Direct mode: the Kubeflow training operator's PyTorchJob (a pod per rank, the container runs
`python -m ddptrain train` itself) and Volcano's pytorch plugin give every pod RANK (its index,
0 on the master), WORLD_SIZE (the pods), MASTER_ADDR and MASTER_PORT, but no LOCAL_RANK: one
process per pod, local rank 0, alone on its host.

Inside a Slurm batch script that starts torchrun, both sets of variables are present; torchrun's
describe the worker (SLURM_* describe the torchrun agent), so they win. A task that srun
started without torchrun gets its rank from SLURM_PROCID and its rendezvous address from the
first host of the step's node list; `export_rendezvous` writes MASTER_ADDR and MASTER_PORT
for `init_process_group`'s env:// method, and is called where the process group starts,
never while merely reading the environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from ddptrain.config import ConfigError

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
# Set in Volcano's pods by its env and svc plugins (the pytorch plugin turns svc on).
_VOLCANO_MARKERS = ("VC_TASK_INDEX", "VK_TASK_INDEX")
# Ports derived from the job id stay in this window: above the well-known and common
# service ports, below Linux's default ephemeral range (32768+), where an outgoing
# connection could already hold the port.
_PORT_BASE, _PORT_SPAN = 15000, 15000


@dataclass(frozen=True)
class ClusterEnv:
    """Who this process is, as told by the launcher."""

    rank: int
    local_rank: int
    world_size: int
    source: str  # "torchrun", "direct" (a pod per rank), "volcano", "slurm" or "single"
    master_addr: str | None = None  # where rank 0's store listens (None: world size 1)
    master_port: int | None = None
    nodes: tuple[str, ...] = ()  # Slurm: the step's hosts, as far as they are known
    local_world_size: int = 1  # ranks on this host (they share its memory)

    def export_rendezvous(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Set MASTER_ADDR / MASTER_PORT for env:// when this launcher did not (srun)."""
        environ = os.environ if environ is None else environ
        if self.world_size > 1 and self.master_addr is not None and self.master_port is not None:
            environ.setdefault("MASTER_ADDR", self.master_addr)
            environ.setdefault("MASTER_PORT", str(self.master_port))


def _int_env(env: Mapping[str, str], name: str, fix: str) -> int:
    raw = env[name]
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"you set {name}={raw!r}, which is not a whole number: {fix}") from None


def _port_env(env: Mapping[str, str], name: str = "MASTER_PORT") -> int:
    port = _int_env(env, name, "give a TCP port number")
    if not 1 <= port <= 65535:
        raise ConfigError(f"you set {name}={port}, which is not a TCP port: give one in "
                          "1..65535 (torchrun --standalone picks a free one)")
    return port


def read_cluster_env(env: Mapping[str, str] | None = None) -> ClusterEnv:
    """Detect the launcher from the environment; refuse half-set or inconsistent identities."""
    env = os.environ if env is None else env
    if any(v in env for v in _TORCHRUN_VARS):
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_JOB_ID" in env:
        return _from_slurm(env)
    return ClusterEnv(rank=0, local_rank=0, world_size=1, source="single")


def _from_torchrun(env: Mapping[str, str]) -> ClusterEnv:
    present = [v for v in _TORCHRUN_VARS if v in env]
    missing = [v for v in _TORCHRUN_VARS if v not in env]
    if missing == ["LOCAL_RANK"]:
        return _direct(env)
    if missing:
        have = ", ".join(f"{v}={env[v]}" for v in present)
        raise ConfigError(
            f"you set {have} but not {', '.join(missing)}: launch with torchrun, "
            "or set all of RANK, LOCAL_RANK and WORLD_SIZE (or none for one process)"
        )
    fix = "unset it or launch with torchrun"
    rank, local_rank, world_size = (_int_env(env, v, fix) for v in _TORCHRUN_VARS)
    if world_size < 1:
        raise ConfigError(f"you set WORLD_SIZE={world_size}: it must be at least 1")
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"you set RANK={rank} with WORLD_SIZE={world_size}: RANK must be in 0..{world_size - 1}"
        )
    if local_rank < 0 or local_rank > rank:
        raise ConfigError(
            f"you set LOCAL_RANK={local_rank} with RANK={rank}: LOCAL_RANK must be in 0..RANK"
        )
    step_tasks = env.get("SLURM_STEP_NUM_TASKS")
    if "TORCHELASTIC_RUN_ID" not in env and step_tasks and step_tasks != str(world_size):
        # RANK/WORLD_SIZE exported by hand (or inherited) in a task that srun started:
        # every task would claim the same identity, and the group would never form.
        raise ConfigError(
            f"you set WORLD_SIZE={world_size}, but Slurm started this process as one of "
            f"SLURM_STEP_NUM_TASKS={step_tasks} tasks: unset RANK, LOCAL_RANK and WORLD_SIZE "
            "(each srun task then takes its rank from Slurm), or start the ranks with torchrun"
        )
    if world_size > 1:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in env:
                raise ConfigError(
                    f"WORLD_SIZE={world_size} but {var} is not set: launch with torchrun, "
                    "which sets it, or export MASTER_ADDR and MASTER_PORT"
                )
    port = _port_env(env) if world_size > 1 else None
    # torchrun says how many ranks share this host; set by hand, assume all of them
    local = _int_env(env, "LOCAL_WORLD_SIZE", fix) if "LOCAL_WORLD_SIZE" in env else world_size
    return ClusterEnv(
        rank, local_rank, world_size, "torchrun", env.get("MASTER_ADDR"), port,
        local_world_size=max(1, local),
    )


def _direct(env: Mapping[str, str]) -> ClusterEnv:
    """RANK and WORLD_SIZE without LOCAL_RANK: a pod (or host) per rank, as PyTorchJob's
    direct mode and Volcano's pytorch plugin start them."""
    fix = "it names this pod's rank among WORLD_SIZE pods; do not set it by hand"
    world_size = _int_env(env, "WORLD_SIZE", fix)
    rank = _int_env(env, "RANK", fix)
    if world_size < 1:
        raise ConfigError(f"you set WORLD_SIZE={world_size}: it must be at least 1")
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"you set RANK={rank} with WORLD_SIZE={world_size}: RANK must be in "
            f"0..{world_size - 1} (one process per pod, the pods numbered from 0)"
        )
    step_tasks = env.get("SLURM_STEP_NUM_TASKS")
    if step_tasks and step_tasks != str(world_size):
        raise ConfigError(
            f"you set WORLD_SIZE={world_size}, but Slurm started this process as one of "
            f"SLURM_STEP_NUM_TASKS={step_tasks} tasks: unset RANK and WORLD_SIZE "
            "(each srun task then takes its rank from Slurm), or start the ranks with torchrun"
        )
    port = None
    if world_size > 1:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in env:
                raise ConfigError(
                    f"RANK={rank} and WORLD_SIZE={world_size} without LOCAL_RANK (one process "
                    f"per pod) but {var} is not set: export MASTER_ADDR and MASTER_PORT (rank "
                    "0's pod address and a free port), or launch with torchrun"
                )
        port = _port_env(env)
    source = "volcano" if any(v in env for v in _VOLCANO_MARKERS) else "direct"
    return ClusterEnv(rank, 0, world_size, source, env.get("MASTER_ADDR"), port)


def _from_slurm(env: Mapping[str, str]) -> ClusterEnv:
    fix = "it comes from Slurm; do not set it by hand"
    # In a step that srun started, the step's task count is the world; SLURM_NTASKS
    # alone would be the job's (they differ when one job runs several steps).
    count_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world_size = _int_env(env, count_var, fix) if count_var in env else 1
    rank = _int_env(env, "SLURM_PROCID", fix)
    local_rank = _int_env(env, "SLURM_LOCALID", fix) if "SLURM_LOCALID" in env else 0
    if world_size <= 1:
        # `sbatch` running `ddptrain train` in its one task: a plain single process.
        return ClusterEnv(0, 0, 1, "slurm")
    if "SLURM_STEP_ID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        # The batch script itself is one process, whatever --ntasks asked for: starting
        # a rank here would wait forever for peers nobody starts.
        raise ConfigError(
            f"you asked for {count_var}={world_size} tasks, but Slurm started this process "
            "as the batch script, not as a task of a step: run it with "
            "`srun python -m ddptrain train ...` (one task per rank), or under torchrun "
            "(scripts/slurm/train.sbatch)"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"SLURM_PROCID={rank} but the step has {count_var}={world_size} tasks: "
            "the scheduler's variables are inconsistent; do not set SLURM_* by hand"
        )
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or ""
    nodes = expand_nodelist(nodelist) if nodelist else ()
    master_addr = env.get("MASTER_ADDR") or (nodes[0] if nodes else None)
    if master_addr is None:
        raise ConfigError(
            f"Slurm says {count_var}={world_size} but gives no node list "
            "(SLURM_STEP_NODELIST / SLURM_NODELIST): export MASTER_ADDR=<first node's address>"
        )
    if "MASTER_PORT" in env:
        port = _port_env(env)
    else:
        # Every task computes the same port from the job id, with no communication.
        job = _int_env(env, "SLURM_JOB_ID", fix)
        port = _PORT_BASE + job % _PORT_SPAN
    # "2(x3),1": tasks per node, the first count is as close as a host's share gets
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    local = re.match(r"\d+", per_node)
    return ClusterEnv(
        rank, local_rank, world_size, "slurm", master_addr, port, nodes,
        local_world_size=max(1, int(local.group())) if local else 1,
    )


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """Host names of a Slurm node list: `scontrol show hostnames` when it answers, else
    our own parser of the same syntax (`node[01-03,07],gpu5`)."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            out = []
        if out:
            return tuple(out)
    return parse_nodelist(nodelist)


_GROUP = re.compile(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*)")


def parse_nodelist(nodelist: str) -> tuple[str, ...]:
    """Expand `prefix[01-03,7]suffix,other` without Slurm (one bracket per name)."""
    hosts: list[str] = []
    pos = 0
    while pos < len(nodelist):
        match = _GROUP.match(nodelist, pos)
        assert match is not None  # the pattern matches the empty string
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            if prefix + suffix:
                hosts.append(prefix + suffix)
        else:
            for part in ranges.split(","):
                lo, _, hi = part.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise ConfigError(f"cannot read the Slurm node list {nodelist!r}")
                width = len(lo)
                for n in range(int(lo), int(hi or lo) + 1):
                    hosts.append(f"{prefix}{n:0{width}d}{suffix}")
        pos = match.end() + 1  # skip the comma
    return tuple(hosts)
