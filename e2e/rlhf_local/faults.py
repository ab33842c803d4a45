"""Fault injection against a real training job on the local cluster.

Shared by the e2e fault suite (`e2e/tests/test_faults.py`) and the recovery benchmark
(`benchmarks/recovery.py`). Each injector does what a real failure does: SIGKILL or SIGSTOP the
trainer's driver process (found through the Ray dashboard, since the stand-in's Ray nodes are
local processes), delete a Ray pod (KubeRay replaces it; the stand-in kills that pod's Ray node),
or corrupt a checkpoint on disk. `TrainingRecord` then reads what the trainer wrote (its step
log and checkpoints) to check that every step after the last checkpoint was trained once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from rlhf_local.harness import wait_for
from rlhf_local.jobs import Jobs, ray_get
from rlhf_local.operator_process import OperatorProcess
from rlhf_local.paths import REPO_ROOT
from rlhfjob import api
from rlhfjob.patches import merge_patch

EXAMPLE = REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml"
LABEL_JOB = f"{api.GROUP}/job"
STEP_LOG = "metrics.jsonl"


def fault_job(name: str, namespace: str, checkpoints: Path, **spec: Any) -> dict[str, Any]:
    """The tiny GRPO example, tuned to fail often and recover fast.

    One trainer rank and two rollout engines of which one may be lost (``minReplicas: 1``), a
    checkpoint every 4 steps with every checkpoint kept (so a lost one shows), a 1 s heartbeat
    judged stale after 10 s, and 1 s of backoff.
    """
    document = yaml.safe_load(EXAMPLE.read_text())
    document = merge_patch(
        document,
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "algorithm": {"totalSteps": 24},
                "roles": {"trainer": {"replicas": 1}, "rollout": {"minReplicas": 1}},
                "checkpoint": {"path": str(checkpoints), "intervalSteps": 4, "keepLast": 100},
                "liveness": {
                    "heartbeatIntervalSeconds": 1,
                    "heartbeatTimeoutSeconds": 10,
                    "progressTimeoutSeconds": 300,
                },
                "recovery": {
                    "maxRestarts": 3,
                    "backoffSeconds": 1,
                    "clusterRecoveryTimeoutSeconds": 300,
                },
            },
        },
    )
    return merge_patch(document, {"spec": spec})


# --- injectors ----------------------------------------------------------------------------------


def driver_pid(dashboard: str, submission_id: str, token: str | None) -> int | None:
    """The trainer driver's process id, as the Ray dashboard reports it."""
    info = ray_get(dashboard, f"/api/jobs/{submission_id}", token)
    pid = (info.get("driver_info") or {}).get("pid")
    return int(pid) if pid else None


def signal_driver(jobs: Jobs, name: str, signum: int) -> int:
    """Send `signum` to the running driver of the job's current attempt; returns its pid."""
    status = jobs.status(name)
    pid = driver_pid(jobs.dashboard(name), status["submissionId"], jobs.ray_token(name))
    assert pid, f"no driver pid for {status['submissionId']}"
    os.kill(pid, signum)
    return pid


def kill_driver(jobs: Jobs, name: str) -> int:
    """SIGKILL, as the OOM killer would."""
    return signal_driver(jobs, name, signal.SIGKILL)


def freeze_driver(jobs: Jobs, name: str) -> int:
    """SIGSTOP: the process lives on but does nothing, heartbeat thread included (a hang)."""
    return signal_driver(jobs, name, signal.SIGSTOP)


def delete_pod(jobs: Jobs, cluster: str, group: str) -> str:
    """Delete one Ray pod of `group` (``head``, ``trainer``, ``rollout``), as a node loss would."""
    pods = jobs.pods(cluster, group)
    assert pods, f"no {group} pod in {cluster}"
    pod = sorted(pods, key=lambda p: p.metadata.name)[-1]
    jobs.lc.core.delete_namespaced_pod(pod.metadata.name, jobs.namespace, grace_period_seconds=0)
    return str(pod.metadata.name)


