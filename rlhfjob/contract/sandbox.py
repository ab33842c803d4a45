"""The sandbox's wire protocol: what the trainer's tool client and the sandbox server agree on.

A job's tool calls (agentic RL) and code-execution rewards run in the job's sandbox, never in a
trainer's or the driver's process: a server (`rlhf_trainer.sandbox.server`, one per sandbox pod)
that runs each call in a fresh, limited child process. The client (`rlhf_trainer.sandbox.client`)
sends `ToolCall`s and reads `ToolResult`s, both JSON, over HTTP:

* ``POST /v1/call`` with ``Authorization: Bearer <the job's token>``: one `ToolCall` in, one
  `ToolResult` out (status 200 whatever the tool did: its failure is in ``outcome``; arguments
  that do not fit the tool's JSON schema are the model's mistake, so they are a 200 too, outcome
  ``error``, ``"invalid arguments: ..."``). 401 for a missing or wrong token, 400 for a body that
  is not a `ToolCall`, 404 for an unknown tool (its body lists the server's ``tools``), 413 for a
  body over `MAX_REQUEST_BYTES`, 503 while the server is full (`SandboxLimits.slots`, after
  waiting `SandboxLimits.queue_seconds`; the client tries another pod).
* ``GET /healthz``: 200 once the server serves (the pod's readiness), no token; the body is a
  `SandboxHealth` (what isolates a call on this pod).
* ``GET /metrics``: Prometheus text (calls by tool and outcome, latency, in-flight), no token.

Every limit a call runs under is the server's (`SandboxLimits`, from its flags: `to_args`); a
call may ask for less time (``timeout_s``), never more.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SANDBOX_PORT = 8470
"""The port the sandbox server listens on in its pod."""
CALL_PATH = "/v1/call"
HEALTH_PATH = "/healthz"
METRICS_PATH = "/metrics"
MAX_REQUEST_BYTES = 1 << 20
"""The largest `ToolCall` the server reads (1 MiB): code and arguments, not data sets."""
MAX_RESULT_BYTES = 1 << 20
"""The largest `ToolResult` the client reads (`rlhfjob.untrusted` rules: bounded, no
redirects, no decompression)."""

Outcome = Literal["ok", "error", "timeout", "killed", "output_limit"]
"""How a call ended: ``ok`` (the tool returned), ``error`` (it raised, or the code failed:
``error`` says how), ``timeout`` (wall or CPU time ran out), ``killed`` (a limit killed the
process: memory, processes), ``output_limit`` (it printed more than ``max_output_bytes``: the
output is cut there)."""


class ToolCall(BaseModel):
    """One call of a named tool with its JSON arguments."""

    model_config = ConfigDict(extra="forbid")

    tool: str = Field(min_length=1, max_length=128)
    """The tool's name, as registered on the server (`rlhf_trainer.sandbox.tools`)."""
    arguments: dict[str, Any] = Field(default_factory=dict)
    """The tool's arguments (checked against its JSON schema by the server)."""
    timeout_s: float | None = Field(default=None, gt=0)
    """Less wall time than the server's limit, if asked; never more."""
    call_id: str = Field(default="", max_length=128)
    """The caller's id of the call (logs and retries), echoed back."""


class ToolResult(BaseModel):
    """What a call gave: its output as text, how it ended, and what it cost."""

    model_config = ConfigDict(extra="forbid")

    call_id: str = ""
    outcome: Outcome
    output: str = ""
    """The tool's result (or its standard output), as the model will read it; cut at the limit."""
    error: str = ""
    """Why it failed, short (an exception's last line, "memory limit (512 MiB)"); empty when
    ok. A call the client could not get answered says ``sandbox unavailable: ...``."""
    seconds: float = Field(default=0.0, ge=0)
    """Wall time of the call inside the sandbox (0 when no sandbox answered)."""

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


class SandboxLimits(BaseModel):
    """What every call runs under (the server's flags; the operator passes the job's spec)."""

    model_config = ConfigDict(extra="forbid")

    wall_seconds: float = Field(default=10.0, gt=0, le=600)
    cpu_seconds: int = Field(default=10, ge=1, le=600)
    memory_bytes: int = Field(default=512 << 20, ge=64 << 20)
    """Address space of the call's process (RLIMIT_AS)."""
    max_processes: int = Field(default=16, ge=1, le=1024)
    """Processes the call's user may run (RLIMIT_NPROC): a fork bomb stops here."""
    max_output_bytes: int = Field(default=64 << 10, ge=1024, le=MAX_RESULT_BYTES // 2)
    max_file_bytes: int = Field(default=16 << 20, ge=0)
    """The largest file a call may write (RLIMIT_FSIZE); where the sandbox has its own mounts,
    also the size of each of its private file systems (the working directory, /tmp)."""
    max_open_files: int = Field(default=64, ge=16, le=4096)
    """File descriptors a call's process may hold (RLIMIT_NOFILE)."""
    slots: int = Field(default=4, ge=1, le=256)
    """Calls one server runs at once; more wait up to `queue_seconds`, then get 503."""
    queue_seconds: float = Field(default=10.0, ge=0, le=600)
    """How long a call waits for a free slot before the server answers 503."""

    def to_args(self) -> list[str]:
        """The server's flags for these limits (``--wall-seconds 10.0 ...``): what the operator
        puts in a sandbox pod's command, and what `rlhf_trainer.sandbox.server` parses."""
        args: list[str] = []
        for name in type(self).model_fields:
            args += [limit_flag(name), str(getattr(self, name))]
        return args


def limit_flag(field: str) -> str:
    """The server flag of a `SandboxLimits` field (``wall_seconds`` -> ``--wall-seconds``)."""
    return "--" + field.replace("_", "-")


class SandboxIsolation(BaseModel):
    """What separates a call from the pod beyond its rlimits, as the server could set it up.

    ``network``: the call has a network namespace of its own with no interface up (no address,
    loopback included, is reachable); otherwise egress rests on the pod's NetworkPolicy.
    ``pids``: its own PID namespace (it sees and signals only its own processes; they all die
    with the call). ``mounts``: its own mount namespace (private /tmp and working directory,
    the token file hidden). ``readonly_root``: the rest of the file system is read-only to it.
    ``uid``: it runs as an unprivileged user of its own, not the server's.
    """

    model_config = ConfigDict(extra="forbid")

    network: bool
    pids: bool
    mounts: bool
    readonly_root: bool
    uid: bool


class SandboxHealth(BaseModel):
    """The body of ``GET /healthz``."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["ok"] = "ok"
    tools: list[str]
    slots: int
    in_flight: int
    isolation: SandboxIsolation
