"""The worker's process tree, as the supervisor signals, kills and reaps it.

Built on :mod:`rollcage.procs` (pidfds, ``/proc``, the stop sequence): this
module knows what belongs to *one rollout*:

* the worker's direct child, kept unreaped until the supervisor is done, so its
  process-group id stays its own (without a sandbox and warm: the holder, and the
  worker forked beside it leads a session and group of its own, held as under bwrap);
* under bubblewrap, the sandbox's init (named by bwrap's status pipe, checked by
  the rollout's token, held by a pidfd from then on): SIGKILL to it takes the
  whole PID namespace at once; and the worker's process group inside it, led by
  the innermost namespace's init, which gets the polite signal; a warm worker
  (:mod:`rollcage.warm`) leads a session and group of its own in that namespace,
  and is held from the moment the template names it;
* everything in the rollout's cgroups;
* the orphans this process (a child subreaper) adopted that carry the rollout's
  token in their environment: a double-forked daemon whose parent is gone.

Every signal sent is recorded, with its reason, for the receipt.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Literal, cast, get_args

from rollcage.budgets import RolloutBudgets
from rollcage.procs import (
    ChildProcess,
    PidHandle,
    ProcInfo,
    any_exit,
    cancel_and_wait,
    environ_has,
    in_proc_thread,
    ns_pids,
    read_proc,
    subtree,
    tree_of,
    within,
)
from rollcage.protocol import SignalEvent

__all__ = ["SignalReason", "WorkerTree"]

SignalReason = Literal["deadline", "stop", "budget", "grace_expired", "cleanup"]
"""Why a signal was sent, as the receipt records it."""


class WorkerTree:
    """One rollout's process tree: a :class:`rollcage.procs.ProcessTree` for :class:`rollcage.procs.TreeStop`.

    Args:
        child: The worker's direct child (bwrap, or the worker itself without a sandbox).
        sandbox: ``bwrap``: the worker's group lives inside the sandbox's PID namespace;
            ``none``: it is the child's own group.
        marked: The environment entry (``NAME=token``) every process of the rollout carries.
        budgets: The rollout's cgroups and bounded file systems, if any.
        signals: Where each signal sent is recorded (the receipt's ``signals_sent``).
        warm: The worker is forked into the sandbox (:meth:`adopt_worker` names it); the
            sandbox's own process group is then only its holder's. Without a sandbox, the
            worker is forked beside the holder (``child``), a group of its own.
    """

    def __init__(
        self,
        child: ChildProcess,
        *,
        sandbox: Literal["bwrap", "none"],
        marked: str,
        budgets: RolloutBudgets | None,
        signals: list[SignalEvent],
        warm: bool = False,
    ) -> None:
        self.child = child
        self.warm = warm
        self.sandbox = sandbox
        self.marked = marked
        self.budgets = budgets
        self.signals = signals
        self.stragglers_killed = 0
        """Processes the last sweep killed that SIGKILL to the tree had not already reached."""
        self._handles: dict[tuple[int, int], PidHandle] = {}
        self._sigkilled: set[tuple[int, int]] = set()
        self._sandbox_init: PidHandle | None = None
        self._group_leader: PidHandle | None = None
        self._locate_task: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- ProcessTree

    def exited(self) -> bool:
        """Whether the worker's direct child has exited."""
        return self.child.poll() is not None

    async def wait(self) -> None:
        """Until the worker's direct child exits.

        **Cancellation:** only the wait ends.
        """
        await self.child.wait()

    async def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the worker's process group; whether it reached anyone.

        **Cancellation:** the signal may or may not have gone to every member.
        """
        if self.sandbox == "none" and self._group_leader is None:
            # Cold, or a warm worker not forked yet (its holder ignores the polite signals).
            return self.child.signal_group(sig)
        if self._group_leader is not None:
            # At once, from the loop: no thread, no walk of /proc (see _locate_group_leader).
            sent = self._group_leader.send_group(sig)
            if sent is not None:
                return sent
        reached = False
        for info in await self._worker_group():
            handle = self._handle(info)
            reached = (handle is not None and handle.send(sig)) or reached
        return reached

    async def kill(self, reason: str) -> None:
        """SIGKILL the whole tree: the sandbox's PID namespace, the child's group, every member found.

        **Cancellation:** what was sent stays sent (the record is written after the sends).
        """
        child = self.child
        tree = [info for info in await self._members() if info.alive and info.pid != child.pid]
        # Atomic against fork: SIGKILL to a PID namespace's init kills the whole namespace, and killpg
        # reaches the whole group (whose id is pinned: the child is not reaped yet).
        if self._sandbox_init is not None:
            self._sandbox_init.send(signal.SIGKILL)
        if self.sandbox == "none" and self._group_leader is not None:
            # No PID namespace holds a warm uncaged worker: its group (its session's) at once.
            self._group_leader.send_group(signal.SIGKILL)
        child.signal_group(signal.SIGKILL)
        for info in tree:
            handle = self._handle(info)
            if handle is not None and handle.send(signal.SIGKILL):
                self._sigkilled.add((info.pid, info.starttime))
        self.record(signal.SIGKILL, "group", _reason(reason))

    async def sweep(self, timeout_s: float) -> bool:
        """Kill and reap every remaining descendant; whether none is left (:attr:`stragglers_killed`).

        **Cancellation:** the sweep stops where it is.
        """
        child = self.child
        killed: set[tuple[int, int]] = set()
        end = time.monotonic() + timeout_s
        confirmed = False
        init = self._sandbox_init
        if init is not None and child.status is not None:
            # bwrap's monitor returns as soon as the worker exits; the sandbox's init follows a moment
            # later, taking the whole PID namespace with it. Let it, rather than count it as a straggler.
            await within(init.wait(), min(1.0, timeout_s))
        while True:
            tree = await self._members()
            alive = [info for info in tree if info.alive and info.pid != child.pid]
            for info in tree:
                # Zombies reparented to us must be reaped; holding a handle lets us reap them safely.
                if info.pid != child.pid and info.ppid == os.getpid():
                    self._handle(info)
            if not alive and child.status is not None:
                confirmed = True
                break
            if self._kill_stragglers(alive, killed):
                self.record(signal.SIGKILL, "descendants", "cleanup")
            if time.monotonic() >= end:
                break
            await self._pause(min(0.05, end - time.monotonic()))
        for handle in self._handles.values():
            if handle.exited():
                handle.reap()
        self.stragglers_killed = len(killed)
        return confirmed

    def _kill_stragglers(self, alive: list[ProcInfo], killed: set[tuple[int, int]]) -> bool:
        """SIGKILL each of ``alive``; whether one is a straggler not seen before (added to ``killed``)."""
        fresh = False
        for info in alive:
            handle = self._handle(info)
            key = (info.pid, info.starttime)
            # Not one already killed with the tree (and still dying): a straggler.
            if handle is not None and handle.send(signal.SIGKILL) and key not in self._sigkilled | killed:
                killed.add(key)
                fresh = True
        return fresh

    async def _pause(self, seconds: float) -> None:
        """Until the child or a held process exits, or ``seconds`` pass; a moment when none is left."""
        pending = [h for h in self._handles.values() if not h.exited()]
        if self.child.status is None:
            await within(self.child.wait(), seconds)
        elif pending:
            await within(any_exit(pending), seconds)
        else:
            await asyncio.sleep(0.005)

    # ----------------------------------------------------------------- the sandbox

    def record(
        self, sig: signal.Signals, target: Literal["group", "descendants"], reason: SignalReason
    ) -> None:
        """Note a signal sent, for the receipt."""
        self.signals.append(SignalEvent(signal=sig.name, target=target, at=time.time(), reason=reason))

    def adopt_sandbox_init(self, pid: int) -> None:
        """Hold the sandbox's (outermost) init, as bwrap's status names it, if it is this rollout's.

        Holding a pidfd on it from the start lets the supervisor find the sandbox's
        processes, kill the whole PID namespace at once, and reap the init if bwrap's
        monitor exits before it (it is then reparented here).
        """
        info = read_proc(pid)
        # The token proves it is this rollout's process and not a PID reused since bwrap wrote it.
        if info is None or not info.alive or not environ_has(pid, self.marked):
            return
        handle = self._handle(info)
        if handle is not None:
            self._sandbox_init = handle
            if self.budgets is not None:
                self.budgets.set_sandbox_root(pid)
            if not self.warm:
                self._locate_task = asyncio.ensure_future(self._locate_group_leader())

    def went_cold(self) -> None:
        """A warm start fell back to cold (its holder became the worker): find the worker's group as a
        cold start's, under the sandbox's innermost init."""
        self.warm = False
        if self._sandbox_init is not None and self._locate_task is None:
            self._locate_task = asyncio.ensure_future(self._locate_group_leader())

    def adopt_worker(self, worker: PidHandle) -> None:
        """Hold a warm worker, forked into the sandbox, as the leader of the worker's process group."""
        if self._group_leader is not None:
            self._group_leader.close()
        self._group_leader = worker

    async def aclose(self) -> None:
        """Stop looking for the group leader and close every pidfd held.

        **Cancellation:** the pidfds are closed whatever happens; the search's end may not be awaited.
        """
        try:
            await cancel_and_wait(self._locate_task)
        finally:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()
            if self._group_leader is not None:
                self._group_leader.close()
                self._group_leader = None

    async def _locate_group_leader(self) -> None:
        """Hold a pidfd on the leader of the worker's process group as soon as the sandbox has one.

        With it, the deadline's SIGTERM goes out at once, from the event loop, to the
        whole group (``pidfd_send_signal``), rather than after a walk of ``/proc``
        that a loaded machine can delay by seconds. Polls briefly while the sandbox
        starts (its inner stages appear one after another).
        """
        pause = 0.01
        while self._group_leader is None and self.child.status is None:
            self._group_leader = await in_proc_thread(self._find_group_leader)
            if self._group_leader is None:
                await asyncio.sleep(pause)
                pause = min(2 * pause, 0.5)

    def _find_group_leader(self) -> PidHandle | None:
        """The innermost sandbox init, once the worker is in its group (blocking; a thread)."""
        init = self._sandbox_init
        if init is None:
            return None
        tree = [info for info in subtree([init.info.pid]) if info.alive]
        leader = _innermost_init(tree)
        if leader is None or not any(info.pgid == leader.pid and info.pid != leader.pid for info in tree):
            return None
        return PidHandle.open(leader)

    async def _worker_group(self) -> list[ProcInfo]:
        """The worker's process group, by a walk of ``/proc`` (where a pidfd cannot signal a group)."""
        leader = self._group_leader
        if not self.warm:
            return await self._sandbox_group()
        if leader is None:
            return []  # not started yet: the sandbox holds only its holder, which the polite signals spare
        tree = await in_proc_thread(subtree, [leader.info.pid])
        return [info for info in tree if info.alive and info.pgid == leader.info.pid]

    async def _sandbox_group(self) -> list[ProcInfo]:
        """Under bwrap: the worker's process group inside the sandbox (empty before the sandbox exists).

        The worker runs under the innermost PID namespace's init, which bwrap's
        ``--new-session`` makes a session and group leader; the worker stays in its
        group. That init is the tree's process with the deepest ``NSpid`` ending in 1;
        it is left out (it only reaps).
        """
        init = self._sandbox_init
        if init is None:
            return []
        tree = [info for info in await in_proc_thread(subtree, [init.info.pid]) if info.alive]
        leader = await in_proc_thread(_innermost_init, tree)
        if leader is None:
            return []
        return [info for info in tree if info.pgid == leader.pid and info.pid != leader.pid]

    async def _members(self) -> list[ProcInfo]:
        """The worker's process tree (its direct child included), the reparented stragglers, and
        everything in the rollout's cgroups."""
        child, budgets, init = self.child, self.budgets, self._sandbox_init
        worker = self._group_leader if self.warm else None

        def walk() -> list[ProcInfo]:
            roots = [child.pid, *(budgets.members() if budgets is not None else [])]
            for held in (init, worker):
                if held is None:
                    continue
                now = read_proc(held.info.pid)
                # Once reaped, a PID may name another process: only the one we hold is a root.
                # (A warm worker's parent is the supervisor, outside the sandbox's tree.)
                if now is not None and now.starttime == held.info.starttime:
                    roots.append(now.pid)
            # Walked from the rollout's own roots, not by reading every process on the machine.
            return tree_of(roots, marked=self.marked)

        return await in_proc_thread(walk)

    def _handle(self, info: ProcInfo) -> PidHandle | None:
        key = (info.pid, info.starttime)
        handle = self._handles.get(key)
        if handle is None:
            handle = PidHandle.open(info)
            if handle is not None:
                self._handles[key] = handle
        return handle


def _reason(reason: str) -> SignalReason:
    if reason in get_args(SignalReason):
        return cast(SignalReason, reason)
    raise ValueError(f"not a reason a signal is recorded for: {reason!r}")


def _innermost_init(tree: list[ProcInfo]) -> ProcInfo | None:
    """The deepest PID namespace's init among ``tree`` (blocking: reads ``/proc``); ``None`` if none."""
    depth: dict[int, int] = {}
    for info in tree:
        nspid = ns_pids(info.pid)
        if nspid[-1:] == (1,):
            depth[info.pid] = len(nspid)
    inits = [info for info in tree if info.pid in depth]
    return max(inits, key=lambda info: depth[info.pid]) if inits else None
