"""Kubernetes types the API embeds, checked against Kubernetes' own schema (issue 28).

A role's `affinity` is a Kubernetes `Affinity`, passed through to the pods, and a volume (the
checkpoint volume, `pods.volumes`) carries a Kubernetes volume source. Accepted as free-form
objects they let a misspelt field or a wrong type through `rlhfjob validate` and the API
server, to be dropped or refused only when the operator built the RayCluster. Their schemas
come from the Kubernetes Python client's models (`rlhfjob.kubegen`, `task crds`), committed as
JSON beside this module: the CRD carries them (so the API server checks them, as KubeRay's CRD
carries the pod template's) and the models check a value against them here, without importing
the client at run time. Of the thirty-odd volume sources, the schema names those an
installation allows by default (`VOLUME_SOURCES`); another is kept as written and left to the
installation's policy, which names the types it allows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

AFFINITY_PATH = Path(__file__).resolve().parent / "kubernetes-affinity.json"
VOLUME_SOURCES_PATH = Path(__file__).resolve().parent / "kubernetes-volume-sources.json"

VOLUME_SOURCES = ("persistentVolumeClaim", "csi", "nfs", "emptyDir", "configMap", "secret")
"""The volume sources whose schema the API carries: the types an installation allows by
default (`--allowed-volume-type`), none of which reaches the node's own files."""


KUBERNETES_VOLUME_SOURCES = (
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi",
    "downwardAPI", "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk",
    "gitRepo", "glusterfs", "hostPath", "image", "iscsi", "nfs", "persistentVolumeClaim",
    "photonPersistentDisk", "portworxVolume", "projected", "quobyte", "rbd", "scaleIO", "secret",
    "storageos", "vsphereVolume",
)  # fmt: skip
"""Every source a Kubernetes volume may have (`io.k8s.api.core.v1.Volume` but its name; a unit
test holds them to the pinned client's): a volume has exactly one of them. Another key, or
none, would reach the pod as a volume without a source, which Kubernetes makes an empty
directory: checkpoints written there are lost with the pod."""


def load_schema(path: Path = AFFINITY_PATH) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}
"""The Python values of a schema's `type` as the API server reads JSON."""


def schema_problems(schema: dict[str, Any], value: Any, path: str = "") -> list[tuple[str, str]]:
    """(field path, message) for each way `value` breaks a structural `schema`: a wrong type,
    a required field missing, a field the type does not have (which the API server would
    drop), a CEL rule of the schema broken."""
    if value is None:
        return [] if schema.get("nullable") else [(path, "must not be null")]
    expected = schema.get("type")
    if expected and (
        not isinstance(value, JSON_TYPES[expected])
        or (expected in ("integer", "number") and isinstance(value, bool))
    ):
        return [(path, f"must be of type {expected}")]
    problems: list[tuple[str, str]] = []
    if isinstance(value, dict):
        properties = schema.get("properties")
        for name in schema.get("required", []):
            if name not in value:
                problems.append((f"{path}.{name}", "required"))
        for name, item in value.items():
            child = f"{path}.{name}"
            if properties is not None and name in properties:
                problems += schema_problems(properties[name], item, child)
            elif isinstance(schema.get("additionalProperties"), dict):
                problems += schema_problems(schema["additionalProperties"], item, child)
            elif properties is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                problems.append((child, f"unknown field {name!r}"))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            problems += schema_problems(schema.get("items", {}), item, f"{path}[{index}]")
    if not problems and (rules := schema.get("x-kubernetes-validations")):
        from rlhfjob.cel import CelRule, broken

        own = [CelRule(r["rule"], r["message"], r.get("fieldPath")) for r in rules]
        problems += [(path + (rule.field_path or ""), rule.message) for rule in broken(own, value)]
    return problems
