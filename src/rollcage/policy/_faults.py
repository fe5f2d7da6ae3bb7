"""Fault injection: which request gets which fault, by schedule or by seeded chance.

A schedule rule is written ``key=value`` pairs joined by ``:``::

    call=3:status=503            the 3rd model request gets HTTP 503
    call=2:kind=hang             the 2nd is accepted and never answered
    call=1-2:kind=reset          the 1st and 2nd have their connection reset
    call=*:status=500            every request gets HTTP 500
    rollout=r-7:call=1:kind=truncated   the 1st request *of rollout r-7* gets a truncated body
    kind=latency:delay=0.2       every request is answered 0.2 s late

Keys: ``call`` (``N``, ``N-M`` or ``*``; default ``*``), ``kind``, ``status``,
``delay`` (seconds, for ``latency``), ``retry_after`` (seconds, for
``rate_limit``), ``rollout`` and ``task`` (only requests of that rollout id /
task id match, and ``call`` then counts that rollout's requests). ``status=429``
means ``kind=rate_limit``; any other ``status=`` means ``kind=status``. Call
numbers are 1-based and count model requests (``/v1/chat/completions`` and
``/v1/responses``), not ``/v1/models``.

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

__all__ = [
    "DEFAULT_RANDOM_KINDS",
    "FaultKind",
    "FaultPlan",
    "FaultRecord",
    "FaultRule",
    "parse_fault_kinds",
    "parse_fault_spec",
]

FaultKind = Literal[
    "latency",
    "status",
    "rate_limit",
    "reset",
    "hang",
    "truncated",
    "malformed",
    "length",
    "empty",
    "bad_arguments",
]
"""What goes wrong with one request (see the module docstring)."""

FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)


class FaultRule(BaseModel):
    """One fault, and which requests it hits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: FaultKind = Field(description="What goes wrong.")
    first_call: int | None = Field(default=None, ge=1, description="First call number hit; None: every call.")
    last_call: int | None = Field(default=None, ge=1, description="Last call number hit (inclusive).")
    rollout: str | None = Field(default=None, description="Only this rollout id; calls count its requests.")
    task: str | None = Field(default=None, description="Only this task id.")
    status: int = Field(default=503, ge=400, le=599, description="HTTP status for kind 'status'.")
    delay_s: float = Field(default=1.0, ge=0, description="Added delay for kind 'latency'.")
    retry_after_s: float = Field(default=1.0, ge=0, description="Retry-After for kind 'rate_limit'.")

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


class FaultRecord(BaseModel):
    """One injected fault, as logged (in memory and as a JSONL line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    call: int = Field(description="1-based number of the request among the server's model requests.")
    rollout_call: int = Field(description="1-based number of the request among its rollout's requests.")
    rollout_id: str = Field(description="X-Rollout-Id of the request ('' if none).")
    task_id: str = Field(description="The task id the request was played for.")
    api: Literal["chat", "responses"] = Field(description="Which endpoint was hit.")
    stream: bool = Field(description="Whether the request asked for a stream.")
    turn: int = Field(description="0-based model turn the request asked for.")
    kind: FaultKind = Field(description="What was injected.")
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
        elif key in ("kind", "status", "rollout", "task"):
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
        raise ConfigError(f"fault {spec!r} is not valid: {exc}") from exc


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
"""Kinds drawn by default: all but ``hang``, which costs the client a whole timeout each time."""


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
