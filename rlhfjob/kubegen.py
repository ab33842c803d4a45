"""Generate the schemas of the Kubernetes types the API embeds (`rlhfjob.api.kubeschema`).

The Kubernetes Python client's models are pydantic models of the API server's OpenAPI
definitions, pinned with the client; `crdgen.to_structural` makes their JSON schema
structural, as for the API's own models.

    python -m rlhfjob.kubegen write   # regenerate the JSON (task crds)
    python -m rlhfjob.kubegen check   # exit 1 when it is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rlhfjob.api.kubeschema import AFFINITY_PATH, VOLUME_SOURCES, VOLUME_SOURCES_PATH
from rlhfjob.crdgen import print_write_or_check, to_structural

QUANTITIES = {"emptyDir": ("sizeLimit",)}
"""Fields of the embedded types that are Kubernetes quantities (an integer or a string): the
client's models type them as strings."""


def _structural(model: Any) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, mode="validation")
    structural: dict[str, Any] = _tidy(to_structural(schema, schema.get("$defs", {})))
    return structural


def affinity() -> str:
    """The structural schema of `io.k8s.api.core.v1.Affinity`, as JSON text."""
    from kubernetes.client import V1Affinity

    structural = _structural(V1Affinity)
    structural["description"] = "A Kubernetes affinity (io.k8s.api.core.v1.Affinity)."
    return _text(structural)


def volume_sources() -> str:
    """The sources of `io.k8s.api.core.v1.Volume` in `VOLUME_SOURCES`, as JSON text: an object
    that keeps any other source as written (the installation's policy judges it)."""
    from kubernetes.client import V1Volume
    from pydantic import TypeAdapter

    from rlhfjob.api.base import Quantity

    quantity = TypeAdapter(Quantity).json_schema()  # the API's own, its CEL rules bounded
    volume = _structural(V1Volume)["properties"]
    properties = {name: volume[name] for name in VOLUME_SOURCES}
    for source, fields in QUANTITIES.items():
        for field in fields:
            node = properties[source]["properties"][field]
            node.pop("type")
            node.update(quantity)
    return _text(
        {
            "type": "object",
            "description": "A Kubernetes volume source (io.k8s.api.core.v1.Volume without name).",
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": properties,
        }
    )


def generate() -> dict[Path, str]:
    """Each generated file and its text."""
    return {AFFINITY_PATH: affinity(), VOLUME_SOURCES_PATH: volume_sources()}


def _text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"


def _tidy(node: Any) -> Any:
    """The client's models end their descriptions with their Python attributes: cut that."""
    if isinstance(node, dict):
        tidy = {key: _tidy(value) for key, value in node.items()}
        if isinstance(tidy.get("description"), str):
            tidy["description"] = tidy["description"].split("\n\nAttributes:")[0].strip()
        return tidy
    if isinstance(node, list):
        return [_tidy(item) for item in node]
    return node


def main(argv: list[str]) -> int:
    codes = [
        print_write_or_check(argv, text, (path,), "rlhfjob.kubegen")
        for path, text in generate().items()
    ]
    return max(codes)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
