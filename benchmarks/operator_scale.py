"""The operator at scale: hundreds of RLHFJobs across namespaces on the local control plane.

    python benchmarks/operator_scale.py [--jobs 300] [--namespaces 10] [--window 180]
                                        [--standin 0] [--profile] [--out FILE]

Runs `rlhfjob operator` as `rlhf_local.session` does (the chart's ServiceAccount and RBAC, the
chart's flags) but with the chart's default timer interval (5 s), creates the jobs from a pool
of threads and measures:

* apply → RayCluster created, per job: from just before the job's create call to the RayCluster's
  ADDED event on a watch (p50, p99);
* the operator's CPU seconds and peak RSS, from /proc of its process;
* API requests per job per minute once nothing changes, reads and writes: the API server's own
  metrics read through the admin client before and after a steady window. The operator's share
  comes from FlowSchemas that the benchmark adds for the operator's ServiceAccount alone (one
  per resource and reads / writes, so `apiserver_flowcontrol_dispatched_requests_total` counts
  exactly its requests); `apiserver_request_total` by verb and resource shows every client's.

The jobs' Ray pods land on a few large KWOK nodes the benchmark adds (pool `scale`) and removes.
The stand-in Ray is off by default (`--standin 0`; N runs at most N Ray clusters), so no
RayCluster gets a dashboard and every job waits for one: the state in which a job costs most
to keep, since the operator asks each job's dashboard (backing off, 5 s up to 60 s apart) on top
of re-reading the job, its RayCluster, pods and Lease at every timer tick. `--profile` samples the
operator's threads (a Python stack sampler in the operator's process: py-spy is not installed).
Prints progress on stderr, the result as JSON on stdout, and writes it to --out. The cluster is
started when it is not running and stopped again afterwards (`--keep-cluster`: left up, with the
stand-in as usual); a cluster that was running keeps running, with its stand-in as before.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import math
import os
import re
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_local.harness import LocalCluster
    from rlhf_local.operator_process import OperatorProcess

GOAL_P99_S = 2.0
GOAL_RSS_MB = 300.0
READS_PER_RECONCILE = 5
"""The most a reconcile reads from the API server: the job, its RayCluster, the RayCluster's
pods and the Lease, and KubeRay's Warning Events while the RayCluster is not ready."""
POOL = "scale"
PODS_PER_NODE = 500
STANDIN_ENV = "RLHF_STANDIN_MAX_CLUSTERS"
READ_VERBS = frozenset({"GET", "LIST", "WATCH"})
#: Resources the operator's RBAC names: (API group, resource or resource/subresource).
OPERATOR_RESOURCES = (
    ("rlhf.dev", "rlhfjobs/status"),
    ("rlhf.dev", "rlhfjobs"),
    ("ray.io", "rayclusters"),
    ("", "pods"),
    ("", "events"),
    ("", "configmaps"),
    ("", "serviceaccounts"),
    ("", "secrets"),
    ("rbac.authorization.k8s.io", "roles"),
    ("rbac.authorization.k8s.io", "rolebindings"),
    ("networking.k8s.io", "networkpolicies"),
    ("coordination.k8s.io", "leases"),
)
FLOW_PREFIX = "rlhf-scale-"
BENCH_LABEL = "rlhf.dev/scale-benchmark"


