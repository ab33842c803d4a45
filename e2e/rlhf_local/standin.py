"""Stand-in Ray: a real local Ray cluster behind every ready KubeRay RayCluster.

Dev and test tooling only. KWOK pods run no processes, so without this a RayCluster in the
local cluster would be an empty shell. The stand-in runs a level-triggered loop over all
RayClusters and their pods:

* a RayCluster whose ``status.state`` is ``ready`` and whose head pod is Ready gets a Ray
  head (``ray start --head``, own ports and temp dir, dashboard on 127.0.0.1); the dashboard
  URL is published as the annotation ``rlhf.dev/dashboard-address`` and the GCS address as
  ``rlhf.dev/gcs-address``;
* every Ready worker pod gets one Ray node that joins that head and advertises its group's
  ``rayStartParams`` (``num-cpus``, ``resources``, ``memory``), with 0 GPUs since there are none;
* a worker pod that is deleted (or terminating) loses its Ray node, so Ray reports it dead;
  a replacement pod gets a new node;
* a deleted head pod, a new head pod, or a deleted RayCluster tears the whole Ray cluster
  down (and clears the annotations); a new head pod then gets a new Ray cluster.

Each Ray node is one ``ray start --block`` process in its own session, so killing its process
group takes the raylet and its workers with it; processes that leave the group (Ray's job
drivers) are found by a marker in their environment and killed too, as they would die with
their pod. A lost head is killed at once and before its workers, as a lost node dies. Every Ray
path lives under ``--temp-root`` so `down` can sweep leftovers. Run as
``python -m rlhf_local.standin --kubeconfig ...``.

``--max-clusters N`` (default: the environment's ``RLHF_STANDIN_MAX_CLUSTERS``, else no limit)
runs at most N Ray clusters at a time; the other RayClusters get no dashboard until one goes.
``0`` turns the stand-in off: it reads nothing and starts nothing (the operator's scale
benchmark runs hundreds of jobs that way), but still says it is ready.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config

from rlhf_local.paths import free_listen_ports, read_ports
from rlhf_local.podenv import pod_environment
from rlhf_operator.names import LABEL_JOB, LABEL_ROLE
from rlhfjob import contract
from rlhfjob.api import ENV_TRAINER_METRICS_PORT
from rlhfjob.contract.env import TRAINER_METRICS_PORT_NAME
from rlhfjob.contract.kuberay import RAY_CLUSTERS, RAY_GROUP, RAY_VERSION

DASHBOARD_ANNOTATION = contract.DASHBOARD_ANNOTATION
GCS_ANNOTATION = "rlhf.dev/gcs-address"
#: Per-node object store: Ray's default (30% of RAM per node) would not fit many nodes here.
OBJECT_STORE_BYTES = int(os.environ.get("RLHF_STANDIN_OBJECT_STORE_BYTES", 100 * 1024 * 1024))
JOIN_TIMEOUT = 90.0
"""Seconds a worker node may take to join its head before it is started again."""
HEAD_START_TIMEOUT = 180.0
AGENT_START_TIMEOUT = 30.0
"""How long a head's dashboard agent may stay unhealthy after its dashboard answers (a few
seconds normally, under 15 on two busy cores) before the head is restarted."""
POLL_SECONDS = 1.0
MAX_CLUSTERS_ENV = "RLHF_STANDIN_MAX_CLUSTERS"


def max_clusters_from_env() -> int | None:
    """`RLHF_STANDIN_MAX_CLUSTERS` as a number (None: unset or empty, no limit)."""
    value = os.environ.get(MAX_CLUSTERS_ENV, "").strip()
    if not value:
        return None
    limit = int(value)
    if limit < 0:
        raise ValueError(f"{MAX_CLUSTERS_ENV} must be 0 or more, not {value}")
    return limit


log = logging.getLogger("standin")


def parse_resources(value: str) -> dict[str, float]:
    """Decode KubeRay's ``resources`` start param, e.g. ``'"{\\"trainer\\": 1}"'``.

    KubeRay passes the value to ``ray start --resources=<value>`` through a shell, so users
    write JSON wrapped in a quoted string; accept that, plain JSON, and unescaped quoting.
    """
    v: Any = value.strip()
    for _ in range(3):
        if isinstance(v, dict):
            return {str(k): float(x) for k, x in v.items()}
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            if isinstance(v, str) and len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
                v = v[1:-1].replace('\\"', '"')
                continue
            raise
    raise ValueError(f"cannot parse rayStartParams resources {value!r}")


def _num(value: str | None, default: int) -> int:
    if value is None:
        return default
    return int(float(str(value).strip().strip("'\"")))


@dataclass
class NodeParams:
    """What one Ray node advertises, from its group's ``rayStartParams``."""

    num_cpus: int
    resources: dict[str, float]
    memory: int | None = None

    @classmethod
    def from_start_params(cls, params: dict[str, str], default_cpus: int) -> NodeParams:
        resources = parse_resources(params["resources"]) if "resources" in params else {}
        memory = _num(params.get("memory"), 0) or None
        return cls(_num(params.get("num-cpus"), default_cpus), resources, memory)

    def args(self) -> list[str]:
        out = [f"--num-cpus={self.num_cpus}", "--num-gpus=0"]
        if self.resources:
            out.append(f"--resources={json.dumps(self.resources)}")
        if self.memory:
            out.append(f"--memory={self.memory}")
        return out


