"""The job policy's rules about volumes, each as its Python check and its CEL, side by side.

A job's checkpoint volume and its pods' volumes may use only the volume types the installation
allows (never `hostPath` by default: the node's disk), and an inline NFS server or CSI driver
only where the installation lists it. Part of `rlhf_operator.policy`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from rlhf_operator.policy_base import (
    Check,
    PodPlace,
    Variable,
    allowed_text,
    field_or,
    is_set,
    pair,
    pod_places,
    unchanged,
)
from rlhfjob.api import PodOverrides, RLHFJobSpec

CHECKPOINT_VOLUME = "spec.checkpoint.volume"
NOT_ALLOWED = "is not allowed (' + variables.allowedVolumesText + ')'"
"""The end of a volume type refusal's CEL message, naming what the installation allows."""


@dataclass(frozen=True)
class InlineSource:
    """A volume source that names its server outside the cluster's objects (no PV an admin
    made): the installation lists the values of `key` it may have."""

    kind: str
    key: str
    what: str
    """What a `key` is, in a message: ``NFS server``."""
    article: str
    setting: str
    """The chart's `jobPolicy` value that lists them (its admission variable has the name)."""


INLINE_SOURCES = (
    InlineSource("nfs", "server", "NFS server", "an", "allowedNfsServers"),
    InlineSource("csi", "driver", "CSI driver", "a", "allowedCsiDrivers"),
)

# ---------------------------------------------------------------------------------------------
# Python


def _type_problems(field: str, types: list[str], allowed: tuple[str, ...]) -> list[str]:
    refused = [kind for kind in types if kind not in allowed]
    if not refused:
        return []
    return [
        f"{field}: volume type {', '.join(refused)} is not allowed here "
        f"(allowed: {', '.join(allowed)})"
    ]


def checkpoint_problems(spec: RLHFJobSpec, allowed: tuple[str, ...]) -> list[str]:
    """The checkpoint volume's type, when it is not one the policy allows."""
    volume = spec.checkpoint.volume
    return [] if volume is None else _type_problems(CHECKPOINT_VOLUME, sorted(volume), allowed)


def pod_problems(path: str, pod: PodOverrides, allowed: tuple[str, ...]) -> list[str]:
    """Each volume of the pod overrides at `path` of a type the policy does not allow."""
    found: list[str] = []
    for index, extra in enumerate(pod.volumes):
        found += _type_problems(f"{path}.volumes[{index}]", extra.source_types(), allowed)
    return found


def inline_problems(
    spec: RLHFJobSpec, *, nfs_servers: tuple[str, ...], csi_drivers: tuple[str, ...]
) -> list[str]:
    """Inline NFS servers and CSI drivers outside the policy's lists."""
    listed = {"nfs": nfs_servers, "csi": csi_drivers}
    sources: dict[str, dict[str, Any]] = {CHECKPOINT_VOLUME: spec.checkpoint.volume or {}}
    for path, pod in spec.pod_places().items():
        for index, volume in enumerate(pod.volumes):
            sources[f"{path}.volumes[{index}]"] = volume.model_extra or {}
    found: list[str] = []
    for field, source in sources.items():
        for inline in INLINE_SOURCES:
            found_source, allowed = source.get(inline.kind), listed[inline.kind]
            if isinstance(found_source, dict) and found_source.get(inline.key) not in allowed:
                found.append(
                    f"{field}: {inline.what} {found_source.get(inline.key)!r} is not allowed "
                    f"({allowed_text(allowed, inline.setting)})"
                )
    return found


# ---------------------------------------------------------------------------------------------
# CEL


def checkpoint_variables() -> list[Variable]:
    """The checkpoint volume's source (a map of one source type), or an empty map."""
    return pair("volume", functools.partial(field_or, path=CHECKPOINT_VOLUME, empty="{}"))


def pod_variables(index: int, place: PodPlace) -> list[Variable]:
    """The volumes of the pod overrides at `place`."""
    return pair(f"podVolumes{index}", functools.partial(place.cel_list, leaf="volumes"))


def checkpoint_check() -> Check:
    """The checkpoint volume's type is one the installation allows."""
    return Check(
        CHECKPOINT_VOLUME,
        f"{unchanged('volume')} || variables.volume.all(t, t in variables.allowedVolumeTypes)",
        f"{CHECKPOINT_VOLUME}: volume type not allowed by the job policy",
        f"'{CHECKPOINT_VOLUME}: volume type '"
        " + variables.volume.filter(t, !(t in variables.allowedVolumeTypes)).join(', ')"
        f" + ' {NOT_ALLOWED}",
    )


def pod_check(index: int, place: PodPlace) -> Check:
    """Each volume of the pod overrides at `place` is of a type the installation allows."""
    volumes = f"variables.podVolumes{index}"
    return Check(
        f"{place.field}.volumes",
        f"{unchanged(f'podVolumes{index}')}"
        f" || {volumes}.all(v, v.all(k, k == 'name' || k in variables.allowedVolumeTypes))",
        f"{place.field}.volumes: volume type not allowed by the job policy",
        f"'{place.field}.volumes: volume type ' + {volumes}.map(v, v.filter(k, k != 'name'"
        " && !(k in variables.allowedVolumeTypes)).join(', ')).filter(t, t != '')"
        f".join(', ') + ' {NOT_ALLOWED}",
    )


def _inline_allowed(v: str, inline: InlineSource) -> str:
    """CEL: the volume source `v` is no inline `inline.kind`, or its key is listed."""
    source, allowed = f"{v}.{inline.kind}", f"variables.{inline.setting}"
    listed = f"has({source}.{inline.key}) && {source}.{inline.key} in {allowed}"
    return f"(!({is_set(source)}) || ({listed}))"


def _inline_check(field: str, name: str, test: str, inline: InlineSource) -> Check:
    """`test` (CEL) holds for the field `field`, read as the variable `name`."""
    return Check.constant(
        field,
        f"{unchanged(name)} || {test}",
        f"{field}: {inline.article} {inline.what} the job policy does not list",
    )


def inline_checks() -> list[Check]:
    """The checkpoint volume's, then each place's volumes', inline servers and drivers."""
    found = [
        _inline_check(
            CHECKPOINT_VOLUME, "volume", _inline_allowed("variables.volume", inline), inline
        )
        for inline in INLINE_SOURCES
    ]
    for index, place in enumerate(pod_places()):
        found += [
            _inline_check(
                f"{place.field}.volumes",
                f"podVolumes{index}",
                f"variables.podVolumes{index}.all(v, {_inline_allowed('v', inline)})",
                inline,
            )
            for inline in INLINE_SOURCES
        ]
    return found
