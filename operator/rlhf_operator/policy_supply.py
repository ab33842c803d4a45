"""The job policy's rules about what a job's pods pull and consume: the registries of their
images and the extended resources they request, each as its Python check and its CEL, side by
side.

An installation may list the registries images come from (empty: any), so that no job runs an
attacker's image, or another team's private one a node has cached (`IfNotPresent` pulls it from
the node without the team's credentials); the list covers `spec.image` and image volumes. It
lists the extended resources (a name with a domain: `nvidia.com/gpu`, `rdma/ib`) a job's pods
may request, so no job takes a device the installation keeps for others; a role's `gpus`
request `nvidia.com/gpu`. Part of `rlhf_operator.policy`.
"""

from __future__ import annotations

import functools
from typing import Any

from rlhf_operator.policy_base import (
    Check,
    PodPlace,
    Variable,
    allowed_text,
    field_or,
    pair,
    placement_places,
    pod_places,
    unchanged,
)
from rlhfjob.api import GPU_RESOURCE, ROLE_NAMES, RLHFJobSpec

DEFAULT_EXTENDED_RESOURCES = (GPU_RESOURCE,)
"""The extended resources a job may request unless the installation says otherwise: GPUs."""
IMAGE = "spec.image"
CHECKPOINT_VOLUME = "spec.checkpoint.volume"
REGISTRIES = "allowedImageRegistries"
RESOURCES = "allowedExtendedResources"
"""The chart's `jobPolicy` values (and the admission policy's variables) of the two lists."""

# ---------------------------------------------------------------------------------------------
# Python


def image_allowed(image: str, registries: tuple[str, ...]) -> bool:
    """Whether `image` comes from one of `registries` (empty: any). An entry is a registry
    (`ghcr.io`, `registry.example.com:5000`), a path under one (`ghcr.io/team`: never
    `ghcr.io/team-b`) or a repository (`ghcr.io/team/trainer`, any tag or digest of it).
    An image without a registry (`ubuntu`, Docker Hub's) matches only an entry spelt so."""
    return not registries or any(_under(image, registry) for registry in registries)


def _under(image: str, registry: str) -> bool:
    if image.startswith(registry if registry.endswith("/") else registry + "/"):
        return True
    return "/" in registry and (
        image == registry or image.startswith((registry + ":", registry + "@"))
    )


def images(spec: RLHFJobSpec) -> dict[str, str]:
    """Every image a job's pods run or mount, by the field that names it: `spec.image` and
    image volumes (a volume's field, as the admission policy names it)."""
    found = {IMAGE: spec.image}
    sources: dict[str, dict[str, Any]] = {CHECKPOINT_VOLUME: spec.checkpoint.volume or {}}
    for path, pod in spec.pod_places().items():
        for index, volume in enumerate(pod.volumes):
            sources[f"{path}.volumes[{index}]"] = volume.model_extra or {}
    for field, source in sources.items():
        image = source.get("image")
        if isinstance(image, dict):
            reference = image.get("reference")
            found[field] = reference if isinstance(reference, str) else ""
    return found


def image_problems(spec: RLHFJobSpec, registries: tuple[str, ...]) -> list[str]:
    """Each image from a registry the installation does not list."""
    return [
        f"{field}: image {image!r} is not from a registry the installation allows "
        f"({allowed_text(registries, REGISTRIES)})"
        for field, image in images(spec).items()
        if not image_allowed(image, registries)
    ]


def is_extended(resource: str) -> bool:
    """Whether a resource name is an extended one: it has a domain (`example.com/fpga`); the
    pod API's own have none (`ephemeral-storage`, `hugepages-2Mi`)."""
    return "/" in resource


def resource_problems(spec: RLHFJobSpec, allowed: tuple[str, ...]) -> list[str]:
    """Each extended resource the pods would request that the installation does not list."""
    found: list[str] = []
    for path, pod in spec.pod_places().items():
        refused = [r for r in sorted(pod.extra_resources) if is_extended(r) and r not in allowed]
        if refused:
            found.append(
                f"{path}.extraResources: {', '.join(refused)} is an extended resource the "
                f"installation does not list ({allowed_text(allowed, RESOURCES)})"
            )
    if GPU_RESOURCE not in allowed:
        for role in ROLE_NAMES:
            if (spec_role := getattr(spec.roles, role)) is not None and spec_role.gpus:
                found.append(
                    f"spec.roles.{role}.gpus: GPUs ({GPU_RESOURCE}) are not an extended resource "
                    f"the installation lists ({allowed_text(allowed, RESOURCES)})"
                )
    return found


