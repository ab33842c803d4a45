"""The operator's Prometheus metrics, named once here (the Grafana dashboards and the chart's
alerts use these names; tests check that every name they query is one of these).

Besides the operator's own series, each RLHFJob it manages has `rlhf_operator_job_*` series
labelled `namespace` and `rlhfjob` (not `job`: Prometheus gives every target a `job` label),
removed when the job goes. They are what the per-job dashboard and the alerts read, so both work
without scraping the trainer. Scrape the operator with `honor_labels: true` (the chart's
ServiceMonitor does): the series' own `namespace` is the job's, not the operator's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rlhfjob.api import Phase, RLHFJob, RLHFJobStatus
from rlhfjob.contract import RestartReason

NAMESPACE_LABEL = "namespace"
JOB_LABEL = "rlhfjob"
"""The label naming an RLHFJob in every per-job series (the operator's and, through the chart's
PodMonitor, the trainer's)."""
JOB_LABELS = (NAMESPACE_LABEL, JOB_LABEL)

JOBS = "rlhf_operator_jobs"
RECONCILES_TOTAL = "rlhf_operator_reconciles_total"
RECONCILE_DURATION_SECONDS = "rlhf_operator_reconcile_duration_seconds"
CLUSTER_READY_SECONDS = "rlhf_operator_cluster_ready_seconds"
FIRST_STEP_SECONDS = "rlhf_operator_first_step_seconds"
SUBMISSIONS_TOTAL = "rlhf_operator_ray_job_submissions_total"
SUBMISSION_FAILURES_TOTAL = "rlhf_operator_ray_job_submission_failures_total"
RESTARTS_TOTAL = "rlhf_operator_restarts_total"
FAILURE_DETECTION_SECONDS = "rlhf_operator_failure_detection_seconds"
RECOVERY_SECONDS = "rlhf_operator_recovery_seconds"
JOB_PHASE = "rlhf_operator_job_phase"
JOB_CONDITION = "rlhf_operator_job_condition"
JOB_RESTART_COUNT = "rlhf_operator_job_restart_count"
JOB_MAX_RESTARTS = "rlhf_operator_job_max_restarts"
JOB_RESTARTS_TOTAL = "rlhf_operator_job_restarts_total"
JOB_STEP = "rlhf_operator_job_step"
JOB_TOTAL_STEPS = "rlhf_operator_job_total_steps"
JOB_STEPS_PER_SECOND = "rlhf_operator_job_steps_per_second"
JOB_ETA_TIMESTAMP_SECONDS = "rlhf_operator_job_eta_timestamp_seconds"
RECONCILE_ERROR = "error"

_LATENCY_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


class OperatorMetrics:
    """One registry per operator, so tests can run several without clashing."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._define_operator_series()
        self._define_job_series()
        self._job_series: dict[tuple[str, str], set[tuple[Gauge | Counter, tuple[str, ...]]]] = {}
        for phase in Phase:
            self.jobs.labels(phase=phase.value).set(0)
        # Every reason from the start: Prometheus sees a series' first sample, so a child made
        # by the first restart would hold it already, and rate() would never show it.
        for reason in RestartReason:
            for family in (self.restarts, self.detection_seconds, self.recovery_seconds):
                family.labels(reason=reason.value)

    def _latency(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Histogram:
        """A histogram of seconds from minutes to an hour (`_LATENCY_BUCKETS`)."""
        return Histogram(
            name, documentation, labels, buckets=_LATENCY_BUCKETS, registry=self.registry
        )

    def _define_operator_series(self) -> None:
        """The operator's own series: reconciles, submissions, restarts and their latencies."""
        r = self.registry
        self.jobs = Gauge(JOBS, "RLHFJobs by phase", ["phase"], registry=r)
        self.reconciles = Counter(
            _base(RECONCILES_TOTAL), "Reconciles by result", ["result"], registry=r
        )
        self.reconcile_seconds = Histogram(
            RECONCILE_DURATION_SECONDS, "Time to reconcile one job", registry=r
        )
        self.cluster_ready_seconds = self._latency(
            CLUSTER_READY_SECONDS, "From RLHFJob creation to its RayCluster ready"
        )
        self.first_step_seconds = self._latency(
            FIRST_STEP_SECONDS, "From RLHFJob creation to the first training step reported"
        )
        self.submissions = Counter(_base(SUBMISSIONS_TOTAL), "Ray job submissions", registry=r)
        self.submission_failures = Counter(
            _base(SUBMISSION_FAILURES_TOTAL),
            "Ray job submissions that failed (dashboard unreachable or refused)",
            registry=r,
        )
        self.restarts = Counter(
            _base(RESTARTS_TOTAL), "Trainer restarts by reason", ["reason"], registry=r
        )
        self.detection_seconds = self._latency(
            FAILURE_DETECTION_SECONDS,
            "From the trainer's last sign of life to the operator's restart decision",
            ("reason",),
        )
        self.recovery_seconds = self._latency(
            RECOVERY_SECONDS,
            "From a failure to the first training step resumed after it",
            ("reason",),
        )

    def _define_job_series(self) -> None:
        """Each RLHFJob's series, labelled `JOB_LABELS` (`observe_job` sets them)."""
        r = self.registry
        self.job_phase = Gauge(
            JOB_PHASE, "1 for the phase the RLHFJob is in", [*JOB_LABELS, "phase"], registry=r
        )
        self.job_condition = Gauge(
            JOB_CONDITION,
            "1 while the RLHFJob's condition is True, else 0",
            [*JOB_LABELS, "condition"],
            registry=r,
        )
        self.job_restart_count = Gauge(
            JOB_RESTART_COUNT, "Restarts of the RLHFJob that spend its budget (status.restartCount"
            " less status.resizes)", JOB_LABELS,
            registry=r,
        )  # fmt: skip
        self.job_max_restarts = Gauge(
            JOB_MAX_RESTARTS, "Restarts the RLHFJob may make (spec.recovery.maxRestarts)",
            JOB_LABELS, registry=r,
        )  # fmt: skip
        self.job_restarts = Counter(
            _base(JOB_RESTARTS_TOTAL),
            "Restarts of the RLHFJob this operator decided, by reason",
            [*JOB_LABELS, "reason"],
            registry=r,
        )
        self.job_step = Gauge(
            JOB_STEP, "Last training step the RLHFJob's trainer reported", JOB_LABELS, registry=r
        )
        self.job_total_steps = Gauge(
            JOB_TOTAL_STEPS, "Training steps of the RLHFJob's whole run", JOB_LABELS, registry=r
        )
        self.job_steps_per_second = Gauge(
            JOB_STEPS_PER_SECOND, "Training steps per second (status.progress)", JOB_LABELS,
            registry=r,
        )  # fmt: skip
        self.job_eta = Gauge(
            JOB_ETA_TIMESTAMP_SECONDS,
            "When the RLHFJob's last step should finish, Unix time (status.progress.eta)",
            JOB_LABELS,
            registry=r,
        )

    def observe_job(self, job: RLHFJob, status: RLHFJobStatus) -> None:
        """Set the job's series from the status just written; series it no longer has go."""
        key = (job.metadata.namespace, job.metadata.name)
        known = self._job_series.setdefault(key, set())
        if not known:  # every reason from zero, so the first restart is an increase
            for reason in RestartReason:
                self.job_restarts.labels(*key, reason.value)
                known.add((self.job_restarts, (*key, reason.value)))
        current: dict[tuple[Gauge | Counter, tuple[str, ...]], float | None] = {
            (self.job_phase, (*key, status.phase.value)): 1,
            (self.job_restart_count, key): status.restart_count - status.resizes,
            (self.job_max_restarts, key): job.spec.recovery.max_restarts,
            (self.job_step, key): status.current_step,
            (self.job_total_steps, key): status.total_steps,
        }
        for condition in status.conditions:
            truth = 1 if condition.status == "True" else 0
            current[(self.job_condition, (*key, condition.type))] = truth
        progress = status.progress
        if progress is not None:
            current[(self.job_steps_per_second, key)] = progress.steps_per_second
            eta = progress.eta.timestamp() if progress.eta is not None else None
            current[(self.job_eta, key)] = eta
        for (metric, labels), value in current.items():
            if value is None:
                continue
            assert isinstance(metric, Gauge)
            metric.labels(*labels).set(value)
            known.add((metric, labels))
        for metric, labels in list(known):
            if metric is not self.job_restarts and current.get((metric, labels)) is None:
                metric.remove(*labels)
                known.discard((metric, labels))

    def record_restart(self, job: RLHFJob, reason: str) -> None:
        """A restart the operator just decided: the operator-wide and the job's counters."""
        self.restarts.labels(reason=reason).inc()
        self.job_restarts.labels(job.metadata.namespace, job.metadata.name, reason).inc()

    def forget_job(self, namespace: str, name: str) -> None:
        """The job is gone: so are its series."""
        for metric, labels in self._job_series.pop((namespace, name), set()):
            metric.remove(*labels)

    def set_phase_counts(self, counts: dict[str, int]) -> None:
        for phase in Phase:
            self.jobs.labels(phase=phase.value).set(counts.get(phase.value, 0))

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)


def _base(name: str) -> str:
    """prometheus_client appends `_total` to a counter's name itself."""
    return name.removesuffix("_total")


METRIC_NAMES = (
    JOBS,
    RECONCILES_TOTAL,
    RECONCILE_DURATION_SECONDS,
    CLUSTER_READY_SECONDS,
    FIRST_STEP_SECONDS,
    SUBMISSIONS_TOTAL,
    SUBMISSION_FAILURES_TOTAL,
    RESTARTS_TOTAL,
    FAILURE_DETECTION_SECONDS,
    RECOVERY_SECONDS,
    JOB_PHASE,
    JOB_CONDITION,
    JOB_RESTART_COUNT,
    JOB_MAX_RESTARTS,
    JOB_RESTARTS_TOTAL,
    JOB_STEP,
    JOB_TOTAL_STEPS,
    JOB_STEPS_PER_SECOND,
    JOB_ETA_TIMESTAMP_SECONDS,
)
