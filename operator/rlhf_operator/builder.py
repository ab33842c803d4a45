"""Pure builders: an RLHFJob in, the Kubernetes objects the operator applies out.

No I/O and no clocks, so the same job always gives byte-identical manifests and server-side
apply of an unchanged job changes nothing. Placement follows design decision 3: the head stays on
CPU; each role is one worker group on its own pool, advertising a Ray custom resource that names
the role so the trainer can pin its actors there.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import yaml

from rlhf_operator import queueing
from rlhf_operator.names import (
    DASHBOARD_PORT,
    LABEL_JOB,
    LABEL_ROLE,
    OPERATOR_POD_LABELS,
    config_map_name,
    disruption_budget_name,
    head_api_policy_name,
    heartbeat_lease_name,
    heartbeat_role_name,
    job_labels,
    network_policy_name,
    ray_auth_secret_name,
    ray_cluster_name,
    trainer_service_account,
)
from rlhf_operator.network import DNS_PODS, NetworkSettings
from rlhf_operator.queueing import PodSetPlacement
from rlhfjob import api
from rlhfjob.api import (
    ElasticRoleSpec,
    PodDefaults,
    PodOverrides,
    RLHFJob,
    RoleSpec,
    Toleration,
)
from rlhfjob.contract import PodEnv
from rlhfjob.contract import kuberay as ray
from rlhfjob.contract.env import TRAINER_METRICS_PORT, TRAINER_METRICS_PORT_NAME
from rlhfjob.contract.kuberay import RAY_API_VERSION, RAY_CLUSTER_KIND

JOB_CONFIG_DIR = api.JOB_CONFIG_DIR
JOB_CONFIG_FILE = "job.yaml"
SHM_PATH = api.SHM_PATH
WRITABLE_PATHS = api.WRITABLE_PATHS
GPU_RESOURCE = api.GPU_RESOURCE
RAY_AUTH_TOKEN_KEY = "auth_token"
"""The key KubeRay reads the token from in `authOptions.secretName`."""

RAY_PORTS = [
    {"name": "gcs-server", "containerPort": 6379},
    {"name": "dashboard", "containerPort": DASHBOARD_PORT},
    {"name": "client", "containerPort": 10001},
    {"name": "metrics", "containerPort": 8080},
    {"name": TRAINER_METRICS_PORT_NAME, "containerPort": TRAINER_METRICS_PORT},
]
"""The head's ports: Ray's (`metrics` is Ray's own exporter, on every Ray pod) and the
trainer driver's metrics, which runs on the head."""
METRICS_PORTS = (8080, TRAINER_METRICS_PORT)
"""Ray's exporter (every Ray pod) and the trainer's (the head): what Prometheus scrapes."""
SCRAPE_ANNOTATIONS = {
    "prometheus.io/scrape": "true",
    "prometheus.io/port": str(TRAINER_METRICS_PORT),
    "prometheus.io/path": "/metrics",
}
"""On the head, for a Prometheus that finds targets by annotation (no Prometheus Operator)."""


def owner_reference(job: RLHFJob) -> dict[str, Any]:
    """Ties owned objects to the job so Kubernetes garbage-collects them with it."""
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": job.metadata.name,
        "uid": job.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(job: RLHFJob, name: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": job_labels(job),
    }
    if job.metadata.uid:  # a job read from a file (`rlhfjob render`) owns nothing yet
        metadata["ownerReferences"] = [owner_reference(job)]
    return metadata


def build_config_map(job: RLHFJob) -> dict[str, Any]:
    """The job config the trainer reads: the RLHFJob itself, so both sides share one format."""
    document = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": job.metadata.name, "namespace": job.metadata.namespace},
        "spec": job.spec.wire(),
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, config_map_name(job)),
        "data": {JOB_CONFIG_FILE: yaml.safe_dump(document, sort_keys=True)},
    }


