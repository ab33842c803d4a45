"""Loading RLHFJob files with errors a person can act on.

The CLI, the trainer and the tests all load jobs through here, so a bad file fails the same way
everywhere: one line per problem, naming the field (`spec.algorithm.groupSize: ...`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlhfjob.api import RLHFJob


class InvalidJobError(ValueError):
    """The job does not satisfy the API's schema or rules; `problems` holds one line per field."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source} is not a valid RLHFJob:\n  " + "\n  ".join(problems))


class UnknownFieldsError(InvalidJobError):
    """Every problem is a field these models do not have. From a file, a typo; from the API
    server, which drops the fields its CRD lacks, a CRD newer than this code (an operator not
    yet upgraded must leave such a job alone, not fail it)."""


_BLAMING = ("cel_rule", "duplicate_key")
"""Errors raised on an object that name the field (or list entry) at fault in their context."""


def describe_errors(error: ValidationError) -> list[str]:
    """Render pydantic errors as `field.path: message` lines (wire names, camelCase)."""
    lines = []
    for item in error.errors():
        where = ""
        for part in item["loc"]:
            where += f"[{part}]" if isinstance(part, int) else f".{part}"
        context = item.get("ctx", {})
        field = context.get("field") if item["type"] in _BLAMING else None
        message = item["msg"].removeprefix("Value error, ")
        # A node's other broken rules (`rlhfjob.api.base._rule_error`), one line each.
        for blamed, text in [(field, message), *context.get("also", ())]:
            path = where
            if blamed:  # the field (or entry) a rule blames, as the server does
                path += blamed if blamed.startswith("[") else f".{blamed}"
            path = path.lstrip(".")
            lines.append(f"{path}: {text}" if path else text)
    return lines


def parse_job(document: dict[str, Any], source: str = "<object>") -> RLHFJob:
    try:
        return RLHFJob.model_validate(document)
    except ValidationError as error:
        unknown = all(item["type"] == "extra_forbidden" for item in error.errors())
        raise (UnknownFieldsError if unknown else InvalidJobError)(
            source, describe_errors(error)
        ) from None


def load_job(path: str | Path) -> RLHFJob:
    """Read one RLHFJob from a YAML file."""
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise InvalidJobError(str(path), [str(error)]) from None
    if not isinstance(document, dict):
        raise InvalidJobError(str(path), ["the file must hold one YAML mapping (an RLHFJob)"])
    return parse_job(document, str(path))
