"""Checkpoints that resume on another number of ZeRO-3 ranks (`rlhf_trainer.state.reshard`).

The pure parts first (addresses, which saved parts fill a wanted one, the files), then one
process that saves under one ZeRO stage and loads under another, then whole runs on a local
Ray: GRPO, and PPO with its critic, train straight on 2 ranks; a second run resumes the
straight run's step-1 checkpoint on 1 rank (2 -> 1) and trains steps 2 and 3; a third resumes
that run's step-2 checkpoint, written by 1 rank, on 2 ranks (1 -> 2) and trains steps 3 and 4.
Every resumed step must match the straight run's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import queue
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from rlhf_trainer.state.export import export_checkpoint  # noqa: E402
from rlhf_trainer.state.reshard import (  # noqa: E402
    MASTER,
    Copy,
    Part,
    PartReader,
    ReshardError,
    SavedState,
    copies_for,
    read_saved_state,
    resized_rank_seed,
    shard_file,
    whole_tensors,
    write_parts,
    zero3_part,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


# --------------------------------------------------------------------------------------------
# Addresses and files (pure, seconds)


@pytest.mark.parametrize(
    ("numel", "partition", "rank", "expected"),
    [
        (10, 5, 0, Part(0, 5)),
        (10, 5, 1, Part(5, 5)),
        (10, 4, 2, Part(8, 2)),  # the last partition ends in padding
        (3, 2, 1, Part(2, 1)),
        (2, 1, 3, Part(2, 0)),  # more ranks than elements: nothing
    ],
)
def test_a_zero3_rank_owns_its_slice_without_the_padding(numel, partition, rank, expected):
    assert zero3_part(numel, partition, rank) == expected


def test_the_parts_of_two_ranks_fill_the_slices_of_one_or_three():
    two = [zero3_part(10, 5, rank) for rank in range(2)]
    assert copies_for(two, Part(0, 10)) == [Copy(0, 0, 0, 5), Copy(1, 0, 5, 5)]
    three = [zero3_part(10, 4, rank) for rank in range(3)]
    assert [copies_for(two, part) for part in three] == [
        [Copy(0, 0, 0, 4)],
        [Copy(0, 4, 0, 1), Copy(1, 0, 1, 3)],
        [Copy(1, 3, 0, 2)],
    ]
    # Saved in any order; a whole tensor written by one rank covers everything.
    assert copies_for(list(reversed(two)), Part(4, 2)) == [Copy(1, 4, 0, 1), Copy(0, 0, 1, 1)]
    assert copies_for([Part(0, 10)], Part(8, 2)) == [Copy(0, 8, 0, 2)]
    assert copies_for(two, Part(3, 0)) == []


def test_a_missing_part_is_an_error_not_zeros():
    with pytest.raises(ReshardError, match="up to 5 of"):
        copies_for([Part(0, 5)], Part(0, 10))
    with pytest.raises(ReshardError, match="up to 0 of"):
        copies_for([Part(5, 5)], Part(0, 10))


def write_state(directory: Path, tensors: dict[str, Any], world_size: int) -> None:
    """`tensors` saved the way `world_size` ZeRO-3 ranks save them: a slice each."""
    directory.mkdir(parents=True, exist_ok=True)
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    for rank in range(world_size):
        parts = {}
        for name, tensor in tensors.items():
            part = zero3_part(tensor.numel(), math.ceil(tensor.numel() / world_size), rank)
            parts[name] = (part, tensor.reshape(-1)[part.start : part.stop])
        write_parts(directory / shard_file(MASTER, rank), parts, shapes)
    state = SavedState(
        world_size=world_size,
        zero_stage=3,
        kinds=(MASTER,),
        optimizer_step=0,
        learning_rate=0.1,
        lr_scheduler=None,
        counters={"global_steps": 0, "global_samples": 0, "skipped_steps": 0},
    )
    (directory / "state.json").write_text(state.to_json())


def test_parts_saved_by_two_ranks_read_back_as_any_ranks_slices_and_whole(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 5, generator=generator),
        "b": torch.randn(7, generator=generator),
        "c": torch.randn(1, generator=generator),  # rank 1 owns none of it
    }
    write_state(tmp_path, tensors, world_size=2)
    reader = PartReader(tmp_path, MASTER, world_size=2)
    for world in (1, 3):
        for name, tensor in tensors.items():
            per_rank = math.ceil(tensor.numel() / world)
            slices = [
                reader.read(name, zero3_part(tensor.numel(), per_rank, r)) for r in range(world)
            ]
            assert torch.equal(torch.cat(slices), tensor.reshape(-1)), (name, world)
    whole = whole_tensors(tmp_path)
    assert whole.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(whole[name], tensor)
    assert read_saved_state(tmp_path).world_size == 2


def test_a_missing_rank_file_says_which(tmp_path):
    write_state(tmp_path, {"w": torch.ones(4)}, world_size=2)
    (tmp_path / shard_file(MASTER, 1)).unlink()
    with pytest.raises(ReshardError, match=r"rank00001\.safetensors is missing"):
        whole_tensors(tmp_path)


def test_the_state_file_round_trips_and_refuses_another_format():
    state = SavedState(
        world_size=2,
        zero_stage=3,
        kinds=(MASTER, "exp_avg", "exp_avg_sq"),
        optimizer_step=7,
        learning_rate=0.003,
        lr_scheduler={"last_epoch": 7, "base_lrs": [0.003], "lr_lambdas": [None]},
        counters={"global_steps": 7, "global_samples": 448, "skipped_steps": 0},
    )
    assert SavedState.from_json(state.to_json()) == state
    other = json.loads(state.to_json()) | {"format": "something-else/1"}
    with pytest.raises(ReshardError, match="unknown state format"):
        SavedState.from_json(json.dumps(other))


def test_the_seed_of_a_resized_rank_is_pinned():
    """Changing it changes what every resized run draws (`seeds` pins its helpers alike)."""
    assert resized_rank_seed(7, 3, 0) == 1923750606391471130
    assert len({resized_rank_seed(7, 3, rank) for rank in range(4)}) == 4
    assert resized_rank_seed(7, 3, 0) != resized_rank_seed(7, 4, 0)


# --------------------------------------------------------------------------------------------
# One process, two ZeRO stages (a 2-GPU group is ZeRO-3, one GPU ZeRO-2: `zero.zero_stage`)


def _save_and_load_across_stages(directory: str, results: Any) -> None:
    """Train a ZeRO-3 engine 2 steps and save it; load it into a ZeRO-2, a no-ZeRO and a ZeRO-3
    engine that keeps small parameters whole; report how far their state and next step are
    from the saving engine's."""
    import os

    import deepspeed

    from rlhf_trainer.modeling.networks import build_causal_lm
    from rlhf_trainer.modeling.zero import (
        deepspeed_config,
        lr_multiplier,
        skip_unused_deepspeed_builds,
    )
    from rlhf_trainer.state import reshard
    from rlhfjob.config import load_job

    torch.set_num_threads(1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    skip_unused_deepspeed_builds(on_gpu=False)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    spec = load_job(EXAMPLES / "grpo-tiny-cpu.yaml").spec
    accumulation = 2

    def engine(stage: int, *, keep_small_whole: bool = False) -> Any:
        config = deepspeed_config(
            spec.algorithm, accumulation_steps=accumulation, bf16=False, on_gpu=False, stage=stage
        )
        if keep_small_whole:  # DeepSpeed's default on GPUs: small tensors stay whole
            config["zero_optimization"].pop("stage3_param_persistence_threshold", None)
        model = build_causal_lm(spec.model, 3, torch.float32, config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier("linear", 2, 20))
        built, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=schedule, config=config
        )
        return built

    tokens = torch.randint(
        1, 32, (2 * accumulation, 10), generator=torch.Generator().manual_seed(0)
    )

    def step(trained: Any) -> list[float]:
        losses = []
        for micro in tokens.split(2):
            logits = trained(input_ids=micro, attention_mask=torch.ones_like(micro)).logits
            loss = logits.logsumexp(-1).mean()
            trained.backward(loss)
            trained.step()
            losses.append(loss.item())
        return losses

    def zeros_step(fresh: Any) -> None:
        for _ in range(accumulation):
            ids = torch.ones((1, 2), dtype=torch.long)
            fresh.backward(fresh(input_ids=ids, attention_mask=ids).logits.sum() * 0.0)
            fresh.step()

    saving = engine(3)
    step(saving)
    step(saving)
    snapshot = reshard.snapshot_engine_state(saving, rank=0, world_size=1)
    saved = Path(directory) / "saved"
    reshard.save_engine_state(saving, saved, rank=0, world_size=1)
    reference_step = step(saving)
    # A background checkpoint's snapshot, written after the engine trained on: the state it
    # was taken at, not the engine's state when written.
    snapshot.write(Path(directory) / "snapshot")
    report_snapshot = {
        kind: max(
            float((whole_tensors(saved, kind)[k] - tensor).abs().max())
            for k, tensor in whole_tensors(Path(directory) / "snapshot", kind).items()
        )
        for kind in read_saved_state(saved).kinds
    }
    same_state = read_saved_state(Path(directory) / "snapshot") == read_saved_state(saved)
    after = Path(directory) / "after-saving"
    reshard.save_engine_state(saving, after, rank=0, world_size=1)
    report: dict[str, Any] = {}
    for name, loaded in [
        ("zero2", engine(2)),
        ("no-zero", engine(0)),
        ("zero3-whole-small", engine(3, keep_small_whole=True)),
    ]:
        restored = reshard.load_engine_state(loaded, saved, lambda e=loaded: zeros_step(e))
        here = Path(directory) / name
        reshard.save_engine_state(loaded, here, rank=0, world_size=1)
        as_loaded = read_saved_state(here)
        differences = {}
        for kind in restored.kinds:  # right after loading: exactly what was saved
            want, got = whole_tensors(saved, kind), whole_tensors(here, kind)
            differences[kind] = max(float((want[k] - got[k]).abs().max()) for k in want)
        losses = step(loaded)
        reshard.save_engine_state(loaded, here, rank=0, world_size=1)
        state = read_saved_state(here)
        want, got = whole_tensors(after), whole_tensors(here)
        report[name] = {
            "loaded": differences,
            "as_loaded": dataclasses.asdict(as_loaded),
            "step": state.optimizer_step,
            "lr": state.learning_rate,
            "scheduler": state.lr_scheduler,
            "counters": state.counters,
            "next_losses": [abs(a - b) for a, b in zip(losses, reference_step, strict=True)],
            "next_weights": max(float((want[k] - got[k]).abs().max()) for k in want),
        }
    report["saved"] = dataclasses.asdict(read_saved_state(saved))
    report["snapshot"] = {"differences": report_snapshot, "same_state": same_state}
    results.put(report)


