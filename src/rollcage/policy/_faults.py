"""Fault injection: which request gets which fault, by schedule or by seeded chance.

A schedule rule is written ``key=value`` pairs joined by ``:``::

    call=3:status=503            the 3rd model request gets HTTP 503
    call=2:kind=hang             the 2nd is accepted and never answered
    call=1-2:kind=reset          the 1st and 2nd have their connection reset
    call=*:status=500            every request gets HTTP 500
    rollout=r-7:call=1:kind=truncated   the 1st request *of rollout r-7* gets a truncated body
    kind=latency:delay=0.2       every request is answered 0.2 s late

Keys: ``call`` (``N``, ``N-M`` or ``*``; default ``*``), ``kind``, ``status``,
``delay`` (seconds, for ``latency`` and ``trickle``), ``retry_after`` (seconds, for
``rate_limit``), ``variant`` (which form of a hostile kind; default: drawn from
the seed and the call number), ``count`` (for ``many_calls``), ``size`` (bytes,
for ``huge_arguments``), ``code`` (for ``failed``), ``rollout`` and ``task`` (only
requests of that rollout id / task id match, and ``call`` then counts that
rollout's requests). ``status=429`` means ``kind=rate_limit``; any other
``status=`` means ``kind=status``. Call numbers are 1-based and count model
requests (``/v1/chat/completions`` and ``/v1/responses``), not ``/v1/models``.

Kinds:

============== ==========================================================================
latency        answer normally after ``delay`` seconds
status         HTTP ``status`` (default 503) with an OpenAI-style error body
rate_limit     HTTP 429 with ``Retry-After: retry_after``
reset          the connection is aborted before any byte of the answer (TCP RST)
hang           the request is accepted and never answered, until the client goes away
               or the server shuts down (it never blocks shutdown)
truncated      HTTP 200 whose JSON body (or event stream) stops halfway
malformed      HTTP 200 whose body (or one stream event) is not JSON
length         the turn, cut short: ``finish_reason=length`` / ``status=incomplete``
empty          an answer with empty text and no tool calls
bad_arguments  the turn's tool calls with their JSON arguments cut short (or one such call)
============== ==========================================================================

Hostile kinds: what a broken or adversarial server does (``rollcage.policy._hostile``
has every variant; a client must classify each, never crash on one):

============== ==========================================================================
no_ids         the turn's tool calls carry no ids at all
reused_ids     every tool call of every turn has the same id
many_calls     the turn's first tool call repeated ``count`` times (default 10000) in one answer
huge_arguments the turn's tool calls padded with ``size`` bytes (default 8 MiB) of arguments
unknown_tool   the turn's tool calls name a tool that does not exist
wrong_types    a field the client reads has the wrong JSON type (``"choices": "x"``, a
               tool-call delta ``{"index": "zero", "function": {"arguments": 5}}``, ...)
bad_sse        a stream whose framing is broken (no ``data:``, events run together, bytes
               that are not UTF-8 outside any string)
odd_sse        a stream framed in legal but unusual ways (CR or CRLF line ends, comments,
               ``data:`` without a space, events split over several ``data:`` lines)
no_answer      a well-formed answer with no answer in it (a stream that is only
               ``data: [DONE]``, ``"choices": []``, a Responses status ``in_progress``)
lying_type     the answer under the other content type (a stream as application/json,
               a JSON body as text/event-stream)
trickle        the normal answer, a few bytes at a time, spread over ``delay`` seconds
deep           the answer carries a value nested 100 containers deep
failed         the server says the request failed, with error ``code`` (default
               ``invalid_api_key``): a Responses ``failed`` status, an error in the stream
bad_tokens     the normal answer carrying token data that is no token data, asked for or
               not: a ``token_id:N`` beyond 64 bits, ids as strings or booleans, negative
               ids, ids of 2^63 and beyond, positive log probabilities, logprobs of the
               wrong shape (a client keeps the answer and drops what is invalid)
============== ==========================================================================

With ``rate > 0`` every request that no rule matched gets a fault with that
probability, its kind drawn from ``kinds``; both draws come from one
``random.Random(seed)``, so a run with the same requests in the same order
gets the same faults.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollcage.errors import ConfigError
from rollcage.protocol import describe_validation_error

__all__ = [
    "CONTENT_FAULTS",
    "DEFAULT_RANDOM_KINDS",
    "WIRE_FAULTS",
    "FaultKind",
    "FaultPlan",
    "FaultRecord",
    "FaultRule",
    "RequestKey",
    "parse_fault_kinds",
    "parse_fault_spec",
]

ContentFaultKind = Literal[
    "length",
    "empty",
    "bad_arguments",
    "no_ids",
    "reused_ids",
    "many_calls",
    "huge_arguments",
    "unknown_tool",
]
"""Kinds that change what the answer says, not how it is sent."""

WireFaultKind = Literal[
    "wrong_types", "bad_sse", "odd_sse", "no_answer", "lying_type", "trickle", "deep", "failed", "bad_tokens"
]
"""Hostile kinds that change how the answer is sent (``rollcage.policy._hostile``)."""

FaultKind = Literal[
    "latency",
    "status",
    "rate_limit",
    "reset",
    "hang",
    "truncated",
    "malformed",
    ContentFaultKind,
    WireFaultKind,
]
"""What goes wrong with one request (see the module docstring)."""

CONTENT_FAULTS: frozenset[str] = frozenset(get_args(ContentFaultKind))
WIRE_FAULTS: frozenset[str] = frozenset(get_args(WireFaultKind))
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)


class FaultRule(BaseModel):
    """One fault, and which requests it hits."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: FaultKind = Field(description="What goes wrong.")
    first_call: int | None = Field(default=None, ge=1, description="First call number hit; None: every call.")
    last_call: int | None = Field(default=None, ge=1, description="Last call number hit (inclusive).")
    rollout: str | None = Field(default=None, description="Only this rollout id; calls count its requests.")
    task: str | None = Field(default=None, description="Only this task id.")
    status: int = Field(default=503, ge=400, le=599, description="HTTP status for kind 'status'.")
    delay_s: float = Field(default=1.0, ge=0, description="Added delay for kind 'latency'.")
    retry_after_s: float = Field(default=1.0, ge=0, description="Retry-After for kind 'rate_limit'.")
    variant: int | None = Field(
        default=None, ge=0, description="Which form of a hostile kind; None: drawn from the seed and call."
    )
    count: int = Field(default=10_000, ge=1, le=1_000_000, description="Tool calls for kind 'many_calls'.")
    size: int = Field(
        default=8 * 1024 * 1024, ge=1, le=1 << 30, description="Bytes of padding for kind 'huge_arguments'."
    )
    code: str = Field(default="invalid_api_key", description="Error code for kind 'failed'.")

    def matches(self, *, call: int, rollout_call: int, rollout_id: str, task_id: str) -> bool:
        """Whether this rule hits a request (``rollout_call`` counts the rollout's own requests)."""
        if self.rollout is not None and self.rollout != rollout_id:
            return False
        if self.task is not None and self.task != task_id:
            return False
        number = rollout_call if self.rollout is not None else call
        if self.first_call is not None and number < self.first_call:
            return False
        last = self.last_call if self.last_call is not None else self.first_call
        return last is None or number <= last


