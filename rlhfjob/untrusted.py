"""Answers from endpoints a job controls, read so that none can hurt the reader.

The operator's Ray dashboard client (`rlhf_operator.rayjobs`) talks to a head that runs the job's
own code, and the trainer's remote-reward client (`rlhf_trainer.rewards.remote`) to a server the
job names. Either may answer anything: a redirect to an address the caller would never have
picked (with the caller's token), a gzip body that inflates a thousandfold, a body of gigabytes,
an error page holding a secret. Both clients keep the same rules, written once here (stdlib
only, so both sides may import it; docs/security.md, "Untrusted endpoints"):

* no redirect is followed: a 3xx is a failure (`redirect_problem`);
* nothing is decompressed: a Content-Encoding other than identity is refused
  (`encoding_problem`); the clients ask for none;
* a body is read up to a bound and no further (`DASHBOARD_MAX_BYTES`,
  `REWARD_ANSWER_MAX_BYTES`, `ERROR_BODY_MAX_BYTES`); a longer one is an error
  (`BodyTooLargeError`), never read whole;
* what an answer says reaches a status, an Event or a log only as a `snippet`: printable ASCII,
  at most `SNIPPET_CHARS` characters, secrets masked.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = [
    "DASHBOARD_MAX_BYTES",
    "ERROR_BODY_MAX_BYTES",
    "REWARD_ANSWER_MAX_BYTES",
    "SNIPPET_CHARS",
    "BodyTooLargeError",
    "encoding_problem",
    "redirect_problem",
    "snippet",
    "too_long_declared",
]

MIB = 1024 * 1024
DASHBOARD_MAX_BYTES = 1 * MIB
"""The most the operator reads of one Ray dashboard answer. The Job Submission API's answers
the operator asks for (one job's state, a submission's id) are a few KiB; Ray's own message in
them (the driver's last log lines) is kept short by Ray."""
REWARD_ANSWER_MAX_BYTES = 16 * MIB
"""The most the trainer reads of one remote reward server's answer: a request holds at most
`batchSize` (65536) samples, and one sample's reward (a float, or a `classify` result with a
few labels) takes well under 256 bytes of JSON."""
ERROR_BODY_MAX_BYTES = 16 * 1024
"""The most read of a non-2xx answer, of which only a snippet is ever shown."""
SNIPPET_CHARS = 200
"""The longest snippet of an answer that a status, an Event or a log line quotes."""
IDENTITY_ENCODINGS = frozenset({"", "identity"})

_MASK = "<redacted>"
_SECRET_PATTERNS = (
    # user:password@ in a URL
    (re.compile(r"(?<=://)[^/\s@]+@"), _MASK + "@"),
    # Authorization headers and bearer / basic credentials
    (re.compile(r"(?i)\b(bearer|basic)\s+[\w.~+/=-]+"), r"\1 " + _MASK),
    # key=value and "key": "value" forms of the usual credential names
    (
        re.compile(
            r"(?i)\b([\w-]*(?:token|secret|password|passwd|api[_-]?key|access[_-]?key|"
            r"authorization|credential|session)[\w-]*)"
            r"(\"?'?\s*[:=]\s*\"?'?)([^\s\"',;&}]+)"
        ),
        r"\1\2" + _MASK,
    ),
    # JSON Web Tokens (a Kubernetes ServiceAccount token among them)
    (re.compile(r"\beyJ[\w-]{6,}\.[\w-]*\.?[\w-]*"), _MASK),
    # cloud and API keys of well-known shapes
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), _MASK),
    (re.compile(r"\b(?:sk|pk|rk|ghp|gho|ghs|xox[abp])[-_][\w-]{16,}"), _MASK),
    # long hex strings (a Ray token is 64 hex digits) and long mixed-case base64 runs
    (re.compile(r"\b[0-9a-fA-F]{32,}\b"), _MASK),
    (re.compile(r"(?=[\w+/=-]*[a-z])(?=[\w+/=-]*[A-Z])(?=[\w+/=-]*\d)[\w+/=-]{32,}"), _MASK),
)
_NOT_PRINTABLE = re.compile(r"[^\x20-\x7e]")


class BodyTooLargeError(ValueError):
    """An answer longer than the reader's bound; what it would have read is not kept."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the answer is longer than {limit} bytes")
        self.limit = limit


def snippet(
    text: str | bytes | bytearray | None,
    *,
    secrets: Iterable[str | None] = (),
    limit: int = SNIPPET_CHARS,
) -> str:
    """`text` as a status, an Event or a log line may quote it: the `secrets` given (the token
    the caller sent) and anything shaped like a credential masked, printable ASCII on one line,
    at most `limit` characters (`...` marks a cut)."""
    if text is None:
        return "(empty)"
    if isinstance(text, bytes | bytearray):
        text = bytes(text[: limit * 8]).decode("utf-8", errors="replace")
    else:
        text = text[: limit * 8]  # masking and cleaning need only what can be shown
    for secret in secrets:
        if secret:
            text = text.replace(secret, _MASK)
    text = " ".join(_NOT_PRINTABLE.sub(" ", text).split())
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    if not text:
        return "(empty)"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def redirect_problem(status: int) -> str | None:
    """Why an answer of `status` is not used: a redirect is never followed (it would carry the
    request, and a token, to an address the caller did not choose). None for any other status."""
    if 300 <= status < 400:
        return f"HTTP {status}: a redirect, which is not followed"
    return None


def encoding_problem(content_encoding: str | None) -> str | None:
    """Why an answer with this Content-Encoding is not read: a compressed body can inflate
    without bound, and nothing here inflates it. None for no encoding or identity."""
    value = (content_encoding or "").strip().lower()
    if value in IDENTITY_ENCODINGS:
        return None
    return f"the answer is encoded ({snippet(value, limit=40)}), which is not accepted"


def too_long_declared(content_length: str | None, limit: int) -> bool:
    """Whether a Content-Length already says the body is over `limit` (then nothing of it is
    read). A missing or malformed header says nothing: the read itself stops at the bound."""
    if content_length is None:
        return False
    try:
        return int(content_length.strip()) > limit
    except ValueError:
        return False
