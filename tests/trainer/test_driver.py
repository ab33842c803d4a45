"""The driver: its small pieces, and as a process (resume equivalence, SIGTERM and SIGKILL).

In the slow test, one run trains N steps straight. Another is stopped with SIGTERM while it
writes a checkpoint, resumed, killed with SIGKILL, and resumed again to N. Both must end with
the same parameters and the same per-step rewards, and no stop may leave a partial checkpoint.
The SIGTERMed driver takes its actors along; the SIGKILLed one cannot, and the last driver
adopts them (a warm restart, timed from its start to its first step). Another slow test kills
one of two rollout engines under a running driver, which goes on with one and re-admits a
replacement.

The drivers join one Ray head started here (`RAY_ADDRESS`), which also exercises the cluster
path of `connect_ray`; the learning tests cover the driver starting its own local Ray.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")

import rlhfjob_cli as cli  # noqa: E402
from rlhf_trainer.run.curves import plot_reward_curve, read_step_log  # noqa: E402
from rlhf_trainer.run.driver import final_status, local_ray_resources  # noqa: E402
from rlhf_trainer.run.loop import progress_line  # noqa: E402
from rlhf_trainer.state.checkpoint import TEMP_DIR_PREFIX, CheckpointStore, read_checkpoint  # noqa: E402
from rlhfjob.api import ray_resource  # noqa: E402
from rlhfjob.config import load_job  # noqa: E402
from rlhfjob.contract import ENV_ATTEMPT as ATTEMPT  # noqa: E402
from rlhfjob.contract import FINAL_STATUS_PREFIX, ExitCode  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "grpo-tiny-cpu.yaml"
TOTAL_STEPS = 6
RUN_TIMEOUT_S = 600
# This head listens on this machine only; without this, Ray turns token auth on by itself
# when ~/.ray/auth_token exists, and the drivers would need the token.
RAY_ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


# --------------------------------------------------------------------------------------------
# Pieces


def test_a_local_ray_advertises_every_role_slot():
    spec = load_job(REPO / "examples" / "ppo-tiny-cpu.yaml").spec
    assert local_ray_resources(spec) == {
        ray_resource("trainer"): 2.0,
        ray_resource("rollout"): 2.0,
        ray_resource("critic"): 1.0,
    }


def test_the_final_status_line_is_one_line_the_operator_can_parse():
    line = final_status(ExitCode.NON_RETRYABLE, "reward function 'x:y':\n  module not found")
    assert line == (
        f"{FINAL_STATUS_PREFIX} code=3 reason=InvalidJob "
        "message=reward function 'x:y': module not found"
    )
    assert "reason=Terminated" in final_status(ExitCode.TERMINATED, "stopped")


def test_the_progress_line_shows_step_reward_kl_and_time():
    record = {
        "step": 7,
        "reward_mean": 0.5,
        "reward_std": 0.25,
        "kl": 0.01,
        "policy_loss": -0.002,
        "value_loss": None,
        "step_seconds": 1.5,
        "phase_seconds": {"generate": 0.2, "update": 1.0, "sync": 0.1, "reward": 0.01},
    }
    assert progress_line(record, 40) == (
        "step  7/40 | reward 0.500 ±0.250 | kl 0.0100 | loss -0.0020 | "
        "1.50 s (update 1.00, generate 0.20, sync 0.10)"
    )
    sampled = {**record, "dropped_groups": 3, "generation_batches": 2}  # dynamic sampling
    assert "| 3 groups dropped in 2 rollouts |" in progress_line(sampled, 40)


def test_a_job_whose_reward_function_is_missing_fails_as_non_retryable(tmp_path, capsys):
    document = yaml.safe_load(EXAMPLE.read_text())
    document["spec"]["reward"]["function"] = "no_such_module:reward"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(document))
    assert cli.main(["train", "--config", str(job)]) == ExitCode.NON_RETRYABLE
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert last_line.startswith(f"{FINAL_STATUS_PREFIX} code=3 reason=InvalidJob")
    assert "no_such_module" in last_line


def test_a_model_config_that_cannot_load_is_non_retryable_unless_the_check_is_left_out():
    from rlhf_trainer.run.loop import NonRetryableError, check_model_config, load_inputs

    spec = load_job(EXAMPLE).spec
    model = spec.model.model_copy(update={"random_init": {"model_type": "no-such-model"}})
    spec = spec.model_copy(update={"model": model})
    with pytest.raises(
        NonRetryableError, match=r"spec\.model\.randomInit\.model_type: .*no-such-model"
    ):
        load_inputs(spec)
    # A warm restart leaves it out: the attempt that started the adopted actors checked it.
    assert len(load_inputs(spec, check_model=False).prompts) > 0
    with pytest.raises(NonRetryableError):
        check_model_config(spec)


def test_lengths_beyond_the_models_context_window_are_non_retryable(tmp_path):
    """The windows the API cannot see at apply: a model type's default (GPT-2: 1024 positions)
    and a saved model's config.json."""
    from transformers import Qwen2Config

    from rlhf_trainer.run.loop import NonRetryableError, check_model_config

    spec = load_job(EXAMPLE).spec
    long = spec.algorithm.model_copy(update={"max_prompt_length": 512, "max_response_length": 513})
    default_window = spec.model.model_copy(update={"random_init": {"model_type": "gpt2"}})
    with pytest.raises(NonRetryableError, match=r"maxResponseLength.*\(512 \+ 513\).* 1024 "):
        check_model_config(spec.model_copy(update={"model": default_window, "algorithm": long}))
    Qwen2Config(vocab_size=16, max_position_embeddings=12).save_pretrained(tmp_path)
    saved = spec.model.model_copy(update={"random_init": None, "policy": str(tmp_path)})
    with pytest.raises(NonRetryableError, match="context window of 12 tokens"):
        check_model_config(spec.model_copy(update={"model": saved}))  # 8 + 8 tokens
    check_model_config(spec)  # the example's 8 + 8 fit its 64


