"""Jobs that try to borrow power they were not given, and the field each must be refused on.

One table, run at the layers that see a job: the operator's own check, at every reconcile
(`tests/security/`), and the real API server with the chart's admission policy and the CRD
(`e2e/tests/test_attacks.py`). Each attack is a patch on the tiny CPU example; `namespace`
"operator" creates it in the operator's namespace. The installation attacked admits jobs through
Kueue and lists the registry of the example's image (`INSTALLATION`), so every job names its
LocalQueue (`QUEUE`) unless the attack's `labels` take the label away. `benchmarks/security.py`
runs both and writes the table to `benchmarks/results/security.json` (the `attack` marks,
`attack_report`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlhfjob.contract.kueue import LABEL_QUEUE_NAME
from rlhfjob.patches import merge_patch

CONTROL_PLANE = "node-role.kubernetes.io/control-plane"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
OTHER_TOKEN = "other-job-ray-auth-0123456789"
"""Another job's Ray token Secret (`names.ray_auth_secret_name`'s form)."""
CHART_KEY = "rlhfjob-ray-auth-key"
"""The chart's key Secret, from which every job's token is derived."""
BORROWED_ACCOUNT = "{operator}"
"""Stands for the operator's own ServiceAccount (filled in by the runner)."""
ALLOWED_REGISTRY = "ghcr.io/rlhfjob"
"""The registry path the installation attacked lists: the example's image is under it."""
INSTALLATION = ("kueue.enabled=true", f"jobPolicy.allowedImageRegistries={{{ALLOWED_REGISTRY}}}")
"""The chart's values of the installation attacked (besides the ServiceAccounts each layer
lists); extended resources as the chart's default (nvidia.com/gpu)."""
QUEUE = {LABEL_QUEUE_NAME: "team-a"}
"""Every attack job's labels (Kueue's queue) unless the attack changes them."""


@dataclass(frozen=True)
class Attack:
    id: str
    what: str
    """The attack in a sentence, as `security.json` lists it."""
    spec: dict[str, Any]
    field: str
    """The field the refusal must name."""
    namespace: str = "job"
    """`job`: a team's namespace; `operator`: the operator's own."""
    layer: str = "policy"
    """`policy`: the job policy (admission policy and operator); `crd`: the CRD's rules."""
    labels: dict[str, Any] | None = None
    """A merge patch of the job's labels (None in it removes one)."""


def _pod(place: str, **pod: Any) -> dict[str, Any]:
    """`pod` overrides at `place`: `pods`, `head` or a role's name."""
    if place == "pods":
        return {"pods": pod}
    if place == "head":
        return {"head": {"pod": pod}}
    return {"roles": {place: {"pod": pod}}}


def _role(role: str, **fields: Any) -> dict[str, Any]:
    return {"roles": {role: fields}}


def _token_env(name: str) -> dict[str, Any]:
    return {"name": "T", "valueFrom": {"secretKeyRef": {"name": name, "key": "auth_token"}}}


def _affinity(term: str) -> dict[str, Any]:
    expression = {"matchExpressions": [{"key": CONTROL_PLANE, "operator": "Exists"}]}
    if term == REQUIRED:
        return {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [expression]}}}
    return {"nodeAffinity": {PREFERRED: [{"weight": 100, "preference": expression}]}}


