"""One invalid RLHFJob of the tables (`rlhfjob.invalid_cases`): a patch on a small valid job
and the field every layer must blame, with the patch helpers the tables are written in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job


@dataclass(frozen=True)
class InvalidCase:
    id: str
    patch: dict[str, Any]
    field: str
    """The field path every layer must name, e.g. `spec.algorithm.groupSize`."""
    rule_message: str | None = None
    """For CEL rules: the rule's message, which every layer must show too."""

    def job(self) -> dict[str, Any]:
        return merge_patch(valid_job(f"invalid-{self.id}"), self.patch)


def spec_patch(**patch: Any) -> dict[str, Any]:
    return {"spec": patch}


def role_patch(role: str, **patch: Any) -> dict[str, Any]:
    return spec_patch(roles={role: patch})


def toleration_patch(role: str, **toleration: Any) -> dict[str, Any]:
    return role_patch(role, tolerations=[toleration])


RANDOM_INIT = {"policy": None, "randomInit": {"model_type": "llama", "vocab_size": 16}}
"""A `model` patch: a random-initialised policy, which has no tokenizer unless one is named."""
