"""Invalid checkpoints and volume sources: paths the pod API would refuse to mount, intervals,
the object store, and volume sources against the Kubernetes schema the API carries. Part of
`rlhfjob.invalid_cases.INVALID_CASES`."""

from __future__ import annotations

from rlhfjob.invalid_case import InvalidCase
from rlhfjob.invalid_case import spec_patch as _spec

NFS_READ_ONLY_YES = {"server": "nfs.local", "path": "/models", "readOnly": "yes"}

CHECKPOINT_CASES: list[InvalidCase] = [
    # --- Checkpoint path, interval and bucket.
    InvalidCase(
        "checkpoint-path-relative", _spec(checkpoint={"path": "ckpt"}), "spec.checkpoint.path"
    ),
    InvalidCase(
        "checkpoint-interval-zero",
        _spec(checkpoint={"intervalSteps": 0}),
        "spec.checkpoint.intervalSteps",
    ),
    InvalidCase("keep-last-zero", _spec(checkpoint={"keepLast": 0}), "spec.checkpoint.keepLast"),
    InvalidCase(
        # A node drain waits for the job's PodDisruptionBudget this long at most.
        "stop-grace-period-too-long",
        _spec(checkpoint={"stopGracePeriodSeconds": 86401}),
        "spec.checkpoint.stopGracePeriodSeconds",
    ),
    InvalidCase(
        "object-store-upload-interval-not-a-multiple",
        _spec(
            checkpoint={
                "intervalSteps": 10,
                "objectStore": {"bucket": "ckpts", "intervalSteps": 15},
            }
        ),
        "spec.checkpoint.objectStore.intervalSteps",
        "objectStore.intervalSteps must be a multiple of intervalSteps",
    ),
    InvalidCase(
        "object-store-bucket-uppercase",
        _spec(checkpoint={"objectStore": {"bucket": "My_Bucket"}}),
        "spec.checkpoint.objectStore.bucket",
    ),
    InvalidCase(
        "object-store-endpoint-not-a-url",
        _spec(checkpoint={"objectStore": {"bucket": "ckpts", "endpoint": "s3.example.com"}}),
        "spec.checkpoint.objectStore.endpoint",
    ),
    InvalidCase(
        "object-store-prefix-without-slash",
        _spec(checkpoint={"objectStore": {"bucket": "ckpts", "prefix": "team-a"}}),
        "spec.checkpoint.objectStore.prefix",
    ),
    # --- Checkpoint volume and path: the pod API would refuse the mount.
    InvalidCase(
        "checkpoint-path-with-dot-dot",
        _spec(checkpoint={"path": "/mnt/checkpoints/../../etc"}),
        "spec.checkpoint.path",
        "path must not contain . or .. segments nor //",
    ),
    InvalidCase(
        "checkpoint-path-with-empty-segment",
        _spec(checkpoint={"path": "/mnt//checkpoints"}),
        "spec.checkpoint.path",
        "path must not contain . or .. segments nor //",
    ),
    InvalidCase(
        "object-store-prefix-up",
        _spec(checkpoint={"objectStore": {"bucket": "ckpt", "prefix": "team-a/../team-b/"}}),
        "spec.checkpoint.objectStore.prefix",
        "prefix must not contain . or .. segments nor //",
    ),
    InvalidCase(
        "checkpoint-path-root",
        _spec(checkpoint={"path": "/"}),
        "spec.checkpoint.path",
        "path must not be /, where the operator mounts a volume",
    ),
    InvalidCase(
        "checkpoint-path-is-tmp",
        _spec(checkpoint={"path": "/tmp/"}),
        "spec.checkpoint.path",
        "path must not be /, where the operator mounts a volume",
    ),
    InvalidCase(
        "checkpoint-path-in-job-config",
        _spec(checkpoint={"path": "/etc/rlhfjob/checkpoints"}),
        "spec.checkpoint.path",
        "nor inside the read-only /etc/rlhfjob",
    ),
    InvalidCase(
        "checkpoint-volume-named",
        _spec(checkpoint={"volume": {"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}}),
        "spec.checkpoint.volume.name",
        "leave out name",
    ),
    # --- Volume sources, in the Kubernetes schema the API carries.
    InvalidCase(
        "volume-source-misspelt-field",
        _spec(
            checkpoint={
                "volume": {"persistentVolumeClaim": {"claimName": "ckpt", "readonly": True}}
            }
        ),
        "spec.checkpoint.volume.persistentVolumeClaim.readonly",
    ),
    InvalidCase(
        "volume-source-without-a-required-field",
        _spec(checkpoint={"volume": {"nfs": {"path": "/exports/checkpoints"}}}),
        "spec.checkpoint.volume.nfs.server",
    ),
    InvalidCase(
        "volume-source-field-of-a-wrong-type",
        _spec(pods={"volumes": [{"name": "models", "nfs": NFS_READ_ONLY_YES}]}),
        "spec.pods.volumes[0].nfs.readOnly",
    ),
    InvalidCase(
        "volume-source-size-not-a-quantity",
        _spec(pods={"volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "lots"}}]}),
        "spec.pods.volumes[0].emptyDir.sizeLimit",
        "must be a Kubernetes quantity",
    ),
]
