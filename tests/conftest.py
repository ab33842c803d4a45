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