def _in_a_process(target: Any, *args: Any, timeout_s: float = 300) -> Any:
    """Run ``target(*args, queue)`` in a fresh process (its own process group) and return
    what it puts on the queue; fail at once if the process dies without answering."""
    context = mp.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=target, args=(*args, results))
    process.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return results.get(timeout=1)
            except queue.Empty:
                assert process.is_alive(), f"the process died (exit code {process.exitcode})"
                assert time.monotonic() < deadline, "the process did not answer in time"
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()


@pytest.mark.slow
def test_a_zero3_state_loads_exactly_under_zero2_without_zero_and_with_whole_small_tensors(
    tmp_path,
):
    pytest.importorskip("deepspeed")
    report = _in_a_process(_save_and_load_across_stages, str(tmp_path))
    saved = report.pop("saved")
    snapshot = report.pop("snapshot")
    assert snapshot == {
        "differences": {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0},
        "same_state": True,
    }, "a snapshot written a step later holds the state it was taken at"
    assert saved["optimizer_step"] == 2 and saved["counters"]["global_steps"] == 2
    for name, outcome in report.items():
        # Loading copies float32 values and the shared state: nothing may change, whatever
        # the loading stage (its own flat layout) did when it created its optimizer state.
        assert outcome["loaded"] == {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}, name
        assert outcome["as_loaded"] | {"zero_stage": 3} == saved, name
        # The step count, learning rate and schedule carry on from the saved ones.
        assert outcome["step"] == 3 and outcome["counters"]["global_steps"] == 3, name
        assert outcome["scheduler"]["last_epoch"] == saved["lr_scheduler"]["last_epoch"] + 1, name
        assert outcome["lr"] == pytest.approx(1e-2 * (1 - 1 / 18)), name  # linear, step 3 of 20
        # The next step matches the saving engine's: its losses exactly (same weights), its
        # update up to the rounding of another stage's kernels (a different flat layout).
        assert outcome["next_losses"] == [0.0, 0.0], name
        assert outcome["next_weights"] < 1e-5, (name, outcome["next_weights"])