def say(message: str, *, end: str = "\n") -> None:
    print(message, end=end, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# In the operator's process (--profile): a stack sampler around `rlhfjob operator`


SAMPLE_SECONDS = 0.02


def _where(code: Any) -> str:
    parts = Path(code.co_filename).parts
    return f"{'/'.join(parts[-2:])}:{code.co_name}"


def sampled_operator(out: str, argv: list[str]) -> int:
    """Run `rlhfjob operator argv` with a CPU sampler; write what it found to `out` at exit.

    Every `SAMPLE_SECONDS` it reads each thread's CPU clock and charges the CPU that thread
    spent since the last sample to the stack it stands in now: a statistical CPU profile (where
    a thread ran and then went idle between two samples, the idle frame gets the charge).
    """
    from rlhfjob_cli import main as cli

    own: dict[str, float] = collections.defaultdict(float)
    inclusive: dict[str, float] = collections.defaultdict(float)
    project: dict[str, float] = collections.defaultdict(float)
    threads: dict[str, float] = collections.defaultdict(float)
    sampler_cpu = [0.0]
    stop = threading.Event()

    def sample() -> None:
        me = threading.get_ident()
        clocks: dict[int, tuple[int, float]] = {}
        while not stop.wait(SAMPLE_SECONDS):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                try:
                    if ident not in clocks:
                        clock = time.pthread_getcpuclockid(ident)
                        clocks[ident] = (clock, time.clock_gettime(clock))
                        continue
                    clock, last = clocks[ident]
                    now = time.clock_gettime(clock)
                except OSError:  # the thread just ended
                    continue
                clocks[ident] = (clock, now)
                spent = now - last
                if spent <= 0:
                    continue
                name = re.sub(r"[-_]\d+(_\d+)?$", "", names.get(ident, "?"))
                threads[name] += spent
                own[_where(frame.f_code)] += spent
                seen: set[str] = set()
                ours = None
                walk: Any = frame
                while walk is not None:
                    where = _where(walk.f_code)
                    if where not in seen:
                        seen.add(where)
                        inclusive[where] += spent
                    if ours is None and "rlhf_operator" in walk.f_code.co_filename:
                        ours = where
                    walk = walk.f_back
                project[ours or "(no rlhf_operator frame)"] += spent
            for ident in set(clocks) - set(names):
                del clocks[ident]
            sampler_cpu[0] = time.thread_time()

    def write() -> None:
        stop.set()
        total = sum(threads.values()) or 1.0

        def top(counter: dict[str, float], n: int = 40) -> list[list[Any]]:
            ranked = sorted(counter.items(), key=lambda item: -item[1])[:n]
            return [[k, round(v, 2), round(v / total, 4)] for k, v in ranked]

        report = {
            "cpu_seconds_sampled": round(total, 1),
            "sample_interval_s": SAMPLE_SECONDS,
            "sampler_cpu_seconds": round(sampler_cpu[0], 2),
            "cpu_seconds_by_thread": {k: v for k, v, _ in top(threads)},
            "self": top(own),
            "inclusive": top(inclusive, 80),
            "innermost_rlhf_operator_frame": top(project),
        }
        Path(out).write_text(json.dumps(report, indent=1) + "\n")

    atexit.register(write)
    threading.Thread(target=sample, name="sampler", daemon=True).start()
    return int(cli(argv))


# ---------------------------------------------------------------------------------------------
# Figures


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None, "max": None}
    return {
        "p50": round(percentile(values, 0.5), 3),
        "p99": round(percentile(values, 0.99), 3),
        "mean": round(statistics.fmean(values), 3),
        "max": round(max(values), 3),
    }


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of counter `name` in a Prometheus text exposition, by its labels."""
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = _SAMPLE.match(line)
        if not match or match.group(1) != name:
            continue
        labels = tuple(sorted(_LABEL.findall(match.group(2) or "")))
        found[labels] = found.get(labels, 0.0) + float(match.group(3))
    return found


def deltas(
    before: dict[tuple[tuple[str, str], ...], float],
    after: dict[tuple[tuple[str, str], ...], float],
    keys: tuple[str, ...],
) -> dict[tuple[str, ...], float]:
    """Increase of each series between two scrapes, summed over every label but `keys`."""
    out: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for labels, value in after.items():
        grown = value - before.get(labels, 0.0)
        if grown > 0:
            named = dict(labels)
            out[tuple(named.get(k, "") for k in keys)] += grown
    return dict(out)


@dataclass
class ProcessStats:
    """CPU and memory of one process, from /proc."""

    pid: int

    def cpu_seconds(self) -> float:
        stat = Path(f"/proc/{self.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def memory_mb(self) -> dict[str, float]:
        values = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                values[key] = int(rest.split()[0]) / 1024
        return values


# ---------------------------------------------------------------------------------------------
# The cluster: stand-in, nodes, FlowSchemas


def standin_limit() -> str | None:
    """The running stand-in's RLHF_STANDIN_MAX_CLUSTERS ("" unset); None: it is not running."""
    from rlhf_local import cluster

    pid = cluster.status().get("standin-ray")
    if pid is None:
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{STANDIN_ENV}=".encode()
    return next((e[len(prefix) :].decode() for e in environ if e.startswith(prefix)), "")


def cluster_up(standin: str | None) -> Path:
    """Start (or reuse) the local cluster with the stand-in limited to `standin` Ray clusters
    (None: as usual); a running stand-in with another limit is restarted."""
    from rlhf_local import cluster, procs
    from rlhf_local.paths import local_dir

    if standin is None:
        os.environ.pop(STANDIN_ENV, None)
    else:
        os.environ[STANDIN_ENV] = standin
    current = standin_limit()
    if current is not None and current != (standin or ""):
        say(f"restarting the stand-in Ray ({STANDIN_ENV}={standin or '(unset)'})")
        procs.stop(cluster.Layout(local_dir()).pid("standin-ray"), grace=30.0)
    return cluster.up()


