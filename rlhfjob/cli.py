"""The `rlhfjob` command line (sub-commands are filled in as the pieces land)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    raise SystemExit("rlhfjob: not implemented yet")
