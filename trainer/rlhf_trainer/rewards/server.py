"""A small HTTP reward server: a sequence-classification checkpoint behind both reward protocols.

For tests, and for users who want a reward server without vLLM::

    python -m rlhf_trainer.rewards.server --model DIR [--host 127.0.0.1] [--port 8000] \\
        [--batch-size 32]

It loads a Hugging Face ``AutoModelForSequenceClassification`` checkpoint and its tokenizer from
``DIR`` (CPU, float32, eval mode, no gradients) and serves

* ``POST /score``: the rlhfjob protocol (``{"prompts", "responses", "metadata"}`` in,
  ``{"rewards"}`` out); a sample's reward is the logit of label 0 for ``prompt + response``;
* ``POST /classify``: the shape of vLLM's classification API (``{"model", "input",
  "use_activation"}`` in, ``{"data": [{"index", "label", "probs", "num_classes"}]}`` out); with
  ``use_activation: false`` the probs are the raw logits, so both routes give the same rewards;
* ``GET /health``: 200 once the model is loaded.

A malformed request gets 400 with ``{"error": "..."}``, an unknown path 404, a scoring failure
500: the statuses the trainer sorts into "fail the job" and "retry" (docs/reward-protocol.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

LOG = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024 * 1024
"""Larger request bodies get 413: a bound on what one request may make the server hold."""


class BadRequestError(Exception):
    """The request is malformed; its message goes back to the client with a 400."""


class _TooLargeError(Exception):
    """The request body is over :data:`MAX_BODY_BYTES` (413)."""


class Scorer:
    """The trainer's `RewardModelScorer` (the same loading, tokenization, padding and pooling as
    the reward-model role), behind a lock: one forward pass runs at a time, since torch already
    spreads one pass over the CPU cores and overlapping passes would only multiply the memory."""

    def __init__(self, model_dir: str | Path, batch_size: int = 32) -> None:
        from rlhf_trainer.rewards.model import RewardModelScorer

        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        self.name = str(model_dir)
        self.scorer = RewardModelScorer(model_dir)
        config = self.scorer.model.config
        self.num_labels = int(config.num_labels)
        self.id2label: dict[int, str] = {int(k): str(v) for k, v in (config.id2label or {}).items()}
        self._lock = threading.Lock()

    def logits(self, texts: Sequence[str]) -> tuple[list[list[float]], int]:
        """Each text's logits (one list of ``num_labels`` per text) and the tokens scored."""
        sequences = self.scorer.tokenize_texts(texts)
        with self._lock:
            rows = self.scorer.logits(sequences, self.batch_size)
        return rows, sum(len(sequence) for sequence in sequences)

    def rewards(self, texts: Sequence[str]) -> list[float]:
        """The logit of label 0 for each text: the reward of the rlhfjob protocol."""
        rows, _ = self.logits(texts)
        return [row[0] for row in rows]

    def activated(self, row: list[float]) -> list[float]:
        """vLLM's default activation: a sigmoid for one label, a softmax for several."""
        import torch

        values = torch.tensor(row)
        if self.num_labels == 1:
            return [float(v) for v in values.sigmoid().tolist()]
        return [float(v) for v in values.softmax(-1).tolist()]


def _string_list(document: dict[str, Any], key: str) -> list[str]:
    value = document.get(key)
    if value is None:
        raise BadRequestError(f"missing field {key!r}")
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise BadRequestError(f"{key!r} must be a list of strings")
    return value


def score_request(scorer: Scorer, document: Any) -> dict[str, Any]:
    """The rlhfjob protocol: ``{"prompts", "responses", "metadata"?}`` to ``{"rewards"}``."""
    if not isinstance(document, dict):
        raise BadRequestError("the body must be a JSON object")
    prompts = _string_list(document, "prompts")
    responses = _string_list(document, "responses")
    if len(prompts) != len(responses):
        raise BadRequestError(f"{len(prompts)} prompts but {len(responses)} responses")
    metadata = document.get("metadata")
    if metadata is not None and (not isinstance(metadata, list) or len(metadata) != len(prompts)):
        raise BadRequestError("'metadata' must be a list with one entry per prompt")
    texts = [p + r for p, r in zip(prompts, responses, strict=True)]
    return {"rewards": scorer.rewards(texts)}