def test_a_ray_version_other_than_the_images_is_non_retryable() -> None:
    """KubeRay starts the cluster for `rayVersion`; another minor release than the image's
    Ray cannot work, a patch release can."""
    from rlhf_trainer.run.startup import NonRetryableError, check_ray_version

    spec = load_job(EXAMPLE).spec
    check_ray_version(spec)  # the default is the pinned Ray
    check_ray_version(spec.model_copy(update={"ray_version": "2.60.3"}), installed="2.60.0")
    with pytest.raises(NonRetryableError, match=r"spec.rayVersion: 2.9.0 .* Ray 2.60.0"):
        check_ray_version(spec.model_copy(update={"ray_version": "2.9.0"}), installed="2.60.0")
    with pytest.raises(NonRetryableError, match=r"spec\.rayVersion: 3\.60\.0"):
        check_ray_version(spec.model_copy(update={"ray_version": "3.60.0"}), installed="2.60.0")


def test_train_without_a_job_file_is_non_retryable(monkeypatch, capsys):
    monkeypatch.delenv("RLHF_JOB_CONFIG", raising=False)
    assert cli.main(["train"]) == ExitCode.NON_RETRYABLE
    assert "no job file" in capsys.readouterr().err


def test_the_step_log_keeps_the_last_record_of_a_step_and_plots(tmp_path):
    log = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "reward_mean": 0.1, "reward_std": 0.0},
        {"step": 2, "reward_mean": 0.2, "reward_std": 0.1},
        {"step": 2, "reward_mean": 0.3, "reward_std": 0.1},  # rewritten after a resume
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = read_step_log(log)
    assert [r["reward_mean"] for r in records] == [0.1, 0.3]
    png = plot_reward_curve(records, tmp_path / "curve.png", "test")
    assert png.read_bytes().startswith(b"\x89PNG")


# --------------------------------------------------------------------------------------------
# The driver as a process


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail after `timeout_s` naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A Ray head advertising the roles' resources; stopped (by its pid) afterwards."""
    port = free_port()
    # Room for two drivers at once: the straight run and the interrupted one.
    resources = {ray_resource("trainer"): 4, ray_resource("rollout"): 2}
    temp_dir = tempfile.mkdtemp(prefix="rlhf-ray-")  # short: Ray's socket paths have a limit
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [
            str(ray_cli),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=2",
            f"--resources={json.dumps(resources)}",
            "--include-dashboard=false",
            # Ports of their own for what listens on a fixed default even so (8265, 10001,
            # 52365): another worker's head on this machine must not collide with this one.
            f"--dashboard-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=RAY_ENV,
    )

    def listening() -> bool:
        assert head.poll() is None, "ray start exited"
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(listening, 120, "the Ray head")
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()


