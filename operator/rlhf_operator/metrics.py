"""The operator's Prometheus metrics, named once here (the Grafana dashboards use these names)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rlhfjob.api import Phase

_LATENCY_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


class OperatorMetrics:
    """One registry per operator, so tests can run several without clashing."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs = Gauge("rlhf_operator_jobs", "RLHFJobs by phase", ["phase"], registry=r)
        self.reconciles = Counter(
            "rlhf_operator_reconciles_total", "Reconciles by result", ["result"], registry=r
        )
        self.reconcile_seconds = Histogram(
            "rlhf_operator_reconcile_duration_seconds", "Time to reconcile one job", registry=r
        )
        self.cluster_ready_seconds = Histogram(
            "rlhf_operator_cluster_ready_seconds",
            "From RLHFJob creation to its RayCluster ready",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_step_seconds = Histogram(
            "rlhf_operator_first_step_seconds",
            "From RLHFJob creation to the first training step reported",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.submissions = Counter(
            "rlhf_operator_ray_job_submissions_total", "Ray job submissions", registry=r
        )
        self.submission_failures = Counter(
            "rlhf_operator_ray_job_submission_failures_total",
            "Ray job submissions that failed (dashboard unreachable or refused)",
            registry=r,
        )
        self.restarts = Counter(
            "rlhf_operator_restarts_total", "Trainer restarts by reason", ["reason"], registry=r
        )
        self.detection_seconds = Histogram(
            "rlhf_operator_failure_detection_seconds",
            "From the trainer's last sign of life to the operator's restart decision",
            ["reason"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.recovery_seconds = Histogram(
            "rlhf_operator_recovery_seconds",
            "From a failure to the first training step resumed after it",
            ["reason"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        for phase in Phase:
            self.jobs.labels(phase=phase.value).set(0)

    def set_phase_counts(self, counts: dict[str, int]) -> None:
        for phase in Phase:
            self.jobs.labels(phase=phase.value).set(counts.get(phase.value, 0))

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
