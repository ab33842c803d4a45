"""Invalid models, algorithms, datasets and schedules: what each layer must refuse about what
the job trains and how. Part of `rlhfjob.invalid_cases.INVALID_CASES`."""

from __future__ import annotations

from rlhfjob.invalid_case import RANDOM_INIT, InvalidCase
from rlhfjob.invalid_case import spec_patch as _spec

ALGORITHM_CASES: list[InvalidCase] = [
    # --- The model.
    InvalidCase(
        "model-neither",
        _spec(model={"policy": None}),
        "spec.model.policy",
        "set exactly one of policy and randomInit",
    ),
    InvalidCase("kernels-unknown", _spec(model={"kernels": "triton"}), "spec.model.kernels"),
    InvalidCase(
        "optimizer-offload-on-cpu-trainers",
        _spec(model={"optimizerOffload": "cpu"}),
        "spec.model.optimizerOffload",
        "model.optimizerOffload cpu moves the optimizer from the trainer's GPUs",
    ),
    InvalidCase(
        "optimizer-offload-unknown",
        _spec(model={"optimizerOffload": "nvme"}),
        "spec.model.optimizerOffload",
    ),
    InvalidCase(
        "kernels-liger-on-cpu-trainers",
        _spec(model={"kernels": "liger"}),
        "spec.model.kernels",
        "model.kernels liger runs Triton kernels on GPUs",
    ),
    InvalidCase(
        "kernels-liger-model-type-it-lacks",
        _spec(
            model={**RANDOM_INIT, "kernels": "liger", "randomInit": {"model_type": "gpt2"}},
            roles={"trainer": {"gpus": 1}},
        ),
        "spec.model.kernels",
        "kernels liger: Liger Kernel has no kernels for this randomInit",
    ),
    InvalidCase(
        "fused-logprobs-model-type-it-lacks",
        _spec(model={**RANDOM_INIT, "fusedLogprobs": True, "randomInit": {"model_type": "gemma2"}}),
        "spec.model.fusedLogprobs",
        "fusedLogprobs: this randomInit.model_type does more than a plain projection",
    ),
    InvalidCase(
        "model-both",
        _spec(model={"randomInit": {"model_type": "qwen2"}}),
        "spec.model.policy",
        "set exactly one of policy and randomInit",
    ),
    # --- The algorithm.
    InvalidCase("algorithm-unknown", _spec(algorithm={"name": "dpo"}), "spec.algorithm.name"),
    InvalidCase(
        "grpo-group-of-one",
        _spec(algorithm={"groupSize": 1}),
        "spec.algorithm.groupSize",
        "grpo, rloo and reinforce-plus-plus-baseline need groupSize >= 2",
    ),
    InvalidCase(
        "rloo-group-of-one",
        _spec(algorithm={"name": "rloo", "groupSize": 1}),
        "spec.algorithm.groupSize",
        "grpo, rloo and reinforce-plus-plus-baseline need groupSize >= 2",
    ),
    InvalidCase(
        "policy-loss-unknown", _spec(algorithm={"policyLoss": "cispo"}), "spec.algorithm.policyLoss"
    ),
    InvalidCase(
        "loss-aggregation-unknown",
        _spec(algorithm={"lossAggregation": "seq-mean"}),
        "spec.algorithm.lossAggregation",
    ),
    InvalidCase(
        "clip-range-low-above-one",
        _spec(algorithm={"clipRangeLow": 1.5}),
        "spec.algorithm.clipRangeLow",
    ),
    InvalidCase(
        "dynamic-sampling-without-groups",
        _spec(algorithm={"name": "ppo", "dynamicSampling": {}}, roles={"critic": {}}),
        "spec.algorithm.dynamicSampling",
        "dynamicSampling drops groups of equal rewards",
    ),
    InvalidCase(
        "overlong-buffer-beyond-the-maximum",
        _spec(algorithm={"maxResponseLength": 16, "overlongShaping": {"bufferLength": 17}}),
        "spec.algorithm.overlongShaping.bufferLength",
        "overlongShaping.bufferLength must not exceed maxResponseLength",
    ),
    InvalidCase("group-size-zero", _spec(algorithm={"groupSize": 0}), "spec.algorithm.groupSize"),
    InvalidCase(
        "steps-and-epochs",
        _spec(algorithm={"epochs": 2}),
        "spec.algorithm.totalSteps",
        "set exactly one of totalSteps and epochs",
    ),
    InvalidCase(
        "neither-steps-nor-epochs",
        _spec(algorithm={"totalSteps": None}),
        "spec.algorithm.totalSteps",
        "set exactly one of totalSteps and epochs",
    ),
    InvalidCase(
        "micro-batch-too-large",
        _spec(algorithm={"promptsPerStep": 2, "groupSize": 2, "microBatchSize": 5}),
        "spec.algorithm.microBatchSize",
        "microBatchSize must not exceed the sequences of a step",
    ),
    InvalidCase("clip-range-zero", _spec(algorithm={"clipRange": 0}), "spec.algorithm.clipRange"),
    InvalidCase("kl-negative", _spec(algorithm={"klCoef": -0.1}), "spec.algorithm.klCoef"),
    InvalidCase(
        "kl-estimator-unknown", _spec(algorithm={"klEstimator": "k2"}), "spec.algorithm.klEstimator"
    ),
    InvalidCase("gamma-above-one", _spec(algorithm={"gamma": 1.5}), "spec.algorithm.gamma"),
    InvalidCase(
        "learning-rate-zero",
        _spec(algorithm={"policyLearningRate": 0}),
        "spec.algorithm.policyLearningRate",
    ),
    InvalidCase("top-p-above-one", _spec(algorithm={"topP": 1.5}), "spec.algorithm.topP"),
    InvalidCase(
        "max-staleness-with-colocated-engines",
        _spec(roles={"rollout": {"placement": "colocated"}}, algorithm={"maxStaleness": 1}),
        "spec.algorithm.maxStaleness",
        "colocated engines share the ranks' devices",
    ),
    InvalidCase(
        "partial-rollouts-on-policy",
        _spec(algorithm={"partialRolloutTokens": 4}),
        "spec.algorithm.partialRolloutTokens",
        "it needs maxStaleness >= 1",
    ),
    InvalidCase(
        "partial-rollout-segment-beyond-the-response",
        _spec(algorithm={"maxStaleness": 1, "maxResponseLength": 16, "partialRolloutTokens": 16}),
        "spec.algorithm.partialRolloutTokens",
        "must be fewer than maxResponseLength",
    ),
    InvalidCase(
        "stop-string-empty",
        _spec(algorithm={"stopStrings": [""]}),
        "spec.algorithm.stopStrings[0]",
    ),
    # --- The dataset.
    InvalidCase("dataset-source-missing", _spec(dataset={"source": None}), "spec.dataset.source"),
    # --- What the trainer would refuse at start, decided by the spec alone.
    InvalidCase(
        "random-init-without-model-type",
        _spec(model={"policy": None, "randomInit": {"hidden_size": 64}}),
        "spec.model.randomInit.model_type",
        "randomInit needs model_type",
    ),
    InvalidCase(
        "stop-strings-without-tokenizer",
        _spec(model=RANDOM_INIT, algorithm={"stopStrings": ["</answer>"]}),
        "spec.algorithm.stopStrings",
        "algorithm.stopStrings needs a tokenizer",
    ),
    InvalidCase(
        "reward-model-without-tokenizer",
        _spec(
            model={**RANDOM_INIT, "reward": "/models/rm"},
            reward={"type": "model", "function": None},
            roles={"reward": {}},
        ),
        "spec.model.tokenizer",
        "a reward model scores text, which needs a tokenizer",
    ),
    InvalidCase(
        "lengths-beyond-the-context-window",
        _spec(
            model={
                **RANDOM_INIT,
                "randomInit": {"model_type": "qwen2", "max_position_embeddings": 8},
            },
            algorithm={"maxPromptLength": 4, "maxResponseLength": 5},
        ),
        "spec.algorithm.maxResponseLength",
        "algorithm.maxPromptLength + algorithm.maxResponseLength exceed the model's context",
    ),
    InvalidCase(
        "lengths-beyond-gpt2s-n-positions",
        _spec(
            model={**RANDOM_INIT, "randomInit": {"model_type": "gpt2", "n_positions": 8}},
            algorithm={"maxPromptLength": 4, "maxResponseLength": 5},
        ),
        "spec.algorithm.maxResponseLength",
        "context window (model.randomInit.max_position_embeddings or n_positions)",
    ),
    InvalidCase(
        "dataset-synthetic-without-task",
        _spec(dataset={"source": "synthetic:"}),
        "spec.dataset.source",
        "the trainer has no such synthetic task",
    ),
    InvalidCase(
        "dataset-synthetic-task-unknown",
        _spec(dataset={"source": "synthetic:repeat-target"}),
        "spec.dataset.source",
        "the trainer has no such synthetic task: it has copy_first, even_tokens, target_token",
    ),
    # --- Schedule consistency.
    InvalidCase(
        "ppo-micro-batch-above-prompts",
        _spec(
            algorithm={"name": "ppo", "promptsPerStep": 4, "microBatchSize": 8},
            roles={"critic": {}},
        ),
        "spec.algorithm.microBatchSize",
        "microBatchSize must not exceed the sequences of a step",
    ),
    InvalidCase(
        "warmup-as-long-as-the-run",
        _spec(algorithm={"warmupSteps": 10}),
        "spec.algorithm.warmupSteps",
        "warmupSteps must be fewer than the run's optimizer steps",
    ),
    InvalidCase(
        "warmup-beyond-update-epochs",
        _spec(algorithm={"updateEpochs": 2, "warmupSteps": 25}),
        "spec.algorithm.warmupSteps",
        "warmupSteps must be fewer than the run's optimizer steps",
    ),
    InvalidCase(
        "total-steps-beyond-bound",
        _spec(algorithm={"totalSteps": 10_000_000_000}),
        "spec.algorithm.totalSteps",
    ),
]
