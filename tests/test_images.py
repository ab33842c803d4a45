"""The images: non-root, source not writable by the runtime user, every dependency pinned."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
IMAGES = {"trainer": ["trainer"], "operator": ["operator"]}
"""Image → the pyproject extras its constraints file pins."""


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)", line):
            pins[_canonical(match.group(1))] = match.group(2)
    return pins


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_the_image_runs_as_non_root_and_installs_pinned(image: str) -> None:
    dockerfile = (ROOT / "images" / image / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)
    assert users and not users[-1].startswith(("root", "0")), users
    assert "chown" not in dockerfile, "the runtime user must not own the installed source"
    installs = re.findall(r"pip (?:install|wheel)[^\n]*", dockerfile)
    project_installs = [line for line in installs if '".[' in line]
    assert project_installs and all("--constraint" in line for line in project_installs)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_the_lock_pins_every_dependency_as_pyproject_asks(image: str) -> None:
    pins = _pins(ROOT / "images" / image / "constraints.txt")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in IMAGES[image]:
        for requirement in extras[extra]:
            match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$", requirement)
            assert match, requirement
            name, spec = _canonical(match.group(1)), match.group(3).split(";")[0].strip()
            assert name in pins, f"{name} is not pinned: run images/lock.sh"
            if spec.startswith("=="):
                assert pins[name] == spec[2:], f"{name}: lock {pins[name]}, pyproject {spec}"
