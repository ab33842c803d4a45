"""Shared test setup: the unit tier imports helper modules from this folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
