"""The Hugging Face rollout engine: sampling, log-probs, seeding, stopping, weight loading."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from rlhf_trainer.modeling.logprobs import logprobs_from_logits
from rlhf_trainer.rollout.base import Completion, SamplingParams
from rlhf_trainer.rollout.engines import HFEngine
from rlhf_trainer.rollout.model_source import ModelSource
from rlhf_trainer.rollout.vllm_engine import VLLMEngine, VLLMWorkerExtension
from rlhf_trainer.seeds import derive_seed

TINY_QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 32,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]  # different lengths: exercises left padding


@pytest.fixture(scope="module")
def engine() -> HFEngine:
    return HFEngine(ModelSource(config=TINY_QWEN2, seed=1))


def reference_logprobs(
    engine: HFEngine, prompt: list[int], completion: Completion, temperature: float
) -> torch.Tensor:
    """Log-probs of the completion's tokens from one full, unpadded forward pass."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0]
    return logprobs_from_logits(logits[len(prompt) - 1 : -1], ids[0, len(prompt) :], temperature)


def test_generates_n_samples_per_prompt_with_the_models_logprobs(engine: HFEngine) -> None:
    sampling = SamplingParams(n=3, temperature=0.7, max_tokens=6, seed=11)
    results = engine.generate(PROMPTS, sampling)
    assert len(results) == len(PROMPTS)
    for prompt, completions in zip(PROMPTS, results, strict=True):
        assert len(completions) == 3
        for completion in completions:
            assert len(completion.token_ids) == len(completion.logprobs) == 6
            assert all(0 <= token < TINY_QWEN2["vocab_size"] for token in completion.token_ids)
            assert completion.policy_version == 0
            expected = reference_logprobs(engine, prompt, completion, temperature=0.7)
            torch.testing.assert_close(
                torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5
            )
    # Three samples of one prompt are not all the same sequence.
    assert len({tuple(c.token_ids) for c in results[0]}) > 1


def test_same_seed_same_samples_other_seed_other_samples(engine: HFEngine) -> None:
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3)
    first = engine.generate(PROMPTS, sampling)
    assert engine.generate(PROMPTS, sampling) == first
    other = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=4))
    assert other != first


def test_respects_max_tokens_and_stops_after_a_stop_token(engine: HFEngine) -> None:
    unstopped = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=12, seed=5))
    assert all(len(c.token_ids) == 12 for completions in unstopped for c in completions)
    stop_token = unstopped[1][0].token_ids[4]
    stopped = engine.generate(
        PROMPTS, SamplingParams(n=2, max_tokens=12, seed=5, stop_token_ids=(stop_token,))
    )
    for before, after in zip(
        [c for cs in unstopped for c in cs], [c for cs in stopped for c in cs], strict=True
    ):
        # The same random draws, cut right after the first stop token (which is kept).
        cut = (
            before.token_ids.index(stop_token) + 1
            if stop_token in before.token_ids
            else len(before.token_ids)
        )
        assert after.token_ids == before.token_ids[:cut]
        assert after.logprobs == before.logprobs[:cut]
    assert len(stopped[1][0].token_ids) <= 5


def test_temperature_zero_is_greedy_with_unscaled_logprobs(engine: HFEngine) -> None:
    results = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=5))
    for prompt, (first, second) in zip(PROMPTS, results, strict=True):
        assert first == second
        ids = torch.tensor([prompt + first.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        assert first.token_ids == logits.argmax(dim=-1).tolist()
        torch.testing.assert_close(
            torch.tensor(first.logprobs), torch.log_softmax(logits, dim=-1).max(dim=-1).values
        )


def test_top_p_truncates_sampling_but_not_the_reported_logprobs(engine: HFEngine) -> None:
    nucleus = engine.generate(PROMPTS, SamplingParams(n=2, top_p=1e-6, max_tokens=5, seed=9))
    greedy = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=5))
    for sampled, argmax in zip(nucleus, greedy, strict=True):
        # A nucleus of one token always picks the argmax; its log-prob is not renormalised to 0.
        assert [c.token_ids for c in sampled] == [c.token_ids for c in argmax]
        assert all(lp < -1e-3 for c in sampled for lp in c.logprobs)


