"""The `rlhfjob` command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from rlhfjob import crdgen
from rlhfjob.invalid_cases import INVALID_CASES

ROOT = Path(__file__).parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlhfjob_cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


def test_crd_prints_the_committed_crd() -> None:
    result = _run("crd")
    assert result.returncode == 0, result.stderr
    assert result.stdout == crdgen.CRD_PATHS[0].read_text()


def test_render_prints_ray_cluster_and_config_map() -> None:
    result = _run("render", "examples/grpo-tiny-cpu.yaml")
    assert result.returncode == 0, result.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all(result.stdout)]
    assert kinds == ["RayCluster", "ConfigMap"]


def test_validate_names_the_field_and_fails(tmp_path: Path) -> None:
    case = next(c for c in INVALID_CASES if c.id == "rollout-gpus-not-multiple-of-tp")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(case.job()))
    result = _run("validate", str(bad), "examples/grpo-tiny-cpu.yaml")
    assert result.returncode == 1
    assert "spec.roles.rollout.gpus: gpus must be a multiple of tensorParallelSize" in result.stderr
    assert "grpo-tiny-cpu.yaml: valid RLHFJob default/grpo-tiny" in result.stdout


def test_render_of_an_invalid_file_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: rlhf.dev/v1alpha1\nkind: RLHFJob\nmetadata: {name: x}\nspec: {}\n")
    result = _run("render", str(bad))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "spec.image: Field required" in result.stderr


def test_render_shows_pod_overrides_and_only_references_to_secrets() -> None:
    result = _run("render", "examples/grpo-hf-secrets-and-models.yaml")
    assert result.returncode == 0, result.stderr
    cluster, config_map = yaml.safe_load_all(result.stdout)
    assert config_map["kind"] == "ConfigMap", "render prints no Secret"
    head = cluster["spec"]["headGroupSpec"]["template"]
    container = head["spec"]["containers"][0]
    (token,) = [var for var in container["env"] if var["name"] == "HF_TOKEN"]
    assert token == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": False}},
    }
    assert container["envFrom"] == [{"secretRef": {"name": "wandb", "optional": False}}]
    assert head["spec"]["priorityClassName"] == "research-high"
    assert head["metadata"]["labels"]["team"] == "alignment"
    trainer = cluster["spec"]["workerGroupSpecs"][0]["template"]
    assert trainer["spec"]["containers"][0]["resources"]["limits"]["rdma/ib"] == "1"


def test_export_of_something_not_a_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    result = _run("export", str(tmp_path / "run"), str(tmp_path / "out"))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("rlhfjob export: ") and "run" in result.stderr
    assert not (tmp_path / "out").exists()
