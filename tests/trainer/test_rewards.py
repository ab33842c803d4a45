"""Loading rule rewards by ``module:function`` and refusing bad reward functions loudly."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlhf_trainer.data import tasks
from rlhf_trainer.rewards.functions import (
    CombinedReward,
    ModelReward,
    RewardFunctionError,
    RewardPart,
    RuleReward,
    load_reward_function,
    standardised,
)

_unique = itertools.count()


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def write_module(directory: Path, source: str) -> str:
    """Write a uniquely named module (imports are cached per name) and return its name."""
    name = f"reward_module_{next(_unique)}"
    (directory / f"{name}.py").write_text(source)
    return name


def test_loads_a_function_by_module_and_name() -> None:
    assert load_reward_function("rlhf_trainer.data.tasks:target_token_reward") is (
        tasks.target_token_reward
    )


@pytest.mark.parametrize(
    ("former", "now"),
    [
        ("rlhf_trainer.tasks:target_token_reward", "rlhf_trainer.data.tasks:target_token_reward"),
        ("rlhf_trainer.text_rewards:exact_answer", "rlhf_trainer.rewards.text:exact_answer"),
    ],
)
def test_job_files_naming_the_former_modules_keep_working(former: str, now: str) -> None:
    assert load_reward_function(former) is load_reward_function(now)


def test_loads_a_dotted_attribute_path(module_dir: Path) -> None:
    name = write_module(
        module_dir,
        "class Scorer:\n"
        "    @staticmethod\n"
        "    def score(prompts, responses, metadata):\n"
        "        return [float(len(r)) for r in responses]\n",
    )
    reward = RuleReward.from_spec(f"{name}:Scorer.score")
    assert reward([[1], [2]], [[5, 6], []]) == [2.0, 0.0]


@pytest.mark.parametrize("spec", ["no_colon_here", ":fn", "module:", ""])
def test_malformed_spec(spec: str) -> None:
    with pytest.raises(RewardFunctionError, match="expected the form 'module:function'") as info:
        load_reward_function(spec)
    assert info.value.spec == spec


def test_missing_module_names_the_spec() -> None:
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function("no_such_package.rewards:score")
    message = str(info.value)
    assert "'no_such_package.rewards:score'" in message
    assert "module 'no_such_package.rewards' not found" in message


def test_module_whose_own_import_fails_is_reported_as_such(module_dir: Path) -> None:
    broken_dependency = write_module(module_dir, "import not_installed_dependency_xyz\n")
    with pytest.raises(RewardFunctionError, match=r"importing module .* failed") as info:
        load_reward_function(f"{broken_dependency}:score")
    assert "not_installed_dependency_xyz" in str(info.value)

    raises_on_import = write_module(module_dir, "raise RuntimeError('bad config')\n")
    with pytest.raises(RewardFunctionError, match="RuntimeError: bad config"):
        load_reward_function(f"{raises_on_import}:score")


def test_missing_attribute_names_the_spec() -> None:
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function("rlhf_trainer.data.tasks:no_such_function")
    assert str(info.value) == (
        "reward function 'rlhf_trainer.data.tasks:no_such_function': "
        "module 'rlhf_trainer.data.tasks' has no attribute 'no_such_function'"
    )


def test_non_callable_attribute() -> None:
    with pytest.raises(RewardFunctionError, match="'TARGET_TOKEN' is not callable"):
        load_reward_function("rlhf_trainer.data.tasks:TARGET_TOKEN")


def test_rule_reward_passes_all_three_lists_and_defaults_metadata(module_dir: Path) -> None:
    name = write_module(
        module_dir,
        "def score(prompts, responses, metadata):\n"
        "    return [p[0] + len(r) + m.get('bonus', 0) for p, r, m in "
        "zip(prompts, responses, metadata)]\n",
    )
    reward = RuleReward.from_spec(f"{name}:score")
    # ints are accepted and converted: 1 + 2 + 10 = 13, 3 + 0 + 0 = 3
    assert reward([[1], [3]], [[7, 7], []], [{"bonus": 10}, {}]) == [13.0, 3.0]
    assert reward([[1]], [[7]]) == [2.0]


def test_rule_reward_accepts_tensors_and_arrays() -> None:
    import torch

    reward = RuleReward(spec="inline", function=lambda p, r, m: torch.tensor([0.5, 1.0]))
    assert reward([[1], [2]], [[1], [2]]) == [0.5, 1.0]


@pytest.mark.parametrize(
    ("returned", "problem"),
    [
        ([1.0], "returned 1 rewards for 2 responses"),
        ("ab", "returned str, expected a list of floats"),
        (None, "returned NoneType, expected a list of floats"),
        ([1.0, float("nan")], "reward 1 is nan, not finite"),
        ([1.0, float("inf")], "reward 1 is inf, not finite"),
        ([1.0, "high"], "reward 1 is 'high', expected a number"),
        ([True, 1.0], "reward 0 is True, expected a number"),
    ],
)
def test_rule_reward_rejects_bad_results(returned: object, problem: str) -> None:
    reward = RuleReward(spec="pkg:bad", function=lambda p, r, m: returned)  # type: ignore[arg-type,return-value]
    with pytest.raises(RewardFunctionError) as info:
        reward([[1], [2]], [[1], [2]])
    assert str(info.value) == f"reward function 'pkg:bad': {problem}"


def test_an_exception_inside_the_function_becomes_a_reward_function_error() -> None:
    def explode(prompts: object, responses: object, metadata: object) -> list[float]:
        raise KeyError("answer")

    reward = RuleReward(spec="pkg:explode", function=explode)  # type: ignore[arg-type]
    with pytest.raises(RewardFunctionError, match="raised KeyError: 'answer'") as info:
        reward([[1]], [[1]])
    assert isinstance(info.value.__cause__, KeyError)


def test_mismatched_batch_lengths_are_a_caller_error() -> None:
    reward = RuleReward.from_spec("rlhf_trainer.data.tasks:target_token_reward")
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        reward([[1], [2]], [[1]])
    with pytest.raises(ValueError, match="1 metadata entries but 2 responses"):
        reward([[1], [2]], [[1], [2]], [{}])


# -- the job's reward: one source or a weighted sum ---------------------------------------


def constant(value: float):  # type: ignore[no-untyped-def]
    return lambda prompts, responses, metadata=None: [value] * len(responses)


def by_length(prompts, responses, metadata=None):  # type: ignore[no-untyped-def]
    return [float(len(r)) for r in responses]


PROMPTS, RESPONSES = [[1], [1], [2]], [[5], [5, 6], [5, 6, 7]]


def test_one_part_of_weight_one_is_that_part_unchanged() -> None:
    reward = CombinedReward([RewardPart("function", 1.0, by_length)])
    assert reward(PROMPTS, RESPONSES) == [1.0, 2.0, 3.0]
    assert reward.last_breakdown == {"function": 2.0}


def test_parts_are_summed_by_weight_and_each_mean_is_reported() -> None:
    reward = CombinedReward(
        [RewardPart("length", 0.5, by_length), RewardPart("format", -2.0, constant(1.0))]
    )
    assert reward(PROMPTS, RESPONSES) == [-1.5, -1.0, -0.5]
    assert reward.last_breakdown == {"length": 2.0, "format": 1.0}


def test_normalised_parts_are_standardised_over_the_batch_before_weighting() -> None:
    reward = CombinedReward(
        [RewardPart("length", 1.0, by_length), RewardPart("flat", 10.0, constant(7.0))],
        normalize=True,
    )
    scores = reward(PROMPTS, RESPONSES)
    # by_length standardised: mean 2, std sqrt(2/3); a part without signal adds 0.
    assert scores == pytest.approx([-1.2247449, 0.0, 1.2247449])
    assert reward.last_breakdown == {"length": 2.0, "flat": 7.0}  # raw means
    assert standardised([0.7] * 7) == [0.0] * 7


def test_a_part_that_returns_the_wrong_count_or_a_nan_fails_naming_it() -> None:
    short = CombinedReward([RewardPart("rm", 1.0, lambda p, r, m=None: [1.0])])
    with pytest.raises(RewardFunctionError, match=r"'rm'.*1 scores"):
        short(PROMPTS, RESPONSES)
    nan = CombinedReward([RewardPart("rm", 1.0, constant(float("nan")))])
    with pytest.raises(RewardFunctionError, match="'rm'"):
        nan(PROMPTS, RESPONSES)


def test_a_model_part_decodes_and_asks_its_replicas_once_attached() -> None:
    class Replicas:
        def score(self, prompt_texts, response_texts, batch_size):  # type: ignore[no-untyped-def]
            self.seen = (prompt_texts, response_texts, batch_size)
            return [float(len(t)) for t in response_texts]

    part = ModelReward(lambda ids: "x" * sum(ids), batch_size=8)
    reward = CombinedReward([RewardPart("model", 1.0, part)])
    assert reward.model_parts() == [part]
    with pytest.raises(RuntimeError, match="not started"):
        reward(PROMPTS, RESPONSES)
    replicas = Replicas()
    part.attach(replicas)
    assert reward(PROMPTS, RESPONSES) == [5.0, 11.0, 18.0]
    assert replicas.seen == (["x", "x", "xx"], ["x" * 5, "x" * 11, "x" * 18], 8)


def test_build_reward_makes_one_part_per_source_with_its_name_and_weight() -> None:
    from rlhf_trainer.rewards.sources import build_reward
    from rlhfjob.api import RewardSpec

    def spec_with(reward: dict) -> SimpleNamespace:  # type: ignore[type-arg]
        return SimpleNamespace(reward=RewardSpec.model_validate(reward))

    single = build_reward(
        spec_with({"function": "rlhf_trainer.data.tasks:target_token_reward"}), None
    )  # type: ignore[arg-type]
    assert [(p.name, p.weight) for p in single.parts] == [("function", 1.0)]
    combined = build_reward(
        spec_with(  # type: ignore[arg-type]
            {
                "type": "combined",
                "normalize": True,
                "components": [
                    {"function": "rlhf_trainer.data.tasks:target_token_reward", "name": "target"},
                    {"function": "rlhf_trainer.data.tasks:target_token_reward", "weight": 0.5},
                    {"type": "model", "weight": 2.0},
                ],
            }
        ),
        lambda ids: " ".join(map(str, ids)),
    )
    assert [(p.name, p.weight) for p in combined.parts] == [
        ("target", 1.0),
        ("function", 0.5),
        ("model", 2.0),
    ]
    assert combined.normalize and len(combined.model_parts()) == 1
    with pytest.raises(RewardFunctionError, match="needs a tokenizer"):
        build_reward(spec_with({"type": "model"}), None)  # type: ignore[arg-type]
