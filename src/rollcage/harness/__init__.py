"""Harnesses: NOOA and any command-line agent, run in the cage with the builtin loop's evidence.

A rollout's agent is its harness (``agent.harness``): ``builtin`` (rollcage's own
loop), ``nooa`` (NVIDIA's NOOA CodeAct agent) or ``command`` (any command line).
A harness other than the builtin one is a black box that brings its own Python
(:class:`~rollcage.protocol.HarnessEnvironment`, mounted read-only) and calls the
model itself, so rollcage takes its evidence from the wire:

* inside the sandbox the worker serves ``http://127.0.0.1:PORT/v1`` (the
  :class:`Forwarder`, to the egress proxy) and runs the harness in the executor's
  cage, sharing only its loopback (:class:`rollcage.harness.worker.HarnessRunner`);
* outside the sandbox the supervisor journals every model call the egress proxy
  captured into ``checkpoint.jsonl`` (:class:`CaptureJournal`), together with the
  tool calls the harness reported (NOOA's events, a command's harness events),
  relayed by the worker and marked ``reported_by: harness``;
* the result's trajectory is the same calls, built by the worker from what its
  forwarder saw and what the harness reported; the outcome classes, deadline,
  stop file, budgets and receipt are the builtin loop's.

``rollcage harness install nooa`` makes NOOA's environment (:func:`install_harness`);
``rollcage run`` finds it, or takes ``--harness-env PATH`` (:func:`resolve_environment`).

The room is split by the side of the sandbox's wall each part runs on, because the
supervisor and the controller import this face and must not load the agent's loop,
the tools or the model client (``tests/core/test_architecture.py`` holds the rule):

* this face and the modules behind it import nothing of the worker's: the
  environments (``_venvs``: made and found on the host, mounted into the cage), the
  supervisor's journal (``_journal``), and what both sides speak — a black box's
  calls read off the wire, numbered the same way on both sides (``_calls``), the
  event and relay line formats and the environment variables that name their
  descriptors (``_events``), and the loopback forwarder with the refusal of a call
  past ``max_policy_calls`` that the egress proxy answers the same way
  (``_forwarder``; it runs in the worker, and reads the wire as the proxy does);
* :mod:`rollcage.harness.worker` is the worker's side only: the runner that takes the
  builtin loop's place, and the NOOA adapter its interpreter runs. It imports the
  agent's loop and the tools, and nothing outside the worker imports it.
"""

from rollcage.harness._calls import WireCalls, WireExchange
from rollcage.harness._events import GRACE_ENV, RELAY_FD_ENV, RelayWriter, read_events, relay_line
from rollcage.harness._forwarder import BUDGET_CODE, Forwarder
from rollcage.harness._journal import CaptureJournal
from rollcage.harness._venvs import (
    NOOA_VERSION,
    default_environment_dir,
    install_harness,
    missing_program,
    resolve_environment,
)

__all__ = [
    "BUDGET_CODE",
    "GRACE_ENV",
    "NOOA_VERSION",
    "RELAY_FD_ENV",
    "CaptureJournal",
    "Forwarder",
    "RelayWriter",
    "WireCalls",
    "WireExchange",
    "default_environment_dir",
    "install_harness",
    "missing_program",
    "read_events",
    "relay_line",
    "resolve_environment",
]
