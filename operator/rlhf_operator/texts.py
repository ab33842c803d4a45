"""How much of a message the operator keeps, wherever it writes one: one place for each limit.

Messages quote their sources (the API server, KubeRay, Ray, the trainer) in their own words,
which can run to pages; what says why fits well within these.
"""

from __future__ import annotations

MESSAGE_LIMIT = 4096
"""The most of a message the status keeps (the job's, a condition's) and of an error or a Ray
job's message read back: the API's limits are higher, but what says why fits here."""
REASON_LIMIT = 1024
"""A condition reason's limit in the API."""
EVENT_MESSAGE_LIMIT = 1024
"""An Event's message: the API server refuses longer ones."""
CAUSE_LIMIT = 800
"""What is kept of the API server's or KubeRay's words on why the cluster does not come up."""
RESTART_MESSAGE_LIMIT = 1000
"""A restart record's message in `status.restartHistory` (kept short: the history is long)."""
STATUS_MESSAGE_MAX_LENGTH = 32768
"""The CRD's `maxLength` of `status.message`: the most a status write may carry (a job refused
before it is reconciled says all of why)."""


def trim(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, an ellipsis saying so."""
    return text if len(text) <= limit else text[: limit - 3] + "..."