@contextlib.contextmanager
def node_drain(jobs: Jobs, cluster: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`kubectl drain` the node of one trainer pod of `cluster` (only that job's pods, so
    nothing else in the cluster is disturbed), in the background as an administrator runs it:
    it cordons the node, then retries the evictions until they are allowed. Yields the node and
    the running drain; the node is uncordoned on leaving."""
    from rlhf_local import cluster as local

    pods = jobs.pods(cluster, "trainer")
    assert pods and pods[0].spec.node_name, f"no scheduled trainer pod in {cluster}"
    node = str(pods[0].spec.node_name)
    drain = subprocess.Popen(
        [str(local.binaries().kubectl), f"--kubeconfig={local.kubeconfig_path()}", "drain",
         node, f"--pod-selector={LABEL_JOB}={cluster}", "--ignore-daemonsets",
         "--delete-emptydir-data", "--timeout=300s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        yield node, drain
    finally:
        if drain.poll() is None:
            drain.kill()
        local.kubectl("uncordon", node)


FULL_TAINT = {"key": "rlhf.dev/full", "value": "true", "effect": "NoSchedule"}
"""What `pool_full` puts on a pool's nodes: no new pod fits, the running ones stay."""


@contextlib.contextmanager
def pool_full(jobs: Jobs, cluster: str, group: str) -> Iterator[list[str]]:
    """Make every node a `group` pod of `cluster` may land on (its nodeSelector) take no new
    pod, as when its node pool is full, so a lost pod of the group is not replaced. A NoSchedule
    taint, not a cordon: the operator reads a cordoned trainer node as a node drain and moves
    the job off it. Yields the nodes; the taint goes on leaving (earlier by `make_room`)."""
    body = jobs.ray_cluster(cluster)
    assert body is not None, f"no RayCluster {cluster}"
    (spec,) = [g for g in body["spec"]["workerGroupSpecs"] if g["groupName"] == group]
    selector = spec["template"]["spec"].get("nodeSelector") or {}
    labels = ",".join(f"{key}={value}" for key, value in sorted(selector.items()))
    listed = jobs.lc.core.list_node(label_selector=labels).items
    nodes = [str(n.metadata.name) for n in listed if n.metadata is not None]
    assert nodes, f"no node matches {group}'s nodeSelector {selector}"
    for name in nodes:
        taints = [*_taints(jobs, name), FULL_TAINT]
        jobs.lc.core.patch_node(name, {"spec": {"taints": taints}})
    try:
        _scheduler_sees_it_full(jobs, selector, spec["template"]["spec"].get("tolerations") or [])
        yield nodes
    finally:
        make_room(jobs, nodes)


def _scheduler_sees_it_full(
    jobs: Jobs, selector: dict[str, str], tolerations: list[dict[str, Any]]
) -> None:
    """Wait until the scheduler itself refuses a pod like the group's: the taint is in its cache,
    so a replacement KubeRay creates at once cannot slip onto the pool before it (a race seen
    under load)."""
    name = "pool-full-probe"
    restricted = client.V1SecurityContext(
        allow_privilege_escalation=False,
        capabilities=client.V1Capabilities(drop=["ALL"]),
        run_as_non_root=True,
        run_as_user=1000,
        seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault"),
    )
    probe = client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            node_selector=selector,
            tolerations=[client.V1Toleration(**_snake(t)) for t in tolerations],
            containers=[
                client.V1Container(name="probe", image="probe", security_context=restricted)
            ],
        ),
    )
    core = jobs.lc.core
    core.create_namespaced_pod(jobs.namespace, probe)
    try:

        def refused() -> bool:
            status = core.read_namespaced_pod(name, jobs.namespace).status
            return any(
                c.type == "PodScheduled" and c.status == "False"
                for c in (status.conditions if status and status.conditions else [])
            )

        wait_for(refused, 30, "the scheduler to refuse a pod on the full pool", interval=0.2)
    finally:
        core.delete_namespaced_pod(name, jobs.namespace, grace_period_seconds=0)


def _snake(fields: dict[str, Any]) -> dict[str, Any]:
    """A toleration from a manifest as the client's model takes it (tolerationSeconds)."""
    return {"toleration_seconds" if k == "tolerationSeconds" else k: v for k, v in fields.items()}


def make_room(jobs: Jobs, nodes: list[str]) -> None:
    """Take `pool_full`'s taint off `nodes`."""
    for name in nodes:
        taints = [t for t in _taints(jobs, name) if t["key"] != FULL_TAINT["key"]]
        jobs.lc.core.patch_node(name, {"spec": {"taints": taints}})


def _taints(jobs: Jobs, node: str) -> list[dict[str, Any]]:
    spec = jobs.lc.core.read_node(node).spec
    taints = spec.taints if spec is not None and spec.taints else []
    return [
        {field: value for field in ("key", "value", "effect") if (value := getattr(t, field))}
        for t in taints
    ]


