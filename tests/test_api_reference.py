"""The field reference (`docs/api-reference.md`): generated from the models and never stale."""

from __future__ import annotations

import re

from rlhfjob import api, docgen


def test_committed_reference_is_fresh() -> None:
    assert docgen.main(["check"]) == 0, (
        "docs/api-reference.md is stale: run `task crds` and commit the result"
    )


def test_every_model_has_a_section_with_a_row_per_field() -> None:
    text = docgen.render_reference()
    for model in (api.RLHFJobSpec, api.RoleSpec, api.Toleration, api.RLHFJobStatus):
        section = text.split(f"\n## {model.__name__}\n", 1)[1].split("\n## ", 1)[0]
        for name, field in model.model_fields.items():
            assert f"| `{field.alias or name}` |" in section, f"{model.__name__}.{name}"


def test_rows_show_type_default_and_description() -> None:
    text = docgen.render_reference()
    assert (
        "| `groupSize` | integer, 1 to 1024 | `8` | Responses sampled per prompt (every estimator "
        "but ppo; grpo normalises rewards within each group). |" in text
    )
    assert "| `image` | string | required |" in text
    assert "| `head` | [HeadSpec](#headspec) | its fields' defaults |" in text
    assert "| `lastHeartbeatTime` | timestamp |" in text
    assert "At: `spec.roles.reference`, `spec.roles.critic`." in text


def test_the_reference_and_the_training_guide_list_every_algorithm_with_its_paper() -> None:
    reference = docgen.render_reference()
    guide = (docgen.REPO_ROOT / "docs" / "training.md").read_text()
    for table in (api.ADVANTAGE_ESTIMATORS, api.POLICY_LOSSES, api.LOSS_AGGREGATIONS):
        for name, choice in table.items():
            papers = re.findall(r"arXiv:\d{4}\.\d{5}", choice.paper)
            assert papers, name
            assert f"`{name}` ({choice.paper})" in reference, name
            row = next((line for line in guide.splitlines() if line.startswith(f"| `{name}`")), "")
            assert all(paper in row for paper in papers), (name, row)
