"""How the trainer driver tells the operator why it stopped: its exit code and last output line.

Ray reports the exit code and the tail of the driver's output; the last line is a `FinalStatus`:
``RLHFJOB_FINAL_STATUS code=<n> reason=<Reason> message=<text>``. `message` is always last and
runs to the end of the line; other ``key=value`` fields may be added before it and a reader
ignores the ones it does not know.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import IntEnum, StrEnum

FINAL_STATUS_PREFIX = "RLHFJOB_FINAL_STATUS"
_MESSAGE = " message="


class ExitCode(IntEnum):
    """How the trainer driver tells the operator why it stopped (Ray reports the exit code)."""

    SUCCEEDED = 0
    FAILED = 1
    """An unexpected error: retrying from the last checkpoint may help."""
    NON_RETRYABLE = 3
    """Bad config, missing model or dataset, broken reward function: retrying cannot help."""
    TERMINATED = 4
    """Stopped by SIGTERM after a clean shutdown (suspend, preemption)."""


class ExitReason(StrEnum):
    """The word for each exit code in the final status line."""

    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    INVALID_JOB = "InvalidJob"
    TERMINATED = "Terminated"


_REASONS = {
    ExitCode.SUCCEEDED: ExitReason.SUCCEEDED,
    ExitCode.FAILED: ExitReason.FAILED,
    ExitCode.NON_RETRYABLE: ExitReason.INVALID_JOB,
    ExitCode.TERMINATED: ExitReason.TERMINATED,
}


@dataclass(frozen=True)
class FinalStatus:
    code: int | None
    """None when a line from some other writer had none."""
    reason: str
    message: str = ""

    @classmethod
    def of(cls, code: ExitCode, message: str) -> FinalStatus:
        """The status for an exit code; the message is folded onto one line, without the
        terminal colour codes Ray puts in its errors (they end up in status and Events)."""
        return cls(int(code), _REASONS[code].value, " ".join(plain(message).split()))

    def format(self) -> str:
        return (
            f"{FINAL_STATUS_PREFIX} code={self.code} reason={self.reason}{_MESSAGE}{self.message}"
        )

    @classmethod
    def parse(cls, output: str) -> FinalStatus | None:
        """The last final status line in a driver's output, or None when it has none."""
        for line in reversed(output.splitlines()):
            if line.startswith(FINAL_STATUS_PREFIX):
                return cls._parse_line(line)
        return None

    @classmethod
    def _parse_line(cls, line: str) -> FinalStatus:
        head, _, message = line.partition(_MESSAGE)
        known = dict(token.partition("=")[::2] for token in head.split()[1:])
        code = known.get("code", "")
        return cls(
            int(code) if code.lstrip("-").isdigit() else None,
            known.get("reason", ""),
            plain(message),
        )


_TERMINAL_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain(text: str) -> str:
    """`text` without ANSI terminal escape sequences (colours)."""
    return _TERMINAL_ESCAPE.sub("", text)
