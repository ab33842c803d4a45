"""CPU benchmark: reward-model scoring, in process and over HTTP, and what stopping at EOS saves.

1. **Scoring.** A random sequence-classification reward model (Qwen2 shape, hidden 256, 4
   layers, the tiny BPE tokenizer) scores batches of prompt + response texts three ways: the
   trainer's `RewardModelScorer` in this process (the ceiling), the project's reward server
   through the `RemoteReward` client (the rlhfjob protocol, one request per batch), and the same
   through the classify protocol. Throughput (samples/s) and latency per batch for each batch
   size; the remote ratios are against the in-process scorer of the same batch.
2. **Stopping at EOS.** The HF engine samples from a random policy whose end-of-sequence logit
   is raised so responses end after about 1/p tokens (varied lengths), with the EOS as a stop
   token and without it (every response runs to the maximum); seconds and tokens of each. The
   ratio is the rollout time with EOS stopping over the time without.

Prints JSON and writes it to `--out` (default benchmarks/results/cpu-rewards.json)::

    .venv/bin/python benchmarks/rewards.py
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "cpu-rewards.json"
WORDS = [
    "what",
    "is",
    "two",
    "plus",
    "two",
    "the",
    "answer",
    "is",
    "4",
    "hello",
    "world",
    "a",
    "b",
    "c",
    "d",
    "e",
]


def texts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def save_reward_model(directory: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(  # type: ignore[call-arg]  # num_labels: a kwarg it accepts
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def timed(fn: Any, repeats: int) -> list[float]:
    fn()  # warm-up
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return seconds


def bench_scoring(work: Path, batch_sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    from rlhf_local.tiny_models import save_tiny_tokenizer
    from rlhf_trainer.rewards.model import RewardModelScorer
    from rlhf_trainer.rewards.server import make_server

    tokenizer_dir = save_tiny_tokenizer(work / "tokenizer")
    model_dir = save_reward_model(work / "reward-model", tokenizer_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    scorer = RewardModelScorer(str(model_dir))
    server = make_server(model_dir, port=0, batch_size=max(batch_sizes))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    results = []
    try:
        for batch in batch_sizes:
            row = bench_batch(scorer, tokenizer, server.url, batch, repeats)
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        server.shutdown()
        server.server_close()
    return results


def bench_batch(scorer: Any, tokenizer: Any, url: str, batch: int, repeats: int) -> dict[str, Any]:
    """One batch size: the in-process scorer, then the server through either protocol."""
    from rlhf_trainer.rewards.remote import RemoteReward
    from rlhfjob.api import RemoteRewardSpec

    prompts, responses = texts(batch, 24, 1), texts(batch, 96, 2)
    prompt_ids = [tokenizer.encode(p) for p in prompts]
    response_ids = [tokenizer.encode(r) for r in responses]

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    local = statistics.median(
        timed(lambda: scorer.score(prompts, responses, batch_size=batch), repeats)
    )
    row: dict[str, Any] = {"batch_size": batch, "in_process_seconds": local}
    for protocol, path in (("rlhfjob", "/score"), ("classify", "/classify")):
        spec = RemoteRewardSpec(url=f"{url}{path}", protocol=protocol, batch_size=batch)
        remote = RemoteReward.from_spec(spec, decode)
        seconds = statistics.median(timed(lambda r=remote: r(prompt_ids, response_ids), repeats))
        row[f"remote_{protocol}_seconds"] = seconds
        row[f"remote_{protocol}_ratio"] = seconds / local
    row["in_process_samples_per_second"] = batch / local
    row["remote_rlhfjob_samples_per_second"] = batch / row["remote_rlhfjob_seconds"]
    return row


def bench_eos(prompts: int, group: int, max_tokens: int, eos_probability: float) -> dict[str, Any]:
    from rlhf_trainer.rollout.base import SamplingParams
    from rlhf_trainer.rollout.engines import HFEngine
    from rlhf_trainer.rollout.model_source import ModelSource

    config = {
        "model_type": "qwen2",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_tokens + 16,
        "tie_word_embeddings": False,
    }
    engine = HFEngine(ModelSource(config=config), max_batch_size=prompts * group)
    eos = 1
    with torch.no_grad():  # a raised EOS logit: responses end after about 1/p tokens
        head = engine.model.lm_head.weight
        head[eos] = 0.0
        bias = torch.nn.Parameter(torch.zeros(head.shape[0]))
        logit = torch.log(
            torch.tensor(eos_probability * (head.shape[0] - 1) / (1 - eos_probability))
        )
        bias[eos] = logit
        engine.model.lm_head.bias = bias
    rng = random.Random(0)
    batch = [[rng.randrange(2, 64) for _ in range(8)] for _ in range(prompts)]
    runs: dict[str, Any] = {}
    for name, stops in (("stop_at_eos", (eos,)), ("to_max_tokens", ())):
        sampling = SamplingParams(
            n=group, max_tokens=max_tokens, seed=3, stop_token_ids=stops, logprobs=False
        )
        seconds = []
        engine.generate(batch, sampling)  # warm-up
        for _ in range(7):
            started = time.perf_counter()
            completions = engine.generate(batch, sampling)
            seconds.append(time.perf_counter() - started)
        lengths = [len(c.token_ids) for row in completions for c in row]
        runs[name] = {
            "seconds": statistics.median(seconds),
            "runs_seconds": seconds,
            "tokens": sum(lengths),
            "length_min": min(lengths),
            "length_median": statistics.median(lengths),
            "length_max": max(lengths),
        }
    runs["time_ratio"] = runs["stop_at_eos"]["seconds"] / runs["to_max_tokens"]["seconds"]
    runs["token_ratio"] = runs["stop_at_eos"]["tokens"] / runs["to_max_tokens"]["tokens"]
    # The HF engine steps a batch until its longest response ends: the time it can save.
    runs["longest_over_max"] = runs["stop_at_eos"]["length_max"] / max_tokens
    runs["shape"] = {
        "prompts": prompts,
        "group": group,
        "max_tokens": max_tokens,
        "eos_probability": eos_probability,
    }
    print(json.dumps(runs), flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-rewards-") as work:
        scoring = bench_scoring(Path(work), args.batch_sizes, args.repeats)
    eos = bench_eos(prompts=8, group=8, max_tokens=256, eos_probability=0.02)
    result = {
        "command": " ".join(["benchmarks/rewards.py", *sys.argv[1:]]),
        "machine": {
            "cpus": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "scoring": scoring,
        "eos": eos,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {
                "scoring_remote_ratio": [r["remote_rlhfjob_ratio"] for r in scoring],
                "eos_time_ratio": eos["time_ratio"],
            }
        )
    )


if __name__ == "__main__":
    main()