def test_load_weights_copies_exactly_and_sets_the_version(engine: HFEngine) -> None:
    other = HFEngine(ModelSource(config=TINY_QWEN2, seed=2))
    source = engine.named_parameters()
    assert not all(torch.equal(other.named_parameters()[n], t) for n, t in source.items())
    other.load_weights(source.items(), version=7)
    assert other.policy_version() == 7
    for name, tensor in source.items():
        assert torch.equal(other.named_parameters()[name], tensor), name
    sampling = SamplingParams(n=1, max_tokens=4, seed=1)
    completions = other.generate(PROMPTS, sampling)
    assert completions == [
        [Completion(c.token_ids, c.logprobs, 7) for c in cs]
        for cs in engine.generate(PROMPTS, sampling)
    ]


def test_load_weights_rejects_mismatches_and_blocks_generation_until_fixed() -> None:
    engine = HFEngine(ModelSource(config=TINY_QWEN2, seed=3))
    name, tensor = next(iter(engine.named_parameters().items()))
    with pytest.raises(ValueError, match="float64"):
        engine.load_weights([(name, tensor.double())], version=1)
    with pytest.raises(RuntimeError, match="part-way"):
        engine.generate(PROMPTS, SamplingParams())
    with pytest.raises(KeyError, match="no parameter"):
        engine.load_weights([("model.nope.weight", tensor)], version=1)
    engine.load_weights([(name, tensor.clone())], version=2)
    assert engine.policy_version() == 2
    assert len(engine.generate(PROMPTS, SamplingParams())) == len(PROMPTS)


def test_model_source_builds_identical_models_for_one_seed() -> None:
    first = HFEngine(ModelSource(config=TINY_QWEN2, seed=5)).named_parameters()
    second = HFEngine(ModelSource(config=TINY_QWEN2, seed=5)).named_parameters()
    assert all(torch.equal(first[name], second[name]) for name in first)
    with pytest.raises(ValueError, match="exactly one"):
        ModelSource()


def test_derived_seeds_are_stable_and_distinct() -> None:
    seeds = [derive_seed(42, index) for index in range(100)]
    assert seeds == [derive_seed(42, index) for index in range(100)]
    assert len(set(seeds)) == 100
    assert all(0 <= seed < 2**62 for seed in seeds)


@pytest.mark.slow
def test_create_rollout_engines_places_actors_on_the_rollout_resource() -> None:
    ray = pytest.importorskip("ray")
    from rlhf_trainer.rollout.engines import create_rollout_engines
    from rlhfjob.api import RolloutRoleSpec, ray_resource

    resource = ray_resource("rollout")
    ray.init(num_cpus=2, resources={resource: 2}, include_dashboard=False, log_to_driver=False)
    try:
        spec = RolloutRoleSpec(replicas=2, backend="hf")
        engines = create_rollout_engines(spec, ModelSource(config=TINY_QWEN2, seed=1))
        assert len(engines) == 2  # one per replica on CPU
        sampling = SamplingParams(n=2, max_tokens=3, seed=1)
        first, second = ray.get([engine.generate.remote(PROMPTS, sampling) for engine in engines])
        assert first == second  # same source, same seed
        assert ray.available_resources().get(resource, 0) == 0  # each holds one slot
        assert ray.get([engine.policy_version.remote() for engine in engines]) == [0, 0]
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------------------------
# VLLMEngine's glue, against a stand-in for the `vllm` package (the real one needs a GPU)
# --------------------------------------------------------------------------------------------


