"""Remote rewards against real HTTP servers: the repo's reward server on a tiny random model, and
small scripted stub servers for the failure statuses, timeouts and concurrency."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")

from rlhf_local.tiny_models import save_tiny_tokenizer
from rlhf_trainer.data.tokenizer import decoder
from rlhf_trainer.rewards.functions import RewardFunctionError
from rlhf_trainer.rewards.remote import (
    RemoteReward,
    RemoteRewardRejected,
    RemoteRewardUnavailable,
    parse_retry_after,
    retry_delay,
    server_message,
)
from rlhf_trainer.rewards.server import RewardServer, make_server
from rlhfjob.api import RemoteRewardSpec

TEXTS = [
    ("what is two plus two", " the answer is 4"),
    ("hello world", " a b c"),
    ("what is", " \\boxed{4}"),
    ("a b c d e", " hello"),
    ("the answer", " is two plus two plus two"),
    ("hello", " world world world"),
    ("two", " 4"),
]


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 sequence classifier saved with the tiny tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    directory = save_tiny_tokenizer(tmp_path_factory.mktemp("reward-model"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # a random head gives rewards near 0; spread them so they differ
        model.score.weight.mul_(50.0)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reward_server(model_dir: Path) -> Iterator[RewardServer]:
    server = make_server(model_dir, "127.0.0.1", 0, batch_size=3)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def expected(model_dir: Path, tokenizer: Any) -> list[float]:
    """Each text scored alone (no padding) by the model loaded here, not through the server."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    rewards = []
    with torch.no_grad():
        for prompt, response in TEXTS:
            ids = tokenizer(prompt + response, return_tensors="pt")["input_ids"]
            rewards.append(float(model(input_ids=ids).logits[0, 0]))
    assert len({round(r, 4) for r in rewards}) == len(rewards), "rewards must tell texts apart"
    return rewards


def encoded(tokenizer: Any) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [tokenizer.encode(prompt) for prompt, _ in TEXTS]
    responses = [tokenizer.encode(response) for _, response in TEXTS]
    return prompts, responses


def spec(url: str, **fields: Any) -> RemoteRewardSpec:
    return RemoteRewardSpec.model_validate({"url": url, "backoffSeconds": 0.01, **fields})


def identity_decode(ids: list[int]) -> str:
    """Token ids as space-separated numbers, so stub servers can read a sample's identity back."""
    return " ".join(str(i) for i in ids)


# ---------------------------------------------------------------------------------- stub server


