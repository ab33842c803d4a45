"""RFC 7386 merge patches on plain documents: how tests, examples and the harness derive one job
from another, the same way `kubectl patch --type merge` would."""

from __future__ import annotations

import copy
from typing import Any


def merge_patch(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch: dicts merge, other values replace, None deletes."""
    result = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge_patch(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result
