"""Shared test setup: the unit tier imports helper modules from this folder.

Every Ray started by the tests (in this process or by a driver it spawns) runs without token
authentication. Ray turns tokens on by itself when `~/.ray/auth_token` exists, and it caches the
mode per process: once one test connected with auth disabled, a later local Ray started with the
file present would demand a token that process no longer sends.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(items: list) -> None:
    """The slow tests (training, Ray) first, the quick ones after them: on several workers
    (pytest-xdist, handing out one test at a time) the quick ones then fill the end, where a
    slow one started last kept one worker busy minutes after the other ran out (longest
    first). A stable sort: each group keeps its order."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