def job_file(
    directory: Path,
    engines: int = 1,
    min_engines: int | None = None,
    *,
    colocated: bool = False,
    background: bool = False,
    staleness: int = 0,
    interval: int = 2,
) -> Path:
    """The GRPO example, shortened to 6 steps with a checkpoint every `interval`, one rollout
    engine (colocated: one inside each of the 2 trainer ranks); `background`: checkpoints
    written while training goes on; `staleness`: `algorithm.maxStaleness`."""
    document = yaml.safe_load(EXAMPLE.read_text())
    spec = document["spec"]
    spec["algorithm"].update(totalSteps=TOTAL_STEPS, maxStaleness=staleness)
    if colocated:
        spec["roles"]["rollout"] = {"placement": "colocated", "backend": "hf"}
    else:
        spec["roles"]["rollout"]["replicas"] = engines
    if min_engines is not None:
        spec["roles"]["rollout"]["minReplicas"] = min_engines
    spec["checkpoint"].update(
        path=str(directory / "checkpoints"),
        intervalSteps=interval,
        keepLast=10,
        background=background,
    )
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def run_dir(directory: Path) -> Path:
    return directory / "checkpoints" / "default" / "grpo-tiny"


class Driver:
    """`rlhfjob train` in a child process, its output in a file."""

    def __init__(self, job: Path, ray_address: str, *args: str, attempt: int = 0) -> None:
        self.log = job.parent / f"driver-{time.monotonic_ns()}.log"
        env = {**RAY_ENV, "RAY_ADDRESS": ray_address, ATTEMPT: str(attempt)}
        self.started_at = time.time()
        with self.log.open("w") as output:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rlhfjob_cli", "train", "--config", str(job), *args],
                stdout=output,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=job.parent,
            )

    def wait(self) -> int:
        return self.process.wait(timeout=RUN_TIMEOUT_S)

    def alive(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"driver exited early:\n{self.output()[-3000:]}")
        return True

    def output(self) -> str:
        return self.log.read_text()


def assert_only_complete_checkpoints(directory: Path) -> list[int]:
    """No temporary leftovers, and every step directory verifies. Returns the steps."""
    root = run_dir(directory)
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(TEMP_DIR_PREFIX)]
    assert leftovers == []
    steps = []
    for step, path in CheckpointStore(root).step_dirs():
        read_checkpoint(path)  # raises if anything is missing or corrupt
        steps.append(step)
    return sorted(steps)


