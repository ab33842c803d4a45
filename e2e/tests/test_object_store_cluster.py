"""The local cluster's S3-compatible object store (SeaweedFS) is a real, private S3 server.

What checkpoints to a bucket will rely on: a multipart upload of several MiB reads back
byte for byte, listing by prefix and deleting work, only the cluster's own key pair gets in
(a wrong secret, an unknown key and an unsigned request are all refused with 403), nothing
listens beyond 127.0.0.1, and a restart of the server keeps what was written. Seconds: one
process, no pods; the restart waits out the master's 15 s warm-up on existing data.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import botocore
import botocore.config
import botocore.exceptions
import pytest

from rlhf_local import cluster, objectstore
from rlhf_local.paths import local_dir, read_ports
from rlhf_local.testing import LocalCluster

pytestmark = pytest.mark.e2e

MIB = 2**20
#: S3's smallest part but the last: the upload below has two of these and a shorter third.
PART = 5 * MIB


def error_code(err: botocore.exceptions.ClientError) -> tuple[int, str]:
    response: Any = err.response
    return response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Code"]


def multipart_upload(s3: Any, bucket: str, key: str, data: bytes) -> dict[str, Any]:
    """Upload `data` in PART-sized parts with the multipart API itself (as a checkpoint
    writer's transfer manager does for big files); the completion's answer."""
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)
    parts = []
    for number, offset in enumerate(range(0, len(data), PART), start=1):
        body = data[offset : offset + PART]
        etag = s3.upload_part(
            Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=number, Body=body
        )["ETag"]
        parts.append({"PartNumber": number, "ETag": etag})
    return dict(
        s3.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
        )
    )


def test_multipart_object_round_trips_lists_by_prefix_and_deletes(
    local_cluster: LocalCluster, s3_bucket: str
) -> None:
    s3 = objectstore.client()
    data = os.urandom(2 * PART + 3 * MIB)  # 13 MiB: three parts
    done = multipart_upload(s3, s3_bucket, "ckpt/step-2/model.bin", data)
    assert done["ETag"].strip('"').endswith("-3"), done  # S3's ETag of a 3-part object

    got = s3.get_object(Bucket=s3_bucket, Key="ckpt/step-2/model.bin")
    assert got["ContentLength"] == len(data)
    assert hashlib.sha256(got["Body"].read()).digest() == hashlib.sha256(data).digest()

    for key in ("ckpt/step-1/manifest.json", "ckpt/step-2/manifest.json", "logs/run.txt"):
        s3.put_object(Bucket=s3_bucket, Key=key, Body=key.encode())
    assert objectstore.list_keys(s3_bucket, "ckpt/step-2/") == [
        "ckpt/step-2/manifest.json",
        "ckpt/step-2/model.bin",
    ]
    assert objectstore.list_keys(s3_bucket, "ckpt/") == [
        "ckpt/step-1/manifest.json",
        "ckpt/step-2/manifest.json",
        "ckpt/step-2/model.bin",
    ]

    s3.delete_object(Bucket=s3_bucket, Key="ckpt/step-2/model.bin")
    assert objectstore.list_keys(s3_bucket, "ckpt/step-2/") == ["ckpt/step-2/manifest.json"]
    with pytest.raises(botocore.exceptions.ClientError) as gone:
        s3.head_object(Bucket=s3_bucket, Key="ckpt/step-2/model.bin")
    assert error_code(gone.value)[0] == 404


def test_only_the_clusters_key_pair_gets_in(local_cluster: LocalCluster, s3_bucket: str) -> None:
    good = objectstore.credentials()
    objectstore.client().put_object(Bucket=s3_bucket, Key="secret.txt", Body=b"x")
    wrong_secret = objectstore.Credentials(good.access_key_id, good.secret_access_key[::-1])
    unknown_key = objectstore.Credentials("AKIDUNKNOWN000000000", good.secret_access_key)
    refusals = {
        "SignatureDoesNotMatch": objectstore.client(creds=wrong_secret, attempts=1),
        "InvalidAccessKeyId": objectstore.client(creds=unknown_key, attempts=1),
    }
    for code, s3 in refusals.items():
        for call in (
            lambda s3=s3: s3.list_buckets(),
            lambda s3=s3: s3.get_object(Bucket=s3_bucket, Key="secret.txt"),
            lambda s3=s3: s3.put_object(Bucket=s3_bucket, Key="intruder.txt", Body=b"y"),
        ):
            with pytest.raises(botocore.exceptions.ClientError) as refused:
                call()
            assert error_code(refused.value) == (403, code)

    anonymous = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=objectstore.endpoint_url(),
        config=botocore.config.Config(
            signature_version=botocore.UNSIGNED, region_name=objectstore.REGION
        ),
    )
    for call in (
        lambda: anonymous.list_objects_v2(Bucket=s3_bucket),
        lambda: anonymous.get_object(Bucket=s3_bucket, Key="secret.txt"),
    ):
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            call()
        assert error_code(refused.value) == (403, "AccessDenied")
    assert objectstore.list_keys(s3_bucket) == ["secret.txt"]  # nothing got in


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket of `pid` in LISTEN state, IPv4 and IPv6."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = str(fd.readlink())
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = local.split(":")
            if table == "tcp":
                ip = ".".join(str(b) for b in reversed(bytes.fromhex(hex_ip)))
            else:
                ip = bytes.fromhex(hex_ip).hex()  # raw; only 127.0.0.1 is expected anyway
            found.add((ip, int(hex_port, 16)))
    return found


def test_server_listens_on_loopback_only(local_cluster: LocalCluster) -> None:
    pid = cluster.status()[objectstore.COMPONENT]
    assert pid is not None
    listening = listening_addresses(pid)
    ports = {read_ports(local_dir())[name] for name in objectstore.PORT_NAMES}
    assert {port for _, port in listening} == ports, listening  # what it listens on, no more
    assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening


def test_restart_keeps_buckets_and_objects(local_cluster: LocalCluster, s3_bucket: str) -> None:
    data = os.urandom(PART + 1)
    multipart_upload(objectstore.client(), s3_bucket, "ckpt/step-7/model.bin", data)
    objectstore.client().put_object(Bucket=s3_bucket, Key="ckpt/latest", Body=b"step-7")
    pid_before = cluster.status()[objectstore.COMPONENT]

    took = cluster.restart(objectstore.COMPONENT)

    assert cluster.status()[objectstore.COMPONENT] not in (None, pid_before)
    s3 = objectstore.client()
    assert s3_bucket in {b["Name"] for b in s3.list_buckets()["Buckets"]}
    assert objectstore.list_keys(s3_bucket) == ["ckpt/latest", "ckpt/step-7/model.bin"]
    body = s3.get_object(Bucket=s3_bucket, Key="ckpt/step-7/model.bin")["Body"].read()
    assert body == data
    assert s3.get_object(Bucket=s3_bucket, Key="ckpt/latest")["Body"].read() == b"step-7"
    # Ready means writable: a put does not wait for the master's warm-up (11 s when it did).
    started = time.monotonic()
    s3.put_object(Bucket=s3_bucket, Key="ckpt/latest", Body=b"step-8")
    assert time.monotonic() - started < 5
    assert s3.get_object(Bucket=s3_bucket, Key="ckpt/latest")["Body"].read() == b"step-8"
    assert took < 60, f"restart took {took:.1f}s"