def remove_checkpoint(step_dir: Path) -> None:
    """Delete one checkpoint from the volume, as a lost or emptied volume would."""
    shutil.rmtree(step_dir)


def corrupt_checkpoint(step_dir: Path) -> Path:
    """Flip bytes in the largest file of a checkpoint, so its hash no longer matches."""
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != "manifest.json"]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    for index in range(0, len(data), max(1, len(data) // 64)):
        data[index] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


# --- what the trainer wrote ---------------------------------------------------------------------


@dataclass
class TrainingRecord:
    """A job's step log and checkpoints, read back from its checkpoint directory."""

    run_dir: Path

    @classmethod
    def of(cls, manifest: dict[str, Any]) -> TrainingRecord:
        spec, meta = manifest["spec"], manifest["metadata"]
        return cls(Path(spec["checkpoint"]["path"]) / meta["namespace"] / meta["name"])

    def records(self) -> list[dict[str, Any]]:
        path = self.run_dir / STEP_LOG
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed driver
            if "kind" not in record:  # a step's line, not an evaluation's
                out.append(record)
        return out

    def steps_by_attempt(self) -> dict[int, list[int]]:
        """The steps each driver attempt logged, in the order it logged them."""
        attempts: dict[int, list[int]] = {}
        for record in self.records():
            attempts.setdefault(int(record.get("attempt", 0)), []).append(int(record["step"]))
        return attempts

    def last_step(self) -> int:
        records = self.records()
        return int(records[-1]["step"]) if records else 0

    def checkpoint_steps(self) -> list[int]:
        """Steps of the checkpoints that verify (manifest, sizes and hashes)."""
        from rlhf_trainer.state.checkpoint import STEP_DIR_PREFIX, CheckpointError, read_checkpoint

        steps = []
        for path in sorted(self.run_dir.glob(f"{STEP_DIR_PREFIX}*")):
            try:
                steps.append(read_checkpoint(path).step)
            except CheckpointError:
                continue
        return steps

    def newest_checkpoint(self) -> int | None:
        steps = self.checkpoint_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        return self.run_dir / f"step-{step:08d}"

    def lineage_problems(self, resumed_from: list[int | None], total_steps: int) -> list[str]:
        """What breaks "every step trained once after the last checkpoint", if anything.

        `resumed_from[k]` is the checkpoint attempt k+1 had to resume from (None: the start):
        the newest complete checkpoint when attempt k died. Attempt 0 trains from step 1, each
        later attempt from its checkpoint + 1, every attempt step by step, the last one to the
        end.
        """
        attempts = self.steps_by_attempt()
        problems = []
        if sorted(attempts) != list(range(len(resumed_from) + 1)):
            problems.append(f"attempts {sorted(attempts)}, expected {len(resumed_from) + 1}")
        for attempt, steps in sorted(attempts.items()):
            if attempt == 0:
                start = 1
            elif attempt - 1 < len(resumed_from):
                start = (resumed_from[attempt - 1] or 0) + 1
            else:
                continue
            expected = list(range(start, start + len(steps)))
            if steps != expected:
                problems.append(f"attempt {attempt} trained steps {steps}, expected {expected}")
        last = attempts[max(attempts)] if attempts else []
        if not last or last[-1] != total_steps:
            problems.append(f"the last attempt ended at {last[-1:]} instead of {total_steps}")
        return problems


def wait_for_step(
    jobs: Jobs, name: str, step: int, timeout: float, operator: OperatorProcess | None = None
) -> int:
    """Wait until the job reports training at `step` or later; returns the step reported."""

    def reached() -> int | None:
        current = jobs.status(name).get("currentStep") or 0
        return int(current) if current >= step and jobs.phase(name) == "Running" else None

    def explain() -> str:
        tail = f"\n{operator.log_tail(60)}" if operator else ""
        return json.dumps(jobs.status(name), indent=1) + tail

    return wait_for(reached, timeout, f"{name} to reach step {step}", interval=0.2, details=explain)


def wait_for_restart(jobs: Jobs, name: str, count: int, timeout: float) -> dict[str, Any]:
    """Wait until the operator recorded restart number `count`; returns its record."""

    def recorded() -> dict[str, Any] | None:
        history = jobs.status(name).get("restartHistory") or []
        return history[count - 1] if len(history) >= count else None

    return wait_for(recorded, timeout, f"restart {count} of {name}", interval=0.1)
