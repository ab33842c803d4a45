"""A rank's colocated engine (`rlhf_trainer.rollout.colocated.ColocatedEngine`) on the CPU: the
weight load reaches the engine exactly, every time, with the garbage collector paused while it
runs."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rlhf_trainer.modeling.networks import build_causal_lm  # noqa: E402
from rlhf_trainer.rollout.colocated import ColocatedEngine  # noqa: E402
from rlhfjob.config import load_job  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-colocated-cpu.yaml"


def test_loads_reach_the_engine_exactly_with_the_collector_paused() -> None:
    spec = load_job(EXAMPLE).spec
    rollout = ColocatedEngine(spec, 0, torch.device("cpu"))
    trainer = build_causal_lm(spec.model, spec.algorithm.seed + 7)  # not the engine's weights
    collector_on_during_load: list[bool] = []
    copy_weights = rollout.engine.copy_weights

    def recording_copy(tensors):  # type: ignore[no-untyped-def]
        collector_on_during_load.append(gc.isenabled())
        copy_weights(tensors)

    rollout.engine.copy_weights = recording_copy  # type: ignore[method-assign]
    for version, collector_before in ((1, True), (2, False)):
        with torch.no_grad():  # a training step between loads (the walk is cached)
            for param in trainer.parameters():
                param.add_(0.5)
        (gc.enable if collector_before else gc.disable)()
        try:
            report = rollout.load(trainer, version)
            assert gc.isenabled() == collector_before  # restored as it was
        finally:
            gc.enable()
        held = rollout.engine.named_parameters()
        for name, param in trainer.named_parameters():
            assert torch.equal(held[name], param.detach()), (version, name)
        assert rollout.engine.policy_version() == version
        assert report["bytes"] == sum(p.numel() * p.element_size() for p in trainer.parameters())
    assert collector_on_during_load and not any(collector_on_during_load)


class RecordingPolicyGroup:
    """Stand-in for the policy's `WorkerGroup` (its real ranks, on the CPU, never lose their
    engines' weights: only vLLM's level-2 sleep does, and vLLM needs a GPU): records calls and
    answers `rollout_holds_weights` as told."""

    def __init__(self, ranks: int) -> None:
        self.actors = [object()] * ranks
        self.held = [True] * ranks
        self.calls: list[tuple[str, tuple[object, ...]]] = []

    def call(self, method: str, *args: object, timeout: float | None = None) -> list[object]:
        self.calls.append((method, args))
        if method == "rollout_holds_weights":
            return list(self.held)
        return [{"bytes": 8}] * len(self.actors)


def test_maintain_reloads_every_rank_once_any_engine_lost_its_weights() -> None:
    from rlhf_trainer.rollout.colocated import ColocatedRollout

    group = RecordingPolicyGroup(2)
    fleet = ColocatedRollout(group)
    fleet.maintain()  # nothing synced yet: nothing to restore
    assert group.calls == []
    fleet.sync(3)
    group.calls.clear()
    fleet.maintain()
    assert group.calls == [("rollout_holds_weights", ())]  # held: no load
    group.held[1] = False  # a checkpoint's snapshot put rank 1's engine to sleep at level 2
    group.calls.clear()
    fleet.maintain()
    # every rank loads (a ZeRO-3 gather is collective), the version last synced
    assert group.calls == [("rollout_holds_weights", ()), ("update_rollout_engine", (3,))]
