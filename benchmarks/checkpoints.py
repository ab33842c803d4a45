"""Checkpoint tiers on this machine: the step stall of a checkpoint, and a resume from the bucket.

    python benchmarks/checkpoints.py [--steps 16] [--interval 4] [--hidden 384] [--layers 6]

The tiny GRPO example with a bigger random model (`--hidden`, `--layers`: a checkpoint of some
hundred MB) trains as `rlhfjob train` (2 ZeRO-3 ranks, a local Ray) with its checkpoints on a
scratch volume every `--interval` steps and uploaded, in the background, to a bucket of a real
SeaweedFS server started here alone (`rlhf_local.objectstore`, the e2e tier's server). From
its step log:

* ``volume_save_seconds``: what training waits for per checkpoint, the save to the volume (the
  ``checkpoint`` phase, counted in the next step's record);
* ``overlap_seconds``: what the background upload costs the steps it overlaps (their time
  beyond the median step with no checkpoint and no upload under way; the step log's
  ``upload_seconds`` says in which step each upload ended), per checkpoint;
* ``sync_upload_seconds``: the same newest checkpoint uploaded again with nothing else
  running, the caller waiting, as a synchronous save to the bucket would make training wait.

``stall_fraction`` = (volume save + overlap) / (volume save + synchronous upload): the stall of
a two-tier checkpoint as a fraction of a synchronous save of the same state to durable
storage; the goal is at most 0.1. Then the volume loses every checkpoint and the same job
resumes (``--resume-from latest``) for one step: ``download_seconds`` is the bucket tier's
part (download and verify every sha256), ``resume_from_bucket_seconds`` the whole resume, from
the command to the first step trained, beside ``resume_from_volume_seconds``, the same resume
with the checkpoint still on the volume (the ceiling of this run). One JSON document on stdout
and in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from rlhf_local import build, objectstore
from rlhf_trainer.run.curves import read_step_log
from rlhf_trainer.run.loop import STEP_LOG
from rlhf_trainer.state.bucket import BucketTier, TieredCheckpoints
from rlhf_trainer.state.checkpoint import CheckpointStore
from rlhfjob.api import ENV_OBJECT_STORE_ACCESS_KEY_ID, ENV_OBJECT_STORE_SECRET_ACCESS_KEY

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples/grpo-tiny-cpu.yaml"
DEFAULT_OUTPUT = "benchmarks/results/checkpoints.json"
JOB = "bench-checkpoints"
NAMESPACE = "default"


def say(message: str) -> None:
    print(f"[checkpoints] {message}", file=sys.stderr, flush=True)


def job_file(scratch: Path, args: argparse.Namespace, bucket: str | None, total_steps: int) -> Path:
    """The job, with its checkpoints on `scratch`'s volume (and in `bucket`, if given)."""
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"] = {"name": JOB, "namespace": NAMESPACE}
    spec = document["spec"]
    spec["model"]["randomInit"].update(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(4, args.hidden // 64),
        num_key_value_heads=2,
    )
    spec["algorithm"]["totalSteps"] = total_steps
    spec["checkpoint"] = {
        "path": str(scratch / ("volume" if bucket else "control")),
        "intervalSteps": args.interval,
        "keepLast": 100,
    }
    if bucket:
        store = {"bucket": bucket, "endpoint": objectstore.endpoint_url(scratch)}
        spec["checkpoint"]["objectStore"] = store
    path = scratch / f"job-{total_steps}{'' if bucket else '-control'}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def train(job: Path, scratch: Path, env: dict[str, str], *resume: str) -> tuple[float, float]:
    """Run `rlhfjob train`; (seconds to its first new step, seconds to its exit)."""
    log = Path(yaml.safe_load(job.read_text())["spec"]["checkpoint"]["path"]) / NAMESPACE / JOB
    log = log / STEP_LOG
    before = len(read_step_log(log)) if log.exists() else 0
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job), *resume],
        env=env, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    first: float | None = None
    while process.poll() is None:
        if first is None and log.exists() and len(read_step_log(log)) > before:
            first = time.monotonic() - started
        time.sleep(0.2)  # polling the step log's length, not waiting for an event
    output = process.stdout.read() if process.stdout else ""
    (scratch / f"train-{len(list(scratch.glob('train-*.log')))}.log").write_text(output)
    if process.returncode != 0:
        raise RuntimeError(f"rlhfjob train exited {process.returncode}:\n{output[-3000:]}")
    ended = time.monotonic() - started
    return (first if first is not None else ended), ended