@dataclass
class Reply:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)

    def encoded(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()


class Stub:
    """A real HTTP server whose answers come from `respond(request_document) -> Reply`; it records
    each request's body and counts requests in flight."""

    def __init__(self, respond: Callable[[Any], Reply]) -> None:
        self.respond = respond
        self.requests: list[Any] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.condition = threading.Condition()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with stub.condition:
                    stub.requests.append(json.loads(body))
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                    stub.condition.notify_all()
                counted = True

                def finished() -> None:
                    """Out of flight before the reply's body goes: the client may send its
                    next request as soon as it has read it (counted after the write, that
                    request could be counted before this one left, one too many)."""
                    nonlocal counted
                    if counted:
                        counted = False
                        with stub.condition:
                            stub.in_flight -= 1
                            stub.condition.notify_all()

                try:
                    reply = stub.respond(json.loads(body))
                    payload = reply.encoded()
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    finished()
                    self.wfile.write(payload)
                except OSError:  # the client gave up (a timeout test)
                    pass
                finally:
                    finished()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self.thread.start()

    def wait_for_requests(self, count: int) -> bool:
        with self.condition:
            return self.condition.wait_for(lambda: len(self.requests) >= count, timeout=10)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def stub() -> Iterator[Callable[[Callable[[Any], Reply]], Stub]]:
    stubs: list[Stub] = []

    def start(respond: Callable[[Any], Reply]) -> Stub:
        stubs.append(Stub(respond))
        return stubs[-1]

    yield start
    for started in stubs:
        started.close()


def echo_rewards(document: Any) -> Reply:
    """rlhfjob answer: each sample's reward is its first prompt token id."""
    return Reply(body={"rewards": [float(p.split()[0]) for p in document["prompts"]]})


def sample_ids(count: int) -> tuple[list[list[int]], list[list[int]]]:
    return [[i, 0] for i in range(count)], [[i] for i in range(count)]


# ---------------------------------------------------------------------------------- the real server


def test_rlhfjob_protocol_matches_local_scoring(
    reward_server: RewardServer, tokenizer: Any, expected: list[float]
) -> None:
    reward = RemoteReward.from_spec(
        spec(f"{reward_server.url}/score", batchSize=4), decoder(tokenizer)
    )
    prompts, responses = encoded(tokenizer)
    rewards = reward(prompts, responses, [{"i": i} for i in range(len(TEXTS))])
    assert rewards == pytest.approx(expected, abs=1e-5)
    stats = reward.last_stats
    assert stats["samples"] == len(TEXTS)
    assert stats["batches"] == 2 and stats["requests"] == 2 and stats["retries"] == 0
    assert 0 < stats["request_seconds_max"] <= stats["seconds"]


def test_classify_protocol_gives_the_same_rewards(
    reward_server: RewardServer, tokenizer: Any, expected: list[float]
) -> None:
    reward = RemoteReward.from_spec(
        spec(f"{reward_server.url}/classify", protocol="classify", model="tiny", batchSize=3),
        decoder(tokenizer),
    )
    prompts, responses = encoded(tokenizer)
    assert reward(prompts, responses) == pytest.approx(expected, abs=1e-5)


def test_order_is_kept_over_batches_and_concurrency(
    reward_server: RewardServer, tokenizer: Any, expected: list[float]
) -> None:
    reward = RemoteReward.from_spec(
        spec(f"{reward_server.url}/score", batchSize=1, maxConcurrency=4), decoder(tokenizer)
    )
    prompts, responses = encoded(tokenizer)
    order = [3, 0, 6, 1, 5, 2, 4, 0, 6]
    rewards = reward([prompts[i] for i in order], [responses[i] for i in order])
    assert rewards == pytest.approx([expected[i] for i in order], abs=1e-5)
    assert reward.last_stats["requests"] == len(order)


def test_the_server_refuses_bad_requests_and_the_trainer_fails_with_its_words(
    reward_server: RewardServer, tokenizer: Any
) -> None:
    import urllib.error
    import urllib.request

    def post(path: str, body: bytes) -> tuple[int, Any]:
        request = urllib.request.Request(f"{reward_server.url}{path}", data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    assert post("/score", b"{not json")[0] == 400
    status, answer = post("/score", json.dumps({"prompts": ["a"]}).encode())
    assert (status, answer) == (400, {"error": "missing field 'responses'"})
    status, answer = post("/score", json.dumps({"prompts": ["a"], "responses": []}).encode())
    assert status == 400 and "1 prompts but 0 responses" in answer["error"]
    assert post("/classify", json.dumps({"input": [1]}).encode())[0] == 400
    assert post("/nowhere", b"{}")[0] == 404
    with urllib.request.urlopen(f"{reward_server.url}/health", timeout=10) as response:
        assert response.status == 200

    # The classify protocol sent to the rlhfjob route: the server's 400, quoted, no retries.
    reward = RemoteReward.from_spec(
        spec(f"{reward_server.url}/score", protocol="classify"), decoder(tokenizer)
    )
    prompts, responses = encoded(tokenizer)
    with pytest.raises(RemoteRewardRejected, match="HTTP 400: missing field 'prompts'") as caught:
        reward(prompts, responses)
    assert caught.value.status == 400
    assert reward.last_stats["requests"] == 1


def test_classify_with_activation_gives_sigmoids(reward_server: RewardServer) -> None:
    import math
    import urllib.request

    def probs(use_activation: bool) -> float:
        body = json.dumps({"input": ["hello world"], "use_activation": use_activation}).encode()
        request = urllib.request.Request(f"{reward_server.url}/classify", data=body)
        with urllib.request.urlopen(request, timeout=10) as response:
            [item] = json.loads(response.read())["data"]
        return float(item["probs"][0])

    logit = probs(False)
    assert probs(True) == pytest.approx(1 / (1 + math.exp(-logit)), abs=1e-6)


# ---------------------------------------------------------------------------------- stubs


def test_requests_carry_the_protocol_fields(stub: Callable[..., Stub]) -> None:
    server = stub(echo_rewards)
    reward = RemoteReward.from_spec(spec(server.url, batchSize=10), identity_decode)
    assert reward([[7], [8]], [[1, 2], [3]], [{"answer": "4"}, {}]) == [7.0, 8.0]
    assert server.requests == [
        {"prompts": ["7", "8"], "responses": ["1 2", "3"], "metadata": [{"answer": "4"}, {}]}
    ]
    # Parquet-style metadata: numpy values, a missing value as NaN, a date.
    import datetime

    import numpy as np

    odd = {"n": np.int64(3), "xs": np.array([1.5, 2.0]), "gap": float("nan"), "t": (1, np.nan)}
    odd["day"] = datetime.date(2024, 5, 1)
    assert reward([[7]], [[1]], [odd]) == [7.0]
    assert server.requests[-1]["metadata"] == [
        {"n": 3, "xs": [1.5, 2.0], "gap": None, "t": [1, None], "day": "2024-05-01"}
    ]

    def classify(document: Any) -> Reply:
        data = [{"index": i, "probs": [float(i)]} for i in range(len(document["input"]))]
        return Reply(body={"data": list(reversed(data))})  # any order: `index` decides

    server = stub(classify)
    reward = RemoteReward.from_spec(spec(server.url, protocol="classify"), identity_decode)
    assert reward([[7], [8], [9]], [[1], [2], [3]]) == [0.0, 1.0, 2.0]
    assert server.requests == [{"input": ["71", "82", "93"], "use_activation": False}]
    reward = RemoteReward.from_spec(
        spec(server.url, protocol="classify", model="rm"), identity_decode
    )
    reward([[7]], [[1]])
    assert server.requests[-1] == {"model": "rm", "input": ["71"], "use_activation": False}


def test_order_is_kept_when_later_batches_answer_first(stub: Callable[..., Stub]) -> None:
    last_answered = threading.Event()

    def respond(document: Any) -> Reply:
        first = document["prompts"][0].split()[0]
        if first == "0":  # the first batch waits until the last one was answered
            assert last_answered.wait(timeout=10)
        reply = echo_rewards(document)
        if first == "8":
            last_answered.set()
        return reply

    server = stub(respond)
    reward = RemoteReward.from_spec(
        spec(server.url, batchSize=2, maxConcurrency=5), identity_decode
    )
    prompts, responses = sample_ids(9)
    assert reward(prompts, responses) == [float(i) for i in range(9)]
    assert last_answered.is_set()


def test_in_flight_requests_never_exceed_max_concurrency(stub: Callable[..., Stub]) -> None:
    limit, batches = 3, 6
    window = 0.3
    holder: dict[str, Stub] = {}

    def respond(document: Any) -> Reply:
        server = holder["server"]
        with server.condition:
            # Hold each request until `limit` overlap (or none are left to come), so the client's
            # concurrency is used in full ...
            server.condition.wait_for(
                lambda: server.in_flight >= limit or len(server.requests) == batches, timeout=10
            )
            # ... then give a request beyond the limit a moment to arrive: absence cannot be
            # waited on, so this bounded window is how an unbounded client is caught.
            server.condition.wait_for(lambda: server.in_flight > limit, timeout=window)
        return echo_rewards(document)

    holder["server"] = server = stub(respond)
    reward = RemoteReward.from_spec(
        spec(server.url, batchSize=1, maxConcurrency=limit), identity_decode
    )
    prompts, responses = sample_ids(batches)
    assert reward(prompts, responses) == [float(i) for i in range(batches)]
    assert server.max_in_flight == limit
    assert len(server.requests) == batches


def test_503_twice_then_success_is_retried(stub: Callable[..., Stub]) -> None:
    replies = iter([Reply(503, {"error": "loading"}), Reply(503, b"busy")])
    server = stub(lambda document: next(replies, None) or echo_rewards(document))
    reward = RemoteReward.from_spec(spec(server.url, maxRetries=2), identity_decode)
    assert reward([[5]], [[1]]) == [5.0]
    assert len(server.requests) == 3
    assert reward.last_stats["requests"] == 3 and reward.last_stats["retries"] == 2


def test_retry_after_overrides_the_backoff(stub: Callable[..., Stub]) -> None:
    replies = iter([Reply(429, {"error": "slow down"}, {"Retry-After": "0"})])
    server = stub(lambda document: next(replies, None) or echo_rewards(document))
    # Without Retry-After the first retry would wait 30 s.
    reward = RemoteReward.from_spec(spec(server.url, backoffSeconds=30), identity_decode)
    started = time.monotonic()
    assert reward([[5]], [[1]]) == [5.0]
    assert time.monotonic() - started < 15
    assert reward.last_stats["retries"] == 1


def test_retry_delays() -> None:
    assert [retry_delay(n, 0.5) for n in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert retry_delay(20, 1.0) == 60.0
    assert retry_delay(3, 120.0) == 120.0  # a base delay over the cap is kept
    assert retry_delay(0, 1.0, retry_after=7.0) == 7.0
    assert retry_delay(0, 1.0, retry_after=3600.0) == 60.0
    assert parse_retry_after(" 2 ") == 2.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert parse_retry_after("-1") is None
    assert parse_retry_after(None) is None


def test_nothing_listening_is_unavailable_after_the_retries() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago, now closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reward = RemoteReward.from_spec(
        spec(f"http://127.0.0.1:{port}/score?key=secret-token", maxRetries=2), identity_decode
    )
    with pytest.raises(RemoteRewardUnavailable, match="after 3 attempt") as caught:
        reward([[1]], [[2]])
    assert "cannot connect" in caught.value.problem
    assert "secret-token" not in str(caught.value)
    assert not isinstance(caught.value, RewardFunctionError)  # retryable
    assert reward.last_stats["requests"] == 3 and reward.last_stats["retries"] == 2


def test_a_400_is_rejected_at_once_with_the_servers_message(stub: Callable[..., Stub]) -> None:
    server = stub(
        lambda document: Reply(400, {"error": {"message": "input too long", "code": 400}})
    )
    reward = RemoteReward.from_spec(spec(server.url, maxRetries=5), identity_decode)
    with pytest.raises(RemoteRewardRejected, match="HTTP 400: input too long") as caught:
        reward([[31337]], [[271828]])
    assert isinstance(caught.value, RewardFunctionError)  # not retryable
    assert "31337" not in str(caught.value) and "271828" not in str(caught.value)
    assert len(server.requests) == 1 and reward.last_stats["retries"] == 0


def test_server_messages() -> None:
    assert server_message(b'{"detail": "bad input"}') == "bad input"
    assert server_message(b'{"object": "error", "message": "no model"}') == "no model"
    assert server_message(b'{"detail": [{"loc": ["body"]}]}') == '[{"loc": ["body"]}]'
    assert server_message(b"x" * 1000) == "x" * 197 + "..."  # a snippet: 200 characters
    assert server_message(b'{"detail": "no\\u001b[2J token=abc123"}') == "no [2J token=<redacted>"
    assert server_message(b"") == "(empty body)"


def test_a_timeout_is_retried_then_unavailable(stub: Callable[..., Stub]) -> None:
    release = threading.Event()

    def slow(document: Any) -> Reply:
        release.wait(timeout=0.2)  # the server is slower than the client's timeout
        return echo_rewards(document)

    server = stub(slow)
    reward = RemoteReward.from_spec(
        spec(server.url, timeoutSeconds=0.05, maxRetries=2), identity_decode
    )
    try:
        with pytest.raises(RemoteRewardUnavailable, match=r"timed out after 0\.05 s"):
            reward([[1]], [[2]])
    finally:
        release.set()
    assert server.wait_for_requests(3)
    assert reward.last_stats["requests"] == 3


@pytest.mark.parametrize(
    ("protocol", "body", "problem"),
    [
        ("rlhfjob", b"<html>oops</html>", "not JSON"),
        ("rlhfjob", {"scores": [1.0, 2.0]}, 'with "rewards"'),
        ("rlhfjob", {"rewards": "1, 2"}, "is str, expected a list"),
        ("rlhfjob", {"rewards": [1.0]}, "1 rewards for 2 samples"),
        ("rlhfjob", b'{"rewards": [1.0, NaN]}', "reward 1 is nan, not finite"),
        ("rlhfjob", {"rewards": [1.0, True]}, "reward 1 is True, expected a number"),
        ("rlhfjob", {"rewards": [1.0, "2"]}, "reward 1 is '2', expected a number"),
        ("classify", {"data": [{"index": 0, "probs": [1.0]}]}, "1 results for 2 inputs"),
        ("classify", {"data": [{"index": 0, "probs": [1.0]}] * 2}, "index 0 appears twice"),
        ("classify", {"data": [{"index": 0, "probs": [1]}, {"probs": [1]}]}, "index is None"),
        ("classify", {"data": [{"index": 0, "probs": [1]}, {"index": 2}]}, "index is 2"),
        ("classify", {"data": [{"index": 0, "probs": []}, {"index": 1}]}, "probs is not"),
        ("classify", {"output": []}, 'a "data" list'),
    ],
)
def test_malformed_answers_are_rejected(
    stub: Callable[..., Stub], protocol: str, body: Any, problem: str
) -> None:
    server = stub(lambda document: Reply(200, body))
    reward = RemoteReward.from_spec(spec(server.url, protocol=protocol), identity_decode)
    with pytest.raises(RemoteRewardRejected, match="malformed answer") as caught:
        reward([[1], [2]], [[3], [4]])
    assert problem in str(caught.value)
    assert len(server.requests) == 1


def test_one_failed_batch_fails_the_call_and_stops_the_others(stub: Callable[..., Stub]) -> None:
    first_refused = threading.Event()

    def respond(document: Any) -> Reply:
        sample = document["prompts"][0].split()[0]
        if sample == "0":  # overloaded: the client backs off for 30 s
            first_refused.set()
            return Reply(503, {"error": "busy"})
        assert first_refused.wait(timeout=10)
        return Reply(422, {"detail": "sample 1 is unscorable"})

    server = stub(respond)
    reward = RemoteReward.from_spec(
        spec(server.url, batchSize=1, maxConcurrency=2, backoffSeconds=30), identity_decode
    )
    started = time.monotonic()
    with pytest.raises(RemoteRewardRejected, match="HTTP 422: sample 1 is unscorable"):
        reward(*sample_ids(2))
    assert time.monotonic() - started < 15  # the backing-off request gave up, not waited 30 s
    assert len(server.requests) == 2


def test_spec_checks() -> None:
    with pytest.raises(RewardFunctionError, match=r"set spec\.model\.tokenizer"):
        RemoteReward.from_spec(spec("http://rm:8000/score"), None)
    with pytest.raises(RewardFunctionError, match="credentials") as caught:
        RemoteReward.from_spec(spec("http://me:hunter2@rm:8000/score"), identity_decode)
    assert "hunter2" not in str(caught.value)
    reward = RemoteReward.from_spec(spec("http://rm:8000/score"), identity_decode)
    assert reward([], []) == []  # no request for no samples
    assert reward.last_stats["requests"] == 0
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        reward([[1], [2]], [[1]])
    with pytest.raises(ValueError, match="1 metadata entries"):
        reward([[1], [2]], [[1], [2]], [{}])
