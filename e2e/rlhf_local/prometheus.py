"""A real Prometheus for the e2e tier: it scrapes the operator and every Ray pod of the stand-in,
and evaluates the chart's alerts, so the dashboards' queries and the alerts are tried on what a
real run exports.

The binary is Debian's (`rlhf_local.build`, cached with the control plane's). In a cluster the
chart's ServiceMonitor and PodMonitor find the targets; here the operator is a static target
labelled as the ServiceMonitor's would be (job = the metrics Service, the release namespace,
`honor_labels`), and the stand-in writes every Ray pod's metrics ports as a file_sd list
labelled as the PodMonitor's relabelings do (`rlhf_local.standin.SCRAPE_TARGETS`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rlhf_local import procs
from rlhf_local.harness import wait_for
from rlhf_local.operator_process import TEMPLATE_API_SERVER
from rlhf_local.paths import REPO_ROOT

CHART = REPO_ROOT / "charts" / "rlhfjob"
RELEASE = "rlhfjob"
RELEASE_NAMESPACE = "rlhfjob-system"
OPERATOR_SCRAPE_JOB = f"{RELEASE}-metrics"
"""The `job` label of the operator's target: the chart's metrics Service of release `rlhfjob`."""
RAY_SCRAPE_JOB = f"{RELEASE_NAMESPACE}/{RELEASE}-ray"
"""The `job` label the Prometheus Operator gives the PodMonitor's targets."""
ALERTS = (
    "RLHFJobTrainerHung",
    "RLHFJobRestartsNearlyExhausted",
    "RLHFJobDegraded",
    "RLHFJobProvisioningStuck",
    "RLHFJobNoStepProgress",
    "RLHFJobOperatorDown",
    "RLHFJobOperatorReconcileErrors",
)
SHORT_ALERTS: dict[str, Any] = {
    "hungWindow": "10m",
    "restartsUsedRatio": 0.3,
    "degradedFor": "5s",
    "provisioningFor": "1s",  # a fast provisioning lasts a few seconds here
    "noProgressFor": "3s",
    "operatorDownFor": "0s",
    "reconcileErrorRatio": 0,
    "reconcileErrorWindow": "1m",
    "reconcileErrorsFor": "0s",
}
"""Durations short enough for a fault case of a few minutes to fire its alerts."""


def render_rules(helm: Path, alerts: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chart's PrometheusRule as a Prometheus rule file (its `spec`), rendered by helm with
    the chart's defaults, or with `alerts` (values under metrics.prometheusRule.alerts)."""
    values = {"metrics": {"prometheusRule": {"enabled": True, "alerts": alerts or {}}}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:  # typed, unlike --set
        file.write(yaml.safe_dump(values))
        file.flush()
        rendered = subprocess.run(
            [str(helm), "template", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE,
             "--show-only", "templates/prometheusrule.yaml", "-f", file.name,
             "--set", TEMPLATE_API_SERVER],  # helm template derives no API server range
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
    rule = yaml.safe_load(rendered)
    assert rule["kind"] == "PrometheusRule", rule
    return {"groups": rule["spec"]["groups"]}


@dataclass
class Prometheus:
    """`prometheus` on 127.0.0.1, scraping every `interval` seconds, with the given rules."""

    binary: Path
    workdir: Path
    operator_port: int
    ray_targets: Path
    """The stand-in's file_sd list of Ray pods' metrics ports."""
    rules: dict[str, Any]
    interval: str = "1s"
    """Scrapes of the operator and rule evaluations: the short alerts need a fine grain."""
    ray_interval: str = "5s"
    """Scrapes of the Ray pods (Ray's exporter, the trainer's): each costs the pod's Ray agent
    CPU, which a joining Ray node needs on two busy cores."""
    port: int = field(default_factory=procs.free_port)
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    """When it started (Unix time)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        return {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "rule_files": [str(self.workdir / "rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": OPERATOR_SCRAPE_JOB,
                    "honor_labels": True,
                    "static_configs": [
                        {
                            "targets": [f"127.0.0.1:{self.operator_port}"],
                            "labels": {"namespace": RELEASE_NAMESPACE},
                        }
                    ],
                },
                {
                    "job_name": RAY_SCRAPE_JOB,
                    "scrape_interval": self.ray_interval,
                    "file_sd_configs": [
                        {"files": [str(self.ray_targets)], "refresh_interval": "5s"}
                    ],
                },
            ],
        }

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "rules.yaml").write_text(yaml.safe_dump(self.rules))
        (self.workdir / "prometheus.yaml").write_text(yaml.safe_dump(self.config()))
        if not self.ray_targets.exists():  # the stand-in writes it with its first cluster
            self.ray_targets.parent.mkdir(parents=True, exist_ok=True)
            self.ray_targets.write_text("[]\n")
        with (self.workdir / "prometheus.log").open("ab") as log:
            self.process = subprocess.Popen(
                [str(self.binary), f"--config.file={self.workdir / 'prometheus.yaml'}",
                 f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}",
                 "--storage.tsdb.retention.time=1d", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.started = time.time()
        wait_for(self.ready, 60, "Prometheus to be ready", details=self.log_tail)
        # Targets come with the first discovery round (about 5 s): until the operator's first
        # scrape, the operator-down alert fires for its absence.
        wait_for(lambda: self.query(f'up{{job="{OPERATOR_SCRAPE_JOB}"}} == 1'), 60,
                 "Prometheus to scrape the operator", details=self.log_tail)  # fmt: skip

    def ready(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{self.log_tail()}")
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
            return bool(response.status == 200)

    def cpu_seconds(self) -> float:
        """CPU time the server has used so far (user + system), what it costs the tier."""
        if self.process is None:
            return 0.0
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        procs.terminate(self.process)
        self.process = None

    def log_tail(self, lines: int = 40) -> str:
        path = self.workdir / "prometheus.log"
        text = path.read_text(errors="replace") if path.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _api(self, endpoint: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{endpoint}?{query}", timeout=30) as r:
            body = json.loads(r.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{endpoint} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series."""
        return list(self._api("query", query=expr)["result"])

    def query_range(self, expr: str, start: float, end: float, step: float = 2.0) -> list[Any]:
        """A range query's series, as a dashboard panel over [start, end] asks it."""
        data = self._api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                         step=str(step))  # fmt: skip
        return list(data["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self._api("targets")["activeTargets"])

    def fired(self, start: float, end: float | None = None, selector: str = "") -> set[str]:
        """The alerts (of series matching `selector`) firing at some time in [start, end]."""
        end = end if end is not None else time.time()
        matchers = ", ".join(filter(None, ['alertstate="firing"', selector]))
        series = self.query_range(f"ALERTS{{{matchers}}}", start, end, step=1.0)
        return {s["metric"]["alertname"] for s in series}


def has_data(series: list[dict[str, Any]]) -> bool:
    """A finite value anywhere in a query's answer (a quantile of no observations is NaN)."""
    for one in series:
        points = one.get("values") or ([one["value"]] if "value" in one else [])
        if any(math.isfinite(float(value)) for _, value in points):
            return True
    return False