def deprioritise(pid: int | None, niceness: int = 19) -> None:
    """Renice every thread of a process (Linux: a thread has its own priority)."""
    assert pid is not None, "the object store is not running"
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.setpriority(os.PRIO_PROCESS, int(task.name), niceness)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds a process has used (Linux `/proc`)."""
    assert pid is not None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stalls(
    records: list[dict[str, Any]], interval: int, spans: dict[int, list[int]] | None = None
) -> dict[str, Any]:
    """Per checkpoint: the volume save, and what the steps after it took beyond the median
    clean step (signed, so noise cancels): those an upload overlapped, or `spans` (the bucket
    run's, for the control run without a bucket)."""
    by_step = {int(r["step"]): r for r in records}

    def work(record: dict[str, Any]) -> float:
        return float(record["step_seconds"]) - record["phase_seconds"].get("checkpoint", 0.0)

    overlapped: dict[int, list[int]] = {}
    for step in sorted(by_step):
        if step % interval or step + 1 not in by_step:
            continue
        span = []
        for later in range(step + 1, max(by_step) + 1):
            span.append(later)
            if by_step[later].get("upload_seconds", 0.0) > 0:
                break
        overlapped[step] = span if spans is None else spans[step]
    busy = {s for span in overlapped.values() for s in span} | {1}  # step 1: warm-up
    clean = [work(by_step[s]) for s in by_step if s not in busy]
    baseline = statistics.median(clean) if clean else None
    saves = [by_step[s + 1]["phase_seconds"].get("checkpoint", 0.0) for s in overlapped]
    overlap = [
        sum(work(by_step[s]) - baseline for s in span)
        for span in overlapped.values()
        if baseline is not None
    ]
    return {
        "spans": overlapped,
        "steps": [
            {
                "step": s,
                "seconds": round(r["step_seconds"], 3),
                "checkpoint": round(r["phase_seconds"].get("checkpoint", 0.0), 3),
                "upload": round(r.get("upload_seconds", 0.0), 3),
            }
            for s, r in sorted(by_step.items())
        ],
        "volume_save_seconds": saves,
        "overlap_seconds": overlap,
        "baseline_step_seconds": baseline,
        "clean_steps": len(clean),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--out", default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    weed = build.ensure_binaries().weed  # builds what is missing (cached)
    scratch = Path(tempfile.mkdtemp(prefix="rlhf-bench-checkpoints-"))
    try:
        say(f"SeaweedFS in {scratch}: {objectstore.start(weed, root=scratch):.1f} s to ready")
        # The bucket's server stands in for a remote store: in a cluster its CPU is another
        # machine's, so here it runs below training (every thread of it).
        deprioritise(objectstore.is_running(scratch))
        bucket = "bench-checkpoints"
        objectstore.create_bucket(bucket, scratch)
        keys = objectstore.credentials(scratch)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env[ENV_OBJECT_STORE_ACCESS_KEY_ID] = keys.access_key_id
        env[ENV_OBJECT_STORE_SECRET_ACCESS_KEY] = keys.secret_access_key

        say(f"training {args.steps} steps, a checkpoint every {args.interval}")
        _, run_seconds = train(job_file(scratch, args, bucket, args.steps), scratch, env)
        run_dir = scratch / "volume" / NAMESPACE / JOB
        measured = stalls(read_step_log(run_dir / STEP_LOG), args.interval)
        say("the same run without a bucket: what a checkpoint costs the next step anyway")
        train(job_file(scratch, args, None, args.steps), scratch, env)
        control = stalls(read_step_log(scratch / "control" / NAMESPACE / JOB / STEP_LOG),
                         args.interval, measured["spans"])  # fmt: skip

        client = objectstore.client(scratch)
        tier = BucketTier(client, bucket, f"{NAMESPACE}/{JOB}/", keep_last=100)
        store = CheckpointStore(run_dir, keep_last=100)
        newest = store.latest_complete()
        assert newest is not None, "no checkpoint on the volume"
        size = sum(f.size for f in newest.files)
        server = objectstore.is_running(scratch)
        server_cpu, started, client_cpu = cpu_seconds(server), time.monotonic(), time.process_time()
        tier.upload(newest)
        sync_upload = time.monotonic() - started
        client_cpu = time.process_time() - client_cpu  # boto3 uploads from a thread pool
        server_cpu = cpu_seconds(server) - server_cpu
        say(f"checkpoint {newest.step}: {size / 1e6:.0f} MB, uploaded again in {sync_upload:.2f} s")

        # The volume loses every checkpoint: the bucket tier's part of a resume, then a whole
        # resume for one step from the bucket; then one from the volume, for the ceiling.
        for _, path in store.step_dirs():
            shutil.rmtree(path)
        started = time.monotonic()
        fetched = TieredCheckpoints(store, tier, None).latest_complete()
        download = time.monotonic() - started
        assert fetched is not None and fetched.step == newest.step, fetched
        for _, path in store.step_dirs():
            shutil.rmtree(path)
        latest = ("--resume-from", "latest")
        from_bucket, _ = train(job_file(scratch, args, bucket, newest.step + 1), scratch, env,
                               *latest)  # fmt: skip
        from_volume, _ = train(job_file(scratch, args, bucket, newest.step + 2), scratch, env,
                               *latest)  # fmt: skip
        resumed = read_step_log(run_dir / STEP_LOG)[-2:]
        assert [r["step"] for r in resumed] == [newest.step + 1, newest.step + 2], resumed
    finally:
        objectstore.stop(root=scratch)
        shutil.rmtree(scratch, ignore_errors=True)

    save = statistics.median(measured["volume_save_seconds"])
    overlap = statistics.median(measured["overlap_seconds"]) if measured["overlap_seconds"] else 0.0
    after = statistics.median(control["overlap_seconds"]) if control["overlap_seconds"] else 0.0
    two_tier, synchronous = save + overlap, save + after + sync_upload
    result = {
        "stall_fraction": round(two_tier / synchronous, 4),
        "resume_from_bucket_seconds": round(from_bucket, 2),
        "resume_from_volume_seconds": round(from_volume, 2),
        "download_seconds": round(download, 3),
        "volume_save_seconds": round(save, 3),
        "overlap_seconds": round(overlap, 3),
        "control_overlap_seconds": round(after, 3),
        "two_tier_stall_seconds": round(two_tier, 3),
        "synchronous_stall_seconds": round(synchronous, 3),
        "sync_upload_seconds": round(sync_upload, 3),
        "upload_cpu_seconds": {"client": round(client_cpu, 3), "server": round(server_cpu, 3)},
        "checkpoint_bytes": size,
        "goal_stall_fraction": 0.1,
        "per_checkpoint": measured,
        "control": control,
        "run_seconds": round(run_seconds, 1),
        "config": vars(args),
        "command": "python " + " ".join(["benchmarks/checkpoints.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average": os.getloadavg(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