@dataclass
class RayNode:
    """One `ray start --block` process group standing in for one pod."""

    pod: str
    pod_uid: str
    group: str
    pid: int
    params: NodeParams
    log: Path
    log_offset: int
    scrape: dict[str, int] = field(default_factory=dict)
    """The pod's metrics ports by name (Ray's `metrics`, the head's `trainer-metrics`), each
    mapped to a free port on 127.0.0.1 as the pod's own IP would serve it."""
    labels: dict[str, str] = field(default_factory=dict)
    """The pod's namespace and labels, for the scrape targets."""
    registered: bool = False
    started: float = field(default_factory=time.monotonic)

    def is_registered(self) -> bool:
        """`ray start` has printed that the node joined (read from its own log)."""
        if not self.registered:
            try:
                with self.log.open("rb") as fh:
                    fh.seek(self.log_offset)
                    self.registered = b"Ray runtime started" in fh.read()
            except OSError:
                pass
        return self.registered

    def alive(self) -> bool:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, os.WNOHANG)
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2] not in "ZX"

    def kill(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace` (0: at once, as a lost node dies); then every
        process the node started that left its group, since in a pod they die with it."""
        kill_nodes([self], grace)


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def kill_nodes(nodes: list[RayNode], grace: float = 5.0) -> None:
    """`RayNode.kill` for several nodes at once: they share one `grace` period (a cluster's
    teardown waits for its slowest node, not for the sum of them), then one sweep for the
    processes that left their groups."""
    if grace > 0:
        for node in nodes:
            _signal_group(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(node.alive() for node in nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
    for node in nodes:
        _signal_group(node.pid, signal.SIGKILL)
    # Ray's job manager starts each driver in a session of its own: find them by the
    # marker every process of these nodes inherits.
    for pid in _processes_with(POD_MARKER, {node.pod_uid for node in nodes}):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


SCRAPE_TARGETS = "scrape-targets.json"
"""In the state dir: every Ray pod's metrics ports as a Prometheus file_sd target list, labelled
as the chart's PodMonitor labels them (namespace, pod, rlhfjob, role; endpoint the port's name)."""


def _scrape_labels(pod: Any) -> dict[str, str]:
    labels = pod.metadata.labels or {}
    found = {"namespace": pod.metadata.namespace, "pod": pod.metadata.name}
    for key, label in ((LABEL_JOB, "rlhfjob"), (LABEL_ROLE, "role")):
        if key in labels:
            found[label] = labels[key]
    return found


POD_MARKER = "RLHF_STANDIN_POD_UID"
"""Set in every Ray node's environment (the pod's uid), so all its processes can be found."""


def _processes_with(name: str, values: set[str]) -> list[int]:
    """Processes whose environment sets `name` to one of `values`."""
    wanted = {f"{name}={value}".encode() for value in values}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if wanted.intersection(environ.split(b"\0")):
            found.append(int(entry.name))
    return found


@dataclass
class LocalRay:
    """The Ray cluster standing in for one RayCluster (identified by its uid)."""

    namespace: str
    name: str
    uid: str
    head_pod_uid: str
    temp_dir: Path
    gcs_port: int
    dashboard_port: int
    head: RayNode
    workers: dict[str, RayNode] = field(default_factory=dict)

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def gcs(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"


def _answers(url: str, token: str | None) -> bool:
    """Whether `url` answers 200 within 2 s (with the job's Ray token when it has one)."""
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {token}"} if token else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _start_order(pod: Any) -> tuple[bool, str]:
    """Trainer pods before the others, then by name."""
    group = (pod.metadata.labels or {}).get("ray.io/group", "")
    return (group != "trainer", str(pod.metadata.name))


def _pod_ready(pod: Any) -> bool:
    if pod.metadata.deletion_timestamp is not None or pod.status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


class StandIn:
    """Reconciles RayClusters and their pods against the local Ray processes it runs."""

    def __init__(
        self,
        temp_root: Path,
        state_dir: Path,
        log_dir: Path,
        kubeconfig: Path,
        max_clusters: int | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.max_clusters = max_clusters
        """At most this many Ray clusters at a time (None: no limit; 0: the stand-in is off)."""
        self.custom = client.CustomObjectsApi()
        self.core = client.CoreV1Api()
        self.temp_root = temp_root
        self.state_dir = state_dir
        self.log_dir = log_dir
        self.clusters: dict[str, LocalRay] = {}
        self.failures: dict[str, float] = {}  # RayCluster or pod uid -> last failed start
        self.stopping = threading.Event()
        self._joining = False  # a worker node is starting but has not registered yet
        self._seq = 0
        # Ports handed out, never twice; the local cluster's own (its cluster.json, beside
        # this state dir) from the start: one of its servers may be down (a restart test).
        self._ports_taken = set(read_ports(state_dir.parent).values())
        self._ports_lock = threading.Lock()

    def _free_ports(self, count: int) -> list[int]:
        """Ports for a Ray node and its pod, probed free and bound later (Ray's seconds later,
        the trainer's metrics port at each driver attempt): below the kernel's ephemeral range,
        which any outgoing connection may take meanwhile ("Address already in use")."""
        with self._ports_lock:
            ports = free_listen_ports(count, exclude=self._ports_taken)
            self._ports_taken.update(ports)
        return ports

    # --- processes -------------------------------------------------------------------

    def _spawn(
        self, label: str, argv: list[str], pod_env: dict[str, str] | None = None
    ) -> tuple[int, Path, int]:
        """Start `argv` in its own session; return pid, log file and where its output starts."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{label}.log"
        env = {**os.environ, **(pod_env or {})}
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Token auth as the pod asks for it (KubeRay sets RAY_AUTH_MODE and RAY_AUTH_TOKEN in
        # every container of a RayCluster with `authOptions`); else off, whatever this machine
        # has (Ray turns it on by itself when ~/.ray/auth_token exists).
        env["RAY_AUTH_MODE"] = (pod_env or {}).get("RAY_AUTH_MODE", "disabled")
        # A raylet waits this long for its dashboard agent; Ray's default (seconds) is too
        # short when a few Ray nodes start at once on two busy cores.
        env.setdefault("RAY_agent_register_timeout_ms", "120000")
        # How long `ray start` waits for its own node to register with the GCS (its loop
        # gives up after ~30 s otherwise, which a busy machine exceeds).
        env.setdefault("RAY_raylet_start_wait_time_s", "120")
        with log_path.open("ab") as out:
            offset = out.tell()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        return proc.pid, log_path, offset

    def _ray(self) -> str:
        ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
        return ray

    def _start_head(self, rc: dict[str, Any], head_pod: Any) -> LocalRay:
        meta = rc["metadata"]
        self._seq += 1
        temp_dir = self.temp_root / f"{self._seq}"
        shutil.rmtree(temp_dir, ignore_errors=True)
        temp_dir.mkdir(parents=True)
        gcs, dash, client_port, agent, metrics = self._free_ports(5)
        head_spec = rc["spec"].get("headGroupSpec", {})
        params = NodeParams.from_start_params(head_spec.get("rayStartParams") or {}, 1)
        argv = [
            self._ray(),
            "start",
            "--head",
            "--block",
            "--disable-usage-stats",
            f"--port={gcs}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--ray-client-server-port={client_port}",
            f"--dashboard-agent-listen-port={agent}",
            f"--metrics-export-port={metrics}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            f"--temp-dir={temp_dir}",
            *params.args(),
        ]
        label = f"{meta['namespace']}.{meta['name']}.head"
        log.info("starting Ray head for %s/%s: %s", meta["namespace"], meta["name"], argv)
        pod_dir = temp_dir / "pods" / head_pod.metadata.name  # removed with the cluster
        pod_env = pod_environment(self.core, head_pod, self.kubeconfig, pod_dir)
        pod_env[POD_MARKER] = head_pod.metadata.uid
        scrape = {"metrics": metrics}
        if ENV_TRAINER_METRICS_PORT in pod_env:  # the driver's port, on a port of its own here
            (trainer_port,) = self._free_ports(1)
            pod_env[ENV_TRAINER_METRICS_PORT] = str(trainer_port)
            scrape[TRAINER_METRICS_PORT_NAME] = trainer_port
        pid, log_path, offset = self._spawn(label, argv, pod_env)
        head = RayNode(
            head_pod.metadata.name, head_pod.metadata.uid, "head", pid, params, log_path, offset,
            scrape, _scrape_labels(head_pod),
        )  # fmt: skip
        local = LocalRay(
            meta["namespace"],
            meta["name"],
            meta["uid"],
            head_pod.metadata.uid,
            temp_dir,
            gcs,
            dash,
            head,
        )
        deadline = time.monotonic() + HEAD_START_TIMEOUT
        token = pod_env.get("RAY_AUTH_TOKEN")
        dashboard_up: float | None = None
        while True:
            if not head.alive():
                raise RuntimeError(f"Ray head for {label} exited; see {self.log_dir}/{label}.log")
            # Ready: the head node registered (its `ray start` says so), the dashboard, which
            # serves the Job Submission API, answers, and so does the head's dashboard agent,
            # which runs the submitted jobs: KubeRay's readiness probe of a head asks the
            # agent's `local_raylet_healthz` too.
            if head.is_registered() and _answers(f"{local.dashboard}/api/version", token):
                dashboard_up = dashboard_up or time.monotonic()
                if _answers(f"http://127.0.0.1:{agent}/api/local_raylet_healthz", token):
                    break
                if time.monotonic() - dashboard_up > AGENT_START_TIMEOUT:
                    # Its ports are probed free, then bound by Ray a moment later: another
                    # process can take one in between, and the agent never starts ("No
                    # available agent to submit job"). A kubelet would restart the container.
                    head.kill()
                    raise RuntimeError(
                        f"the dashboard agent of the Ray head for {label} is not healthy "
                        f"{AGENT_START_TIMEOUT:.0f}s after its dashboard answered; restarting it"
                    )
            if time.monotonic() > deadline or self.stopping.is_set():
                head.kill()
                raise RuntimeError(f"Ray head for {label} not ready in {HEAD_START_TIMEOUT}s")
            time.sleep(0.25)
        return local

    def _start_worker(self, local: LocalRay, pod: Any, params: NodeParams) -> RayNode:
        agent, metrics = self._free_ports(2)
        argv = [
            self._ray(),
            "start",
            "--block",
            "--disable-usage-stats",
            f"--address={local.gcs}",
            f"--dashboard-agent-listen-port={agent}",
            f"--metrics-export-port={metrics}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            f"--temp-dir={local.temp_dir}",
            *params.args(),
        ]
        group = pod.metadata.labels.get("ray.io/group", "")
        log.info(
            "starting Ray node for pod %s/%s (%s)", pod.metadata.namespace, pod.metadata.name, group
        )
        pod_dir = local.temp_dir / "pods" / pod.metadata.name
        pod_env = pod_environment(self.core, pod, self.kubeconfig, pod_dir)
        pod_env[POD_MARKER] = pod.metadata.uid
        pid, log_path, offset = self._spawn(
            f"{local.namespace}.{local.name}.{pod.metadata.name}", argv, pod_env
        )
        return RayNode(pod.metadata.name, pod.metadata.uid, group, pid, params, log_path, offset,
                       {"metrics": metrics}, _scrape_labels(pod))  # fmt: skip

    # --- API ---------------------------------------------------------------------------

    def _annotate(self, local: LocalRay, publish: bool) -> None:
        value = {
            DASHBOARD_ANNOTATION: local.dashboard if publish else None,
            GCS_ANNOTATION: local.gcs if publish else None,
        }
        try:
            self.custom.patch_namespaced_custom_object(
                RAY_GROUP,
                RAY_VERSION,
                local.namespace,
                RAY_CLUSTERS,
                local.name,
                # The uid makes the patch fail on a successor of the same name (409/422): a
                # torn-down cluster must not clear the new cluster's addresses.
                {"metadata": {"uid": local.uid, "annotations": value}},
            )
        except client.ApiException as err:
            if err.status not in (404, 409, 422):
                raise

    def teardown(self, uid: str, reason: str) -> None:
        local = self.clusters.pop(uid, None)
        if local is None:
            return
        log.info("tearing down Ray cluster of %s/%s: %s", local.namespace, local.name, reason)
        # The head first, and at once, as when its pod is lost: its dashboard (the Job
        # Submission API) and its drivers go with it, before the workers' actors die and a
        # driver could report a failure of its own.
        local.head.kill(grace=0)
        kill_nodes(list(local.workers.values()))
        shutil.rmtree(local.temp_dir, ignore_errors=True)
        try:
            self._annotate(local, publish=False)
        except Exception as err:  # the API may already be gone during shutdown
            log.warning(
                "could not clear annotations of %s/%s: %s", local.namespace, local.name, err
            )

    def reconcile(self) -> None:
        """One pass: compare RayClusters and pods with running Ray processes and fix it."""
        listed: Any = self.custom.list_cluster_custom_object(RAY_GROUP, RAY_VERSION, RAY_CLUSTERS)
        rcs: list[dict[str, Any]] = listed["items"]
        pods: list[Any] = self.core.list_pod_for_all_namespaces(
            label_selector="ray.io/cluster"
        ).items
        by_cluster: dict[tuple[str, str], list[Any]] = {}
        for pod in pods:
            key = (pod.metadata.namespace, pod.metadata.labels["ray.io/cluster"])
            by_cluster.setdefault(key, []).append(pod)

        # Ray gives a joining node 30 s to register, and its dashboard agent alone can take
        # that long on two busy cores: start worker nodes one at a time.
        self._joining = any(
            n.alive() and not n.is_registered()
            for c in self.clusters.values()
            for n in c.workers.values()
        )
        # Tear down first: a deleted cluster's processes must not outlive it while a
        # successor of the same name starts (a head takes half a minute to start here).
        current = {rc["metadata"]["uid"] for rc in rcs}
        for uid in list(self.clusters):
            if uid not in current:
                self.teardown(uid, "RayCluster deleted")
        for rc in rcs:
            if rc["metadata"].get("deletionTimestamp"):
                self.teardown(rc["metadata"]["uid"], "RayCluster is being deleted")
        for rc in rcs:
            meta = rc["metadata"]
            if meta.get("deletionTimestamp"):
                continue
            cluster_pods = by_cluster.get((meta["namespace"], meta["name"]), [])
            self._reconcile_cluster(rc, cluster_pods)
        self._write_state()

    def _reconcile_cluster(self, rc: dict[str, Any], pods: list[Any]) -> None:
        meta = rc["metadata"]
        uid = meta["uid"]
        heads = [
            p for p in pods if p.metadata.labels.get("ray.io/node-type") == "head" and _pod_ready(p)
        ]
        head_pod = heads[0] if heads else None
        local = self.clusters.get(uid)
        if local is not None:
            if head_pod is None or head_pod.metadata.uid != local.head_pod_uid:
                self.teardown(uid, "head pod deleted or replaced")
                local = None
            elif not local.head.alive():
                self.teardown(uid, "Ray head process exited")
                local = None
        if local is None:
            state = (rc.get("status") or {}).get("state")
            if state != "ready" or head_pod is None:
                return
            if self._backing_off(uid):
                return
            if self.max_clusters is not None and len(self.clusters) >= self.max_clusters:
                return  # limited: this one waits for a slot
            try:
                local = self._start_head(rc, head_pod)
            except RuntimeError as err:
                log.error("%s", err)
                self.failures[uid] = time.monotonic()
                return
            self.clusters[uid] = local
            self._annotate(local, publish=True)
            log.info("Ray cluster for %s/%s at %s", local.namespace, local.name, local.dashboard)

        groups = {
            g.get("groupName", ""): g.get("rayStartParams") or {}
            for g in rc["spec"].get("workerGroupSpecs") or []
        }
        live = {
            p.metadata.uid: p
            for p in pods
            if p.metadata.labels.get("ray.io/node-type") == "worker" and _pod_ready(p)
        }
        for pod_uid, node in list(local.workers.items()):
            if pod_uid not in live:
                log.info("pod %s gone: killing its Ray node", node.pod)
                node.kill()
                del local.workers[pod_uid]
            elif not node.alive():
                log.warning("Ray node of pod %s exited on its own; restarting it soon", node.pod)
                del local.workers[pod_uid]
                self.failures[pod_uid] = time.monotonic()
            elif not node.is_registered() and time.monotonic() - node.started > JOIN_TIMEOUT:
                # Its raylet can die while `ray start --block` lives on (an agent that was too
                # slow to report its ports on a busy machine): start that node again.
                log.warning("Ray node of pod %s did not join in %.0fs; restarting it", node.pod,
                            JOIN_TIMEOUT)  # fmt: skip
                node.kill()
                del local.workers[pod_uid]
                self.failures[pod_uid] = time.monotonic()
        # Trainer nodes first: the ZeRO ranks take the longest to build, and they can start
        # building while the other nodes join.
        for pod_uid, pod in sorted(live.items(), key=lambda item: _start_order(item[1])):
            if pod_uid in local.workers or self._backing_off(pod_uid) or self._joining:
                continue
            group = pod.metadata.labels.get("ray.io/group", "")
            params = NodeParams.from_start_params(groups.get(group, {}), 1)
            local.workers[pod_uid] = self._start_worker(local, pod, params)
            self._joining = True

    def _backing_off(self, uid: str) -> bool:
        """True shortly after a Ray process for `uid` (RayCluster or pod) failed to start."""
        return time.monotonic() - self.failures.get(uid, -1e9) < 15

    def _write_state(self) -> None:
        """Publish what runs where, for `down`, tests and curious humans."""
        state = {
            f"{c.namespace}/{c.name}": {
                "dashboard": c.dashboard,
                "gcs": c.gcs,
                "temp_dir": str(c.temp_dir),
                "head": asdict(c.head),
                "workers": {n.pod: asdict(n) for n in c.workers.values()},
            }
            for c in self.clusters.values()
        }
        tmp = self.state_dir / "clusters.json.tmp"
        tmp.write_text(json.dumps(state, indent=2, default=str) + "\n")
        tmp.replace(self.state_dir / "clusters.json")
        targets = [
            {"targets": [f"127.0.0.1:{port}"], "labels": {**node.labels, "endpoint": name}}
            for c in self.clusters.values()
            for node in (c.head, *c.workers.values())
            for name, port in sorted(node.scrape.items())
        ]
        text = json.dumps(targets, indent=2, sort_keys=True) + "\n"
        path = self.state_dir / SCRAPE_TARGETS
        if not path.exists() or path.read_text() != text:  # Prometheus reloads on a change
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)

    def run(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ready = self.state_dir / "ready"
        if self.max_clusters == 0:
            log.info("off (%s=0): no Ray clusters, no reads", MAX_CLUSTERS_ENV)
            self._write_state()
            ready.write_text(f"{os.getpid()}\n")
            self.stopping.wait()
            return
        while not self.stopping.is_set():
            try:
                self.reconcile()
                if not ready.exists():
                    ready.write_text(f"{os.getpid()}\n")
            except Exception:
                log.exception("reconcile failed; retrying")
            self.stopping.wait(POLL_SECONDS)
        for uid in list(self.clusters):
            self.teardown(uid, "stand-in stopping")
        self._write_state()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stand-in Ray for the local cluster")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--temp-root", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, required=True, help="one log per Ray node")
    parser.add_argument(
        "--max-clusters",
        type=int,
        default=max_clusters_from_env(),
        help=f"at most this many Ray clusters at a time; 0: off (default: ${MAX_CLUSTERS_ENV})",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout
    )
    config.load_kube_config(config_file=args.kubeconfig)
    standin = StandIn(
        args.temp_root, args.state_dir, args.log_dir, Path(args.kubeconfig), args.max_clusters
    )

    def stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        standin.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    standin.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
