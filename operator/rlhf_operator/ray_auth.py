"""Ray token auth: one operator key, one token per job, and no Secret the operator must read.

Every RayCluster runs Ray with token auth (KubeRay's `authOptions.mode: token`), so nothing
outside the job can submit code to its head, stop it or read its state. The token is an HMAC of
the job's identity under the operator's key: the operator creates the job's Secret (which
KubeRay puts in every Ray container's environment), named after the token's fingerprint, and can
compute both again after a restart, so its RBAC needs only `create` on Secrets: never `get`,
`list` or `patch` (whose answer would carry a Secret's data). Deleting and recreating a job
gives a new uid, hence a new token; a new key gives new tokens and new Secret names.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from rlhf_operator.ports import Dashboard
from rlhfjob.api import RLHFJob

MIN_KEY_BYTES = 32


class RayAuthKeyError(ValueError):
    """The operator's key is missing or too short to derive tokens from."""


class RayAuth:
    """Derives each job's Ray token from the operator's secret key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise RayAuthKeyError(
                f"the Ray auth key has {len(key)} bytes; it needs {MIN_KEY_BYTES}"
            )
        self._key = key

    @classmethod
    def from_file(cls, path: str | Path) -> RayAuth:
        try:
            key = Path(path).read_bytes().strip()
        except OSError as error:
            raise RayAuthKeyError(f"cannot read the Ray auth key {path}: {error}") from None
        return cls(key)

    @staticmethod
    def new_key() -> bytes:
        """A fresh key (for the local harness; the Helm chart makes and keeps its own)."""
        return secrets.token_hex(MIN_KEY_BYTES).encode()

    def token(self, job: RLHFJob) -> str:
        identity = f"{job.metadata.namespace}/{job.metadata.name}/{job.metadata.uid or ''}"
        return hmac.new(self._key, identity.encode(), hashlib.sha256).hexdigest()

    def dashboard(self, job: RLHFJob, url: str) -> Dashboard:
        """The job's Ray dashboard at `url`, with the token it asks for."""
        return Dashboard(url, self.token(job))

    def __repr__(self) -> str:  # never the key, in a log or a traceback
        return "RayAuth(<key>)"
