"""The Kubernetes manifests in scripts/k8s/ read by real parsers.

Pod and Job templates go through the `kubernetes` client's models (the API's own types)
and must come back out unchanged, so a misspelt or misplaced field, which the models
drop, fails here instead of being ignored by the cluster. The custom resources around
them (PyTorchJob, JobSet) are checked field by field for what a restart needs: the
command is scripts/launch.sh with `--resume_from auto`, the run directory is on the
shared volume, the grace period leaves time for a checkpoint, and exit 143 (preempted,
after a checkpoint) is retried while exit 2 (bad input) is not. The training flags go
through ddptrain's own parser.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO

from ddptrain.config_cli import parse_config
from ddptrain.errors import EXIT_DIVERGED, EXIT_PEER_LOST, EXIT_USAGE
from ddptrain.launch.rundir import resolve_layout

k8s = pytest.importorskip("kubernetes.client")

K8S = REPO / "scripts" / "k8s"
PREEMPTED_ON_K8S = 143  # 128 + SIGTERM: what a preempted pod exits with
# SIGTERM to exit: the next agreed step, then a checkpoint of a large model (tens of GB):
# well above Kubernetes' default of 30 s.
MIN_GRACE_S = 120
PVC = "ddptrain-runs"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _model(data: dict[str, Any], kind: str) -> Any:
    """`data` as the API type `kind`; it must serialize back to `data` itself."""
    api = k8s.ApiClient()
    model = api.deserialize(json.dumps(data), kind, "application/json")
    assert api.sanitize_for_serialization(model) == data, f"fields the {kind} model dropped"
    return model


def _retried_by_exit_code_policy(code: int) -> bool:
    """The training operator's `restartPolicy: ExitCode`: 128 and above (a signal) is
    retried, 1-127 is a permanent failure."""
    return code >= 128


def _check_pod(pod: Any, container: str, volumes_from: str = "pvc.yaml") -> list[str]:
    """What every pod of a ddptrain job needs; returns the training flags."""
    spec = pod.spec
    assert spec.termination_grace_period_seconds >= MIN_GRACE_S
    (main,) = [c for c in spec.containers if c.name == container]
    assert main.command[0].endswith("scripts/launch.sh")
    args = list(main.args)
    assert args[args.index("--resume_from") + 1] == "auto"
    run_dir = Path(args[args.index("--output_dir") + 1])
    claims = {v.name: v.persistent_volume_claim.claim_name for v in spec.volumes
              if v.persistent_volume_claim is not None}
    mounted = [m for m in main.volume_mounts if claims.get(m.name) == PVC]
    assert any(run_dir.is_relative_to(m.mount_path) for m in mounted), (run_dir, mounted)
    parse_config(args)  # ddptrain's own flags, valid values
    return args


def test_the_volume_is_shared_by_pods_on_several_nodes() -> None:
    (pvc,) = _docs("pvc.yaml")
    claim = _model(pvc, "V1PersistentVolumeClaim")
    assert claim.metadata.name == PVC
    assert claim.spec.access_modes == ["ReadWriteMany"]


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "pytorchjob-elastic.yaml"])
def test_pytorchjob_pods_restart_on_preemption_and_resume(name: str) -> None:
    (job,) = _docs(name)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) <= {"Master", "Worker"}
    for replica in replicas.values():
        assert replica["restartPolicy"] == "ExitCode"
        # the operator's variables go into the container named "pytorch"
        _check_pod(_model(replica["template"], "V1PodTemplateSpec"), "pytorch")
    assert _retried_by_exit_code_policy(PREEMPTED_ON_K8S)
    assert not _retried_by_exit_code_policy(EXIT_USAGE)
    assert not _retried_by_exit_code_policy(EXIT_DIVERGED)


def test_the_elastic_pytorchjob_trains_the_same_steps_at_every_size() -> None:
    (job,) = _docs("pytorchjob-elastic.yaml")
    spec = job["spec"]
    elastic = spec["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d"
    assert elastic["maxRestarts"] >= 1  # membership changes restart the worker group
    low, high = elastic["minReplicas"], elastic["maxReplicas"]
    assert low <= spec["pytorchReplicaSpecs"]["Worker"]["replicas"] <= high
    assert "Master" not in spec["pytorchReplicaSpecs"]  # elastic jobs are all workers
    pod = _model(spec["pytorchReplicaSpecs"]["Worker"]["template"], "V1PodTemplateSpec")
    config = parse_config(_check_pod(pod, "pytorch"))
    assert config.global_batch_size is not None
    for pods in range(low, high + 1):  # --global_batch_size divides at every size
        resolve_layout(config, pods * int(spec["nprocPerNode"]))
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_jobset_pods_get_the_pet_variables_and_restart_on_preemption() -> None:
    (jobset,) = _docs("jobset.yaml")
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    name = jobset["metadata"]["name"]
    (rjob,) = jobset["spec"]["replicatedJobs"]
    job = _model(rjob["template"], "V1JobTemplateSpec").spec
    pod = job.template.spec
    assert pod.restart_policy == "Never"  # a podFailurePolicy needs it
    _check_pod(job.template, "trainer")
    (container,) = pod.containers
    env = {e.name: e for e in container.env}
    nodes = rjob["replicas"] * job.parallelism
    assert job.completion_mode == "Indexed" and job.completions == job.parallelism
    assert env["PET_NNODES"].value == str(nodes)
    assert env["PET_NODE_RANK"].value_from.field_ref.field_path == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    # pod 0 of job 0, by its host name on the JobSet's headless service
    assert env["PET_MASTER_ADDR"].value == f"{name}-{rjob['name']}-0-0.{name}"
    assert int(env["PET_MASTER_PORT"].value) > 0
    assert int(env["PET_NPROC_PER_NODE"].value) >= 1

    # Any failed pod fails its Job at once, and the JobSet restarts every pod (they
    # resume) - unless the podFailurePolicy failed the Job, which ends the JobSet.
    assert job.backoff_limit == 0
    final = {
        code for rule in job.pod_failure_policy.rules if rule.action == "FailJob"
        for code in rule.on_exit_codes.values
        if rule.on_exit_codes.operator == "In"
        and rule.on_exit_codes.container_name in (None, container.name)
    }
    assert {EXIT_USAGE, EXIT_DIVERGED} <= final
    assert PREEMPTED_ON_K8S not in final and EXIT_PEER_LOST not in final
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] >= 1
    (rule,) = policy["rules"]
    assert rule["action"] == "FailJobSet" and rule["onJobFailureReasons"] == ["PodFailurePolicy"]