def classify_request(scorer: Scorer, document: Any) -> dict[str, Any]:
    """The classify shape of vLLM: ``{"model"?, "input", "use_activation"?}`` to ``{"data"}``.

    ``use_activation`` defaults to true as in vLLM; the trainer sends false for raw logits."""
    if not isinstance(document, dict):
        raise BadRequestError("the body must be a JSON object")
    raw = document.get("input")
    if raw is None:
        raise BadRequestError("missing field 'input'")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise BadRequestError("'input' must be a string or a list of strings")
    use_activation = document.get("use_activation", True)
    if not isinstance(use_activation, bool):
        raise BadRequestError("'use_activation' must be a boolean")
    rows, tokens = scorer.logits(texts)
    data = []
    for index, row in enumerate(rows):
        probs = scorer.activated(row) if use_activation else row
        best = max(range(len(row)), key=row.__getitem__)
        data.append(
            {
                "index": index,
                "label": scorer.id2label.get(best, f"LABEL_{best}"),
                "probs": probs,
                "num_classes": len(row),
            }
        )
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": document.get("model") or scorer.name,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


ROUTES = {"/score": score_request, "/classify": classify_request}


class RewardHandler(BaseHTTPRequestHandler):
    """Routes requests to the server's :class:`Scorer`; every answer is JSON."""

    server: RewardServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == "/health":
            self._send(HTTPStatus.OK, {"status": "ok"})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no route GET {self.path}"})

    def do_POST(self) -> None:
        route = ROUTES.get(self.path.split("?", 1)[0])
        try:
            document = self._read_json()
        except (BadRequestError, _TooLargeError) as error:
            # The body may be left unread: it must not be taken for the next request.
            self.close_connection = True
            status = (
                HTTPStatus.BAD_REQUEST
                if isinstance(error, BadRequestError)
                else HTTPStatus.REQUEST_ENTITY_TOO_LARGE
            )
            self._send(status, {"error": str(error)})
            return
        if route is None:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no route POST {self.path}"})
            return
        try:
            answer = route(self.server.scorer, document)
        except BadRequestError as error:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(error)})
            return
        except Exception as error:  # the model failed: the client may retry
            LOG.exception("scoring failed")
            self._send(
                HTTPStatus.INTERNAL_SERVER_ERROR,
                {"error": f"scoring failed: {type(error).__name__}: {error}"},
            )
            return
        self._send(HTTPStatus.OK, answer)

    def _read_json(self) -> Any:
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise BadRequestError("missing Content-Length")
        try:
            length = int(length_header)
        except ValueError:
            raise BadRequestError("invalid Content-Length") from None
        if length < 0:
            raise BadRequestError("invalid Content-Length")
        if length > MAX_BODY_BYTES:
            raise _TooLargeError(f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
        body = self.rfile.read(length)
        try:
            return json.loads(body)
        except ValueError as error:
            raise BadRequestError(f"invalid JSON: {error}") from None

    def _send(self, status: HTTPStatus, document: dict[str, Any]) -> None:
        body = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        LOG.debug("%s %s", self.address_string(), format % args)


class RewardServer(ThreadingHTTPServer):
    """A threading HTTP server holding one :class:`Scorer` (requests are handled concurrently;
    the scorer serialises the forward passes)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], scorer: Scorer) -> None:
        self.scorer = scorer
        super().__init__(address, RewardHandler)

    @property
    def url(self) -> str:
        """``http://host:port`` of the bound socket (the real port when 0 was asked for)."""
        host, port = self.server_address[:2]
        host_text = host.decode() if isinstance(host, bytes) else str(host)
        if ":" in host_text:
            host_text = f"[{host_text}]"
        return f"http://{host_text}:{port}"


def make_server(
    model_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, batch_size: int = 32
) -> RewardServer:
    """Load the model in ``model_dir`` and bind ``host:port`` (0 picks a free port; see
    :attr:`RewardServer.url`). Call ``serve_forever()`` on the result, in a thread for tests."""
    return RewardServer((host, port), Scorer(model_dir, batch_size=batch_size))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlhf_trainer.rewards.server",
        description="Serve a sequence-classification reward model over HTTP (/score, /classify).",
    )
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--batch-size", type=int, default=32, help="texts per forward pass")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = make_server(args.model, args.host, args.port, args.batch_size)
    LOG.info("serving %s on %s (/score, /classify, /health)", args.model, server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
