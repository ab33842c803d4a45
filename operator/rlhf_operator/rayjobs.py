"""A small client for Ray's Job Submission REST API on the head's dashboard.

Only what the operator needs: submit (idempotent by submission id), read one job's status, stop
it. Every call carries the job's Ray token and has a timeout; a dashboard that does not answer
(or refuses the token) raises `DashboardUnavailableError`, which the reconciler turns into a
condition and a retry, never a failure of the job.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from rlhf_operator.parsers import ray_job_view
from rlhf_operator.ports import Dashboard, DashboardUnavailableError
from rlhf_operator.views import RayJobView

__all__ = ["DashboardUnavailableError", "RayJobClient"]

REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=10)


class RayJobClient:
    """`ports.RayJobsPort` over aiohttp."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def _request(
        self, method: str, dashboard: Dashboard, path: str, payload: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        url = f"{dashboard.url}{path}"
        headers = {"Authorization": f"Bearer {dashboard.token}"} if dashboard.token else {}
        try:
            async with self._session.request(
                method, url, json=payload, headers=headers, timeout=REQUEST_TIMEOUT
            ) as response:
                text = await response.text()
                if response.status in (401, 403):  # a token that does not match this head
                    raise DashboardUnavailableError(f"{method} {url}: HTTP {response.status}")
                if response.status >= 500 and "already exists" not in text:
                    problem = f"{method} {url}: HTTP {response.status}: {text}"
                    raise DashboardUnavailableError(problem)
                try:
                    body = await response.json(content_type=None) if text else None
                except ValueError:
                    body = text
                return response.status, body
        except (aiohttp.ClientError, TimeoutError) as error:
            problem = f"{method} {url}: {error or type(error).__name__}"
            raise DashboardUnavailableError(problem) from None

    async def status(self, dashboard: Dashboard, submission_id: str) -> RayJobView | None:
        """The job's state, or None when no job with that id was submitted."""
        code, body = await self._request("GET", dashboard, f"/api/jobs/{submission_id}")
        if code == 404:
            return None
        if code != 200 or not isinstance(body, dict) or "status" not in body:
            raise DashboardUnavailableError(f"unexpected answer for job {submission_id}: {code}")
        return ray_job_view(submission_id, body)

    async def submit(
        self,
        dashboard: Dashboard,
        submission_id: str,
        entrypoint: str,
        *,
        env: dict[str, str],
        metadata: dict[str, str],
    ) -> None:
        """Submit once: a second submission of the same id is a no-op, not a duplicate job."""
        payload = {
            "entrypoint": entrypoint,
            "submission_id": submission_id,
            "runtime_env": {"env_vars": env},
            "metadata": metadata,
        }
        code, body = await self._request("POST", dashboard, "/api/jobs/", payload)
        if code == 200 or "already exists" in str(body):
            return
        raise DashboardUnavailableError(f"submitting {submission_id}: HTTP {code}: {body}")

    async def stop(self, dashboard: Dashboard, submission_id: str) -> None:
        code, body = await self._request("POST", dashboard, f"/api/jobs/{submission_id}/stop")
        if code not in (200, 404):
            raise DashboardUnavailableError(f"stopping {submission_id}: HTTP {code}: {body}")
