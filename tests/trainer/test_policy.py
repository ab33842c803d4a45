"""ZeRO-3 ranks on the CPU: Ray actors, gloo, DeepSpeed stage 3.

Checks the policy against a plain single-process copy of the same model: the gathered
parameters are the full model's, log-probs match a plain forward, and one update equals plain
AdamW on the token-mean loss of the whole batch (which pins down sharding, padding,
micro-batching and the loss scaling between them). The reference role's ranks give the initial
model's log-probs, and the critic starts at zero and moves toward its targets.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")
pytest.importorskip("deepspeed")

from rlhf_trainer.algo import formulas as alg  # noqa: E402
from rlhf_trainer.algo.batch import Batch, build_batch  # noqa: E402
from rlhf_trainer.modeling import logprobs as lp  # noqa: E402
from rlhf_trainer.modeling.networks import build_causal_lm  # noqa: E402
from rlhf_trainer.ranks.actors import CriticWorker, PolicyWorker, ReferenceWorker  # noqa: E402
from rlhf_trainer.ranks.group import WorkerGroup  # noqa: E402
from rlhf_trainer.topology import rollout_rows  # noqa: E402
from rlhfjob.api import RLHFJobSpec, ray_resource  # noqa: E402
from rlhfjob.config import load_job  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo-tiny-cpu.yaml"


def tiny_spec() -> RLHFJobSpec:
    """The CPU example with 6 rows per step over 2 ranks in micro-batches of 2 (so padded)."""
    spec = load_job(EXAMPLE).spec
    algorithm = spec.algorithm.model_copy(
        update={
            "prompts_per_step": 3,
            "group_size": 2,
            "micro_batch_size": 2,
            "policy_learning_rate": 1e-2,
            "max_grad_norm": 0.5,
            "kl_coef": 0.0,
            "entropy_coef": 0.0,
        }
    )
    roles = spec.roles.model_copy(
        update={"trainer": spec.roles.trainer.model_copy(update={"replicas": 2})}
    )
    return spec.model_copy(update={"algorithm": algorithm, "roles": roles})


@pytest.fixture(scope="module")
def local_ray():
    ray.init(
        num_cpus=2,
        resources={
            ray_resource("trainer"): 4,  # the shared group, and one loaded from a checkpoint
            ray_resource("reference"): 1,
            ray_resource("critic"): 1,
        },
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def spec() -> RLHFJobSpec:
    return tiny_spec()


@pytest.fixture(scope="module")
def group(local_ray, spec):
    workers = WorkerGroup(PolicyWorker, spec, "trainer", spec.roles.trainer, 10).wait_ready()
    yield workers
    workers.shutdown()


def sample_batch(spec: RLHFJobSpec) -> Batch:
    generator = torch.Generator().manual_seed(1)
    rows = rollout_rows(spec)
    vocab = spec.model.random_init["vocab_size"]
    prompts = [torch.randint(1, vocab, (3 + row % 2,), generator=generator) for row in range(rows)]
    responses = [
        torch.randint(1, vocab, (2 + row % 3,), generator=generator) for row in range(rows)
    ]
    return build_batch([p.tolist() for p in prompts], [r.tolist() for r in responses])


def plain_logprobs(model, batch: Batch, temperature: float):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return lp.logprobs_from_logits(logits[:, :-1], batch.input_ids[:, 1:], temperature)


def test_the_group_shards_parameters(group, spec):
    full = build_causal_lm(spec.model, spec.algorithm.seed)
    total = sum(p.numel() for p in full.parameters())
    local = group.call("local_parameter_count")
    assert all(0 < count < total for count in local)
    assert sum(local) >= total  # shards cover everything (with a little alignment padding)


def test_gathered_parameters_equal_the_full_model(group, spec):
    full = build_causal_lm(spec.model, spec.algorithm.seed)
    gathered, *others = group.call("state_dict")
    assert others == [None]
    expected = dict(full.named_parameters())
    assert gathered.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(gathered[name], tensor.detach()), name


def test_logprobs_match_a_plain_forward_and_an_update_matches_plain_adamw(group, spec):
    logprobs_and_update_match_plain(group, spec)


def test_fused_logprobs_give_the_same_logprobs_and_update_under_zero3(local_ray, spec):
    """`model.fusedLogprobs`: the head's weight gathered by ZeRO-3 for the swapped forward and
    again for its backward pass, and the same numbers as the plain model's logits."""
    model = spec.model.model_copy(update={"fused_logprobs": True})
    fused_spec = spec.model_copy(update={"model": model})
    workers = WorkerGroup(PolicyWorker, fused_spec, "trainer", spec.roles.trainer, 10)
    try:
        logprobs_and_update_match_plain(workers.wait_ready(), fused_spec)
    finally:
        workers.shutdown()