class FakeModel:
    """What `VLLMWorkerExtension` needs of a vLLM model: `load_weights(weights=...)`."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loaded.update((name, tensor.clone()) for name, tensor in weights)


class FakeWorker(VLLMWorkerExtension):
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.model_runner = SimpleNamespace(model=FakeModel())


class FakeLLM:
    """Records what VLLMEngine asks of `vllm.LLM`; RPCs run on one in-process fake worker."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[str] = []
        self.sampler_seeds: list[int] = []
        self.requests: list[tuple[list[int], Any]] = []
        self.worker = FakeWorker()

    def generate(self, prompts: list[dict[str, Any]], params: list[Any], use_tqdm: bool) -> Any:
        self.sampler_seeds.append(torch.initial_seed())  # what vLLM's sampler would draw from
        outputs = []
        for prompt, param in zip(prompts, params, strict=True):
            self.requests.append((prompt["prompt_token_ids"], param))
            samples = [
                SimpleNamespace(
                    index=j,
                    token_ids=[prompt["prompt_token_ids"][-1] + j, 7],
                    logprobs=[
                        {prompt["prompt_token_ids"][-1] + j: SimpleNamespace(logprob=-0.25)},
                        {7: SimpleNamespace(logprob=-1.5), 3: SimpleNamespace(logprob=-9.0)},
                    ],
                )
                for j in reversed(range(param.n))  # out of order: the engine sorts by index
            ]
            outputs.append(SimpleNamespace(outputs=samples))
        return outputs

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple[Any, ...] = ()
    ) -> list[Any]:
        self.calls.append(method)
        # vLLM sends RPC arguments as plain data (colocated: in-process, tensors as they are)
        if method not in ("rlhf_load_weights", "rlhf_load_tensors"):
            args = tuple(json.loads(json.dumps(args)))
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(f"wake_up {','.join(tags)}")


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = ModuleType("vllm")
    vllm.LLM = FakeLLM  # type: ignore[attr-defined]
    vllm.SamplingParams = SimpleNamespace  # type: ignore[attr-defined]
    parallel_state = ModuleType("vllm.distributed.parallel_state")
    parallel_state.get_world_group = lambda: SimpleNamespace(rank=0)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.distributed", ModuleType("vllm.distributed"))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", parallel_state)


def test_vllm_engine_starts_llm_for_token_ids_and_maps_sampling(fake_vllm: None) -> None:
    engine = VLLMEngine(ModelSource(config=TINY_QWEN2, dtype="bfloat16"), enforce_eager=True)
    llm = engine._llm
    assert isinstance(llm, FakeLLM)
    assert llm.kwargs["skip_tokenizer_init"] is True
    assert llm.kwargs["load_format"] == "dummy"  # config only: real weights come by sync
    assert (
        llm.kwargs["worker_extension_cls"] == "rlhf_trainer.rollout.vllm_engine.VLLMWorkerExtension"
    )
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert (llm.kwargs["dtype"], llm.kwargs["enforce_eager"]) == ("bfloat16", True)
    config = json.loads((Path(llm.kwargs["model"]) / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"]) == ("qwen2", 32)
    # Without it vLLM picks the base class (Qwen2Model), served as a non-generating pooler.
    assert config["architectures"] == ["Qwen2ForCausalLM"]

    sampling = SamplingParams(n=2, temperature=0.9, max_tokens=5, seed=4, stop_token_ids=(3,))
    results = engine.generate(PROMPTS, sampling)
    params = [param for _, param in llm.requests]
    assert all(
        (p.n, p.temperature, p.max_tokens, p.logprobs, p.stop_token_ids, p.ignore_eos)
        == (2, 0.9, 5, 0, [3], True)
        for p in params
    )
    assert all(p.detokenize is False for p in params)
    # One seed for the call, set in the worker before it samples; none per request (vLLM draws
    # the noise of seeded requests one request at a time).
    assert all(getattr(p, "seed", None) is None for p in params)
    assert llm.calls[-1] == "rlhf_seed" and llm.sampler_seeds == [4]
    assert results[1] == [
        Completion([10, 7], [-0.25, -1.5], 0),
        Completion([11, 7], [-0.25, -1.5], 0),
    ]
    llm.requests.clear()
    torch.manual_seed(99)  # whatever ran in between
    engine.generate(PROMPTS, sampling)
    engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.9, max_tokens=5, seed=5))
    assert llm.sampler_seeds == [4, 4, 5]  # reproducible, and another seed is another stream

    greedy = engine.generate(PROMPTS, SamplingParams(n=3, temperature=0.0))
    assert all(p.n == 1 for _, p in llm.requests[-len(PROMPTS) :])
    assert all(len(set(map(tuple, (c.token_ids for c in cs)))) == 1 for cs in greedy)
    assert all(len(cs) == 3 for cs in greedy)


