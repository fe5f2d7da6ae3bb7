"""The ``launch`` step of one supervision: the worker's plan, its spawn, and a warm start's hand-over.

:mod:`rollcage.supervisor.core` draws the sequence (check, prepare, launch, watch, stop, clean up,
collect, receipt); this module is its launch, cold or warm:

* :meth:`Launch.choose`: whether the worker is forked from a warm template
  (:mod:`rollcage.warm`) or started cold (a predicate per sandbox: bwrap as root, bwrap without
  root through the user namespaces it made as this uid, and ``--sandbox none``, whose worker is
  forked uncaged beside a holder);
* :meth:`Launch.plan`: the launcher's plan (bubblewrap's command line, or a plain child);
* :meth:`Launch.start`: bubblewrap (or the worker) spawned from the launcher's thread, held
  as a :class:`~rollcage.supervisor.tree.WorkerTree`; for a warm start, its holder's socket
  (:class:`~rollcage.supervisor.warm.WarmStart`);
* :meth:`Launch.follow`: bubblewrap's status (the sandbox's init, held by the tree) and the
  warm start itself: the template forks the worker into the cage, the tree adopts it, and its
  exit status goes back to the holder;
* :meth:`Launch.aclose`: the tasks ended, the warm start's sockets closed, whatever happened.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import orjson

from rollcage.budgets import RolloutBudgets, Scratch
from rollcage.cage import launcher
from rollcage.errors import SandboxError, SupervisorError
from rollcage.forkserver import pass_fds_problem
from rollcage.procs import ChildProcess, cancel_and_wait, read_ready
from rollcage.protocol import SignalEvent
from rollcage.runfiles import RolloutLayout
from rollcage.supervisor.config import TOKEN_ENV, BwrapSandbox, NoSandbox, SupervisorConfig
from rollcage.supervisor.sandbox import BwrapLauncher, LaunchPlan, NoSandboxLauncher
from rollcage.supervisor.tree import WorkerTree
from rollcage.supervisor.warm import (
    Template,
    WarmStart,
    cage_mounts,
    refuse_cage_mounts,
    refuse_userns,
    template_for,
    userns_entry,
)

__all__ = ["Launch"]

logger = logging.getLogger("rollcage.supervisor")

_LAUNCH_TIMEOUT_S = 60.0
"""How long a launch may wait for the launcher thread (milliseconds when all is well)."""


class Launch:
    """One rollout's launch: its plan, the process spawned, and (warm) the worker forked into the cage.

    Args:
        config: The supervision's configuration.
        launcher: The sandbox's launcher (checked already).
        token: The rollout's supervision token (its processes carry it in their environment).
        rollout_id: For the log.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        launcher: BwrapLauncher | NoSandboxLauncher,
        *,
        token: str,
        rollout_id: str,
    ) -> None:
        self.config = config
        self.launcher = launcher
        self.marked = f"{TOKEN_ENV}={token}"
        self.rollout_id = rollout_id
        self.template: Template | None = None
        """The warm template the worker is forked from (its bytecode cache's); ``None``: cold."""
        self.plan: LaunchPlan | None = None
        self.child: ChildProcess | None = None
        """What was spawned: bubblewrap, or the worker itself."""
        self.tree: WorkerTree | None = None
        """The worker's process tree, once it is started."""
        self._warm: WarmStart | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._failed: Callable[[str], None] = lambda _: None

    def choose(self, bytecode: str | None, *, pass_fds: Sequence[int] = ()) -> None:
        """Fork this rollout's worker from a warm template (:mod:`rollcage.warm`), or start it cold.

        Warm only where its start is equivalent and tested: rollcage's own worker, and a sandbox whose
        warm start is (:meth:`_warm_bwrap`, :meth:`_warm_userns`, :meth:`_warm_none`). ``pass_fds``,
        the descriptors the worker inherits (a harness rollout's relay to the supervisor), travel
        with every warm start (:attr:`~rollcage.forkserver.WorkerStart.pass_fds`); a start that
        cannot carry them (more than :data:`~rollcage.forkserver.MAX_PASS_FDS`, a standard
        descriptor's number) is refused here, and the worker starts cold, inheriting them as a cold
        worker does.
        """
        self.template = None
        if self.config.worker_command is not None:
            return
        if self._warm_bwrap() or self._warm_userns():
            thread = None
        elif self._warm_none():
            # The worker's parent-death signal is the thread's that started the template: one
            # template per such thread, as a cold worker's is the thread's that spawns it.
            thread = threading.get_ident()
        else:
            return
        problem = pass_fds_problem(pass_fds) if pass_fds else None
        if problem is not None:
            logger.warning("rollout %s: started cold, not warm: %s", self.rollout_id, problem)
            return
        self.template = template_for(bytecode, thread=thread)

    def _warm_bwrap(self) -> bool:
        """bwrap's warm start: as root (two stages), into the cage bwrap made."""
        sandbox, launcher = self.config.sandbox, self.launcher
        return (
            isinstance(sandbox, BwrapSandbox)
            and sandbox.worker_start == "warm"
            and isinstance(launcher, BwrapLauncher)
            and launcher.owner is not None
        )

    def _warm_userns(self) -> bool:
        """bwrap's warm start without root: into the user namespaces bwrap made as this uid, through a
        go-between (:mod:`rollcage.warm`); not once the kernel has refused one in this process."""
        sandbox, launcher = self.config.sandbox, self.launcher
        return (
            os.geteuid() != 0
            and isinstance(sandbox, BwrapSandbox)
            and sandbox.worker_start == "warm"
            and isinstance(launcher, BwrapLauncher)
            and launcher.enters_warm
            and userns_entry()
        )

    def _warm_none(self) -> bool:
        """``--sandbox none``'s warm start: the worker forked beside a holder, uncaged, as any user."""
        sandbox = self.config.sandbox
        return (
            isinstance(sandbox, NoSandbox)
            and sandbox.worker_start == "warm"
            and isinstance(self.launcher, NoSandboxLauncher)
        )

    @property
    def scratch_in_cage(self) -> bool:
        """Whether the worker mounts the cage's ``/tmp`` and ``/dev/shm`` itself (a warm start, where no
        earlier one was refused): the host's mount table, which every launch copies and reads again,
        then holds one mount per rollout in flight, not three."""
        return self.template is not None and cage_mounts()

    def plan_for(
        self,
        layout: RolloutLayout,
        *,
        command: Sequence[str],
        env: dict[str, str],
        token_env: dict[str, str],
        status_fd: int | None,
        pass_fds: Sequence[int],
        extra_ro: Sequence[str],
        worker_journal: bool,
        budgets: RolloutBudgets | None,
        scratch: Scratch | None,
        image_root: str | None = None,
    ) -> LaunchPlan:
        """The launcher's plan for the worker (bwrap's needs ``budgets`` and ``scratch``).

        ``image_root``: an image rollout's mounted copy-on-write root, bound into the worker's cage.
        """
        if isinstance(self.launcher, BwrapLauncher):
            assert budgets is not None
            self.plan = self.launcher.plan(
                layout,
                worker_command=command,
                worker_env=env,
                token_env=token_env,
                status_fd=status_fd,
                scratch=scratch,
                enter=budgets.enter_prefix(),
                extra_ro=extra_ro,
                worker_journal=worker_journal,
                pass_fds=pass_fds,
                warm_cgroups=budgets.cgroup_procs() if self.template is not None else None,
                image_root=None if image_root is None else Path(image_root),
            )
        else:
            if image_root is not None:
                raise SandboxError("an image rollout needs the bwrap sandbox (--sandbox none has no cage)")
            self.plan = self.launcher.plan(
                layout,
                worker_command=command,
                worker_env=env,
                token_env=token_env,
                pass_fds=pass_fds,
                warm=self.template is not None,
            )
        return self.plan

    def start(
        self,
        plan: LaunchPlan,
        *,
        log_fd: int,
        status_fd: int | None,
        budgets: RolloutBudgets | None,
        signals: list[SignalEvent],
    ) -> WorkerTree:
        """Spawn what the plan runs (bubblewrap from the launcher's thread, or the worker); its tree.

        A warm start's holder reads the worker's exit status on its socket and announces itself there;
        bwrap's own words go to the log either way.

        Raises:
            SupervisorError: It could not be spawned.
        """
        # A warm worker's descriptors go with its start to the template. Where the holder runs the cold
        # worker should the warm start fail (without root, --sandbox none), it holds them too, at their
        # numbers, for that worker (a shell cannot close a number past 9 when the warm one is running).
        fallback = plan.warm is not None and (plan.warm.userns or not plan.warm.caged)
        inherited = plan.pass_fds if plan.warm is None or fallback else ()
        pass_fds = (*(() if status_fd is None else (status_fd,)), *inherited)
        warm = None
        try:
            if plan.warm is not None:
                assert self.template is not None
                # Its imports overlap the making of the cage (the first time only). The process's
                # template is started by its keeper thread, so it outlives this rollout's thread (a
                # Ray node runs each rollout on one); --sandbox none's is this thread's own.
                self.template.start()
                self._warm = warm = WarmStart(plan.pass_fds)
            spawn = functools.partial(
                ChildProcess.spawn,
                plan.argv,
                env=plan.env,
                cwd=plan.cwd,
                stdin=None if warm is None else warm.holder_stdin,
                stdout=log_fd if warm is None else warm.holder_stdout,
                stderr=log_fd,
                pass_fds=pass_fds,
            )
            # bubblewrap from a mount namespace without the other rollouts' mounts (rollcage.cage's
            # launcher): its launch then costs the same however many rollouts are in flight.
            binds = budgets.launch_binds() if plan.sandbox == "bwrap" and budgets is not None else None
            # An image rollout's root (an overlay, not one of rollcage's tmpfs) is in the host's
            # mount table, so the launcher's base, made again when that table changes, holds it: no
            # bind here (a detached copy of an overlay cannot be attached in the launch's namespace).
            self.child = launcher().run(spawn, binds, timeout_s=_LAUNCH_TIMEOUT_S, late=ChildProcess.abandon)
            if warm is not None:
                warm.spawned()
        except OSError as exc:
            raise SupervisorError(f"cannot start the worker ({plan.argv[0]}): {exc}") from exc
        self.tree = WorkerTree(
            self.child,
            sandbox=plan.sandbox,
            marked=self.marked,
            budgets=budgets,
            signals=signals,
            warm=plan.warm is not None,
        )
        logger.debug("rollout %s: worker started (pid %d, %s)", self.rollout_id, self.child.pid, plan.sandbox)
        return self.tree

    def follow(
        self,
        status_fd: int | None,
        *,
        log_fd: int,
        deadline_at: float,
        budgets: RolloutBudgets | None,
        failed: Callable[[str], None],
    ) -> None:
        """Follow the start in the background: bwrap's status on ``status_fd`` (taken: closed when read),
        and a warm start's hand-over (``failed`` is told why a warm worker was not started)."""
        if status_fd is not None:
            self._tasks.append(asyncio.ensure_future(self._read_bwrap_status(status_fd)))
        if self._warm is not None:
            start = self._start_warm(self._warm, log_fd=log_fd, deadline_at=deadline_at, budgets=budgets)
            self._tasks.append(asyncio.ensure_future(start))
            self._failed = failed

    async def aclose(self) -> None:
        """End the start's tasks and close the warm start's sockets (ending a worker not reaped yet).

        **Cancellation:** run shielded by the caller (``finish``); what is left is left to ``close``.
        """
        try:
            await cancel_and_wait(*self._tasks)
        finally:
            # ``failed`` is the supervision's (a bound method), and the supervision holds this launch:
            # dropped once closed, the pair goes with its last reference, not at a full collection.
            self._failed = lambda _: None
        if self._warm is not None:
            self._warm.close()

    async def _start_warm(
        self, warm: WarmStart, *, log_fd: int, deadline_at: float, budgets: RolloutBudgets | None
    ) -> None:
        """Have the template fork the worker into the cage once its holder is there; hold the worker,
        then pass its exit status to the holder (the worker is this process's child)."""
        plan, tree, template = self.plan, self.tree, self.template
        assert plan is not None and plan.warm is not None and tree is not None and template is not None
        try:
            worker = await warm.start(
                template,
                plan.warm,
                log_fd=log_fd,
                marked=self.marked,
                timeout_s=max(deadline_at - time.monotonic(), 0.0),
            )
            roots = warm.take_roots()
            if roots and budgets is not None:
                budgets.hold_cage_scratch(roots)
            else:
                for fd in roots:
                    os.close(fd)
            uncaged = not plan.warm.caged
            # The kernel refused a non-root start's entry into its cage, before any worker ran: its
            # holder runs the cold worker in the cage bwrap made as for a cold start.
            fallback = plan.warm.userns and warm.refused
            if worker is not None:
                tree.adopt_worker(worker)
            elif warm.failure is not None and uncaged:
                # Nothing contains an uncaged worker that a cold start would not: its holder runs it.
                logger.warning("rollout %s: %s; the worker starts cold", self.rollout_id, warm.failure)
            elif warm.failure is not None and fallback:
                if warm.kernel_refused:
                    # The next would be refused alike: this process's later starts are cold (one warning).
                    refuse_userns(warm.failure)
                    logger.debug("rollout %s: %s; the worker starts cold", self.rollout_id, warm.failure)
                else:
                    logger.warning("rollout %s: %s; the worker starts cold", self.rollout_id, warm.failure)
                tree.went_cold()
            elif warm.failure is not None:
                if warm.mount_refused:
                    refuse_cage_mounts(warm.failure)
                # Its holder exits with 125 and no result: the receipt says why, as for any failed start.
                logger.error("rollout %s: %s", self.rollout_id, warm.failure)
                self._failed(warm.failure)
            await warm.relay(uncaged=uncaged, cold=uncaged or fallback)
        finally:
            warm.close()

    async def _read_bwrap_status(self, fd: int) -> None:
        """Read bwrap's JSON status: its first document names the sandbox's (outermost) init process."""
        os.set_blocking(fd, False)
        buffer = b""
        try:
            while True:
                chunk = await read_ready(fd, 4096)
                if not chunk:
                    return
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    try:
                        document = orjson.loads(line)
                    except orjson.JSONDecodeError:
                        continue
                    if isinstance(document, dict) and isinstance(document.get("child-pid"), int):
                        assert self.tree is not None  # read only once the worker is started
                        self.tree.adopt_sandbox_init(document["child-pid"])
        finally:
            os.close(fd)