# --------------------------------------------------------------------------------------------
# Whole runs on a local Ray: 2 ranks -> 1 -> 2 (slow)

STEPS = 4
TOLERANCE = 1e-5
"""How far a resumed step's losses, entropy, KL and gradient norm may be from the straight
run's (absolute; they are of order 1e-3 to 3).

With 2 ranks each rank sums its micro-batches' gradients and the two sums are added; with 1
rank one sum runs over all of them. Float32 addition is not associative, so the gradients
differ in their last bits (about 1e-7 relative); AdamW divides by the root of the second
moment, which magnifies that where a gradient is near zero, and each step carries it on.
Everything else is the same: the rows, the micro-batches' contents, the token-mean weighting
(`ShardPlan.loss_scale`) and, so, the samples. Measured: at most 4e-8. Loading the weights but
not AdamW's moments moved them by 5e-3 and more in the first resumed step.
"""
WEIGHT_TOLERANCE = 1e-4
"""How far the resumed run's fp32 weights may be from the straight run's at the same step:
the same rounding, carried through AdamW's steps of about lr = 3e-3 (measured: at most 3e-6;
a lost optimizer state moves weights by about lr)."""


def job_document(algorithm: str, checkpoints: Path) -> dict[str, Any]:
    """The tiny example of `algorithm` shortened to `STEPS` steps of 12 rows in micro-batches
    of 4 (so 2 ranks pad their last micro-batch, 1 rank does not), 2 update epochs (the
    second one moves with the first one's AdamW step), 1 rollout engine, 2 ranks per group."""
    document = yaml.safe_load((EXAMPLES / f"{algorithm}-tiny-cpu.yaml").read_text())
    spec = document["spec"]
    spec["algorithm"].update(totalSteps=STEPS, microBatchSize=4, updateEpochs=2)
    if algorithm == "grpo":
        spec["algorithm"].update(promptsPerStep=3, groupSize=4)
    else:
        spec["algorithm"].update(promptsPerStep=12)
        spec["roles"]["critic"]["replicas"] = 2
    spec["roles"]["rollout"]["replicas"] = 1
    spec["checkpoint"].update(path=str(checkpoints), intervalSteps=1, keepLast=STEPS)
    return document


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    pytest.importorskip("deepspeed")
    from rlhfjob.api import ray_resource

    ray.init(
        num_cpus=2,
        resources={
            ray_resource("trainer"): 2,
            ray_resource("rollout"): 1,
            ray_resource("critic"): 2,
        },
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def train(
    algorithm: str,
    directory: Path,
    *,
    ranks: int,
    steps: int,
    resume_from: Path | None = None,
) -> tuple[list[Any], Any]:
    """Steps of one run with `ranks` ranks per group (`RunContext.zero_ranks`), a checkpoint
    after each, like `Trainer.run`; returns the step results and the run's store."""
    from rlhf_trainer.run.context import RunContext
    from rlhf_trainer.run.loop import Trainer, load_inputs
    from rlhfjob.api import RLHFJob

    job = RLHFJob.model_validate(job_document(algorithm, directory / "checkpoints"))
    zero_ranks = {"trainer": ranks} | ({"critic": ranks} if algorithm == "ppo" else {})
    context = RunContext(
        resume_from=str(resume_from) if resume_from else None, zero_ranks=zero_ranks
    )
    trainer = Trainer(job, load_inputs(job.spec), threading.Event(), context, detached=False)
    try:
        assert [group.world_size for group in trainer.groups] == [ranks] * len(trainer.groups)
        trainer.restore()
        trainer.sync_weights()
        results = []
        for _ in range(steps):
            results.append(trainer.run_step())
            trainer.save_checkpoint()
        return results, trainer.store
    finally:
        trainer.shutdown()
        trainer.finish()


def compared(result: Any) -> dict[str, float]:
    """What must match between a resumed step and the straight run's."""
    numbers = {
        "policy_loss": result.policy["policy_loss"],
        "entropy": result.policy["entropy"],
        "grad_norm": result.policy["grad_norm"],
        "approx_kl": result.policy["approx_kl"],
    }
    if result.kl is not None:
        numbers["kl"] = result.kl
    if result.critic:
        numbers["value_loss"] = result.critic["value_loss"]
    return numbers


def assert_same_steps(resumed: list[Any], straight: list[Any]) -> None:
    by_step = {result.step: result for result in straight}
    for result in resumed:
        expected = by_step[result.step]
        assert result.reward_mean == expected.reward_mean, result.step  # the same samples
        got, want = compared(result), compared(expected)
        assert got == pytest.approx(want, abs=TOLERANCE, rel=0), (result.step, got, want)


def assert_same_weights(resumed_store: Any, straight_store: Any, step: int, role: str) -> None:
    want = whole_tensors(straight_store.step_dir(step) / role)
    got = whole_tensors(resumed_store.step_dir(step) / role)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=WEIGHT_TOLERANCE, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_checkpoint_resumes_on_fewer_and_more_ranks_as_if_uninterrupted(
    local_ray, tmp_path, algorithm
):
    roles = ["policy", "critic"] if algorithm == "ppo" else ["policy"]
    straight, straight_store = train(algorithm, tmp_path / "straight", ranks=2, steps=STEPS)
    assert [result.step for result in straight] == list(range(1, STEPS + 1))
    assert straight_store.step_dir(1).is_dir()
    manifest = json.loads((straight_store.step_dir(1) / "manifest.json").read_text())
    assert set(manifest["extra"]["ranks"].values()) == {2}

    # 2 -> 1: the straight run's step-1 checkpoint, on one rank per group.
    shrunk, shrunk_store = train(
        algorithm, tmp_path / "shrunk", ranks=1, steps=2, resume_from=straight_store.step_dir(1)
    )
    assert [result.step for result in shrunk] == [2, 3]
    assert_same_steps(shrunk, straight)
    for role in roles:
        assert read_saved_state(shrunk_store.step_dir(2) / role).world_size == 1
        assert_same_weights(shrunk_store, straight_store, 3, role)
    # The policy of step 3 exports as the same model whether 2 ranks wrote it or 1.
    exported = {
        name: export_checkpoint(store.step_dir(3), tmp_path / f"export-{name}")
        for name, store in (("two", straight_store), ("one", shrunk_store))
    }
    assert_same_export(exported["two"], exported["one"])

    # 1 -> 2: the shrunk run's step-2 checkpoint, written by one rank, on two again.
    grown, grown_store = train(
        algorithm, tmp_path / "grown", ranks=2, steps=2, resume_from=shrunk_store.step_dir(2)
    )
    assert [result.step for result in grown] == [3, 4]
    assert_same_steps(grown, straight)
    for role in roles:
        assert_same_weights(grown_store, straight_store, 4, role)


def assert_same_export(got: Path, want: Path) -> None:
    """Two exported directories hold the same model, up to the ranks' summing order."""
    from safetensors.torch import load_file

    got_tensors, want_tensors = (load_file(d / "model.safetensors") for d in (got, want))
    assert got_tensors.keys() == want_tensors.keys()
    for name, tensor in want_tensors.items():
        assert got_tensors[name].dtype == tensor.dtype, name
        torch.testing.assert_close(
            got_tensors[name], tensor, rtol=0, atol=WEIGHT_TOLERANCE, msg=name
        )
    assert json.loads((got / "config.json").read_text()) == json.loads(
        (want / "config.json").read_text()
    )
