"""Start-up pacing: how many rollouts of one event loop may start up at once.

A rollout's costliest CPU is its start: the sandbox's launch chain and the worker's
interpreter with its imports (``bench/profile.py``: most of a rollout's CPU). Started
all at once, 256 rollouts share the machine's cores evenly, so none gets past its
start before all of them do, and the first result arrives only after every rollout's
start-up has been paid. Paced, a rollout starts when one of at most two per CPU
slots is free, and holds it only while it starts up: until the sandbox's first
request reaches the proxy (the worker is running the agent), the worker exits, or
``START_HOLD_S`` passes (a worker that never calls out does not block the others).
"""

from __future__ import annotations

import asyncio
import os
import weakref

__all__ = ["START_HOLD_S", "start_gate", "start_slots"]

START_HOLD_S = 2.0
"""The longest a rollout holds its start-up slot."""

_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def start_slots() -> int:
    """Rollouts that may start up at once: two per CPU this process may run on (at least two)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(2, 2 * cpus)


def start_gate() -> asyncio.Semaphore:
    """The running event loop's start-up slots (made on first use)."""
    loop = asyncio.get_running_loop()
    gate = _gates.get(loop)
    if gate is None:
        gate = _gates[loop] = asyncio.Semaphore(start_slots())
    return gate
