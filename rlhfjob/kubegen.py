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
from typing import Any

from rlhfjob.api.kubeschema import SCHEMA_PATH
from rlhfjob.crdgen import print_write_or_check, to_structural


def generate() -> str:
    """The structural schema of `io.k8s.api.core.v1.Affinity`, as JSON text."""
    from kubernetes.client import V1Affinity

    schema = V1Affinity.model_json_schema(by_alias=True, mode="validation")
    structural = _tidy(to_structural(schema, schema.get("$defs", {})))
    structural["description"] = "A Kubernetes affinity (io.k8s.api.core.v1.Affinity)."
    return json.dumps(structural, indent=1, sort_keys=True) + "\n"


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
    return print_write_or_check(argv, generate(), (SCHEMA_PATH,), "rlhfjob.kubegen")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