def _resources(cpu: int | str, memory: int | str, gpus: int, pod: PodOverrides) -> dict[str, Any]:
    amounts: dict[str, Any] = {"cpu": str(cpu), "memory": str(memory)}
    if gpus:
        amounts[GPU_RESOURCE] = str(gpus)
    amounts.update((name, str(amount)) for name, amount in sorted(pod.extra_resources.items()))
    # Requests equal limits: training pods are Guaranteed QoS and are not evicted first (and
    # extended resources such as rdma/ib must be requested as they are limited).
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _tolerations(tolerations: list[Toleration]) -> list[dict[str, Any]]:
    return [toleration.wire() for toleration in tolerations]


def _volumes(job: RLHFJob, pod: PodOverrides) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The operator's volumes and mounts, then the job's own (the API keeps them apart)."""
    shm: dict[str, Any] = {"medium": "Memory"}
    if pod.shm_size is not None:
        shm["sizeLimit"] = str(pod.shm_size)
    volumes: list[dict[str, Any]] = [
        {"name": api.SHM_VOLUME, "emptyDir": shm},
        *({"name": name, "emptyDir": {}} for name in WRITABLE_PATHS),
        {"name": api.JOB_CONFIG_VOLUME, "configMap": {"name": config_map_name(job)}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": api.SHM_VOLUME, "mountPath": SHM_PATH},
        *({"name": name, "mountPath": path} for name, path in WRITABLE_PATHS.items()),
        {"name": api.JOB_CONFIG_VOLUME, "mountPath": JOB_CONFIG_DIR, "readOnly": True},
    ]
    # Without a volume the root filesystem, read-only, could not hold checkpoints: an emptyDir
    # does, for the pod's lifetime (a smoke test's; real jobs name a shared volume).
    source = job.spec.checkpoint.volume or {"emptyDir": {}}
    volumes.append({"name": api.CHECKPOINT_VOLUME, **source})
    mounts.append({"name": api.CHECKPOINT_VOLUME, "mountPath": job.spec.checkpoint.path})
    volumes += [volume.wire() for volume in pod.volumes]
    mounts += [mount.wire() for mount in pod.volume_mounts]
    return volumes, mounts


# Pod Security "restricted": non-root, no privilege escalation, no capabilities, the runtime's
# seccomp profile; and a read-only root filesystem (Ray writes only under /tmp and the cache).
_CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
_POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 100,
    "fsGroup": 100,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _pod_env(job: RLHFJob, role: str, pod: PodOverrides) -> list[dict[str, Any]]:
    """The contract's variables, then the job's own: references stay references (the kubelet
    resolves them; the operator never reads a Secret)."""
    env = PodEnv(
        job_name=job.metadata.name,
        job_namespace=job.metadata.namespace,
        role=role,
        job_config=f"{JOB_CONFIG_DIR}/{JOB_CONFIG_FILE}",
        metrics_port=TRAINER_METRICS_PORT if role == "head" else None,
    )
    contract = [{"name": name, "value": value} for name, value in env.to_env().items()]
    credentials = (
        _object_store_credentials(job) + _tracking_credentials(job) if role == "head" else []
    )
    return contract + credentials + [var.wire() for var in pod.env]


def _object_store_credentials(job: RLHFJob) -> list[dict[str, Any]]:
    """The checkpoint bucket's keys, by reference, for the driver (it runs on the head)."""
    store = job.spec.checkpoint.object_store
    if store is None or store.credentials_secret is None:
        return []
    names = (api.ENV_OBJECT_STORE_ACCESS_KEY_ID, api.ENV_OBJECT_STORE_SECRET_ACCESS_KEY)
    return [
        {
            "name": name,
            "valueFrom": {"secretKeyRef": {"name": store.credentials_secret, "key": key}},
        }
        for name, key in zip(names, api.OBJECT_STORE_SECRET_KEYS, strict=True)
    ]