class RequestKey(BaseModel):
    """Which model request this is: what the request log and the fault log both name it by."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    call: int = Field(description="1-based number of the request among the server's model requests.")
    rollout_call: int = Field(description="1-based number of the request among its rollout's requests.")
    rollout_id: str = Field(description="X-Rollout-Id of the request ('' if none).")
    task_id: str = Field(description="The task id the request was played for.")
    api: Literal["chat", "responses"] = Field(description="Which endpoint was hit.")
    stream: bool = Field(description="Whether the request asked for a stream.")
    turn: int = Field(description="0-based model turn the request asked for.")


class FaultRecord(RequestKey):
    """One injected fault, as logged (in memory and as a JSONL line)."""

    kind: FaultKind = Field(description="What was injected.")
    variant: int | None = Field(default=None, description="Which form of a wire-level hostile kind.")
    status: int | None = Field(default=None, description="HTTP status sent, for status/rate_limit.")
    source: Literal["schedule", "random"] = Field(description="A schedule rule or the seeded draw.")
    at: float = Field(description="Unix time of injection.")


def parse_fault_spec(spec: str) -> FaultRule:
    """Parse one ``--fault`` rule (grammar in the module docstring).

    Raises:
        ConfigError: the rule does not parse.
    """
    fields: dict[str, object] = {}
    for part in spec.split(":"):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ConfigError(f"fault {spec!r}: expected key=value pairs joined by ':', got {part!r}")
        if key == "call":
            if value != "*":
                first, _, last = value.partition("-")
                fields["first_call"], fields["last_call"] = first, last or first
        elif key in ("kind", "status", "rollout", "task", "variant", "count", "size", "code"):
            fields[key] = value
        elif key == "delay":
            fields["delay_s"] = value
        elif key == "retry_after":
            fields["retry_after_s"] = value
        else:
            raise ConfigError(f"fault {spec!r}: unknown key {key!r}")
    if "kind" not in fields:
        if "status" not in fields:
            raise ConfigError(f"fault {spec!r}: give kind= or status=")
        fields["kind"] = "rate_limit" if fields["status"] == "429" else "status"
    try:
        return FaultRule.model_validate(fields)
    except ValidationError as exc:
        raise ConfigError(f"fault {spec!r} is not valid: {describe_validation_error(exc)}") from exc


def parse_fault_kinds(spec: str | Sequence[str]) -> list[FaultRule]:
    """Parse ``--fault-kinds`` (``"500,503,429,reset,..."``) into the rules random draws pick from.

    A number is an HTTP status (``429``: ``rate_limit``); a name is a kind with its defaults.

    Raises:
        ConfigError: an unknown kind or status.
    """
    names = [name.strip() for name in (spec.split(",") if isinstance(spec, str) else spec)]
    rules: list[FaultRule] = []
    for name in filter(None, names):
        if name.isdigit():
            rules.append(parse_fault_spec(f"status={name}"))
        elif name in FAULT_KINDS:
            rules.append(FaultRule.model_validate({"kind": name}))
        else:
            raise ConfigError(
                f"unknown fault kind {name!r}; kinds: {', '.join(FAULT_KINDS)} or an HTTP status"
            )
    return rules


DEFAULT_RANDOM_KINDS = "latency,500,503,429,reset,truncated,malformed,length,empty,bad_arguments"
"""Kinds drawn by default: all but ``hang``, which costs the client a whole timeout each time, and the
hostile kinds, which are asked for by name."""


class FaultPlan:
    """Decides, request by request, which fault (if any) to inject.

    Not thread-safe: the server consults it from its one event loop.

    Args:
        rules: Schedule rules (``FaultRule`` or ``--fault`` strings); the first match wins.
        rate: Probability of a random fault for a request no rule matched.
        kinds: What random faults are drawn from (rules or a ``--fault-kinds`` string).
        seed: Seed of the random draws.
    """

    def __init__(
        self,
        rules: Sequence[FaultRule | str] = (),
        *,
        rate: float = 0.0,
        kinds: Sequence[FaultRule] | str | None = None,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ConfigError(f"fault rate must be within [0, 1], got {rate}")
        self.rules = [parse_fault_spec(rule) if isinstance(rule, str) else rule for rule in rules]
        self.rate = rate
        if kinds is None or isinstance(kinds, str):
            self.kinds = parse_fault_kinds(kinds or DEFAULT_RANDOM_KINDS)
        else:
            self.kinds = list(kinds)
        if rate > 0 and not self.kinds:
            raise ConfigError("a fault rate needs at least one fault kind")
        self.seed = seed
        self._random = random.Random(seed)

    def decide(
        self, *, call: int, rollout_call: int, rollout_id: str, task_id: str
    ) -> tuple[FaultRule, Literal["schedule", "random"]] | None:
        """The fault for one request and where it came from, or None."""
        # Draw for every request, whatever the schedule says, so that adding a rule or a request's
        # own outcome never shifts the draws of later requests.
        drawn: FaultRule | None = None
        if self.rate > 0:
            hit = self._random.random() < self.rate
            choice = self._random.choice(self.kinds)
            drawn = choice if hit else None
        for rule in self.rules:
            if rule.matches(call=call, rollout_call=rollout_call, rollout_id=rollout_id, task_id=task_id):
                return rule, "schedule"
        return None if drawn is None else (drawn, "random")

    def variant(self, rule: FaultRule, call: int) -> int:
        """Which form of a hostile kind a request gets: the rule's, else drawn from (seed, call).

        Its own draw, apart from ``decide``'s stream: a kind's variants never shift other faults.
        """
        if rule.variant is not None:
            return rule.variant
        return random.Random(f"{self.seed}:{call}").randrange(1 << 30)