def node_manifests(count: int) -> list[dict[str, Any]]:
    """Large untainted KWOK nodes of pool `scale` for every job's head and workers."""
    from rlhf_local import pools

    pool = pools.Pool(POOL, count, cpu="4000", memory="16Ti", instance_type="kwok.scale", gpus=2000)
    manifests = []
    for i, name in enumerate(pool.node_names()):
        manifest = pools.node_manifest(pool, name, zone=f"local-{'ab'[i % 2]}")
        manifest["spec"]["taints"] = []
        for key in ("capacity", "allocatable"):
            manifest["status"][key]["pods"] = str(PODS_PER_NODE)
        manifests.append(manifest)
    return manifests


def flow_schemas(service_account: str, namespace: str) -> list[dict[str, Any]]:
    """FlowSchemas that match only the operator's ServiceAccount: one per resource and reads
    or writes, and one for the rest, so the API server counts the operator's requests apart."""
    subject = {"kind": "ServiceAccount", "serviceAccount": {"name": service_account,
                                                            "namespace": namespace}}  # fmt: skip
    schemas = []

    def schema(name: str, precedence: int, rules: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": FLOW_PREFIX + name, "labels": {BENCH_LABEL: "true"}},
            "spec": {
                "priorityLevelConfiguration": {"name": "workload-low"},
                "matchingPrecedence": precedence,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [{"subjects": [subject], **rules}],
            },
        }

    precedence = 1000
    for group, resource in OPERATOR_RESOURCES:
        groups = [group, "events.k8s.io"] if resource == "events" else [group]
        for kind, verbs in (
            ("read", ["get", "list", "watch"]),
            ("write", ["create", "update", "patch", "delete", "deletecollection"]),
        ):
            precedence += 1
            rule = {"verbs": verbs, "apiGroups": groups, "resources": [resource],
                    "namespaces": ["*"], "clusterScope": True}  # fmt: skip
            label = f"{resource.replace('/', '-')}-{kind}"
            schemas.append(schema(label, precedence, {"resourceRules": [rule]}))
    for kind, verbs in (("read", ["get", "list", "watch"]), ("write", ["*"])):
        precedence += 1
        rule = {"verbs": verbs, "apiGroups": ["*"], "resources": ["*"], "namespaces": ["*"],
                "clusterScope": True}  # fmt: skip
        schemas.append(schema(f"other-{kind}", precedence, {"resourceRules": [rule]}))
    paths = {"nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}
    schemas.append(schema("paths-read", precedence + 1, paths))  # discovery, /version
    return schemas


def schema_resource(flow_schema: str) -> tuple[str, str] | None:
    """(resource, "read" | "write") of one of our FlowSchemas ("other": any other resource,
    "paths": URLs that are no resource, such as discovery)."""
    if not flow_schema.startswith(FLOW_PREFIX):
        return None
    label = flow_schema.removeprefix(FLOW_PREFIX)
    resource, _, kind = label.rpartition("-")
    return resource.replace("rlhfjobs-status", "rlhfjobs/status"), kind


# ---------------------------------------------------------------------------------------------
# Watching what the operator makes


@dataclass
class Seen:
    """What the watches saw, with the time (monotonic) each thing was first seen."""

    cluster_added: dict[tuple[str, str], float] = field(default_factory=dict)
    cluster_ready: dict[tuple[str, str], float] = field(default_factory=dict)
    job_status: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    job_events: int = 0
    cluster_events: int = 0
    last_change: float = field(default_factory=time.monotonic)
    """When a job of ours last changed (what the operator writes; KubeRay's RayCluster updates
    do not count)."""
    lock: threading.Lock = field(default_factory=threading.Lock)


class Watch(threading.Thread):
    """A cluster-wide watch of one custom resource, restarted when it ends."""

    def __init__(
        self,
        kubeconfig: Path,
        group: str,
        version: str,
        plural: str,
        on_event: Callable[[str, dict[str, Any]], None],
        label_selector: str | None = None,
    ) -> None:
        super().__init__(name=f"watch-{plural}", daemon=True)
        self.kubeconfig = kubeconfig
        self.args = (group, version, plural)
        self.on_event = on_event
        self.label_selector = label_selector
        self.started_listing = threading.Event()

    def run(self) -> None:
        from kubernetes import client, config, watch
        from kubernetes.client.exceptions import ApiException

        api = client.CustomObjectsApi(config.new_client_from_config(str(self.kubeconfig)))
        version: str | None = None
        selector = self.label_selector
        while True:
            try:
                if version is None:
                    listed: Any = api.list_cluster_custom_object(
                        *self.args, label_selector=selector
                    )
                    for item in listed["items"]:
                        self.on_event("ADDED", item)
                    version = listed["metadata"]["resourceVersion"]
                    self.started_listing.set()
                stream = watch.Watch().stream(
                    api.list_cluster_custom_object, *self.args, resource_version=version,
                    timeout_seconds=120, allow_watch_bookmarks=True, label_selector=selector,
                )  # fmt: skip
                for event in stream:
                    kind, item = event["type"], event["object"]
                    if kind == "ERROR":  # 410 Gone: list again
                        version = None
                        break
                    version = item["metadata"]["resourceVersion"]
                    if kind != "BOOKMARK":
                        self.on_event(kind, item)
            except ApiException as error:
                if error.status == 410:
                    version = None
                time.sleep(0.5)
            except Exception:  # a dropped connection on a busy machine: watch again
                time.sleep(0.5)


def settled(status: dict[str, Any]) -> bool:
    """A job that got as far as it can: Running, or its cluster ready and its dashboard silent
    (no stand-in Ray behind it)."""
    if status.get("phase") in ("Running", "Failed", "Succeeded"):
        return True
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return conditions.get("ClusterReady") == "True" and conditions.get("DashboardReachable") in (
        "False",
        "True",
    )


def state_of(status: dict[str, Any]) -> str:
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    reachable = conditions.get("DashboardReachable")
    return f"{status.get('phase', '-')}, DashboardReachable={reachable}"


# ---------------------------------------------------------------------------------------------
# The run


def job_manifests(jobs: int, namespaces: list[str]) -> list[dict[str, Any]]:
    from rlhf_local import pools
    from rlhf_local.jobs import SLEEP_FOREVER, job_manifest
    from rlhfjob.patches import merge_patch

    on_pool = {"nodeSelector": {pools.POOL_LABEL: POOL}}
    manifests = []
    for i in range(jobs):
        namespace = namespaces[i % len(namespaces)]
        document = job_manifest(f"job-{i:03d}", namespace, SLEEP_FOREVER)
        manifests.append(
            merge_patch(
                document,
                {"spec": {"head": on_pool, "roles": {"trainer": on_pool, "rollout": on_pool}}},
            )
        )
    return manifests


def create_all(
    kubeconfig: Path, manifests: list[dict[str, Any]], threads: int
) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float], list[str]]:
    """Create every job from `threads` threads; (before each call, after it, failures)."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    from rlhfjob import api

    before: dict[tuple[str, str], float] = {}
    after: dict[tuple[str, str], float] = {}
    failures: list[str] = []
    local = threading.local()

    def create(manifest: dict[str, Any]) -> None:
        if not hasattr(local, "custom"):
            local.custom = client.CustomObjectsApi(config.new_client_from_config(str(kubeconfig)))
        key = (manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        before[key] = time.monotonic()
        for attempt in range(5):
            try:
                local.custom.create_namespaced_custom_object(
                    api.GROUP, api.VERSION, key[0], api.PLURAL, manifest
                )
                break
            except ApiException as error:
                if error.status == 409:
                    break
                if error.status in (429, 500, 503, 504) and attempt < 4:
                    time.sleep(0.2 * (attempt + 1))
                    continue
                failures.append(f"{key[0]}/{key[1]}: HTTP {error.status} {error.reason}")
                return
        after[key] = time.monotonic()

    with ThreadPoolExecutor(threads, thread_name_prefix="create") as pool:
        list(pool.map(create, manifests))
    return before, after, failures


def wait_until(
    what: str, done: Callable[[], bool], progress: Callable[[], str], timeout: float
) -> bool:
    deadline = time.monotonic() + timeout
    shown = 0.0
    while not done():
        if time.monotonic() > deadline:
            say(f"\r{what}: {progress()} (timed out after {timeout:.0f}s)")
            return False
        if time.monotonic() - shown >= 1.0:
            say(f"\r{what}: {progress()}   ", end="")
            shown = time.monotonic()
        time.sleep(0.1)
    say(f"\r{what}: {progress()}   ")
    return True


def scrape(lc: LocalCluster) -> str:
    """The API server's /metrics, as the admin reads it."""
    response = lc.api.call_api("GET", f"{lc.api.configuration.host}/metrics")
    return bytes(response.read()).decode()