def final_policy(directory: Path) -> dict[str, torch.Tensor]:
    """The policy parameters of the step-N checkpoint, whole, from the ranks' parts."""
    from rlhf_trainer.state.reshard import whole_tensors

    return whole_tensors(CheckpointStore(run_dir(directory)).step_dir(TOTAL_STEPS) / "policy")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("colocated", "staleness"),
    [(False, 0), (True, 0), (False, 1)],
    ids=["disaggregated", "colocated", "generated-ahead"],
)
def test_stopped_and_resumed_training_equals_uninterrupted_training(
    ray_address, tmp_path, colocated, staleness
):
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    straight_dir.mkdir()
    resumed_dir.mkdir()
    # Colocated, checkpoints are written in the background (`checkpoint.background`): the
    # resumed run must equal the straight one either way. Generated ahead (`maxStaleness`),
    # a checkpoint holds the next step's batch, which the resumed run trains on.
    options = {"colocated": colocated, "background": colocated, "staleness": staleness}
    straight_job = job_file(straight_dir, **options)
    resumed_job = job_file(resumed_dir, **options)

    straight = Driver(straight_job, ray_address)

    # SIGTERM while the step-2 checkpoint is being written: the write completes, the run stops.
    first = Driver(resumed_job, ray_address)
    root = run_dir(resumed_dir)

    def writing_a_checkpoint() -> bool:
        return (
            first.alive()
            and root.is_dir()
            and any(
                p.name.startswith(TEMP_DIR_PREFIX) or p.name.startswith("step-")
                for p in root.iterdir()
            )
        )

    wait_for(writing_a_checkpoint, RUN_TIMEOUT_S, "the first checkpoint write")
    first.process.send_signal(signal.SIGTERM)
    assert first.wait() == ExitCode.TERMINATED, first.output()[-3000:]
    assert "RLHFJOB_FINAL_STATUS code=4 reason=Terminated" in first.output()
    stopped_at = assert_only_complete_checkpoints(resumed_dir)
    assert stopped_at and max(stopped_at) < TOTAL_STEPS

    # Resume, then SIGKILL (no chance to clean up) once a later checkpoint exists.
    second = Driver(resumed_job, ray_address, "--resume-from", "latest", attempt=1)
    later = CheckpointStore(root).step_dir(max(stopped_at) + 2)
    wait_for(lambda: second.alive() and later.is_dir(), RUN_TIMEOUT_S, f"{later.name}")
    second.process.kill()
    second.wait()
    assert "resuming from" in second.output()
    assert "starting actors" in second.output()  # the first driver took its actors along

    # The killed driver's actors are still there: the next driver adopts them (warm restart).
    third = Driver(resumed_job, ray_address, "--resume-from", "latest", attempt=2)
    assert third.wait() == ExitCode.SUCCEEDED, third.output()[-3000:]
    assert straight.wait() == ExitCode.SUCCEEDED, straight.output()[-3000:]
    adopted = re.search(r"adopted (\d+) actors from the previous attempt", third.output())
    # 2 policy ranks and 1 engine; colocated, the engines came inside the 2 ranks
    assert adopted and int(adopted[1]) == (2 if colocated else 3), third.output()[-3000:]
    assert_only_complete_checkpoints(resumed_dir)
    resumed_at = CheckpointStore(root).latest_complete()
    lines = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    by_third = [line for line in lines if line["attempt"] == 2]
    resumed = re.search(r"resuming from \S+ \(step (\d+)\)", third.output())
    assert resumed is not None
    checkpoint_step = int(resumed[1])
    assert resumed_at is not None and resumed_at.step == TOTAL_STEPS
    # Every step after the checkpoint it resumed from, trained once by the third driver.
    assert [line["step"] for line in by_third] == list(range(checkpoint_step + 1, TOTAL_STEPS + 1))
    warm_seconds = by_third[0]["time"] - third.started_at
    print(f"warm restart: driver start to its first trained step in {warm_seconds:.1f} s")

    straight_rewards = [
        r["reward_mean"] for r in read_step_log(run_dir(straight_dir) / "metrics.jsonl")
    ]
    resumed_rewards = [r["reward_mean"] for r in read_step_log(root / "metrics.jsonl")]
    assert len(straight_rewards) == TOTAL_STEPS
    assert resumed_rewards == straight_rewards  # the same samples, step for step

    expected, got = final_policy(straight_dir), final_policy(resumed_dir)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)


