"""The RLHFJob models: defaults, the examples, and every invalid case named by field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlhf_operator import builder, names
from rlhfjob import api
from rlhfjob.api import Phase, RLHFJob, RLHFJobSpec
from rlhfjob.config import InvalidJobError, load_job, parse_job
from rlhfjob.contract import PodEnv
from rlhfjob.invalid_cases import INVALID_CASES, MODEL_ONLY_CASES
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import valid_job

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


def test_there_are_at_least_25_invalid_cases() -> None:
    assert len(INVALID_CASES) >= 25
    cases = INVALID_CASES + MODEL_ONLY_CASES
    assert len({case.id for case in cases}) == len(cases)


@pytest.mark.parametrize("case", INVALID_CASES + MODEL_ONLY_CASES, ids=lambda case: case.id)
def test_each_case_breaks_only_its_patch(case) -> None:
    """The job a case patches is valid, its name too: what is refused is the patch."""
    parse_job(valid_job(f"invalid-{case.id}"))


@pytest.mark.parametrize("case", INVALID_CASES + MODEL_ONLY_CASES, ids=lambda case: case.id)
def test_models_reject_invalid_job_naming_the_field(case) -> None:
    with pytest.raises(InvalidJobError) as raised:
        parse_job(case.job(), source=case.id)
    blamed = [line for line in raised.value.problems if line.startswith(f"{case.field}:")]
    assert blamed, f"expected a problem on {case.field}, got {raised.value.problems}"
    if case.rule_message:
        assert case.rule_message in blamed[0]


def test_valid_base_job_is_accepted_with_defaults() -> None:
    job = parse_job(valid_job())
    assert job.metadata.namespace == "default"
    assert job.spec.algorithm.group_size == 8
    assert job.spec.checkpoint.keep_last == 3
    assert job.spec.recovery.max_restarts == 3
    assert job.spec.liveness.heartbeat_timeout_seconds == 60
    assert job.spec.roles.reference is None
    assert list(job.spec.roles.enabled()) == ["trainer", "rollout"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_and_round_trip(path: Path) -> None:
    job = load_job(path)
    again = RLHFJobSpec.model_validate(job.spec.wire())
    assert again == job.spec


def test_wire_form_is_camel_case_without_nulls() -> None:
    wire = parse_job(valid_job()).spec.wire()
    assert "groupSize" in wire["algorithm"]
    assert "group_size" not in wire["algorithm"]
    assert "reference" not in wire["roles"]


def test_load_job_reports_yaml_and_shape_errors(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    with pytest.raises(InvalidJobError, match=r"broken\.yaml"):
        load_job(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string")
    with pytest.raises(InvalidJobError, match="one YAML mapping"):
        load_job(scalar)


def test_several_problems_are_all_reported() -> None:
    document = valid_job()
    document["spec"]["algorithm"].update(groupSize=0, klCoef=-1)
    with pytest.raises(InvalidJobError) as raised:
        parse_job(document)
    fields = {line.split(":")[0] for line in raised.value.problems}
    assert {"spec.algorithm.groupSize", "spec.algorithm.klCoef"} <= fields


def test_every_broken_rule_of_one_object_is_reported() -> None:
    """Two CEL rules of the spec broken at once: both named, as the API server names them (a
    user fixing one should not meet the other only on the next try)."""
    document = valid_job()
    del document["spec"]["model"]["policy"]
    document["spec"]["model"]["randomInit"] = {"model_type": "llama", "n_positions": 4}
    document["spec"]["algorithm"]["stopStrings"] = ["</answer>"]
    with pytest.raises(InvalidJobError) as raised:
        parse_job(document)
    fields = {line.split(":")[0] for line in raised.value.problems}
    assert {"spec.algorithm.maxResponseLength", "spec.algorithm.stopStrings"} <= fields


def test_every_defaulted_section_is_valid_on_its_own() -> None:
    """A default that breaks a rule would fail with no field to blame; keep them consistent."""
    for field in RLHFJobSpec.model_fields.values():
        if field.default_factory is not None:
            field.default_factory()  # type: ignore[call-arg]  # raises if the default is invalid


def test_terminal_phases() -> None:
    assert {phase for phase in Phase if phase.terminal} == {Phase.SUCCEEDED, Phase.FAILED}


def test_status_parses_what_the_operator_writes() -> None:
    document = valid_job()
    document["status"] = {
        "phase": "Running",
        "currentStep": 3,
        "restartHistory": [{"time": "2026-01-01T00:00:00Z", "reason": "TrainerHung"}],
    }
    job = RLHFJob.model_validate(document)
    assert job.status is not None
    assert job.status.phase is Phase.RUNNING
    assert job.status.restart_history[0].reason == "TrainerHung"


def test_a_name_of_the_longest_allowed_length_derives_valid_names_unshortened() -> None:
    name = "j" * api.MAX_NAME_LENGTH
    job = parse_job(valid_job(name))
    derived = {
        names.ray_cluster_name(job): "",
        names.config_map_name(job): "-config",
        names.trainer_service_account(job): "-trainer",
        names.heartbeat_role_name(job): "-heartbeat",
        names.ray_auth_secret_name(job, None): "-ray-auth",
        names.network_policy_name(job): "-ray-head",
        names.head_api_policy_name(job): "-head-api",
        names.dashboard_url(job).split("//")[1].split(".")[0]: "-head-svc",
    }
    dns_label = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
    for value, suffix in derived.items():
        assert value == name + suffix, "a derived name was shortened"
        assert dns_label.fullmatch(value), value
        assert suffix == "" or suffix in api.DERIVED_NAME_SUFFIXES, suffix
    secret = names.ray_auth_secret_name(job, "token")  # the stem and the token's fingerprint
    assert dns_label.fullmatch(secret) and secret != names.ray_auth_secret_name(job, "other")
    assert re.search(names.RAY_AUTH_SECRETS, secret), "what the job policy keeps jobs from"
    assert api.MAX_NAME_LENGTH <= names.MAX_RAY_CLUSTER_NAME
    assert names.job_labels(job)[names.LABEL_JOB] == name  # a label value: at most 63


def test_reserved_mount_paths_are_the_operators_mounts() -> None:
    job = parse_job(valid_job())
    volumes, mounts = builder._volumes(job, job.spec.pod_overrides("trainer"))
    checkpoints = {job.spec.checkpoint.path}
    assert {mount["mountPath"] for mount in mounts} == set(api.RESERVED_MOUNT_PATHS) | checkpoints
    assert [volume["name"] for volume in volumes] == list(api.OPERATOR_VOLUMES)
    read_only = {mount["mountPath"] for mount in mounts if mount.get("readOnly")}
    assert read_only == set(api.READ_ONLY_MOUNT_PATHS)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("groupSize", "8"),  # text is no integer
        ("groupSize", 8.0),  # nor is a float
        ("klCoef", float("inf")),  # a file's .inf: JSON cannot carry it
        ("klCoef", float("nan")),
        ("scaleRewards", "yes"),
    ],
)
def test_models_type_fields_as_the_api_server_does(field: str, value: object) -> None:
    document = valid_job()
    document["spec"]["algorithm"][field] = value
    with pytest.raises(InvalidJobError, match=re.escape(f"spec.algorithm.{field}")):
        parse_job(document)


def test_quantities_follow_kubernetes_syntax() -> None:
    good = ["4", "500m", "0.5", ".5", "16Gi", "1e3", "1E", "+2", "100Ki", 8]
    bad = ["lots", "1.2.3", "16GB", "16Gii", "1e", "-1", -1, "4 ", " 4", "4\n", ""]
    for value in good:
        document = merge_role(cpu=value)
        parse_job(document)
    for value in bad:
        with pytest.raises(InvalidJobError, match=re.escape("spec.roles.trainer.cpu")):
            parse_job(merge_role(cpu=value))


def merge_role(**fields: object) -> dict:
    document = valid_job()
    document["spec"]["roles"]["trainer"].update(fields)
    return document


def test_label_syntax_of_node_selectors() -> None:
    good = {"pool": "a100", "nvidia.com/gpu.product": "H100-SXM", "k8s.io/x": "", "a_b.c": "Z9"}
    parse_job(merge_role(nodeSelector=good))
    for key in ["", "/pool", "Example.com/pool", "pool/", "-pool", "a/b/c", "x" * 64]:
        with pytest.raises(InvalidJobError, match="every key must be a label key"):
            parse_job(merge_role(nodeSelector={key: "v"}))
    for value in ["-a", "a-", "a b", "x" * 64, "ä"]:
        with pytest.raises(InvalidJobError, match=re.escape("spec.roles.trainer.nodeSelector")):
            parse_job(merge_role(nodeSelector={"pool": value}))


@pytest.mark.parametrize(
    "image",
    [
        "trainer",
        "trainer:1",
        "ghcr.io/rlhfjob/trainer:0.1.0",
        "localhost:5000/a/b_c/d-e:latest",
        "[::1]:5000/trainer",
        "registry.example.com/team/trainer@sha256:" + "a" * 64,
        "example.com/trainer:1.0@sha256:" + "0" * 64,
    ],
)
def test_image_references_the_runtime_accepts(image: str) -> None:
    document = valid_job()
    document["spec"]["image"] = image
    parse_job(document)


def test_a_pods_own_overrides_go_over_spec_pods() -> None:
    """Maps merged, lists joined (the pod's entry wins on its key), single values replaced."""
    job = parse_job(
        merge_patch(
            valid_job(),
            {
                "spec": {
                    "pods": {
                        "labels": {"team": "a", "tier": "x"},
                        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                        "envFrom": [{"configMapRef": {"name": "common"}}],
                        "volumes": [{"name": "models", "emptyDir": {}}],
                        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                        "shmSize": "1Gi",
                    },
                    "roles": {
                        "trainer": {
                            "pod": {
                                "labels": {"tier": "train"},
                                "env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}],
                                "envFrom": [
                                    {"configMapRef": {"name": "common"}},
                                    {"secretRef": {"name": "own"}},
                                ],
                                "volumes": [{"name": "models", "configMap": {"name": "m"}}],
                                "volumeMounts": [
                                    {"name": "models", "mountPath": "/models", "readOnly": True}
                                ],
                                "extraResources": {"rdma/ib": 1},
                            }
                        }
                    },
                }
            },
        )
    )
    trainer = job.spec.pod_overrides("trainer")
    assert trainer.labels == {"team": "a", "tier": "train"}
    assert [(var.name, var.value) for var in trainer.env] == [("A", "1"), ("B", "3"), ("C", "4")]
    assert [source.wire() for source in trainer.env_from] == [
        {"configMapRef": {"name": "common", "optional": False}},
        {"secretRef": {"name": "own", "optional": False}},
    ]
    assert [volume.wire() for volume in trainer.volumes] == [
        {"name": "models", "configMap": {"name": "m"}}
    ]
    assert [mount.read_only for mount in trainer.volume_mounts] == [True]
    assert trainer.shm_size == "1Gi" and trainer.extra_resources == {"rdma/ib": 1}
    rollout = job.spec.pod_overrides("rollout")  # no pod of its own: spec.pods as it is
    assert rollout.labels == {"team": "a", "tier": "x"} and rollout.extra_resources == {}
    assert [var.value for var in rollout.env] == ["1", "2"]
    assert set(job.spec.pod_places()) == {"spec.pods", "spec.roles.trainer.pod"}


def test_reserved_env_names_are_what_the_operator_writes() -> None:
    job = parse_job(valid_job())
    written = {var["name"] for var in builder._pod_env(job, "head", job.spec.pod_overrides("head"))}
    written |= set(PodEnv(attempt=1).to_env())  # the Ray job submission's
    assert written <= set(api.RESERVED_ENV)
    assert {"RAY_ADDRESS", "RAY_AUTH_TOKEN"} <= set(api.RESERVED_ENV)
