"""Harnesses: NOOA and any command-line agent, run in the cage with the builtin loop's evidence.

A rollout's agent is its harness (``agent.harness``): ``builtin`` (rollcage's own
loop), ``nooa`` (NVIDIA's NOOA CodeAct agent) or ``command`` (any command line).
A harness other than the builtin one is a black box that brings its own Python
(:class:`~rollcage.protocol.HarnessEnvironment`, mounted read-only) and calls the
model itself, so rollcage takes its evidence from the wire:

* inside the sandbox the worker serves ``http://127.0.0.1:PORT/v1`` (the
  :class:`Forwarder`, to the egress proxy) and runs the harness in the executor's
  cage, sharing only its loopback (:class:`HarnessRunner`);
* outside the sandbox the supervisor journals every model call the egress proxy
  captured into ``checkpoint.jsonl`` (:class:`CaptureJournal`), together with the
  tool calls the harness reported (NOOA's events, a command's harness events,
  :mod:`rollcage.harness._events`), marked ``reported_by: harness``;
* the result's trajectory is the same calls, built by the worker from what its
  forwarder saw and what the harness reported; the outcome classes, deadline,
  stop file, budgets and receipt are the builtin loop's.

``rollcage harness install nooa`` makes NOOA's environment (:func:`install_harness`);
``rollcage run`` finds it, or takes ``--harness-env PATH`` (:func:`resolve_environment`).
"""

from rollcage.harness._calls import (
    Api,
    WireCall,
    WireCalls,
    WireExchange,
    model_call,
    model_call_api,
    requested_tool_calls,
)
from rollcage.harness._environments import (
    NOOA_PYTHONS,
    NOOA_VERSION,
    default_environment_dir,
    find_python,
    harness_home,
    install_harness,
    resolve_environment,
)
from rollcage.harness._events import (
    EVENTS_FD_ENV,
    MAX_EVENT_BYTES,
    MAX_EVENTS,
    RELAY_FD_ENV,
    AnswerEvent,
    ErrorEvent,
    HarnessEvent,
    RelayWriter,
    ToolEndEvent,
    ToolStartEvent,
    parse_relay_line,
    read_events,
    read_lines,
    relay_line,
)
from rollcage.harness._forwarder import BUDGET_CODE, Forwarder, budget_refusal
from rollcage.harness._journal import CaptureJournal
from rollcage.harness._runner import GRACE_ENV, NOOA_ADAPTER, HarnessRunner, HarnessSink, task_text

__all__ = [
    "BUDGET_CODE",
    "EVENTS_FD_ENV",
    "GRACE_ENV",
    "MAX_EVENTS",
    "MAX_EVENT_BYTES",
    "NOOA_ADAPTER",
    "NOOA_PYTHONS",
    "NOOA_VERSION",
    "RELAY_FD_ENV",
    "AnswerEvent",
    "Api",
    "CaptureJournal",
    "ErrorEvent",
    "Forwarder",
    "HarnessEvent",
    "HarnessRunner",
    "HarnessSink",
    "RelayWriter",
    "ToolEndEvent",
    "ToolStartEvent",
    "WireCall",
    "WireCalls",
    "WireExchange",
    "budget_refusal",
    "default_environment_dir",
    "find_python",
    "harness_home",
    "install_harness",
    "model_call",
    "model_call_api",
    "parse_relay_line",
    "read_events",
    "read_lines",
    "relay_line",
    "requested_tool_calls",
    "resolve_environment",
    "task_text",
]