@dataclass
class Run:
    args: argparse.Namespace
    lc: LocalCluster
    namespaces: list[str]
    workdir: Path
    seen: Seen = field(default_factory=Seen)
    result: dict[str, Any] = field(default_factory=dict)

    def ours(self, item: dict[str, Any]) -> tuple[str, str] | None:
        metadata = item.get("metadata") or {}
        if metadata.get("namespace") not in self.namespaces:
            return None
        return metadata["namespace"], metadata["name"]

    def on_cluster(self, kind: str, item: dict[str, Any]) -> None:
        key = self.ours(item)
        if key is None:
            return
        now = time.monotonic()
        with self.seen.lock:
            self.seen.cluster_events += 1
            self.seen.cluster_added.setdefault(key, now)
            if (item.get("status") or {}).get("state") == "ready":
                self.seen.cluster_ready.setdefault(key, now)

    def on_job(self, kind: str, item: dict[str, Any]) -> None:
        key = self.ours(item)
        if key is None or kind == "DELETED":
            return
        with self.seen.lock:
            self.seen.job_events += 1
            self.seen.last_change = time.monotonic()
            self.seen.job_status[key] = item.get("status") or {}


def main() -> int:
    if sys.argv[1:2] == ["--sample-operator"]:  # the operator's own process, under --profile
        return sampled_operator(sys.argv[2], sys.argv[4:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--namespaces", type=int, default=10)
    parser.add_argument("--threads", type=int, default=8, help="threads creating jobs")
    parser.add_argument("--window", type=float, default=180.0, help="seconds of steady state")
    parser.add_argument(
        "--quiet", type=float, default=20.0, help="seconds no job changed, before the window"
    )
    parser.add_argument("--settle-timeout", type=float, default=300.0)
    parser.add_argument("--timer-interval", type=float, default=5.0, help="the chart's default")
    parser.add_argument(
        "--standin", default="0", help="Ray clusters the stand-in runs at most (0: off; 'all')"
    )
    parser.add_argument("--profile", action="store_true", help="sample the operator's stacks")
    parser.add_argument(
        "--probes", type=int, default=20,
        help="jobs applied one at a time after the steady window, with every job managed",
    )  # fmt: skip
    parser.add_argument("--keep-cluster", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/operator-scale.json")
    args = parser.parse_args()

    import tempfile

    from kubernetes import config

    from rlhf_local import cluster
    from rlhf_local.harness import LocalCluster

    standin = None if args.standin == "all" else str(int(args.standin))
    was_running = cluster.is_running()
    before_standin = standin_limit() if was_running else None
    say("starting the local control plane" + (" (running: reused)" if was_running else ""))
    kubeconfig = cluster_up(standin)
    lc = LocalCluster(kubeconfig, config.new_client_from_config(config_file=str(kubeconfig)))
    tag = uuid.uuid4().hex[:4]
    namespaces = [f"scale-{tag}-{i}" for i in range(args.namespaces)]
    workdir = Path(tempfile.mkdtemp(prefix="rlhfjob-scale-"))
    run = Run(args, lc, namespaces, workdir)
    nodes = node_manifests(max(1, math.ceil(args.jobs * 3 / (PODS_PER_NODE * 0.8))))
    schemas: list[dict[str, Any]] = []
    operator: OperatorProcess | None = None
    try:
        operator, schemas = prepare(run, nodes)
        measure(run, operator)
    finally:
        if operator is not None:
            operator.stop()
        if was_running or args.keep_cluster:
            say("cleaning up (namespaces, nodes, FlowSchemas)")
            for namespace in namespaces:
                lc.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
            if schemas:
                lc.kubectl("delete", "flowschema", "-l", BENCH_LABEL, check=False)
            lc.kubectl("delete", "node", "-l", f"rlhf.dev/pool={POOL}", "--wait=false",
                       check=False)  # fmt: skip
            cluster_up(before_standin or None)  # the stand-in as it was (or as usual)
        else:
            say("stopping the local control plane (this run started it)")
            cluster.down()
    if args.profile and (workdir / "profile.json").exists():
        run.result["profile"] = json.loads((workdir / "profile.json").read_text())
    text = json.dumps(run.result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    say(f"operator log: {workdir / 'operator.log'}")
    return 0 if run.result.get("completed") == args.jobs else 1


def prepare(run: Run, nodes: list[dict[str, Any]]) -> tuple[OperatorProcess, list[dict[str, Any]]]:
    """Nodes, namespaces, FlowSchemas, watches and the operator."""
    import yaml
    from kubernetes import client

    from rlhf_local.harness import wait_for
    from rlhf_local.operator_process import (
        OPERATOR_NAMESPACE,
        chart_service_account,
        operator_kubeconfig,
    )
    from rlhf_operator.names import LABEL_JOB
    from rlhfjob import api

    lc, args = run.lc, run.args
    say(f"adding {len(nodes)} KWOK nodes of pool {POOL!r} and {len(run.namespaces)} namespaces")
    lc.apply(yaml.safe_dump_all(nodes))
    for namespace in run.namespaces:
        lc.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))

    def nodes_ready() -> bool:
        listed = lc.core.list_node(label_selector=f"rlhf.dev/pool={POOL}").items
        return len(listed) == len(nodes) and all(
            any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))
            for n in listed
            if n.status is not None
        )

    wait_for(nodes_ready, 120, "the scale nodes to be Ready")
    kubeconfig = operator_kubeconfig(lc, run.workdir / "kubeconfig")
    schemas = flow_schemas(chart_service_account(), OPERATOR_NAMESPACE)
    lc.apply(yaml.safe_dump_all(schemas))
    watches = [
        Watch(lc.kubeconfig, "ray.io", "v1", "rayclusters", run.on_cluster, LABEL_JOB),
        Watch(lc.kubeconfig, api.GROUP, api.VERSION, api.PLURAL, run.on_job),
    ]
    for watch in watches:
        watch.start()
        watch.started_listing.wait(30)
    operator = scale_operator(
        kubeconfig,
        run.workdir / "operator.log",
        args.timer_interval,
        run.workdir / "profile.json" if args.profile else None,
    )
    say(f"starting the operator (the chart's RBAC, --timer-interval={args.timer_interval:g})")
    operator.start()
    return operator, schemas