def join_the_jobs_ray(job: Path, ray_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray.init` in the job's Ray namespace, where its named actors are."""
    import ray

    from rlhf_trainer.ranks.adoption import ray_namespace

    for key in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED"):
        monkeypatch.setenv(key, RAY_ENV[key])
    namespace = ray_namespace(load_job(job), os.environ)
    ray.init(address=ray_address, namespace=namespace, log_to_driver=False)


@pytest.mark.slow
def test_training_goes_on_while_a_rollout_engine_is_lost_and_replaced(
    ray_address, tmp_path, monkeypatch
):
    """Kill one of two engines' processes: the driver carries on with one, starts a
    replacement, syncs it and generates with both again; its log and step log say so."""
    ray = pytest.importorskip("ray")

    job = job_file(tmp_path, engines=2, min_engines=1)
    driver = Driver(job, ray_address)
    log = run_dir(tmp_path) / "metrics.jsonl"
    wait_for(lambda: driver.alive() and log.is_file(), RUN_TIMEOUT_S, "the first step")

    join_the_jobs_ray(job, ray_address, monkeypatch)
    try:
        os.kill(ray.get(ray.get_actor("rollout-engine-1").pid.remote()), signal.SIGKILL)
        replacing = "starting rollout engine 2"
        wait_for(lambda: driver.alive() and replacing in driver.output(), RUN_TIMEOUT_S, replacing)
        # Hold the driver until the replacement is up, so it rejoins before the last step.
        driver.process.send_signal(signal.SIGSTOP)
        try:
            replacement = ray.get_actor("rollout-engine-2")
            ray.get(replacement.ping.remote(), timeout=RUN_TIMEOUT_S)
        finally:
            driver.process.send_signal(signal.SIGCONT)
        assert driver.wait() == ExitCode.SUCCEEDED, driver.output()[-3000:]
        # A driver that finishes takes its actors along (none is left for a next attempt).
        wait_for(lambda: not ray.util.list_named_actors(), 60, "the job's actors to go")
    finally:
        ray.shutdown()

    output = driver.output()
    assert "rollout engine 1 lost during" in output
    assert "continuing with 1/2 engines" in output
    assert "rollout engine 2 rejoined; 2/2 engines" in output
    records = read_step_log(log)
    assert [r["step"] for r in records] == list(range(1, TOTAL_STEPS + 1))  # each step once
    engines = [r["rollout_engines"] for r in records]
    assert 1 in engines[:-1] and engines[-1] == 2, engines  # one engine for a while, then two
    assert {r["attempt"] for r in records} == {0}


@pytest.mark.slow
def test_below_its_minimum_engines_the_driver_checkpoints_its_last_step_before_it_fails(
    ray_address, tmp_path, monkeypatch
):
    """Both engines must live and one is lost (a node drain evicts the rollout pods at once,
    the trainer's wait for the checkpoint): the step in flight cannot finish, so the driver
    checkpoints the last step it trained, off the interval, and fails as retryable: the
    restart loses no step. Whether the loss shows before the step's update (the step is
    undone) or after it (the weight sync: the step counts), the checkpoint is the last step
    in the log."""
    ray = pytest.importorskip("ray")
    from trainer.killing import kill_actor

    job = job_file(tmp_path, engines=2, min_engines=2, interval=100)
    driver = Driver(job, ray_address)
    log = run_dir(tmp_path) / "metrics.jsonl"
    wait_for(lambda: driver.alive() and log.is_file(), RUN_TIMEOUT_S, "the first step")
    driver.process.send_signal(signal.SIGSTOP)  # mid-run, whichever phase it is in
    join_the_jobs_ray(job, ray_address, monkeypatch)
    try:
        kill_actor(ray.get_actor("rollout-engine-1"))
    finally:
        driver.process.send_signal(signal.SIGCONT)
        ray.shutdown()
    assert driver.wait() == ExitCode.FAILED, driver.output()[-3000:]
    steps = [r["step"] for r in read_step_log(log)]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] < TOTAL_STEPS, steps
    assert assert_only_complete_checkpoints(tmp_path) == [steps[-1]], driver.output()[-3000:]
    assert f"no step after {steps[-1]}: " in driver.output()


@pytest.mark.slow
def test_a_reward_that_breaks_mid_training_fails_the_job_instead_of_restarting_it(
    ray_address, tmp_path
):
    """A reward source that raises while scoring (a rule function, a remote server's 4xx) is a
    problem retrying cannot fix: exit code 3 with its words, not a restart."""
    (tmp_path / "broken_grader.py").write_text(
        "def score(prompts, responses, metadata):\n    raise ValueError('the grader is broken')\n"
    )
    job = job_file(tmp_path)
    document = yaml.safe_load(job.read_text())
    document["spec"]["reward"]["function"] = "broken_grader:score"
    job.write_text(yaml.safe_dump(document))
    driver = Driver(job, ray_address)
    assert driver.wait() == ExitCode.NON_RETRYABLE, driver.output()[-3000:]
    last_line = driver.output().strip().splitlines()[-1]
    assert last_line.startswith(f"{FINAL_STATUS_PREFIX} code=3 reason=InvalidJob"), last_line
    assert "broken_grader:score" in last_line and "the grader is broken" in last_line
