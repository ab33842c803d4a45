"""Small RLHFJobs for the local cluster: roles on the fake GPU pools, head on the CPU pool.

Used by the operator's e2e tests and its latency benchmark. Their driver is a Python one-liner
(`spec.entrypoint`) rather than the trainer, so they test the operator's lifecycle quickly.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from rlhf_local import pools
from rlhfjob.invalid_cases import merge_patch, valid_job

GPU_TOLERATION = {"key": pools.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def driver(code: str) -> str:
    """An entrypoint that runs `code` with this interpreter (the stand-in Ray's Python)."""
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


SLEEP_FOREVER = driver("import time\nwhile True: time.sleep(1)")
FINISH_AT_ONCE = driver("print('trained')")


def job_manifest(name: str, namespace: str, entrypoint: str, **spec: Any) -> dict[str, Any]:
    """A job with one trainer and one rollout replica, each asking for one fake GPU."""
    small = {"cpu": "1", "memory": "1Gi"}

    def on_pool(pool: str) -> dict[str, Any]:
        return {
            **small,
            "gpus": 1,
            "nodeSelector": {pools.POOL_LABEL: pool},
            "tolerations": [GPU_TOLERATION],
        }

    document = merge_patch(
        valid_job(name),
        {
            "metadata": {"namespace": namespace},
            "spec": {
                "entrypoint": entrypoint,
                "head": {**small, "nodeSelector": {pools.POOL_LABEL: "cpu"}},
                "roles": {"trainer": on_pool("gpu-train"), "rollout": on_pool("gpu-rollout")},
                "liveness": {"progressTimeoutSeconds": 3600},
            },
        },
    )
    return merge_patch(document, {"spec": spec})
