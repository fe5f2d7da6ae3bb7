"""Stopping a process tree the trio way: a polite signal, a grace period, SIGKILL to all, wait for the exit.

trio's ``run_process`` stops a child with ``deliver_cancel`` (SIGTERM, five
seconds, SIGKILL), shielded, and always waits for the exit. Here the same
sequence is an explicit state, so that a stop interrupted half-way (the caller
cancelled during the grace period) resumes where it was, and a step taken twice
or out of order fails loudly::

    RUNNING ──terminate──► TERMINATING ──kill──► KILLING ──sweep──► STOPPED
       │                        │    (grace ends, or hurry)    ▲
       └──────────kill──────────┴───────────────sweep──────────┘

What is stopped is a :class:`ProcessTree`: five operations any owner of
processes can provide. :class:`GroupTree` is the one for a child that leads its
own session (the executors, a contained command); the supervisor provides its
own (bubblewrap's PID namespace, pidfds on every member, cgroups).
:class:`StopStrategy` is the parameter: how long the grace period is, how long
to wait for the tree to be gone, and which signal asks politely.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rollcage.procs._cancel import first_of, shielded, within
from rollcage.procs._handles import PidHandle, group_exists, signal_group
from rollcage.procs._table import in_proc_thread, live_members

__all__ = ["GroupTree", "ProcessTree", "StopPhase", "StopStrategy", "TreeStop", "stop_tree"]

logger = logging.getLogger("rollcage.procs")


class StopPhase(enum.Enum):
    """Where the stop of one process tree stands."""

    RUNNING = "running"
    """Nothing sent yet."""
    TERMINATING = "terminating"
    """The polite signal went to the group; the grace period runs (if it reached anyone)."""
    KILLING = "killing"
    """SIGKILL went to the whole tree (possibly more than once)."""
    STOPPED = "stopped"
    """The tree was swept: every member killed and waited for (or the wait ran out)."""


_ALLOWED: dict[StopPhase, frozenset[StopPhase]] = {
    StopPhase.RUNNING: frozenset({StopPhase.TERMINATING, StopPhase.KILLING, StopPhase.STOPPED}),
    StopPhase.TERMINATING: frozenset({StopPhase.KILLING, StopPhase.STOPPED}),
    StopPhase.KILLING: frozenset({StopPhase.KILLING, StopPhase.STOPPED}),
    StopPhase.STOPPED: frozenset(),
}


@dataclass(frozen=True)
class StopStrategy:
    """How to stop a process tree.

    Attributes:
        grace_s: Between the polite signal and SIGKILL; ``0``: SIGKILL at once, no polite signal.
        kill_wait_s: After SIGKILL, how long to wait for the tree's leader, and then
            for every member, to be gone.
        polite: The signal that asks the group to stop.
    """

    grace_s: float
    kill_wait_s: float
    polite: signal.Signals = signal.SIGTERM

    def __post_init__(self) -> None:
        for name in ("grace_s", "kill_wait_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"StopStrategy.{name} must be a finite number of seconds >= 0, got {value}")


class ProcessTree(Protocol):
    """What :class:`TreeStop` needs of a process tree: a leader, its group, and whatever else it owns."""

    def exited(self) -> bool:
        """Whether the tree's leader has exited (a zombie counts)."""

    async def wait(self) -> None:
        """Return once the tree's leader has exited; bounded by the caller.

        **Cancellation:** only the wait ends.
        """

    async def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the leader's process group; whether it reached anyone.

        **Cancellation:** the signal may or may not have been sent.
        """

    async def kill(self, reason: str) -> None:
        """SIGKILL the whole tree, atomically where the kernel allows; ``reason`` says why (for records).

        **Cancellation:** what was sent stays sent.
        """

    async def sweep(self, timeout_s: float) -> bool:
        """Kill and reap whatever is left of the tree until nothing is, for up to ``timeout_s``.

        Returns:
            Whether nothing of the tree is left.

        **Cancellation:** the sweep stops where it is.
        """


class TreeStop:
    """The stop of one process tree, as an explicit state (see the module docstring).

    Each step moves the state on and fails loudly (``RuntimeError``) when taken out of
    order; :meth:`run` takes whatever steps are left, so a stop interrupted by a
    cancellation resumes where it was.
    """

    def __init__(self, tree: ProcessTree, strategy: StopStrategy) -> None:
        self.tree = tree
        self.strategy = strategy
        self._phase = StopPhase.RUNNING
        self._grace_until: float | None = None
        self._hurry = asyncio.Event()

    @property
    def phase(self) -> StopPhase:
        """Where the stop stands."""
        return self._phase

    @property
    def grace_until(self) -> float | None:
        """When the grace period ends (``time.monotonic()``); ``None`` before it starts, or if the
        polite signal reached no one."""
        return self._grace_until

    def _move(self, to: StopPhase) -> None:
        if to not in _ALLOWED[self._phase]:
            raise RuntimeError(f"a process tree's stop cannot go from {self._phase.value} to {to.value}")
        self._phase = to

    def hurry(self) -> None:
        """Skip what is left of the grace period (e.g. on a second cancellation)."""
        self._hurry.set()

    async def terminate(self) -> bool:
        """RUNNING → TERMINATING: send the polite signal to the group; the grace period starts if it
        reached anyone.

        Returns:
            Whether it reached anyone.

        **Cancellation:** the state is TERMINATING, with no grace period; the signal may have gone.
        """
        self._move(StopPhase.TERMINATING)
        reached = await self.tree.signal_group(self.strategy.polite)
        if reached:
            self._grace_until = time.monotonic() + self.strategy.grace_s
        return reached

    async def wait_grace(self) -> None:
        """In TERMINATING: wait until the leader exits, the grace period ends, or :meth:`hurry`.

        **Cancellation:** the wait ends; the state is unchanged.
        """
        if self._phase is not StopPhase.TERMINATING:
            raise RuntimeError(f"no grace period to wait for: the stop is {self._phase.value}")
        until = self._grace_until
        if until is None or self.tree.exited() or self._hurry.is_set():
            return
        await first_of(self.tree.wait(), self._hurry.wait(), seconds=until - time.monotonic())

    async def kill(self, reason: str) -> None:
        """→ KILLING (again, if it already is): SIGKILL the whole tree, then wait up to
        ``kill_wait_s`` for its leader to exit.

        **Cancellation:** the state is KILLING; the wait ends.
        """
        self._move(StopPhase.KILLING)
        await self.tree.kill(reason)
        await within(self.tree.wait(), self.strategy.kill_wait_s)

    async def sweep(self) -> bool:
        """→ STOPPED: kill and reap what is left, for up to ``kill_wait_s``; whether nothing is.

        **Cancellation:** the sweep stops where it is; the state is unchanged.
        """
        if self._phase is StopPhase.STOPPED:
            raise RuntimeError("the process tree was already swept")
        gone = await self.tree.sweep(self.strategy.kill_wait_s)
        self._move(StopPhase.STOPPED)
        return gone

    async def run(self, reason: str = "stop") -> bool:
        """Take the steps left: polite signal, grace, SIGKILL to the whole tree, sweep.

        Returns:
            Whether nothing of the tree is left.

        **Cancellation:** stops where it is (the state says where); call it again to
        resume, or run it under :func:`rollcage.procs.shielded` to finish.
        """
        if self._phase is StopPhase.RUNNING and self.strategy.grace_s > 0 and not self.tree.exited():
            await self.terminate()
        if self._phase is StopPhase.TERMINATING:
            await self.wait_grace()
        if self._phase in (StopPhase.RUNNING, StopPhase.TERMINATING) and not self.tree.exited():
            await self.kill("grace_expired" if self._grace_until is not None else reason)
        return await self.sweep()


async def stop_tree(tree: ProcessTree, strategy: StopStrategy, *, reason: str = "stop") -> bool:
    """Stop ``tree`` (polite signal, grace, SIGKILL to all, sweep), shielded from cancellation.

    Args:
        tree: What to stop.
        strategy: The grace period and the waits.
        reason: Why, passed to :meth:`ProcessTree.kill` when SIGKILL goes out before the grace ran out.

    Returns:
        Whether nothing of the tree is left.

    **Cancellation:** shielded: the tree is always stopped and waited for (bounded by
    ``grace_s`` and three times ``kill_wait_s``), then ``CancelledError`` propagates.
    """
    return await shielded(TreeStop(tree, strategy).run(reason))


class GroupTree:
    """A child that leads its own session and process group, with everything it started there.

    A :class:`ProcessTree`: polite signals go to the group; SIGKILL to the group
    (and to ``also_kill``, e.g. a cgroup), then to every live member of the group
    or the session found in ``/proc``, through pidfds, until none is left.

    Args:
        pgid: The leader's pid (its group and session id). The leader must not have
            been reaped by anyone but ``exit``'s owner while this is in use.
        exit: Resolved when the leader has exited (it is never cancelled here).
        also_kill: More to kill with the group (e.g. a cgroup), awaited after the group's SIGKILL.
    """

    def __init__(
        self,
        pgid: int,
        exit: asyncio.Future[Any],
        *,
        also_kill: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.pgid = pgid
        self._exit = exit
        self._also_kill = also_kill

    def exited(self) -> bool:
        """Whether the leader has exited."""
        return self._exit.done()

    async def wait(self) -> None:
        """Return once the leader has exited.

        **Cancellation:** only the wait ends.
        """
        await asyncio.wait({self._exit})

    async def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the group.

        **Cancellation:** not a suspension point.
        """
        return signal_group(self.pgid, sig)

    async def kill(self, reason: str) -> None:
        """SIGKILL the group and ``also_kill``.

        **Cancellation:** the group's SIGKILL is sent; ``also_kill`` may be cut short.
        """
        logger.debug("killing process group %d (%s)", self.pgid, reason)
        signal_group(self.pgid, signal.SIGKILL)
        if self._also_kill is not None:
            await self._also_kill()

    async def sweep(self, timeout_s: float) -> bool:
        """SIGKILL the group, ``also_kill``, and every live member of the group or session until none
        is left; then wait (as long again) for the leader's exit.

        **Cancellation:** the sweep stops where it is.
        """
        await self.kill("sweep")
        deadline = time.monotonic() + timeout_s
        delay = 0.002
        while True:
            members = await in_proc_thread(live_members, self.pgid)
            if members is None:
                gone = await self._group_gone(deadline)  # no /proc: the group alone, zombies included
                break
            if not members:
                gone = True
                break
            for info in members:
                handle = PidHandle.open(info)
                if handle is not None:
                    handle.send(signal.SIGKILL)
                    handle.close()
            if time.monotonic() >= deadline:
                gone = False
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        await within(self.wait(), timeout_s)
        return gone

    async def _group_gone(self, deadline: float) -> bool:
        delay = 0.002
        while group_exists(self.pgid):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return True
