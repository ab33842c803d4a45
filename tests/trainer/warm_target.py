"""A stand-in for `rlhfjob train` that the warm driver's tests fork (`test_warmstart.py`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path


def main(argv: list[str]) -> int:
    """`train echo CODE`: print the environment's marker and the arguments, return CODE.
    `train wait PIDFILE`: write the pid, wait; SIGTERM makes it return 4 (a clean stop)."""
    _, action, value = argv
    if action == "echo":
        print(f"marker={os.environ.get('WARM_TEST_MARKER')} argv={argv} cwd={Path.cwd()}")
        sys.stdout.flush()
        return int(value)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    Path(value).write_text(str(os.getpid()))
    stopped.wait()
    return 4
