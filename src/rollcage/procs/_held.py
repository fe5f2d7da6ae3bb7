"""Cancel signals held while a process starts, so that one sent early cancels it instead of killing it.

A worker promises a *cancelled* result for SIGTERM and SIGINT, but it can keep the
promise only once its handlers are in place (its event loop's). A signal that arrives
before, with its default action, ends the process with no result at all. So the
worker's start holds them (blocked, pending) from its first instruction, and lets
them go once its handlers are installed: a signal sent meanwhile is delivered then,
to the handler.

A blocked mask is inherited by every process forked or executed meanwhile: what
holds the signals lets them go before it starts any child, or the child could not be
stopped politely.
"""

from __future__ import annotations

import signal

__all__ = ["hold_cancel_signals", "release_cancel_signals"]

_CANCEL_SIGNALS: frozenset[signal.Signals] = frozenset({signal.SIGTERM, signal.SIGINT})
"""The signals a worker answers with a cancelled result."""


def hold_cancel_signals() -> set[int | signal.Signals]:
    """Block SIGTERM and SIGINT in this thread (and so in what it forks); the mask before.

    A signal sent meanwhile stays pending, and is delivered when they are let go
    (:func:`release_cancel_signals`, or the mask returned, set again).
    """
    return signal.pthread_sigmask(signal.SIG_BLOCK, _CANCEL_SIGNALS)


def release_cancel_signals() -> None:
    """Unblock SIGTERM and SIGINT in this thread: one that is pending is delivered now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _CANCEL_SIGNALS)
