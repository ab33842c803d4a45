"""The job policy's rules about Secrets, each as its Python check and its CEL, side by side.

A Ray token Secret is never readable by a job (it would reach another job's head), and where
the installation does not allow `secret` volumes, no Secret may reach the pods another way: the
environment, or the checkpoint bucket's credentials. Part of `rlhf_operator.policy`.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from rlhf_operator.names import RAY_AUTH_SECRETS
from rlhf_operator.policy_base import (
    Check,
    PodPlace,
    Variable,
    field_or,
    is_set,
    pair,
    pod_places,
    present,
    same_side,
    unchanged,
)
from rlhfjob.api import PodOverrides, RLHFJobSpec

BUCKET_SECRET = "spec.checkpoint.objectStore.credentialsSecret"
TRACKING_SECRETS = (
    "spec.tracking.mlflow.credentialsSecret",
    "spec.tracking.wandb.apiKeySecret",
)
SPEC_SECRETS = {"bucketSecret": BUCKET_SECRET, "mlflowSecret": TRACKING_SECRETS[0],
                "wandbSecret": TRACKING_SECRETS[1]}  # fmt: skip
"""The Secrets the spec names itself (given to the head's container), by CEL variable."""
SECRETS_REFUSED = "Secrets may not be read here (the job policy does not allow secret volumes)"
ENVIRONMENT_REFUSED = "Secrets may not be read into the environment here"
TOKEN_REFUSED = "a Ray token Secret (a name ending -ray-auth-…) may not be read by any job"

# ---------------------------------------------------------------------------------------------
# Python


def _volume_secrets(where: str, source: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, name) of each Secret a volume source reads: a `secret` volume, a `projected`
    one's secret sources, and a CSI driver's `nodePublishSecretRef`."""
    found: list[tuple[str, str]] = []
    secret = source.get("secret")
    if isinstance(secret, dict) and isinstance(secret.get("secretName"), str):
        found.append((f"{where}.secret.secretName", secret["secretName"]))
    projected = source.get("projected")
    sources = projected.get("sources") if isinstance(projected, dict) else None
    for index, item in enumerate(sources if isinstance(sources, list) else []):
        ref = item.get("secret") if isinstance(item, dict) else None
        if isinstance(ref, dict) and isinstance(ref.get("name"), str):
            found.append((f"{where}.projected.sources[{index}].secret.name", ref["name"]))
    csi = source.get("csi")
    ref = csi.get("nodePublishSecretRef") if isinstance(csi, dict) else None
    if isinstance(ref, dict) and isinstance(ref.get("name"), str):
        found.append((f"{where}.csi.nodePublishSecretRef.name", ref["name"]))
    return found


def _pod_secrets(pod: PodOverrides) -> list[tuple[str, str]]:
    """(field below the pod, name) of every Secret the pod overrides read."""
    found = [
        (f"env[{index}].valueFrom.secretKeyRef.name", var.value_from.secret_key_ref.name)
        for index, var in enumerate(pod.env)
        if var.value_from is not None and var.value_from.secret_key_ref is not None
    ]
    found += [
        (f"envFrom[{index}].secretRef.name", source.secret_ref.name)
        for index, source in enumerate(pod.env_from)
        if source.secret_ref is not None
    ]
    for index, volume in enumerate(pod.volumes):
        found += _volume_secrets(f"volumes[{index}]", volume.model_extra or {})
    return found


def token_problems(spec: RLHFJobSpec) -> list[str]:
    """A reference to a Ray token Secret, which would let one job reach another's head."""
    refs: dict[str, list[tuple[str, str]]] = {}
    for path, pod in spec.pod_places().items():
        refs[path] = [(f"{path}.{field}", name) for field, name in _pod_secrets(pod)]
    pulls = spec.pods.image_pull_secrets if spec.pods is not None else []
    refs.setdefault("spec.pods", []).extend(
        (f"spec.pods.imagePullSecrets[{index}].name", pull.name) for index, pull in enumerate(pulls)
    )
    checkpoint = spec.checkpoint
    refs["spec.checkpoint"] = _volume_secrets("spec.checkpoint.volume", checkpoint.volume or {})
    if checkpoint.object_store and checkpoint.object_store.credentials_secret:
        refs["spec.checkpoint"].append((BUCKET_SECRET, checkpoint.object_store.credentials_secret))
    refs["spec.tracking"] = [
        (field, name) for field, name in spec_secrets(spec).items() if field in TRACKING_SECRETS
    ]
    return [
        f"{place}: {field.removeprefix(place + '.')} names {name!r}, a Ray token Secret (a "
        "name ending -ray-auth-…): no job may read one, its own included (the operator "
        "hands each job its token)"
        for place, found in refs.items()
        for field, name in found
        if re.search(RAY_AUTH_SECRETS, name)
    ]


def environment_problems(path: str, pod: PodOverrides) -> list[str]:
    """Where `pod` reads a Secret into the environment: as much power as a `secret` volume
    (checked where the policy does not allow those)."""
    refs = [
        f"{path}.env[{index}].valueFrom.secretKeyRef"
        for index, var in enumerate(pod.env)
        if var.value_from is not None and var.value_from.secret_key_ref is not None
    ]
    refs += [
        f"{path}.envFrom[{index}].secretRef"
        for index, source in enumerate(pod.env_from)
        if source.secret_ref is not None
    ]
    return [f"{ref}: {SECRETS_REFUSED}" for ref in refs]


def spec_secrets(spec: RLHFJobSpec) -> dict[str, str]:
    """The Secrets the spec names itself, by field: the bucket's and the trackers' credentials."""
    bucket, tracking = spec.checkpoint.object_store, spec.tracking
    named = {
        BUCKET_SECRET: bucket.credentials_secret if bucket else None,
        TRACKING_SECRETS[0]: tracking.mlflow.credentials_secret if tracking.mlflow else None,
        TRACKING_SECRETS[1]: tracking.wandb.api_key_secret if tracking.wandb else None,
    }
    return {field: name for field, name in named.items() if name}


def bucket_problems(spec: RLHFJobSpec) -> list[str]:
    """The Secrets the spec names itself (checked where secret volumes are not allowed)."""
    return [f"{field}: {SECRETS_REFUSED}" for field in spec_secrets(spec)]


# ---------------------------------------------------------------------------------------------
# CEL

TOKEN = f"matches('{RAY_AUTH_SECRETS}')"


def _volume_token(v: str) -> str:
    """CEL: the volume source `v` reads a Ray token Secret (`_volume_secrets`)."""
    sources = f"{v}.projected.sources"
    return (
        f"({is_set(f'{v}.secret')} && has({v}.secret.secretName) && {v}.secret.secretName.{TOKEN})"
        f" || ({is_set(f'{v}.csi')} && {is_set(f'{v}.csi.nodePublishSecretRef')}"
        f" && has({v}.csi.nodePublishSecretRef.name) && {v}.csi.nodePublishSecretRef.name.{TOKEN})"
        f" || ({is_set(f'{v}.projected')} && {is_set(sources)}"
        f" && {sources}.exists(s, {is_set('s.secret')} && has(s.secret.name)"
        f" && s.secret.name.{TOKEN}))"
    )


def _pod_tokens(index: int, place: PodPlace, root: str) -> str:
    """CEL: the pod overrides at `place` read a Ray token Secret (`_pod_secrets`)."""
    ref = "e.valueFrom.secretKeyRef"
    volumes = f"variables.{same_side(root, f'podVolumes{index}')}"
    found = (
        f"{place.cel_list(root, 'env')}.exists(e, {is_set('e.valueFrom')} && {is_set(ref)}"
        f" && {ref}.name.{TOKEN})"
        f" || {place.cel_list(root, 'envFrom')}.exists(e, {is_set('e.secretRef')}"
        f" && e.secretRef.name.{TOKEN})"
        f" || {volumes}.exists(v, {_volume_token('v')})"
    )
    if place.field == "spec.pods":
        found += f" || {place.cel_list(root, 'imagePullSecrets')}.exists(p, p.name.{TOKEN})"
    return f"({found})"


def _checkpoint_tokens(root: str) -> str:
    """CEL: the checkpoint's volume or bucket reads a Ray token Secret."""
    volume = f"variables.{same_side(root, 'volume')}"
    bucket = f"{present(root, BUCKET_SECRET)} && {root}.{BUCKET_SECRET}.{TOKEN}"
    return f"({_volume_token(volume)}) || ({bucket})"


def _environment_secrets(place: PodPlace, root: str) -> str:
    """CEL: the names of the Secrets the pod overrides at `place` read into the environment."""
    return (
        f"{place.cel_list(root, 'env')}.filter(e, has(e.valueFrom) && e.valueFrom != null"
        " && has(e.valueFrom.secretKeyRef) && e.valueFrom.secretKeyRef != null)"
        f".map(e, e.valueFrom.secretKeyRef.name) + {place.cel_list(root, 'envFrom')}"
        ".filter(e, has(e.secretRef) && e.secretRef != null).map(e, e.secretRef.name)"
    )


def environment_variables(index: int, place: PodPlace) -> list[Variable]:
    """The Secrets read into the environment at `place` (where secret volumes are refused)."""
    expression = functools.partial(_environment_secrets, place)
    return pair(f"podSecrets{index}", expression, secrets_refused=True)


def token_variables() -> list[Variable]:
    """Whether each place of pod overrides, and the checkpoint, reads a Ray token Secret."""
    found = [
        variable
        for index, place in enumerate(pod_places())
        for variable in pair(f"podTokens{index}", functools.partial(_pod_tokens, index, place))
    ]
    return [
        *found,
        *pair("checkpointTokens", _checkpoint_tokens),
        *pair("trackingTokens", _tracking_tokens),
    ]


def _tracking_tokens(root: str) -> str:
    """CEL: a tracker's credentials name a Ray token Secret."""
    return " || ".join(
        f"({present(root, field)} && {root}.{field}.{TOKEN})" for field in TRACKING_SECRETS
    )


def bucket_variables() -> list[Variable]:
    """The Secrets the spec names itself (where secret volumes are refused)."""
    return [
        variable
        for name, field in SPEC_SECRETS.items()
        for variable in pair(
            name, functools.partial(field_or, path=field, empty="''"), secrets_refused=True
        )
    ]


def _token_check(field: str, name: str) -> Check:
    return Check.constant(
        field, f"{unchanged(name)} || !variables.{name}", f"{field}: {TOKEN_REFUSED}"
    )


def token_checks() -> list[Check]:
    """No place of pod overrides, nor the checkpoint, reads a Ray token Secret."""
    found = [
        _token_check(place.field, f"podTokens{index}") for index, place in enumerate(pod_places())
    ]
    return [
        *found,
        _token_check("spec.checkpoint", "checkpointTokens"),
        _token_check("spec.tracking", "trackingTokens"),
    ]


def environment_check(index: int, place: PodPlace) -> Check:
    """No Secret is read into the environment at `place` (where secret volumes are refused)."""
    secrets = f"variables.podSecrets{index}"
    return Check(
        place.field,
        f"{unchanged(f'podSecrets{index}')} || size({secrets}) == 0",
        f"{place.field}: {ENVIRONMENT_REFUSED} (secret is not an allowed volume type)",
        f"'{place.field}: {ENVIRONMENT_REFUSED} (' + {secrets}.join(', ')"
        " + '; secret is not an allowed volume type)'",
        secrets_refused=True,
    )


def bucket_checks() -> list[Check]:
    """The spec names no Secret itself (where secret volumes are refused)."""
    return [
        Check.constant(
            field,
            f"{unchanged(name)} || variables.{name} == ''",
            f"{field}: {ENVIRONMENT_REFUSED} (secret is not an allowed volume type)",
            secrets_refused=True,
        )
        for name, field in SPEC_SECRETS.items()
    ]
