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
    assert users == {"testing.py", "attack_report.py"}  # the fixtures; a pytest plugin


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


# ---------------------------------------------------------------------------------------------
# The modules' own graph, and their size

MODULE_LINE_LIMIT = 800
"""No production module is longer: past it a module holds more than one idea."""
DECISION_CORE = PACKAGES["rlhf_operator"] / "lifecycle"
DECISION_CORE_LIMITS = (600, 300)
"""Lines per module and per class in the decision core (issue: the 932-line planner class)."""
DECISION_CORE_LAYERS = [
    ["plan"],
    ["builder"],
    ["shared"],
    ["reports", "drain"],
    ["scaling"],
    ["admission", "training", "ending"],
    ["provisioning"],
    ["ladder"],
    ["__init__"],
]
"""The decision core's layers, top down: a module imports only modules of layers above its own."""


def module_name(path: Path) -> str:
    for package, root in PACKAGES.items():
        if path.is_relative_to(root):
            parts = path.relative_to(root).with_suffix("").parts
            return ".".join([package, *parts]).removesuffix(".__init__")
    raise AssertionError(path)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for root in PACKAGES.values() for p in root.rglob("*.py")}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project's modules `path` imports, anywhere in it (a deferred import still makes a
    circle: it only hides it from the interpreter until the call)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
    return {name for name in found if name in known}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    graph = {name: imported_modules(path, known) - {name} for name, path in modules.items()}
    for name in graph:  # a package's __init__ importing its own modules is not a circle
        graph[name] = {dep for dep in graph[name] if not name.startswith(f"{dep}.")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_circle() -> None:
    assert circles(import_graph()) == []


def test_circles_are_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_production_module_is_over_the_line_limit() -> None:
    production = [p for name in ("rlhfjob", "rlhf_operator", "rlhf_trainer", "rlhfjob_cli")
                  for p in PACKAGES[name].rglob("*.py")]  # fmt: skip
    long = {str(p.relative_to(ROOT)): n for p in production
            if (n := len(p.read_text().splitlines())) > MODULE_LINE_LIMIT}  # fmt: skip
    assert long == {}


def test_the_decision_core_is_small_pieces() -> None:
    module_limit, class_limit = DECISION_CORE_LIMITS
    too_long: dict[str, int] = {}
    for path in DECISION_CORE.glob("*.py"):
        tree = ast.parse(path.read_text())
        if (lines := len(path.read_text().splitlines())) > module_limit:
            too_long[path.name] = lines
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                if (lines := node.end_lineno - node.lineno + 1) > class_limit:
                    too_long[f"{path.name}:{node.name}"] = lines
    assert too_long == {}


def test_the_decision_core_imports_only_upward_layers() -> None:
    layer_of = {name: i for i, layer in enumerate(DECISION_CORE_LAYERS) for name in layer}
    assert set(layer_of) == {p.stem for p in DECISION_CORE.glob("*.py")}, "a module's layer"
    prefix = "rlhf_operator.lifecycle."
    graph = import_graph()
    wrong = {}
    for stem, layer in layer_of.items():
        module = prefix.removesuffix(".") if stem == "__init__" else prefix + stem
        below = {
            dep.removeprefix(prefix)
            for dep in graph[module]
            if dep.startswith(prefix) and layer_of[dep.removeprefix(prefix)] >= layer
        }
        if below:
            wrong[stem] = sorted(below)
    assert wrong == {}


def test_the_design_module_map_names_every_module() -> None:
    """`docs/design.md`'s "Where things live" names each module a newcomer may open."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text[text.index("## Where things live") : text.index("## Decisions taken")]
    unnamed = {
        str(path.relative_to(ROOT))
        for root in PACKAGES.values()
        for path in root.rglob("*.py")
        if path.name != "__init__.py" and path.stem not in block
    }
    assert unnamed == set()