def measure(run: Run, operator: OperatorProcess) -> None:
    args, lc, seen = run.args, run.lc, run.seen
    assert operator.process is not None
    stats = ProcessStats(operator.process.pid)
    cpu_start = stats.cpu_seconds()
    manifests = job_manifests(args.jobs, run.namespaces)
    keys = [(m["metadata"]["namespace"], m["metadata"]["name"]) for m in manifests]
    created: dict[str, Any] = {}

    def create() -> None:
        created["before"], created["after"], created["failures"] = create_all(
            lc.kubeconfig, manifests, args.threads
        )
        created["done"] = time.monotonic()

    say(f"creating {args.jobs} RLHFJobs in {len(run.namespaces)} namespaces "
        f"from {args.threads} threads")  # fmt: skip
    started = time.monotonic()
    creator = threading.Thread(target=create, name="creator")
    creator.start()
    rss_peak_seen = [0.0]

    def progress() -> str:
        rss_peak_seen[0] = max(rss_peak_seen[0], stats.memory_mb().get("VmRSS", 0.0))
        with seen.lock:
            clusters = sum(1 for k in keys if k in seen.cluster_added)
            ready = sum(1 for k in keys if k in seen.cluster_ready)
            done = sum(1 for k in keys if settled(seen.job_status.get(k, {})))
        made = len(created.get("after", {})) if "done" in created else "…"
        return (
            f"jobs created {made}/{args.jobs}, RayClusters {clusters}, ready {ready}, "
            f"jobs settled {done}; operator {stats.cpu_seconds() - cpu_start:.0f} CPU-s, "
            f"{rss_peak_seen[0]:.0f} MB"
        )

    def all_clusters() -> bool:
        with seen.lock:
            return "done" in created and all(k in seen.cluster_added for k in created["after"])

    wait_until("apply → RayCluster", all_clusters, progress, timeout=300)
    creator.join()
    cpu_created = stats.cpu_seconds()
    burst_s = time.monotonic() - started

    def quiet() -> bool:
        with seen.lock:
            every = all(settled(seen.job_status.get(k, {})) for k in keys)
            return every and time.monotonic() - seen.last_change >= args.quiet

    calm = wait_until("settling", quiet, progress, timeout=args.settle_timeout)
    settle_s = time.monotonic() - started

    # -- the steady window: nobody of ours talks to the API server but the operator --------
    say(f"steady window of {args.window:.0f}s")
    text_before = scrape(lc)
    ops_before = operator.metrics()
    cpu_before, window_start = stats.cpu_seconds(), time.monotonic()
    events_before = (seen.job_events, seen.cluster_events)
    while (left := window_start + args.window - time.monotonic()) > 0:
        rss_peak_seen[0] = max(rss_peak_seen[0], stats.memory_mb().get("VmRSS", 0.0))
        say(f"\rsteady window: {left:4.0f}s left", end="")
        time.sleep(min(5.0, left))
    window_s = time.monotonic() - window_start
    cpu_window = stats.cpu_seconds() - cpu_before
    text_after = scrape(lc)
    ops_after = operator.metrics()
    say("")
    memory = stats.memory_mb()
    cpu_total = stats.cpu_seconds()
    with seen.lock:
        statuses = {k: seen.job_status.get(k, {}) for k in keys}
        job_events = seen.job_events - events_before[0]
        cluster_events = seen.cluster_events - events_before[1]
        added = dict(seen.cluster_added)
        ready_at = dict(seen.cluster_ready)

    before = created["before"]
    creating_s = max(created["after"].values(), default=0.0) - min(before.values(), default=0.0)
    latency = [added[k] - before[k] for k in keys if k in added and k in before]
    after_call = [
        added[k] - created["after"][k] for k in keys if k in added and k in created["after"]
    ]
    call = [created["after"][k] - before[k] for k in keys if k in created["after"]]
    to_ready = [ready_at[k] - before[k] for k in keys if k in ready_at and k in before]
    minutes, jobs = window_s / 60, args.jobs

    # The operator alone, by its FlowSchemas.
    flows = deltas(
        parse_metrics(text_before, "apiserver_flowcontrol_dispatched_requests_total"),
        parse_metrics(text_after, "apiserver_flowcontrol_dispatched_requests_total"),
        ("flow_schema",),
    )
    operator_requests: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for (schema,), count in flows.items():
        if (where := schema_resource(schema)) is not None:
            operator_requests[where[0]][where[1]] = count
    dispatched = parse_metrics(text_after, "apiserver_flowcontrol_dispatched_requests_total")
    have_flows = any(
        dict(labels).get("flow_schema", "").startswith(FLOW_PREFIX) for labels in dispatched
    )
    reads = sum(v.get("read", 0.0) for v in operator_requests.values())
    writes = sum(v.get("write", 0.0) for v in operator_requests.values())
    # Every client, by verb and resource.
    requests = deltas(
        parse_metrics(text_before, "apiserver_request_total"),
        parse_metrics(text_after, "apiserver_request_total"),
        ("verb", "group", "resource", "subresource"),
    )
    by_resource = {
        f"{verb} {group + '/' if group else ''}{resource}{'/' + sub if sub else ''}": round(n)
        for (verb, group, resource, sub), n in sorted(requests.items(), key=lambda kv: -kv[1])
        if resource
    }
    all_writes = sum(n for (verb, *_), n in requests.items() if verb not in READ_VERBS)
    reconciles = sum(parse_metrics(ops_after, "rlhf_operator_reconciles_total").values()) - sum(
        parse_metrics(ops_before, "rlhf_operator_reconciles_total").values()
    )

    probe_latency = probe(run, args.probes)
    probe_p99 = summary(probe_latency)["p99"]
    p50 = summary(latency)["p50"]
    p99 = summary(latency)["p99"]
    peak_rss = round(max(memory.get("VmHWM", 0.0), rss_peak_seen[0]), 1)
    per_job_minute = (lambda n: round(n / jobs / minutes, 3)) if minutes else (lambda n: None)
    steady_writes = per_job_minute(writes if have_flows else all_writes)
    steady_reads = per_job_minute(reads) if have_flows else None
    reconciles_per_job_minute = per_job_minute(reconciles)
    reads_per_reconcile = round(reads / reconciles, 2) if reconciles else None
    max_reconciles = 60 / args.timer_interval
    states = collections.Counter(state_of(s) for s in statuses.values())
    log_text = operator.log_path.read_text(errors="replace") if operator.log_path.exists() else ""
    run.result.update(
        {
            "benchmark": "operator-scale",
            "command": "task bench:scale  # python benchmarks/operator_scale.py "
            f"--jobs {args.jobs} --namespaces {args.namespaces} --threads {args.threads} "
            f"--window {args.window:g} --standin {args.standin} --probes {args.probes}"
            + (" --profile" if args.profile else ""),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{os.cpu_count()} cores; local control plane (etcd, kube-apiserver, "
            "scheduler, controller-manager, KWOK, KubeRay) and the operator on the same cores",
            "jobs": jobs,
            "namespaces": args.namespaces,
            "completed": len(latency),
            "create_failures": created["failures"],
            "timer_interval_s": args.timer_interval,
            "standin_max_clusters": args.standin,
            "apply_to_raycluster_p50_s": p50,
            "apply_to_raycluster_p99_s": p99,
            "peak_rss_mb": peak_rss,
            "operator_cpu_seconds": round(cpu_total - cpu_start, 1),
            "steady_writes_per_job_minute": steady_writes,
            "steady_reads_per_job_minute": steady_reads,
            "goals": {
                "apply_to_raycluster_p99_s": {
                    "goal": f"< {GOAL_P99_S:g}",
                    "value": p99,
                    "met": p99 is not None and p99 < GOAL_P99_S,
                },
                "apply_to_raycluster_p99_s_one_at_a_time": {
                    "goal": f"< {GOAL_P99_S:g} with every job managed (not in a burst)",
                    "value": probe_p99,
                    "met": probe_p99 is not None and probe_p99 < GOAL_P99_S,
                },
                "peak_rss_mb": {
                    "goal": f"< {GOAL_RSS_MB:g}",
                    "value": peak_rss,
                    "met": peak_rss < GOAL_RSS_MB,
                },
                "steady_writes_per_job_minute": {
                    "goal": "0",
                    "value": steady_writes,
                    "met": steady_writes == 0,
                },
                "reconciles_per_job_minute": {
                    "goal": f"<= {max_reconciles:g} (the timer)",
                    "value": reconciles_per_job_minute,
                    "met": reconciles_per_job_minute is not None
                    and reconciles_per_job_minute <= max_reconciles,
                },
                "steady_reads_per_job_minute": {
                    "goal": f"<= {max_reconciles * READS_PER_RECONCILE:g} "
                    f"({READS_PER_RECONCILE} reads a reconcile at most)",
                    "value": steady_reads,
                    "met": steady_reads is not None
                    and steady_reads <= max_reconciles * READS_PER_RECONCILE,
                },
            },
            "apply_to_raycluster_s": summary(latency),
            "apply_to_raycluster_one_at_a_time_s": {
                **summary(probe_latency),
                "what": f"{args.probes} jobs applied one after another (each once the one "
                f"before has its RayCluster) after the steady window, {jobs} jobs managed",
            },
            "create_call_s": summary(call),
            "create_returned_to_raycluster_s": summary(after_call),
            "apply_to_raycluster_ready_s": summary(to_ready),
            "burst": {
                "seconds_to_last_raycluster": round(burst_s, 1),
                "seconds_creating_jobs": round(creating_s, 1),
                "jobs_created_per_second": round(jobs / creating_s, 1) if creating_s else None,
                "operator_cpu_seconds": round(cpu_created - cpu_start, 1),
            },
            "settle": {"seconds_from_start": round(settle_s, 1), "quiet": calm},
            "steady": {
                "window_s": round(window_s, 1),
                "operator_cpu_seconds": round(cpu_window, 1),
                "operator_cpu_fraction_of_a_core": round(cpu_window / window_s, 3),
                "reconciles_per_job_minute": reconciles_per_job_minute,
                "reads_per_reconcile": reads_per_reconcile,
                "operator_requests_per_job_minute": {
                    resource: {k: per_job_minute(v) for k, v in counts.items()}
                    for resource, counts in sorted(operator_requests.items())
                },
                "operator_requests_measured_by": "FlowSchemas of the operator's ServiceAccount"
                if have_flows
                else "unavailable: apiserver_flowcontrol metrics missing",
                "job_watch_events": job_events,
                "raycluster_watch_events": cluster_events,
                "all_clients_writes_per_minute": round(all_writes / minutes, 1),
                "all_clients_requests_in_window": by_resource,
            },
            "jobs_at_steady_state": dict(states),
            "operator_memory_mb": {k: round(v, 1) for k, v in memory.items()},
            "operator_log": {
                "reconcile_failures": log_text.count("reconcile failed"),
                "lines": log_text.count("\n"),
            },
        }
    )


def probe(run: Run, count: int) -> list[float]:
    """Apply `count` more jobs one at a time, with every other job managed: apply → RayCluster
    for a job that arrives alone, which is what a user waits for, unlike a 300-job burst."""
    if count <= 0:
        return []
    manifests = job_manifests(count, run.namespaces[:1])
    for manifest in manifests:
        manifest["metadata"]["name"] = f"probe-{manifest['metadata']['name']}"
    latencies = []
    for manifest in manifests:
        key = (manifest["metadata"]["namespace"], manifest["metadata"]["name"])
        before, _, failures = create_all(run.lc.kubeconfig, [manifest], 1)
        if failures:
            say(f"probe {key[1]}: {failures}")
            continue

        def added(key: tuple[str, str] = key) -> bool:
            with run.seen.lock:
                return key in run.seen.cluster_added

        if wait_until(f"probe {key[1]}", added, lambda: "waiting for its RayCluster", 60):
            with run.seen.lock:
                latencies.append(run.seen.cluster_added[key] - before[key])
    return latencies


def _replace_flag(arguments: Iterable[str], name: str, value: str) -> list[str]:
    return [f"{name}={value}" if a.startswith(f"{name}=") else a for a in arguments]


def scale_operator(
    kubeconfig: Path, log_path: Path, timer_interval: float, profile_path: Path | None
) -> OperatorProcess:
    """`rlhf_local.operator_process.OperatorProcess` (the chart's flags) at `timer_interval`,
    optionally under the stack sampler (`--sample-operator`)."""
    from rlhf_local.operator_process import OperatorProcess

    class ScaleOperator(OperatorProcess):
        def command(self) -> list[str]:
            base = _replace_flag(super().command(), "--timer-interval", f"{timer_interval:g}")
            if profile_path is None:
                return base
            assert base[1:3] == ["-m", "rlhfjob_cli"], base
            here = str(Path(__file__).resolve())
            return [sys.executable, here, "--sample-operator", str(profile_path), "--", *base[3:]]

    return ScaleOperator(kubeconfig=kubeconfig, log_path=log_path)


if __name__ == "__main__":
    raise SystemExit(main())
