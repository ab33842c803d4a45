"""The Prometheus series of multi-turn rollouts (`spec.environment`): turns, how trajectories
ended, tool calls by tool and outcome, and the sandbox's round trip. `TrainerMetrics` has them
(`EpisodeSeries`); the step log's `env_*` figures come from `environments.episodes.figures`.
Every one is zero in a job without an environment."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

ENVIRONMENT_TURNS_TOTAL = "rlhf_trainer_environment_turns_total"
ENVIRONMENT_TRAJECTORIES_TOTAL = "rlhf_trainer_environment_trajectories_total"
TOOL_CALLS_TOTAL = "rlhf_trainer_tool_calls_total"
TOOL_ROUND_TRIP_SECONDS = "rlhf_trainer_tool_round_trip_seconds"
EPISODE_METRIC_NAMES = (
    ENVIRONMENT_TURNS_TOTAL,
    ENVIRONMENT_TRAJECTORIES_TOTAL,
    TOOL_CALLS_TOTAL,
    TOOL_ROUND_TRIP_SECONDS,
)
STOP_LABEL = "stop"
TOOL_LABEL = "tool"
TOOL_OUTCOME_LABEL = "outcome"
ROUND_TRIP_BUCKETS_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class EpisodeSeries:
    """The environment's series, defined once; `record_episodes` fills them from a batch's
    trajectory summaries (the records' `episode` field)."""

    def _episode_series(self, registry: CollectorRegistry) -> None:
        self.environment_turns = Counter(
            ENVIRONMENT_TURNS_TOTAL.removesuffix("_total"),
            "Model turns of the trajectories trained on (spec.environment).",
            registry=registry,
        )
        self.environment_trajectories = Counter(
            ENVIRONMENT_TRAJECTORIES_TOTAL.removesuffix("_total"),
            "Trajectories trained on, by how they ended: done, or truncated at turns, tokens "
            "or turn_length.",
            [STOP_LABEL],
            registry=registry,
        )
        self.tool_calls = Counter(
            TOOL_CALLS_TOTAL.removesuffix("_total"),
            "Tool calls of the trajectories trained on, by tool and outcome (ok, error, "
            "timeout, killed, output_limit).",
            [TOOL_LABEL, TOOL_OUTCOME_LABEL],
            registry=registry,
        )
        self.tool_round_trip = Histogram(
            TOOL_ROUND_TRIP_SECONDS,
            "Wall time of one turn's tool calls in the sandbox, as the driver waits for them.",
            buckets=ROUND_TRIP_BUCKETS_SECONDS,
            registry=registry,
        )

    def record_episodes(self, episodes: Sequence[dict[str, Any]]) -> None:
        """Count a batch's trajectories (their summaries, `environments.episodes`)."""
        for episode in episodes:
            self.environment_turns.inc(episode["turns"])
            self.environment_trajectories.labels(episode["stop"]).inc()
            for key, count in episode["tool_outcomes"].items():
                tool, _, outcome = key.rpartition("/")
                self.tool_calls.labels(tool, outcome).inc(count)
            for seconds in episode["tool_round_trips"]:
                self.tool_round_trip.observe(seconds)