ATTACKS: list[Attack] = [
    Attack(
        "host-path-checkpoints",
        "a hostPath checkpoint volume mounts the node's filesystem",
        {"checkpoint": {"volume": {"hostPath": {"path": "/"}}}},
        "spec.checkpoint.volume",
    ),
    Attack(
        "host-path-pod-volume",
        "a hostPath pod volume mounts the node's filesystem",
        _pod("rollout", volumes=[{"name": "root", "hostPath": {"path": "/"}}]),
        "spec.roles.rollout.pod.volumes",
    ),
    Attack(
        "operator-service-account",
        "a job runs its pods as the operator's ServiceAccount",
        {"serviceAccountName": BORROWED_ACCOUNT},
        "spec.serviceAccountName",
        namespace="operator",
    ),
    Attack(
        "unlisted-service-account",
        "a job runs its pods as a ServiceAccount the policy does not list",
        {"serviceAccountName": "someone-else"},
        "spec.serviceAccountName",
    ),
    Attack(
        "operator-namespace",
        "a job in the operator's namespace (its key Secret and identity live there)",
        {},
        "metadata.namespace",
        namespace="operator",
    ),
    Attack(
        "token-env",
        "another job's Ray token read through an env secretKeyRef",
        _pod("pods", env=[_token_env(OTHER_TOKEN)]),
        "spec.pods",
    ),
    Attack(
        "token-env-from",
        "another job's Ray token read through envFrom",
        _pod("trainer", envFrom=[{"secretRef": {"name": OTHER_TOKEN}}]),
        "spec.roles.trainer.pod",
    ),
    Attack(
        "token-secret-volume",
        "the chart's key Secret mounted as a secret volume",
        _pod("head", volumes=[{"name": "k", "secret": {"secretName": CHART_KEY}}]),
        "spec.head.pod",
    ),
    Attack(
        "token-projected-volume",
        "another job's Ray token through a projected volume",
        _pod(
            "pods",
            volumes=[{"name": "t", "projected": {"sources": [{"secret": {"name": OTHER_TOKEN}}]}}],
        ),
        "spec.pods",
    ),
    Attack(
        "token-image-pull-secret",
        "another job's Ray token named as an image pull secret",
        _pod("pods", imagePullSecrets=[{"name": OTHER_TOKEN}]),
        "spec.pods",
    ),
    Attack(
        "token-bucket-credentials",
        "the chart's key Secret given as the bucket's credentials",
        {"checkpoint": {"objectStore": {"bucket": "ckpts", "credentialsSecret": CHART_KEY}}},
        "spec.checkpoint",
    ),
    Attack(
        "tolerate-every-taint",
        "a toleration of every taint (operator Exists, no key) onto any node",
        _role("trainer", tolerations=[{"operator": "Exists"}]),
        "spec.roles.trainer.tolerations",
    ),
    Attack(
        "tolerate-control-plane",
        "a toleration of the control plane's taint",
        _role("rollout", tolerations=[{"key": CONTROL_PLANE, "operator": "Exists"}]),
        "spec.roles.rollout.tolerations",
    ),
    Attack(
        "control-plane-node-selector",
        "a node selector onto the control-plane nodes",
        _role("trainer", nodeSelector={CONTROL_PLANE: ""}),
        "spec.roles.trainer.nodeSelector",
    ),
    Attack(
        "control-plane-required-affinity",
        "a required node affinity onto the control-plane nodes",
        _role("rollout", affinity=_affinity(REQUIRED)),
        "spec.roles.rollout.affinity",
    ),
    Attack(
        "control-plane-preferred-affinity",
        "a preferred node affinity onto the control-plane nodes",
        _role("trainer", affinity=_affinity(PREFERRED)),
        "spec.roles.trainer.affinity",
    ),
    Attack(
        "system-priority-class",
        "a system priority class, to preempt the cluster's own pods",
        _pod("pods", priorityClassName="system-node-critical"),
        "spec.pods.priorityClassName",
    ),
    Attack(
        "unlisted-scheduler",
        "a scheduler the policy does not list, past the cluster's placement rules",
        _pod("pods", schedulerName="my-own-scheduler"),
        "spec.pods.schedulerName",
    ),
    Attack(
        "inline-nfs-server",
        "an inline NFS volume from a server the policy does not list",
        _pod("head", volumes=[{"name": "n", "nfs": {"server": "a.example.com", "path": "/"}}]),
        "spec.head.pod.volumes",
    ),
    Attack(
        "inline-csi-driver",
        "an inline CSI volume of a driver the policy does not list",
        _pod("pods", volumes=[{"name": "c", "csi": {"driver": "hostpath.csi.k8s.io"}}]),
        "spec.pods.volumes",
    ),
    Attack(
        "unqueued-job",
        "a job without Kueue's queue label, where Kueue admits jobs, runs outside its team's "
        "quota at any priority",
        {},
        f"metadata.labels[{LABEL_QUEUE_NAME}]",
        labels={LABEL_QUEUE_NAME: None},
    ),
    Attack(
        "unlisted-image-registry",
        "an image from a registry the installation does not list (an attacker's, or another "
        "team's private image a node has cached, pulled IfNotPresent)",
        {"image": "docker.io/attacker/trainer:1"},
        "spec.image",
    ),
    Attack(
        "look-alike-image-path",
        "an image of another owner whose name begins like the listed path (ghcr.io/rlhfjob-x "
        "beside ghcr.io/rlhfjob)",
        {"image": f"{ALLOWED_REGISTRY}-attacker/trainer:1"},
        "spec.image",
    ),
    Attack(
        "unlisted-extended-resource",
        "an extended resource the installation does not list (a device kept for others)",
        _pod("trainer", extraResources={"example.com/fpga": 1}),
        "spec.roles.trainer.pod.extraResources",
    ),
    Attack(
        "apparmor-unconfined",
        "an annotation that turns the AppArmor profile off",
        _pod(
            "trainer",
            annotations={"container.apparmor.security.beta.kubernetes.io/ray-worker": "unconfined"},
        ),
        "spec.roles.trainer.pod.annotations",
        layer="crd",
    ),
    Attack(
        "seccomp-unconfined",
        "an annotation that turns the seccomp profile off",
        _pod("pods", annotations={"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}),
        "spec.pods.annotations",
        layer="crd",
    ),
]


EXAMPLE = Path(__file__).resolve().parents[2] / "examples/grpo-tiny-cpu.yaml"


def attack_job(attack: Attack, namespace: str, operator_account: str) -> dict[str, Any]:
    """The tiny CPU example with the attack's patch, named after it, in `namespace` (the
    operator's own where the attack says so); `BORROWED_ACCOUNT` becomes `operator_account`."""
    spec = json.loads(json.dumps(attack.spec).replace(BORROWED_ACCOUNT, operator_account))
    labels = merge_patch(QUEUE, attack.labels or {})
    metadata = {"name": f"attack-{attack.id}", "namespace": namespace, "labels": labels}
    return merge_patch(yaml.safe_load(EXAMPLE.read_text()), {"metadata": metadata, "spec": spec})
