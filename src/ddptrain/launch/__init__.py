"""Launch: who this process is (`cluster`: torchrun, then Slurm, then a single process), the
process group's start and teardown (`process_group`), the run directory a job owns
(`rundir`) and `ddptrain doctor`. A new cluster kind is a new reader in `cluster`.

Exports load on first use, so `ddptrain --help` answers without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ClusterEnv", "RunLock", "read_cluster_env", "setup_distributed",
           "teardown_distributed"]

_EXPORTS = {
    "ClusterEnv": "cluster", "read_cluster_env": "cluster", "RunLock": "rundir",
    "setup_distributed": "process_group", "teardown_distributed": "process_group",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"ddptrain.launch.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'ddptrain.launch' has no attribute {name!r}")