# ---------------------------------------------------------------------------------------------
# CEL


def _listed_text(variable: str) -> str:
    """CEL: the installation's list `variable`, in words (as `allowed_text` writes it)."""
    return (
        f"(size(variables.{variable}) == 0 ? 'none' : variables.{variable}.join(', '))"
        f" + '; the chart\\'s jobPolicy.{variable}'"
    )


def _from_listed(image: str) -> str:
    """CEL: the image `image` comes from a listed registry (`image_allowed`, the list set)."""
    return (
        f"variables.{REGISTRIES}.exists(r, {image}.startsWith(r.endsWith('/') ? r : r + '/')"
        f" || (r.contains('/') && ({image} == r || {image}.startsWith(r + ':')"
        f" || {image}.startsWith(r + '@'))))"
    )


def _image_volume_allowed(v: str) -> str:
    """CEL: the volume source `v` is no image volume, or its image is from a listed registry."""
    reference = f"{v}.image.reference"
    return f"(!has({v}.image) || (has({reference}) && {_from_listed(reference)}))"


def _gpu_places() -> list[tuple[int, PodPlace]]:
    """The roles (by their index among `placement_places`), where `gpus` is."""
    return [(i, p) for i, p in enumerate(placement_places()) if p.field != "spec.head"]


def variables() -> list[Variable]:
    """The image; each place's extra resources; each role's GPUs (the volumes are
    `policy_volumes`' variables)."""
    found = pair("image", functools.partial(field_or, path=IMAGE, empty="''"))
    for index, place in enumerate(pod_places()):
        found += pair(
            f"podResources{index}",
            functools.partial(place.cel_list, leaf="extraResources", empty="{}"),
        )
    for index, place in _gpu_places():
        found += pair(f"gpus{index}", functools.partial(place.cel_list, leaf="gpus", empty="0"))
    return found


def _any_registry(test: str) -> str:
    return f"size(variables.{REGISTRIES}) == 0 || {test}"


def image_checks() -> list[Check]:
    """The image, the checkpoint volume's and each place's image volumes, from listed
    registries."""
    found = [
        Check(
            IMAGE,
            f"{unchanged('image')} || {_any_registry(_from_listed('variables.image'))}",
            f"{IMAGE}: an image from a registry the job policy does not list",
            f"'{IMAGE}: image ' + variables.image + ' is not from a registry the installation"
            f" allows (allowed: ' + {_listed_text(REGISTRIES)} + ')'",
        ),
        Check.constant(
            CHECKPOINT_VOLUME,
            f"{unchanged('volume')} || {_any_registry(_image_volume_allowed('variables.volume'))}",
            f"{CHECKPOINT_VOLUME}: an image volume from a registry the job policy does not list",
        ),
    ]
    for index, place in enumerate(pod_places()):
        each = f"variables.podVolumes{index}.all(v, {_image_volume_allowed('v')})"
        found.append(
            Check.constant(
                f"{place.field}.volumes",
                f"{unchanged(f'podVolumes{index}')} || {_any_registry(each)}",
                f"{place.field}.volumes: an image volume from a registry the job policy does not"
                " list",
            )
        )
    return found


def resource_checks() -> list[Check]:
    """Each place's extended resources, and each role's GPUs, listed by the installation."""
    found: list[Check] = []
    for index, place in enumerate(pod_places()):
        resources = f"variables.podResources{index}"
        refused = f"{resources}.filter(k, k.contains('/') && !(k in variables.{RESOURCES}))"
        found.append(
            Check(
                f"{place.field}.extraResources",
                f"{unchanged(f'podResources{index}')} || size({refused}) == 0",
                f"{place.field}.extraResources: an extended resource the job policy does not list",
                f"'{place.field}.extraResources: ' + {refused}.join(', ') + ' is an extended"
                f" resource the installation does not list (allowed: ' + {_listed_text(RESOURCES)}"
                " + ')'",
            )
        )
    for index, place in _gpu_places():
        found.append(
            Check(
                f"{place.field}.gpus",
                f"{unchanged(f'gpus{index}')} || variables.gpus{index} == 0"
                f" || '{GPU_RESOURCE}' in variables.{RESOURCES}",
                f"{place.field}.gpus: GPUs are not an extended resource the job policy lists",
                f"'{place.field}.gpus: GPUs ({GPU_RESOURCE}) are not an extended resource the"
                f" installation lists (allowed: ' + {_listed_text(RESOURCES)} + ')'",
            )
        )
    return found
