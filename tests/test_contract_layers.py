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

MODULE_LINE_LIMIT, CLASS_LINE_LIMIT, FUNCTION_LINE_LIMIT = 600, 300, 80
"""No production module, class or function is longer: past it, it holds more than one idea."""
SIZE_EXCEPTIONS: dict[str, str] = {}
"""`path:qualified name` of a justified exception, and the reason; none today."""
TRAINER_LAYERS = [
    ["registry", "seeds", "topology", "elastic", "masked"],
    ["sandbox"],
    ["modeling"],
    ["state"],
    ["data"],
    ["rewards"],
    ["rollout"],
    ["algo"],
    ["environments"],
    ["ranks"],
    ["run"],
]
"""The trainer's floors, bottom up: the ground floor's modules, then its sub-packages by
concern; a module imports only from its own floor or the ones below (docs/design.md)."""
DECISION_CORE = PACKAGES["rlhf_operator"] / "lifecycle"
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


def production_files() -> list[Path]:
    names = ("rlhfjob", "rlhf_operator", "rlhf_trainer", "rlhfjob_cli")
    return [path for name in names for path in PACKAGES[name].rglob("*.py")]


def oversized(path: Path, root: Path = ROOT) -> dict[str, int]:
    """`path`'s module, classes and functions over their limits, by `path:qualified name`."""
    text = path.read_text()
    where = str(path.relative_to(root))
    found: dict[str, int] = {}
    if (lines := len(text.splitlines())) > MODULE_LINE_LIMIT:
        found[where] = lines

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                lines = child.end_lineno - child.lineno + 1
                limit = CLASS_LINE_LIMIT if isinstance(child, ast.ClassDef) else FUNCTION_LINE_LIMIT
                if lines > limit:
                    found[f"{where}:{prefix}{child.name}"] = lines
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(text), "")
    return found


def test_no_production_module_class_or_function_is_over_its_limit() -> None:
    too_long = {k: v for p in production_files() for k, v in oversized(p).items()}
    assert {k: v for k, v in too_long.items() if k not in SIZE_EXCEPTIONS} == {}
    assert set(SIZE_EXCEPTIONS) <= set(too_long), "an exception that no longer is one"


def test_the_size_check_finds_long_functions_and_classes(tmp_path: Path) -> None:
    def body(lines: int) -> str:
        return "\n".join(f"        x{i} = {i}" for i in range(lines))

    source = tmp_path / "long.py"
    source.write_text(
        f"class C:\n    def f(self):\n{body(FUNCTION_LINE_LIMIT)}\n"
        f"class D:\n    def g(self):\n{body(FUNCTION_LINE_LIMIT - 1)}\n"
        f"    def h(self):\n{body(CLASS_LINE_LIMIT - FUNCTION_LINE_LIMIT)}\n"
    )
    assert oversized(source, tmp_path) == {
        "long.py:C.f": FUNCTION_LINE_LIMIT + 1,
        "long.py:D": CLASS_LINE_LIMIT + 2,
        "long.py:D.h": CLASS_LINE_LIMIT - FUNCTION_LINE_LIMIT + 1,
    }


def trainer_floor(module: str) -> int:
    """The floor of a trainer module (`rlhf_trainer.rollout.fleet` -> rollout's)."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else ""
    for floor, names in enumerate(TRAINER_LAYERS):
        if name in names:
            return floor
    raise AssertionError(f"{module}: not on any floor of TRAINER_LAYERS")


def test_the_trainer_imports_only_its_own_floor_or_below() -> None:
    graph = import_graph()
    trainer = [name for name in graph if name.startswith("rlhf_trainer.")]
    wrong = {
        name: sorted(
            dep
            for dep in graph[name]
            if dep.startswith("rlhf_trainer.") and trainer_floor(dep) > trainer_floor(name)
        )
        for name in trainer
    }
    assert {name: deps for name, deps in wrong.items() if deps} == {}


def test_every_trainer_package_is_a_floor() -> None:
    root = PACKAGES["rlhf_trainer"]
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    modules = {p.stem for p in root.glob("*.py")} - {"__init__"}
    assert packages | modules == {name for floor in TRAINER_LAYERS for name in floor}


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