def _tracking_credentials(job: RLHFJob) -> list[dict[str, Any]]:
    """The experiment trackers' keys, by reference and each optional (MLflow takes a user and
    password or a token), for the driver on the head."""
    tracking = job.spec.tracking
    refs: list[tuple[str, str]] = []
    if tracking.mlflow is not None and tracking.mlflow.credentials_secret is not None:
        refs += [(tracking.mlflow.credentials_secret, key) for key in api.MLFLOW_SECRET_KEYS]
    if tracking.wandb is not None and tracking.wandb.api_key_secret is not None:
        refs.append((tracking.wandb.api_key_secret, api.WANDB_SECRET_KEY))
    return [
        {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}},
        }
        for secret, key in refs
    ]


def _whole_job(pods: PodDefaults | None) -> dict[str, Any]:
    """What only the whole job chooses, alike in every pod: priority, scheduler, pull secrets."""
    if pods is None:
        return {}
    chosen: dict[str, Any] = {}
    if pods.priority_class_name:
        chosen["priorityClassName"] = pods.priority_class_name
    if pods.scheduler_name:
        chosen["schedulerName"] = pods.scheduler_name
    if pods.image_pull_secrets:
        chosen["imagePullSecrets"] = [secret.wire() for secret in pods.image_pull_secrets]
    return chosen


