"""The RayCluster builder: placement by role, determinism, and golden files users can read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_operator import builder
from rlhf_operator.names import short_name
from rlhf_operator.network import NetworkSettings
from rlhfjob.config import load_job, parse_job
from rlhfjob.patches import merge_patch
from rlhfjob.valid_cases import EVERY_POD_OVERRIDE, MODELS, SECRET_ENV, valid_job

ROOT = Path(__file__).parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"


def _job(patch: dict[str, Any] | None = None, uid: str = "0000-uid"):
    document = merge_patch(valid_job("demo"), patch or {})
    document["metadata"]["uid"] = uid
    return parse_job(document)


def _groups(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}


def _container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_rendered_examples_match_golden_files(path: Path) -> None:
    job = load_job(path)
    rendered = builder.to_yaml(builder.build_ray_cluster(job), builder.build_config_map(job))
    golden = GOLDEN / f"{path.stem}.rendered.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert golden.read_text() == rendered, f"re-run with UPDATE_GOLDEN=1 to accept: {golden}"


def test_same_input_gives_byte_identical_output() -> None:
    first = builder.to_yaml(builder.build_ray_cluster(_job()))
    second = builder.to_yaml(builder.build_ray_cluster(_job()))
    assert first == second
    assert "&id" not in first, "shared objects must not turn into YAML anchors"


def test_one_worker_group_per_enabled_role_with_placement() -> None:
    selector = {"rlhf.dev/pool": "gpu-train"}
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    job = _job(
        {
            "spec": {
                "algorithm": {"name": "ppo"},
                "roles": {
                    "trainer": {
                        "replicas": 2,
                        "gpus": 8,
                        "nodeSelector": selector,
                        "tolerations": [toleration],
                    },
                    "rollout": {
                        "replicas": 3,
                        "minReplicas": 1,
                        "gpus": 8,
                        "tensorParallelSize": 2,
                        "backend": "vllm",
                    },
                    "critic": {"gpus": 2, "affinity": {"podAntiAffinity": {}}},
                },
            }
        }
    )
    groups = _groups(builder.build_ray_cluster(job))
    assert list(groups) == ["trainer", "rollout", "critic"]

    trainer = groups["trainer"]
    assert (trainer["replicas"], trainer["minReplicas"], trainer["maxReplicas"]) == (2, 2, 2)
    assert trainer["template"]["spec"]["nodeSelector"] == selector
    assert trainer["template"]["spec"]["tolerations"] == [toleration]
    limits = _container(trainer["template"])["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "8"
    advertised = json.loads(json.loads(trainer["rayStartParams"]["resources"]))
    assert advertised == {"rlhf-role-trainer": 8}

    rollout = groups["rollout"]
    assert (rollout["replicas"], rollout["minReplicas"], rollout["maxReplicas"]) == (3, 1, 3)
    advertised = json.loads(json.loads(rollout["rayStartParams"]["resources"]))
    assert advertised == {"rlhf-role-rollout": 4}, "8 GPUs / TP 2 = 4 engines per pod"
    assert groups["critic"]["template"]["spec"]["affinity"] == {"podAntiAffinity": {}}


def test_a_colocated_rollout_gets_no_worker_group_and_rides_on_the_trainer_pods() -> None:
    job = _job(
        {
            "spec": {
                "roles": {
                    "trainer": {"replicas": 2, "gpus": 8},
                    "rollout": {"placement": "colocated", "backend": "vllm"},
                },
            }
        }
    )
    groups = _groups(builder.build_ray_cluster(job))
    assert list(groups) == ["trainer"]
    advertised = json.loads(json.loads(groups["trainer"]["rayStartParams"]["resources"]))
    assert advertised == {"rlhf-role-trainer": 8}, "one rank, and so one engine, per GPU"


def test_head_requests_no_gpu_and_hosts_no_actors() -> None:
    cluster = builder.build_ray_cluster(_job({"spec": {"roles": {"trainer": {"gpus": 8}}}}))
    head = cluster["spec"]["headGroupSpec"]
    resources = _container(head["template"])["resources"]
    assert "nvidia.com/gpu" not in resources["requests"]
    assert "nvidia.com/gpu" not in resources["limits"]
    assert head["rayStartParams"]["num-cpus"] == "0"


def test_every_pod_gets_shm_job_config_and_checkpoint_volume() -> None:
    volume = {"persistentVolumeClaim": {"claimName": "ckpt"}}
    job = _job({"spec": {"checkpoint": {"path": "/ckpt", "volume": volume}}})
    cluster = builder.build_ray_cluster(job)
    templates = [cluster["spec"]["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster["spec"]["workerGroupSpecs"]
    ]
    for template in templates:
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in _container(template)["volumeMounts"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
        assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
        assert volumes["job-config"]["configMap"]["name"] == "demo-config"
        assert mounts == {
            "dshm": "/dev/shm",
            "job-config": "/etc/rlhfjob",
            "checkpoints": "/ckpt",
            **builder.WRITABLE_PATHS,
        }


RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}  # fmt: skip
"""What Pod Security "restricted" admits."""


def test_pods_pass_pod_security_restricted_with_a_read_only_root() -> None:
    volume = {"persistentVolumeClaim": {"claimName": "ckpt"}}
    cluster = builder.build_ray_cluster(_job({"spec": {"checkpoint": {"volume": volume}}}))
    for group in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]:
        spec = group["template"]["spec"]
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] is True
        assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
        container = _container(group["template"])["securityContext"]
        assert container["allowPrivilegeEscalation"] is False
        assert container["capabilities"] == {"drop": ["ALL"]}
        assert container["readOnlyRootFilesystem"] is True
        for volume_spec in spec["volumes"]:
            (kind,) = set(volume_spec) - {"name"}
            assert kind in RESTRICTED_VOLUME_TYPES, volume_spec


def test_only_the_head_gets_an_api_token() -> None:
    cluster = builder.build_ray_cluster(_job())
    assert cluster["spec"]["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        assert group["template"]["spec"]["automountServiceAccountToken"] is False


def test_ray_runs_with_token_auth_from_the_jobs_secret() -> None:
    job = _job()
    cluster = builder.build_ray_cluster(job, ray_token="t0ken")
    secret = builder.build_ray_auth_secret(job, "t0ken")
    assert cluster["spec"]["authOptions"] == {
        "mode": "token",
        "secretName": secret["metadata"]["name"],
    }
    assert secret["data"] == {"auth_token": "dDBrZW4="}
    assert "t0ken" not in json.dumps(cluster)
    # Named after the token: a new key gives a new Secret, and no one without the token can
    # make one of that name ahead of the operator.
    assert (
        builder.build_ray_auth_secret(job, "other")["metadata"]["name"]
        != secret["metadata"]["name"]
    )


def test_a_job_read_from_a_file_renders_to_yaml_kubectl_applies() -> None:
    job = load_job(ROOT / "examples" / "grpo-1gpu.yaml")
    rendered = builder.to_yaml(builder.build_ray_cluster(job), builder.build_config_map(job))
    assert "&id" not in rendered and "*id" not in rendered, "no YAML anchors"
    assert "uid:" not in rendered and "ownerReferences" not in rendered


def test_labels_and_owner_reference_tie_objects_to_the_job() -> None:
    job = _job(uid="abc-123")
    for manifest in (builder.build_ray_cluster(job), builder.build_config_map(job)):
        metadata = manifest["metadata"]
        assert metadata["labels"]["rlhf.dev/job"] == "demo"
        (owner,) = metadata["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("RLHFJob", "demo", "abc-123")
        assert owner["controller"] is True
    cluster = builder.build_ray_cluster(job)
    roles = [
        g["template"]["metadata"]["labels"]["rlhf.dev/role"]
        for g in cluster["spec"]["workerGroupSpecs"]
    ]
    assert roles == ["trainer", "rollout"]


def test_long_names_are_shortened_deterministically_and_stay_unique() -> None:
    first, second = "a" * 60 + "x", "a" * 60 + "y"
    assert len(short_name(first, 53)) <= 53
    assert short_name(first, 53) == short_name(first, 53) != short_name(second, 53)
    longest = _job({"metadata": {"name": "a" * 53}})  # the API's limit
    assert builder.ray_cluster_name(longest) == "a" * 53
    assert builder.ray_cluster_name(_job()) == "demo"


def test_config_map_holds_the_job_the_trainer_reads_back() -> None:
    job = _job()
    config_map = builder.build_config_map(job)
    document = yaml.safe_load(config_map["data"][builder.JOB_CONFIG_FILE])
    assert parse_job(document).spec == job.spec


def _templates(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = cluster["spec"]
    groups = {group["groupName"]: group["template"] for group in spec["workerGroupSpecs"]}
    return {"head": spec["headGroupSpec"]["template"], **groups}


def test_pod_overrides_render_into_every_group_with_the_groups_own_on_top() -> None:
    templates = _templates(builder.build_ray_cluster(_job({"spec": EVERY_POD_OVERRIDE})))
    for group, template in templates.items():
        pod, container = template["spec"], _container(template)
        env = {var["name"]: var for var in container["env"]}
        assert list(env)[:4] == [
            "RLHF_JOB_NAME",
            "RLHF_JOB_NAMESPACE",
            "RLHF_ROLE",
            "RLHF_JOB_CONFIG",
        ]
        assert env["HF_TOKEN"] == SECRET_ENV | {
            "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": False}}
        }
        assert env["LOG_LEVEL"]["value"] == ("debug" if group == "head" else "info")
        assert container["envFrom"] == [
            {"prefix": "WANDB_", "secretRef": {"name": "wandb", "optional": False}},
            {"configMapRef": {"name": "settings", "optional": True}},
        ]
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        assert volumes["models"] == MODELS["volumes"][0]
        mounts = {mount["name"]: mount for mount in container["volumeMounts"]}
        assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
        assert ("scratch" in mounts) == ("scratch" in volumes) == (group == "trainer")
        shm = volumes["dshm"]["emptyDir"]
        assert shm == {"medium": "Memory", "sizeLimit": "64Gi" if group == "trainer" else "8Gi"}
        assert pod["priorityClassName"] == "research-high"
        assert pod["schedulerName"] == "gang-scheduler"
        assert pod["imagePullSecrets"] == [{"name": "registry"}]
        labels = template["metadata"]["labels"]
        assert labels["team"] == "alignment" and labels["rlhf.dev/role"] == group
        assert ("tier" in labels) == (group == "trainer")
        scrape = builder.SCRAPE_ANNOTATIONS if group == "head" else {}
        assert template["metadata"]["annotations"] == {"example.com/owner": "rl", **scrape}
        resources = container["resources"]
        assert resources["requests"] == resources["limits"]
        assert ("rdma/ib" in resources["limits"]) == (group == "trainer")
    assert _container(templates["trainer"])["resources"]["limits"]["rdma/ib"] == "1"


def test_a_job_without_overrides_renders_as_before() -> None:
    template = _templates(builder.build_ray_cluster(_job()))["trainer"]
    assert "envFrom" not in _container(template)
    assert "annotations" not in template["metadata"]
    assert not {"priorityClassName", "schedulerName", "imagePullSecrets"} & set(template["spec"])
    shm = next(v for v in template["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory"}


def test_secrets_stay_references_in_everything_the_operator_writes() -> None:
    """The operator never reads a Secret: what it applies names the Secret, never its value."""
    job = _job({"spec": EVERY_POD_OVERRIDE})
    objects = builder.build_owned_objects(job, "t0ken", NetworkSettings("rlhfjob-system"))
    cluster = next(o for o in objects if o["kind"] == "RayCluster")
    for template in _templates(cluster).values():
        (hf,) = [var for var in _container(template)["env"] if var["name"] == "HF_TOKEN"]
        assert "value" not in hf and hf["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    config = next(o for o in objects if o["kind"] == "ConfigMap")
    stored = yaml.safe_load(config["data"][builder.JOB_CONFIG_FILE])
    assert stored["spec"]["pods"]["env"][0] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": False}},
    }
    # The one Secret the operator writes is the job's Ray token, which it derives itself.
    (secret,) = [o["metadata"]["name"] for o in objects if o["kind"] == "Secret"]
    assert secret.startswith("demo-ray-auth-")


def test_the_head_serves_the_trainers_metrics_where_prometheus_looks() -> None:
    cluster = builder.build_ray_cluster(_job())
    head = cluster["spec"]["headGroupSpec"]["template"]
    container = head["spec"]["containers"][0]
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env["RLHF_TRAINER_METRICS_PORT"] == "9400"
    assert {"name": "trainer-metrics", "containerPort": 9400} in container["ports"]
    assert head["metadata"]["annotations"]["prometheus.io/port"] == "9400"
    for group in cluster["spec"]["workerGroupSpecs"]:
        worker = group["template"]
        assert "RLHF_TRAINER_METRICS_PORT" not in {
            v["name"] for v in worker["spec"]["containers"][0]["env"]
        }
        assert "prometheus.io/scrape" not in worker["metadata"].get("annotations", {})


def test_a_job_may_opt_its_head_out_of_annotation_scraping() -> None:
    job = _job({"spec": {"head": {"pod": {"annotations": {"prometheus.io/scrape": "false"}}}}})
    head = builder.build_ray_cluster(job)["spec"]["headGroupSpec"]["template"]
    assert head["metadata"]["annotations"]["prometheus.io/scrape"] == "false"


def test_only_the_head_gets_the_checkpoint_buckets_credentials_by_reference() -> None:
    """The driver uploads checkpoints from the head; the ranks never talk to the bucket."""
    store = {"bucket": "ckpts", "endpoint": "http://s3.local:8333", "credentialsSecret": "s3"}
    job = _job({"spec": {"checkpoint": {"objectStore": store}}})
    objects = builder.build_owned_objects(job, "t0ken", NetworkSettings("rlhfjob-system"))
    cluster = next(o for o in objects if o["kind"] == "RayCluster")
    wanted = {"RLHF_OBJECT_STORE_ACCESS_KEY_ID", "RLHF_OBJECT_STORE_SECRET_ACCESS_KEY"}
    for name, template in _templates(cluster).items():
        env = {var["name"]: var for var in _container(template)["env"] if var["name"] in wanted}
        if name != "head":
            assert not env, name
            continue
        assert {var["valueFrom"]["secretKeyRef"]["key"] for var in env.values()} == {
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
        }
        assert all(var["valueFrom"]["secretKeyRef"]["name"] == "s3" for var in env.values())
    # Without a Secret the pods use their ambient credentials: nothing is added.
    ambient = _job({"spec": {"checkpoint": {"objectStore": {"bucket": "ckpts"}}}})
    head = _templates(builder.build_ray_cluster(ambient))["head"]
    assert not {var["name"] for var in _container(head)["env"]} & wanted
