"""A stand-in for a fleet's `log` and `on_change` callbacks, shared by the fleet tests."""

from __future__ import annotations


class Recorder:
    """What the fleet logs and reports."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.counts: list[tuple[int, int]] = []

    def log(self, line: str) -> None:
        self.lines.append(line)

    def report(self, live: int, desired: int) -> None:
        self.counts.append((live, desired))

    def saw(self, text: str) -> bool:
        return any(text in line for line in self.lines)