def _pod_template(
    job: RLHFJob,
    *,
    role: str,
    container_name: str,
    spec: RoleSpec | api.HeadSpec,
    ports: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One group's pod: the role's placement and resources, the operator's volumes and
    environment, and what the job adds (`spec.pods` with the group's own `pod` over it)."""
    pod = job.spec.pod_overrides(role)
    volumes, mounts = _volumes(job, pod)
    gpus = spec.gpus if isinstance(spec, RoleSpec) else 0
    container: dict[str, Any] = {
        "name": container_name,
        "image": job.spec.image,
        "imagePullPolicy": job.spec.image_pull_policy,
        "resources": _resources(spec.cpu, spec.memory, gpus, pod),
        "env": _pod_env(job, role, pod),
    }
    if pod.env_from:
        container["envFrom"] = [source.wire() for source in pod.env_from]
    container["volumeMounts"] = mounts
    container["securityContext"] = copy.deepcopy(_CONTAINER_SECURITY)
    if ports:
        container["ports"] = ports
    pod_spec: dict[str, Any] = {
        "serviceAccountName": trainer_service_account(job),
        # Only the head's driver talks to the API server (it renews the heartbeat Lease).
        "automountServiceAccountToken": role == "head",
        "securityContext": copy.deepcopy(_POD_SECURITY),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(sorted(spec.node_selector.items()))
    if spec.tolerations:
        pod_spec["tolerations"] = _tolerations(spec.tolerations)
    if isinstance(spec, RoleSpec) and spec.affinity:
        pod_spec["affinity"] = spec.affinity
    pod_spec.update(_whole_job(job.spec.pods))
    metadata: dict[str, Any] = {
        # The operator's labels last: they select the job's pods (NetworkPolicy, the operator).
        "labels": {**dict(sorted(pod.labels.items())), **job_labels(job), LABEL_ROLE: role}
    }
    # The job's own annotations over the scrape annotations: a job may opt out of them.
    annotations = {**(SCRAPE_ANNOTATIONS if role == "head" else {}), **pod.annotations}
    if annotations:
        metadata["annotations"] = dict(sorted(annotations.items()))
    return {"metadata": metadata, "spec": pod_spec}


def _worker_group(job: RLHFJob, role: str, spec: RoleSpec) -> dict[str, Any]:
    advertised = {api.ray_resource(role): api.actor_slots(spec)}
    return {
        "groupName": role,
        "replicas": spec.replicas,
        "minReplicas": (
            spec.effective_min_replicas if isinstance(spec, ElasticRoleSpec) else spec.replicas
        ),
        "maxReplicas": spec.replicas,
        # KubeRay's format: the value is itself a quoted JSON string.
        "rayStartParams": {"resources": json.dumps(json.dumps(advertised))},
        "template": _pod_template(job, role=role, container_name="ray-worker", spec=spec),
    }


def build_ray_cluster(
    job: RLHFJob,
    placement: dict[str, PodSetPlacement] | None = None,
    ray_token: str | None = None,
) -> dict[str, Any]:
    """The `ray.io/v1` RayCluster for a job: a CPU head plus one worker group per enabled role.

    `placement` is what Kueue's admission adds to each group's pods (its flavors' node labels
    and tolerations), for a queued job; `ray_token` names the auth Secret (None: its stem).
    """
    cluster: dict[str, Any] = {
        "apiVersion": RAY_API_VERSION,
        "kind": RAY_CLUSTER_KIND,
        "metadata": _metadata(job, ray_cluster_name(job)),
        "spec": {
            "rayVersion": job.spec.ray_version,
            "enableInTreeAutoscaling": False,
            # KubeRay puts the token of this Secret in every Ray container's environment.
            "authOptions": {"mode": "token", "secretName": ray_auth_secret_name(job, ray_token)},
            "headGroupSpec": {
                "serviceType": "ClusterIP",
                # num-cpus 0: the head runs only the driver; actors go to their role's pool.
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
                "template": _pod_template(
                    job, role="head", container_name="ray-head", spec=job.spec.head, ports=RAY_PORTS
                ),
            },
            "workerGroupSpecs": [
                _worker_group(job, role, spec) for role, spec in job.spec.roles.enabled().items()
            ],
        },
    }
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for group in groups:
        added = (placement or {}).get(group.get("groupName", "head"))
        if added:
            _place(group["template"]["spec"], added)
    return cluster


def _place(pod_spec: dict[str, Any], added: PodSetPlacement) -> None:
    """Merge an admission's placement into a pod: the flavor's node labels join the pool's
    selector, its tolerations join the pool's."""
    if selector := added.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(
            sorted({**pod_spec.get("nodeSelector", {}), **selector}.items())
        )
    tolerations = pod_spec.get("tolerations", [])
    extra = [t for t in added.get("tolerations", []) if t not in tolerations]
    if extra:
        pod_spec["tolerations"] = [*tolerations, *extra]


def build_workload(job: RLHFJob, priority: int | None) -> dict[str, Any]:
    """The Kueue Workload of a queued job (`queueing.build_workload`): its pod sets are the
    groups of the RayCluster it is admitted for."""
    return queueing.build_workload(
        job, build_ray_cluster(job), owner_reference(job), job_labels(job), priority
    )


def build_ray_auth_secret(job: RLHFJob, token: str) -> dict[str, Any]:
    """The job's Ray token (`ray_auth.RayAuth` derives it), for `authOptions.secretName`."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(job, ray_auth_secret_name(job, token)),
        "type": "Opaque",
        "data": {RAY_AUTH_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_network_policies(job: RLHFJob, network: NetworkSettings) -> list[dict[str, Any]]:
    """Who may reach the job's Ray pods and where they may connect (`network`).

    In: each other; the operator's pods, to the head's dashboard; Prometheus's namespaces, to
    the metrics ports. Out: each other, the cluster DNS, the installation's approved entries
    that the spec's destinations match (bucket endpoint, remote reward servers, trackers) and
    its extra destinations (`network`). A second policy lets the head alone reach the API
    server (its heartbeat Lease); no address block admits link-local or metadata addresses."""
    own_pods = {"podSelector": {"matchLabels": {LABEL_JOB: job.metadata.name}}}
    operator: dict[str, Any] = {"podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}
    operator["namespaceSelector"] = _namespace(network.operator_namespace)
    ingress: list[dict[str, Any]] = [
        {"from": [copy.deepcopy(own_pods)]},
        {"from": [operator], "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]},
    ]
    if network.prometheus_namespaces:
        ingress.append(
            {
                "from": [
                    {"namespaceSelector": _namespace(name)}
                    for name in network.prometheus_namespaces
                ],
                "ports": [{"protocol": "TCP", "port": port} for port in METRICS_PORTS],
            }
        )
    dns = {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(DNS_PODS)}}
    egress: list[dict[str, Any]] = [
        {"to": [copy.deepcopy(own_pods)]},
        {"to": [dns], "ports": [{"protocol": p, "port": 53} for p in ("UDP", "TCP")]},
    ]
    egress += [rule for rule in network.egress_rules(job) if rule not in egress]
    head = {LABEL_JOB: job.metadata.name, ray.LABEL_NODE_TYPE: ray.NODE_HEAD}
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(job, network_policy_name(job)),
            "spec": {
                **own_pods,
                "policyTypes": ["Ingress", "Egress"],
                "ingress": ingress,
                "egress": egress,
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(job, head_api_policy_name(job)),
            "spec": {
                "podSelector": {"matchLabels": head},
                "policyTypes": ["Egress"],
                "egress": network.api_server_rules(),
            },
        },
    ]


def _namespace(name: str | None) -> dict[str, Any]:
    """A namespace selector for `name` (None: every namespace)."""
    return {"matchLabels": {"kubernetes.io/metadata.name": name}} if name else {}


DRAIN_GUARDED_ROLES = ("head", "trainer")
"""The pods whose loss loses the training run's state: the head (the driver and Ray's GCS) and
the trainer ranks. A node drain waits for them (`build_disruption_budget`)."""


def build_disruption_budget(job: RLHFJob) -> dict[str, Any]:
    """No voluntary eviction of the head or a trainer pod (a node drain, an autoscaler's
    scale-down): the drain waits, the operator sees their node cordoned, has the trainer
    checkpoint its step, and moves the job off the node (its pods are deleted then, which a
    budget allows). Rollout and reward pods may go: the job degrades instead."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(job, disruption_budget_name(job)),
        "spec": {
            "maxUnavailable": 0,
            "selector": {
                "matchLabels": {LABEL_JOB: job.metadata.name},
                "matchExpressions": [
                    {"key": LABEL_ROLE, "operator": "In", "values": list(DRAIN_GUARDED_ROLES)}
                ],
            },
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Writes repeated objects out in full: `kubectl apply` and humans read no anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(*manifests: dict[str, Any]) -> str:
    """Manifests as one multi-document YAML string, key order preserved (it is deterministic)."""
    return "---\n".join(
        yaml.dump(m, Dumper=_NoAliasDumper, sort_keys=False, width=100) for m in manifests
    )


def build_heartbeat_lease(job: RLHFJob) -> dict[str, Any]:
    """Created by the operator so the trainer needs `update` on this one Lease, not `create`."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": _metadata(job, heartbeat_lease_name(job)),
        "spec": {"leaseDurationSeconds": job.spec.liveness.heartbeat_timeout_seconds},
    }


def build_trainer_rbac(job: RLHFJob) -> list[dict[str, Any]]:
    """The Ray pods' identity: it may read and renew this job's Lease, and nothing else."""
    name = trainer_service_account(job)
    role_name = heartbeat_role_name(job)
    objects: list[dict[str, Any]] = []
    if job.spec.service_account_name is None:
        objects.append(
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(job, name)}
        )
    objects.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(job, role_name),
            "rules": [
                {
                    "apiGroups": ["coordination.k8s.io"],
                    "resources": ["leases"],
                    "resourceNames": [heartbeat_lease_name(job)],
                    "verbs": ["get", "update", "patch"],
                }
            ],
        }
    )
    objects.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(job, role_name),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": role_name,
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": name, "namespace": job.metadata.namespace}
            ],
        }
    )
    return objects


def build_owned_objects(
    job: RLHFJob,
    ray_token: str,
    network: NetworkSettings,
    placement: dict[str, PodSetPlacement] | None = None,
) -> list[dict[str, Any]]:
    """Everything the operator applies for a running job, in dependency order."""
    return [
        *build_trainer_rbac(job),
        build_ray_auth_secret(job, ray_token),
        *build_network_policies(job, network),
        build_disruption_budget(job),
        build_config_map(job),
        build_ray_cluster(job, placement, ray_token),
    ]
