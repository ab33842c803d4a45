"""The layers the contract sits between: imports run only downward, and the wheel holds no
development code.

API and contract (`rlhfjob`) ← operator (`rlhf_operator`), trainer (`rlhf_trainer`) ← CLI
(`rlhfjob_cli`, the one place that imports everything). The local harness (`rlhf_local`) is a
development install of its own, and only its pytest fixtures import pytest.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).parent.parent
PACKAGES = {
    "rlhfjob": ROOT / "rlhfjob",
    "rlhf_operator": ROOT / "operator" / "rlhf_operator",
    "rlhf_trainer": ROOT / "trainer" / "rlhf_trainer",
    "rlhfjob_cli": ROOT / "cli" / "rlhfjob_cli",
    "rlhf_local": ROOT / "e2e" / "rlhf_local",
}
MAY_NOT_IMPORT = {
    "rlhfjob": {"rlhf_operator", "rlhf_trainer", "rlhfjob_cli", "rlhf_local"},
    "rlhf_operator": {"rlhf_trainer", "rlhfjob_cli", "rlhf_local"},
    "rlhf_trainer": {"rlhf_operator", "rlhfjob_cli", "rlhf_local"},
    "rlhf_local": {"rlhfjob_cli"},
}


def imports(path: Path, *, top_level_only: bool = False) -> set[str]:
    """Top-level package names `path` imports (anywhere, or only at module level)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(MAY_NOT_IMPORT))
def test_no_import_runs_upward(package: str) -> None:
    wrong = {
        str(path.relative_to(ROOT)): sorted(imports(path) & MAY_NOT_IMPORT[package])
        for path in PACKAGES[package].rglob("*.py")
    }
    assert {path: names for path, names in wrong.items() if names} == {}


def test_only_the_harness_fixtures_import_pytest() -> None:
    users = {
        path.name
        for path in PACKAGES["rlhf_local"].glob("*.py")
        if "pytest" in imports(path, top_level_only=True)
    }
    assert users == {"testing.py"}


def test_the_wheel_holds_the_cli_and_not_the_harness() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    packaged = {
        package.split(".")[0]
        for where in find["where"]
        for package in find_packages(where=str(ROOT / where), include=find["include"])
    }
    assert packaged == {"rlhfjob", "rlhf_operator", "rlhf_trainer", "rlhfjob_cli"}
    assert pyproject["project"]["scripts"]["rlhfjob"] == "rlhfjob_cli:main"