def logprobs_and_update_match_plain(group: WorkerGroup, spec: RLHFJobSpec) -> None:
    batch = sample_batch(spec)
    full = build_causal_lm(spec.model, spec.algorithm.seed)
    algorithm = spec.algorithm

    expected = plain_logprobs(full, batch, algorithm.temperature).detach()
    got = group.call_sharded("logprobs", ray.put(batch))
    mask = batch.action_mask.bool()
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=1e-5)

    advantages = torch.linspace(-1.0, 1.0, len(batch))
    train_batch = batch.with_fields(old_logprobs=expected, advantages=advantages)
    metrics = group.call("train", ray.put(train_batch))
    assert metrics[0] == metrics[1]  # group-wide means, identical on every rank

    # The same update without DeepSpeed: one token-mean loss over the whole batch.
    plain = copy.deepcopy(full)
    optimizer = torch.optim.AdamW(
        plain.parameters(), lr=algorithm.policy_learning_rate, weight_decay=0.0
    )
    loss = alg.clipped_policy_loss(
        plain_logprobs(plain, batch, algorithm.temperature),
        expected,
        advantages,
        batch.action_mask,
        clip_range=algorithm.clip_range,
    ).loss
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), algorithm.max_grad_norm)
    optimizer.step()

    # Adam is blind to the gradient's scale, so the loss and the gradient norm pin the scaling.
    assert metrics[0]["policy_loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert metrics[0]["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)
    updated = group.call("state_dict")[0]
    before = dict(full.named_parameters())
    for name, tensor in plain.named_parameters():
        assert not torch.equal(updated[name], before[name]), name
        # Steps are ~lr = 1e-2; Adam magnifies rounding where a gradient is near zero.
        torch.testing.assert_close(updated[name], tensor.detach(), atol=3e-4, rtol=0)


def test_ranks_load_a_saved_checkpoint_partitioned(local_ray, spec, tmp_path):
    # Another seed than the job's, so equal weights mean the checkpoint was read.
    saved = build_causal_lm(spec.model, spec.algorithm.seed + 21)
    saved.save_pretrained(tmp_path / "policy")
    model = spec.model.model_copy(update={"random_init": None, "policy": str(tmp_path / "policy")})
    loaded_spec = spec.model_copy(update={"model": model})
    workers = WorkerGroup(PolicyWorker, loaded_spec, "trainer", spec.roles.trainer, 10)
    try:
        workers.wait_ready()
        total = sum(p.numel() for p in saved.parameters())
        assert all(0 < count < total for count in workers.call("local_parameter_count"))
        gathered = workers.call("state_dict")[0]
        expected = dict(saved.named_parameters())
        assert gathered.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(gathered[name], tensor.detach()), name
        batch = sample_batch(spec)
        got = workers.call_sharded("logprobs", ray.put(batch))
        want = plain_logprobs(saved, batch, spec.algorithm.temperature).detach()
        mask = batch.action_mask.bool()
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    finally:
        workers.shutdown()


def test_the_reference_role_gives_the_initial_models_logprobs(local_ray, spec):
    role = spec.roles.trainer.model_copy(update={"replicas": 1})
    reference = WorkerGroup(ReferenceWorker, spec, "reference", role, 10).wait_ready()
    try:
        batch = sample_batch(spec)
        full = build_causal_lm(spec.model, spec.algorithm.seed)
        expected = plain_logprobs(full, batch, spec.algorithm.temperature).detach()
        got = reference.call_sharded("reference_logprobs", ray.put(batch))
        mask = batch.action_mask.bool()
        torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=1e-5)
    finally:
        reference.shutdown()


def test_the_critic_starts_at_zero_and_moves_toward_its_returns(local_ray, spec):
    role = spec.roles.trainer.model_copy(update={"replicas": 1})
    critic = WorkerGroup(CriticWorker, spec, "critic", role, 10).wait_ready()
    try:
        batch = sample_batch(spec)
        mask = batch.action_mask
        before = critic.call_sharded("values", ray.put(batch))
        assert before.shape == mask.shape
        assert torch.count_nonzero(before) == 0  # the value head starts at zero
        returns = mask.clone()  # every response token is worth 1
        targets = batch.with_fields(old_values=before, returns=returns)
        metrics = critic.call("train", ray.put(targets))[0]
        assert metrics["value_loss"] == pytest.approx(0.5)  # 0.5 * (0 - 1)^2 on every token
        after = critic.call_sharded("values", ray.put(batch))
        assert float((after * mask).sum() / mask.sum()) > 0.0
    finally:
        critic.shutdown()