def test_vllm_engine_receives_a_sync_inside_its_worker(fake_vllm: None) -> None:
    from rlhf_trainer.rollout.sync_plan import plan_weight_sync, tensor_metadata
    from rlhf_trainer.rollout.weight_sync import WeightSyncSender

    engine = VLLMEngine(ModelSource(config=TINY_QWEN2))
    llm = engine._llm
    assert isinstance(llm, FakeLLM)
    assert engine.weight_sync_ranks() == 1
    weights = list(HFEngine(ModelSource(config=TINY_QWEN2, seed=8)).named_parameters().items())
    plan = plan_weight_sync(tensor_metadata(weights), version=3, bucket_bytes=8192)
    sender = WeightSyncSender(2, host="127.0.0.1", timeout_s=10, connect_timeout_s=30)
    joining = threading.Thread(target=engine.init_weight_sync, args=(sender.info, 1))
    joining.start()
    sender.connect()
    joining.join(30)
    receiving = threading.Thread(target=engine.receive_weights, args=(plan,))
    receiving.start()
    sender.send(plan, iter(weights))
    receiving.join(30)
    assert not receiving.is_alive()
    loaded = llm.worker.model_runner.model.loaded
    assert set(loaded) == {name for name, _ in weights}
    assert all(torch.equal(loaded[name], tensor) for name, tensor in weights)
    assert engine.policy_version() == 3
    assert llm.calls[-2:] == ["rlhf_receive_weights", "reset_prefix_cache"]
    engine.close_weight_sync()
    sender.close()

    engine.load_weights(weights[:1], version=4)  # the direct path, through the RPC
    assert engine.policy_version() == 4
    assert llm.calls[-2:] == ["rlhf_load_weights", "reset_prefix_cache"]


def test_a_level_2_sleep_outside_an_update_blocks_generation_until_a_load(
    fake_vllm: None,
) -> None:
    """A colocated engine put to sleep at level 2 for a checkpoint's snapshot frees its weights;
    waking it for the next step once sampled a whole batch from uninitialised memory (reward 0,
    KL in the thousands after every checkpoint of a GPU run). Now it refuses until loaded."""
    engine = VLLMEngine(ModelSource(config=TINY_QWEN2), colocated=True)
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=2)
    engine.sleep(1)  # level 1 keeps the weights (in host memory)
    engine.wake()
    assert engine.holds_weights and engine.generate(PROMPTS, sampling)

    engine.sleep(2)
    assert not engine.holds_weights
    engine.wake()
    with pytest.raises(RuntimeError, match="level 2"):
        engine.generate(PROMPTS, sampling)

    engine.sleep(2)
    weights = list(HFEngine(ModelSource(config=TINY_QWEN2, seed=8)).named_parameters().items())
    engine.load_tensors(weights)
    assert not engine.holds_weights  # not until the last bucket is in
    engine.finish_load(5)
    engine.wake()
    assert engine.holds_weights and engine.policy_version() == 5
    assert engine.generate(PROMPTS, sampling)
