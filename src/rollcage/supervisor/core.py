"""``supervise()``: run one prepared rollout directory to its receipt.

The sequence, for one rollout::

    check      the rollout directory and the sandbox (errors raised before anything is written)
    prepare    validate input.json, start the egress proxy, write the worker's view of the input,
               make the rollout's budgets (cgroups, bounded file systems; see budgets.py)
    launch     the worker in a new session (bwrap or plain), stdout+stderr to worker.log; forked from
               the warm template into its cage where it can be (launch.py, warm.py)
    watch      until it exits, the deadline passes, a budget is exceeded, or a stop arrives
    stop       SIGTERM to the worker's process group (at once, through a pidfd held since launch),
               grace, SIGKILL to the whole tree
    clean up   find every remaining descendant (/proc, the cgroups), SIGKILL it, reap it; confirm none left
    collect    the budgets' last reading, the workspace back from its bounded file system, result.json
               into the rollout directory, leftover temporary files swept, journal's last seq
    receipt    classify the outcome (one pure function), publish receipt.json atomically, last

Many rollouts can be supervised concurrently in one event loop: all state is
per call. The only process-wide change is the child-subreaper flag, set once;
descendants are told apart by a per-rollout token in their environment.
The open-file limit is raised to its hard limit once, and the egress proxies
share what it affords (:mod:`rollcage.supervisor.fds`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import orjson
from pydantic import ValidationError

from rollcage.budgets import (
    BUDGETS_RECORD,
    RolloutBudgets,
    Scratch,
    owner_tag,
    private_parent,
    release_leftovers,
    remove_staged_view,
    sweep_orphans,
    watch_budget,
)
from rollcage.durable import publish_bytes, publish_json, read_journal, sweep_temp_artifacts
from rollcage.errors import (
    ConfigError,
    HeaderValueError,
    JournalCorruptError,
    RollcageError,
    SupervisorError,
)
from rollcage.harness import GRACE_ENV, RELAY_FD_ENV, CaptureJournal
from rollcage.headers import header_value
from rollcage.procs import (
    ChildProcess,
    ExitStatus,
    PidHandle,
    StopPhase,
    StopStrategy,
    TreeStop,
    cancel_and_wait,
    ensure_subreaper,
    environ_has,
    first_of,
    scan_processes,
    shielded,
    within,
)
from rollcage.protocol import (
    SignalEvent,
    SupervisorReceipt,
    WorkerInput,
    WorkerResult,
    describe_validation_error,
)
from rollcage.runfiles import RolloutLayout
from rollcage.supervisor.bytecode import worker_bytecode
from rollcage.supervisor.config import TOKEN_ENV, BwrapSandbox, SupervisorConfig
from rollcage.supervisor.fds import raise_open_file_limit, retry_on_emfile
from rollcage.supervisor.imageroot import ImageRoot, mount_image_root, release_image_root
from rollcage.supervisor.launch import Launch
from rollcage.supervisor.outcome import OutcomeEvidence, classify_outcome
from rollcage.supervisor.pacing import START_HOLD_S, start_gate
from rollcage.supervisor.proxy import MODEL_PREFIX, EgressProxy, identity_headers, routes_for, sandbox_input
from rollcage.supervisor.sandbox import (
    BwrapLauncher,
    LaunchPlan,
    NoSandboxLauncher,
    worker_environment,
)
from rollcage.supervisor.stopfiles import watch_stop_file
from rollcage.supervisor.tree import WorkerTree

__all__ = ["Supervised", "default_worker_command", "kill_leftovers", "supervise", "supervise_rollout"]

logger = logging.getLogger("rollcage.supervisor")

_Cause = Literal["deadline", "stop", "budget"]
_MAX_RESULT_BYTES = 1 << 30
_LOG_TAIL_BYTES = 4096


def kill_leftovers(rollout_dir: str | os.PathLike[str]) -> int:
    """Kill what a SIGKILLed supervisor left running for this rollout; return how many were killed.

    A supervisor that is itself killed cannot reap its worker, and bubblewrap's
    parent-death signal can miss a sandbox that was starting at that moment. Each
    rollout's processes carry its supervision token (recorded in the staging area,
    out of the sandbox's reach), so a later run can find them without guessing by
    name. A rollout with no token file (finished, or never launched) has nothing left.
    Blocking: run it in a thread.
    """
    layout = RolloutLayout(Path(rollout_dir))
    try:
        token, home = _read_token(layout)
    except OSError:
        _release_leftovers(layout)
        return 0
    if _copied_from_live_original(layout, token, home):
        # A copy of a rollout directory whose original still holds the token: the processes,
        # mounts and cgroups it names are the original's (perhaps a live run's), never this copy's.
        with contextlib.suppress(OSError):
            layout.token.unlink()
        return 0
    killed = 0
    marked = f"{TOKEN_ENV}={token}"
    for info in scan_processes().values():
        if info.pid == os.getpid() or not info.alive or not environ_has(info.pid, marked):
            continue
        handle = PidHandle.open(info)
        if handle is None:
            continue
        try:
            killed += handle.send(signal.SIGKILL)
        finally:
            handle.close()
    # Its mounts and cgroups go once nothing is left inside.
    _release_leftovers(layout)
    with contextlib.suppress(OSError):
        layout.token.unlink()
    return killed


def _release_leftovers(layout: RolloutLayout) -> None:
    """Release what a killed supervisor left for this rollout: its image root, then its budgets' leftovers.

    Blocking; idempotent; never raises (the image root's ``changes/`` stays: it is evidence).
    """
    with contextlib.suppress(OSError, RollcageError):
        release_image_root(layout.root)
    release_leftovers(layout)


def _write_token(layout: RolloutLayout, token: str) -> None:
    """The token file: the token, then the real path of the rollout directory it was written in."""
    layout.token.write_text(f"{token}\n{os.path.realpath(layout.root)}\n")


def _read_token(layout: RolloutLayout) -> tuple[str, str | None]:
    """The token and the directory it was written in (``None``: not recorded, an older file)."""
    lines = layout.token.read_text().split("\n")
    return lines[0].strip(), (lines[1] if len(lines) > 1 and lines[1] else None)


def _copied_from_live_original(layout: RolloutLayout, token: str, home: str | None) -> bool:
    """Whether this rollout directory is a copy whose original, elsewhere, still holds ``token``."""
    if home is None or home == os.path.realpath(layout.root):
        return False
    try:
        return _read_token(RolloutLayout(Path(home)))[0] == token
    except OSError:
        return False  # the original is gone (moved here, or finished): what is left is this one's


def default_worker_command(bytecode: str | None = None) -> list[str]:
    """The real worker, run by this interpreter in isolated mode (``-I``: cwd and PYTHON* ignored).

    Args:
        bytecode: A compiled bytecode cache (:func:`~rollcage.supervisor.bytecode.worker_bytecode`)
            the worker reads its ``.pyc`` files from; ``None``: none.
    """
    prefix = ["-X", f"pycache_prefix={bytecode}"] if bytecode is not None else []
    return [sys.executable, "-I", "-B", *prefix, "-m", "rollcage", "worker"]


class Supervised(NamedTuple):
    """What supervising one rollout produced: its receipt and its result, parsed once.

    Attributes:
        receipt: The receipt, as written to ``receipt.json``.
        result: ``result.json`` as validated for the receipt (``receipt.result_valid``);
            ``None`` when there is no valid one. Callers use it instead of reading the
            file again.
    """

    receipt: SupervisorReceipt
    result: WorkerResult | None


async def supervise(
    rollout_dir: str | os.PathLike[str],
    config: SupervisorConfig | None = None,
    *,
    stop: asyncio.Event | None = None,
    credentials: Mapping[str, str] | None = None,
) -> SupervisorReceipt:
    """Run the worker on one prepared rollout directory and return its receipt.

    ``supervise_rollout`` does the same and also returns the validated result.

    **Cancellation:** as for ``supervise_rollout``.
    """
    return (await supervise_rollout(rollout_dir, config, stop=stop, credentials=credentials)).receipt


async def supervise_rollout(
    rollout_dir: str | os.PathLike[str],
    config: SupervisorConfig | None = None,
    *,
    stop: asyncio.Event | None = None,
    credentials: Mapping[str, str] | None = None,
) -> Supervised:
    """Run the worker on one prepared rollout directory; return its receipt and its parsed result.

    The directory must hold ``input.json`` (a ``WorkerInput`` with endpoints as
    the host reaches them) and may hold ``workspace/``; it must not hold a
    ``result.json`` or ``receipt.json`` already (one directory per attempt). The
    worker gets one wall-clock deadline (``config.deadline_s``, counted from this
    call); at the deadline, or on a stop, it gets SIGTERM, then after
    ``config.grace_s`` SIGKILL with its whole process tree. Whatever happens,
    ``receipt.json`` is written last, atomically, and returned.

    Args:
        rollout_dir: The rollout directory.
        config: How to supervise; ``None``: the defaults (bubblewrap, 600 s).
        stop: Set it to stop the rollout early (outcome ``cancelled``). A file
            named ``stop`` in the rollout directory has the same effect.
        credentials: Where the credential variables the config names are read:
            ``None``, this process's environment; else this mapping, so a caller that
            holds a key in memory (the Ray backend) never puts it in an environment
            that every child process inherits.

    Returns:
        The receipt, as written to ``receipt.json``, and the result it was classified by.

    Raises:
        ConfigError: The directory is missing or was already used, or a credential
            variable named in the config is not set. Nothing was written.
        SandboxError: bubblewrap was asked for (the default) and cannot be used.
            Nothing was written.
        SupervisorError: The machinery itself failed (the worker could not be
            started, a file could not be written); no receipt may exist.

    **Cancellation:** cancelling the caller is a stop: the worker gets SIGTERM,
    the grace period and SIGKILL, the tree is reaped and the receipt (outcome
    ``cancelled``) is written, shielded from further cancellation, and then
    ``CancelledError`` propagates. A second cancellation skips what is left of
    the grace period. The wait is bounded by ``grace_s + 2 * kill_wait_s`` (plus
    up to a second for a sandbox to wind down) and the time to write the receipt.
    """
    run = _Supervision(Path(rollout_dir), config or SupervisorConfig(), stop, credentials)
    await asyncio.to_thread(run.check)
    cancelled = False
    try:
        await run.run()
    except asyncio.CancelledError:
        cancelled = True
    except Exception as exc:
        # The machinery failed (the worker cannot be started, a file cannot be written): still
        # stop whatever runs and write a receipt that says so, rather than leave a silent directory.
        logger.exception("rollout %s: the supervisor failed", run.rollout_id)
        run.setup_failure = f"the supervisor failed: {type(exc).__name__}: {exc}"
    # A cancellation while finishing is remembered (and raised after) and hurries the stop along.
    receipt = await shielded(run.finish(cancelled=cancelled), on_cancel=run.hurry)
    if cancelled:
        raise asyncio.CancelledError
    return Supervised(receipt, run.result)


class _Supervision:
    """The state of one ``supervise()`` call."""

    def __init__(
        self,
        root: Path,
        config: SupervisorConfig,
        stop: asyncio.Event | None,
        credentials: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.credential_source: Mapping[str, str] = os.environ if credentials is None else credentials
        self.layout = RolloutLayout(root)
        self.stop_event = stop
        self.started_at = time.time()
        self.t0 = time.monotonic()
        self.deadline_at = self.t0 + config.deadline_s
        self.token = secrets.token_hex(16)
        self.launcher: BwrapLauncher | NoSandboxLauncher = config.sandbox.launcher()
        self.rollout_id = root.name
        self.original: WorkerInput | None = None
        self.setup_failure: str | None = None
        self.launch = Launch(config, self.launcher, token=self.token, rollout_id=root.name)
        """The worker's plan, its spawn and (warm) its hand-over: :mod:`~rollcage.supervisor.launch`."""
        self.proxy: EgressProxy | None = None
        self.private_dir: str | None = None
        self.budgets: RolloutBudgets | None = None
        self.log_fd: int | None = None
        self.signals: list[SignalEvent] = []
        self.stop_cause: _Cause | None = None
        self.stop_requested = False
        self.deadline_fired = False
        self.tree: WorkerTree | None = None
        """The worker's process tree, once it is started (the launch's)."""
        self.stopping: TreeStop | None = None
        """Where stopping the tree stands (one state machine), once it is started."""
        self._hurried = False
        self.budget_task: asyncio.Task[None] | None = None
        self.start_task: asyncio.Task[None] | None = None
        self.turn: asyncio.Semaphore | None = None
        """The start-up slot this rollout holds (see pacing.py), until its worker has started up."""
        self._stop_seen: asyncio.Event | None = None
        """Set once the stop file is seen: run's one watch of it, from its first look to its end."""
        self.budget_exceeded: tuple[str, str] | None = None
        """The budget the policy exceeded first: its name and the reason in words."""
        self._over_budget = asyncio.Event()
        self.credentials: tuple[str | None, dict[str, str]] = (None, {})
        self.result: WorkerResult | None = None
        """The validated result.json, once collected."""
        self.result_keep_problem: str | None = None
        """Why the worker's result.json could not be kept in the rollout directory (a disk full)."""
        self.swept_at_start = 0
        """Temporary files a killed supervisor left in the rollout directory, removed at the start."""
        self.journal: CaptureJournal | None = None
        """A harness rollout's journal, written here from the capture (see :mod:`rollcage.harness`)."""
        self.relay_task: asyncio.Future[None] | None = None
        self.image_root: ImageRoot | None = None
        """An image rollout's mounted copy-on-write root (:mod:`rollcage.supervisor.imageroot`)."""

    # ----------------------------------------------------------------- check and prepare

    def check(self) -> None:
        """Refuse before writing anything (blocking; runs in a thread)."""
        root = self.layout.root.absolute()
        self.layout = RolloutLayout(root)
        if not root.is_dir():
            raise ConfigError(f"rollout directory {root} does not exist")
        # A supervisor SIGKILLed while publishing left temporary files (``.result.json.<hex>.tmp``):
        # evidence of nothing, removed whether or not this run goes on (only such names are touched).
        self.swept_at_start = sweep_temp_artifacts(root)
        for used in (self.layout.receipt, self.layout.result):
            if os.path.lexists(used):
                raise ConfigError(f"{used} already exists: each attempt needs a fresh rollout directory")
        self.launcher.check()
        key: str | None = None
        if self.config.api_key_env is not None:
            key = self.credential_source.get(self.config.api_key_env)
            if not key:
                raise ConfigError(
                    f"api_key_env names {self.config.api_key_env}, which is not set in the "
                    "supervisor's environment"
                )
            _check_credential(key, self.config.api_key_env)
        resource_keys: dict[str, str] = {}
        for name, variable in self.config.resource_api_key_envs.items():
            value = self.credential_source.get(variable)
            if not value:
                raise ConfigError(
                    f"resource_api_key_envs[{name!r}] names {variable}, which is not set in the supervisor's "
                    "environment"
                )
            _check_credential(value, variable)
            resource_keys[name] = value
        self.credentials = (key, resource_keys)

    def _read_input(self) -> None:
        try:
            raw = self.layout.input.read_bytes()
        except OSError as exc:
            self.setup_failure = f"the worker was not started: cannot read input.json: {exc}"
            return
        try:
            self.original = WorkerInput.model_validate_json(raw)
        except (ValidationError, RollcageError) as exc:
            # Decoded a second time only here: the receipt of an invalid input still names its rollout.
            with contextlib.suppress(orjson.JSONDecodeError):
                data = orjson.loads(raw)
                if isinstance(data, dict) and isinstance(data.get("rollout_id"), str) and data["rollout_id"]:
                    self.rollout_id = data["rollout_id"]
            problem = describe_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
            self.setup_failure = f"the worker was not started: input.json is invalid: {problem}"
            return
        self.rollout_id = self.original.rollout_id

    def _read_first(self) -> tuple[str | None, bool]:
        """Sweep what gone supervisors left (once per process), read input.json; (a missing harness
        path, whether the stop file is there already). Blocking: one thread hop for all of it."""
        if self.launcher.kind == "bwrap":
            # Once per process: what supervisors that are gone left on this machine (mounts, cgroups).
            sweep_orphans()
        retry_on_emfile(self._read_input)
        if self.setup_failure is not None or self.original is None:
            return None, False
        return _missing_harness_paths(self.original), os.path.exists(self.layout.stop)

    def _make_private_dir(self) -> tuple[str | None, str | None]:
        """(the supervisor's own directory, the worker's bytecode cache), either ``None`` if not needed.

        The directory holds the proxy socket and the bounded file systems' mount points; it is named
        for the rollout (its mounts say whose they are, in a table of every rollout's). Blocking.
        """
        # The cache first: nothing can fail once the directory exists, which finish() removes.
        bytecode = worker_bytecode() if self.config.worker_command is None else None
        private = None
        if self.config.proxy is not None or self.launcher.kind == "bwrap":
            private = tempfile.mkdtemp(**_private_dir_name(self.rollout_id, private_parent()))
        return private, bytecode

    def _prepare_budgets(self, budgets: RolloutBudgets, in_cage: bool) -> Scratch:
        """Write the token, then mount and make what the budgets need (blocking)."""
        # Before anything is mounted or made: if this supervisor is SIGKILLed from here on,
        # the next run finds the rollout by its token and releases what it left (kill_leftovers).
        self.layout.staging.mkdir(mode=0o700, exist_ok=True)
        _write_token(self.layout, self.token)
        return budgets.prepare(in_cage=in_cage)

    def _prepare_files(self, plan: LaunchPlan, worker_input: WorkerInput) -> None:
        layout = self.layout
        layout.staging.mkdir(mode=0o700, exist_ok=True)
        # Written before launch and removed with the staging area: if this supervisor is
        # SIGKILLed, the next run can still find (and kill) this rollout's processes by it.
        _write_token(layout, self.token)
        layout.workspace.mkdir(exist_ok=True)
        data = worker_input.model_dump_json().encode()
        fd = os.open(layout.worker_input, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, data)
            os.fchmod(fd, 0o644)
        finally:
            os.close(fd)
        if plan.sandbox == "bwrap":
            layout.worker_root.mkdir(mode=0o700, exist_ok=True)
            if plan.worker_journal:
                fd = os.open(layout.checkpoint, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
                os.close(fd)
        if plan.owner is not None:
            # The sandbox runs as an unprivileged host uid: hand it exactly what it may write.
            uid, gid = plan.owner
            os.chown(layout.worker_root, uid, gid)
            if plan.worker_journal:
                os.chown(layout.checkpoint, uid, gid, follow_symlinks=False)
            for directory, dirs, files in os.walk(layout.workspace):
                os.chown(directory, uid, gid, follow_symlinks=False)
                for name in [*dirs, *files]:
                    os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)

    def _stage(self, plan: LaunchPlan, worker_input: WorkerInput) -> int:
        """Lay out the files the sandbox shows, then open ``worker.log``; its descriptor (blocking)."""
        retry_on_emfile(self._prepare_files, plan, worker_input)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
        return retry_on_emfile(os.open, self.layout.log, flags, 0o600)

    # ----------------------------------------------------------------- run

    async def run(self) -> None:
        """Prepare, launch and watch the worker until it exits or has been stopped."""
        try:
            ensure_subreaper()
        except OSError as exc:
            raise SupervisorError(f"cannot become a child subreaper: {exc}") from exc
        raise_open_file_limit()
        # One thread hop for what the start reads first (each hop costs more than these reads).
        missing, stop_file = await asyncio.to_thread(self._read_first)
        if self.setup_failure is not None or self.original is None:
            return
        if missing is not None:
            self.setup_failure = (
                f"the worker was not started: the harness environment's {missing} does not exist on this "
                "machine (harness_env in input.json): 'rollcage harness install', or fix --harness-env"
            )
            return
        if stop_file or (self.stop_event is not None and self.stop_event.is_set()):
            self.stop_requested = True
            self.stop_cause = "stop"
            logger.info(
                "rollout %s: stop asked for before the start; the worker is not started", self.rollout_id
            )
            return
        # One watch of the stop file from here to the end (the first look was _read_first's).
        async with watch_stop_file(self.layout.stop, self.config.stop_poll_s, just_looked=True) as seen:
            self._stop_seen = seen
            try:
                await self._start_and_watch()
            finally:
                self._stop_seen = None  # no longer looked at

    async def _start_and_watch(self) -> None:
        """Wait for a start-up slot, prepare, launch and watch the worker (``run``'s, once it may start)."""
        assert self.original is not None
        if self.config.start_pacing == "cpus" and not await self._wait_turn():
            return
        self.private_dir, bytecode = await asyncio.to_thread(self._make_private_dir)
        if self.private_dir is not None:
            private = Path(self.private_dir)
            self.layout = RolloutLayout(
                self.layout.root,
                private / "proxy.sock" if self.config.proxy is not None else None,
                # The worker's view beside the proxy socket: made and removed off the rollout's disk.
                view=private if self.launcher.kind == "bwrap" else None,
            )
        env = worker_environment(
            allow=self.config.env_allow, extra=self.config.env, sandbox=self.launcher.kind
        )
        harness = self.original.agent.harness
        if harness is not None and harness.type != "builtin":
            # A harness gets part of the grace to report its partial episode; the worker needs the rest.
            env[GRACE_ENV] = repr(self.config.grace_s)
        relay_write = await self._open_journal()
        launch = self.launch
        launch.rollout_id = self.rollout_id
        launch.choose(bytecode, pass_fds=() if relay_write is None else (relay_write,))
        if relay_write is not None:
            env[RELAY_FD_ENV] = str(relay_write)
        harness_env = self.original.harness_env
        status_read, status_write = os.pipe() if self.launcher.kind == "bwrap" else (None, None)
        try:
            scratch = None
            if isinstance(self.launcher, BwrapLauncher):
                assert isinstance(self.config.sandbox, BwrapSandbox) and self.private_dir is not None
                self.budgets = RolloutBudgets(
                    self.config.sandbox,
                    self.layout,
                    Path(self.private_dir),
                    owner=self.launcher.owner,
                    name=f"rollcage-{owner_tag()}-{self.token[:12]}",
                )
                scratch = await asyncio.to_thread(self._prepare_budgets, self.budgets, launch.scratch_in_cage)
                if self.original.image is not None:
                    sandbox = self.config.sandbox
                    self.image_root = await asyncio.to_thread(
                        functools.partial(
                            mount_image_root,
                            self.original.image,
                            self.layout.root,
                            self.launcher.owner,
                            # What the rollout writes in the image counts as its workspace does.
                            max_bytes=sandbox.workspace_bytes,
                            max_inodes=sandbox.workspace_inodes,
                        )
                    )
            plan = launch.plan_for(
                self.layout,
                command=self.config.worker_command or default_worker_command(bytecode),
                env=env,
                token_env={TOKEN_ENV: self.token},
                status_fd=status_write,
                pass_fds=() if relay_write is None else (relay_write,),
                extra_ro=[
                    *(harness_env.mounts if harness_env is not None else []),
                    *([bytecode] if bytecode is not None else []),
                ],
                worker_journal=self.journal is None,
                budgets=self.budgets,
                scratch=scratch,
                image_root=None if self.image_root is None else str(self.image_root.merged),
            )
            await self._launch(plan, status_write)
        except BaseException:
            if status_read is not None:
                os.close(status_read)
            raise
        finally:
            # The launched bwrap (and the worker) hold their own copies now.
            for fd in (status_write, relay_write):
                if fd is not None:
                    os.close(fd)
        assert self.log_fd is not None and launch.child is not None
        launch.follow(
            status_read,
            log_fd=self.log_fd,
            deadline_at=self.deadline_at,
            budgets=self.budgets,
            failed=self._warm_start_failed,
        )
        if self.budgets is not None:
            self.budget_task = asyncio.ensure_future(self._watch_budgets())
        if self.turn is not None:
            self.start_task = asyncio.ensure_future(self._hold_turn())
        await self._watch(launch.child)

    def _warm_start_failed(self, failure: str) -> None:
        """No warm worker was started: the receipt says why, as for any failed start; unless the rollout
        was being stopped meanwhile (a start cut short by a deadline times out)."""
        if self.stop_cause is None:
            self.setup_failure = f"the worker was not started: {failure}"

    async def _open_journal(self) -> int | None:
        """For a harness rollout behind the proxy: this side's journal and the relay pipe's write end.

        A black-box harness leaves no evidence of its own that can be trusted, so the supervisor
        journals its model calls from the capture and the tool calls the worker relays (see
        :mod:`rollcage.harness`); the worker then writes no journal. ``None`` for the builtin loop.
        """
        original = self.original
        assert original is not None
        harness = original.agent.harness
        if self.config.proxy is None or harness is None or harness.type == "builtin":
            return None
        if not original.checkpoint.enabled:
            return None
        journal = CaptureJournal(
            self.layout.checkpoint, rollout_id=self.rollout_id, model_prefix=MODEL_PREFIX
        )
        try:
            await journal.__aenter__()
        except RollcageError as exc:
            # Evidence is best effort: the worker journals what it sees itself, as without a proxy.
            logger.error("rollout %s: cannot open the journal, the worker keeps it: %s", self.rollout_id, exc)
            return None
        self.journal = journal
        read, write = os.pipe()
        os.set_inheritable(write, True)
        self.relay_task = asyncio.ensure_future(journal.pump(read))
        return write

    async def _wait_turn(self) -> bool:
        """Wait for a start-up slot (see :mod:`~rollcage.supervisor.pacing`); False if stopped meanwhile.

        A stop (event or file) or the deadline while waiting ends the rollout before
        its worker is started, as a stop before the start does.
        """
        gate = start_gate()
        turn = asyncio.ensure_future(gate.acquire())
        stopped = asyncio.ensure_future(self._stop_arrives())
        try:
            await asyncio.wait(
                {turn, stopped},
                timeout=max(self.deadline_at - time.monotonic(), 0.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            await cancel_and_wait(turn, stopped)
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self.turn = gate
        was_stopped = stopped.done() and not stopped.cancelled()
        if self.turn is not None and not was_stopped:
            return True
        self._end_turn()
        if was_stopped:
            self.stop_requested = True
            self.stop_cause = "stop"
            logger.info("rollout %s: stopped while waiting to start; not started", self.rollout_id)
        else:
            self.deadline_fired = True
            self.stop_cause = "deadline"
            logger.info("rollout %s: the deadline passed while waiting to start", self.rollout_id)
        return False

    async def _hold_turn(self) -> None:
        """Keep the start-up slot until the worker's first request or START_HOLD_S.

        A worker that exits sooner gives it back as its rollout finishes (``finish``
        cancels this). Not ``child.wait()`` here: a second reader on the child's pidfd
        would take the place of ``_watch``'s.
        """
        try:
            if self.proxy is not None:
                await within(self.proxy.first_request.wait(), START_HOLD_S)
            else:
                await asyncio.sleep(START_HOLD_S)
        finally:
            self._end_turn()

    def _end_turn(self) -> None:
        if self.turn is not None:
            self.turn.release()
            self.turn = None

    async def _launch(self, plan: LaunchPlan, status_fd: int | None) -> None:
        """Start the egress proxy, lay out the sandbox's files, then spawn (:meth:`Launch.start`)."""
        assert self.original is not None
        worker_input = self.original
        if self.config.proxy is not None:
            assert self.layout.proxy_socket is not None and plan.proxy_socket is not None
            model_key, resource_keys = self.credentials
            self.proxy = EgressProxy(
                self.layout.proxy_socket,
                routes_for(self.original, model_credential=model_key, resource_credentials=resource_keys),
                capture_path=self.layout.capture,
                rollout_id=self.rollout_id,
                config=self.config.proxy,
                socket_owner=plan.owner,
                identity=identity_headers(self.original),
                on_budget_exceeded=self._budget_passed,
                on_capture=None if self.journal is None else self.journal.on_capture,
                model_call_limit=None if self.journal is None else self.original.agent.max_policy_calls,
            )
            await self.proxy.__aenter__()
            worker_input = sandbox_input(self.original, plan.proxy_socket)
        self.log_fd = await asyncio.to_thread(self._stage, plan, worker_input)
        self.tree = self.launch.start(
            plan,
            log_fd=self.log_fd,
            status_fd=status_fd,
            budgets=self.budgets,
            signals=self.signals,
        )
        self.stopping = TreeStop(
            self.tree, StopStrategy(grace_s=self.config.grace_s, kill_wait_s=self.config.kill_wait_s)
        )
        if self._hurried:
            self.stopping.hurry()

    async def _watch(self, child: ChildProcess) -> None:
        exited, stopped, _ = await first_of(
            child.wait(),
            self._stop_arrives(),
            self._over_budget.wait(),
            seconds=self.deadline_at - time.monotonic(),
        )
        if child.status is not None or not exited.cancelled():
            return
        if self._over_budget.is_set():
            await self._terminate("budget")
        else:
            await self._terminate("deadline" if stopped.cancelled() else "stop")

    async def _watch_budgets(self) -> None:
        """Read the sandbox's budgets until one is exceeded (then the rollout ends); never without budgets.

        Read with the other supervisions' of this loop, in one thread hop (see :mod:`.budgets`).
        """
        budgets = self.budgets
        if budgets is None:
            return
        assert isinstance(self.config.sandbox, BwrapSandbox)
        async with watch_budget(budgets.check, self.config.sandbox.budget_poll_s) as breach:
            budget, words = await breach
        self._budget_passed(budget, f"{budget}: {words}")

    def _budget_passed(self, budget: str, reason: str) -> None:
        """A per-rollout budget was exceeded: the rollout ends, as the policy's fault."""
        if self.budget_exceeded is None:
            self.budget_exceeded = (budget, reason)
            self._over_budget.set()

    async def _stop_arrives(self) -> None:
        """Return once a stop is asked for: the event, or the stop file (run's watch, :mod:`.stopfiles`)."""
        seen = self._stop_seen
        assert seen is not None, "waited for a stop outside run's watch of the stop file"
        if self.stop_event is None:
            await seen.wait()
        else:
            await first_of(seen.wait(), self.stop_event.wait())

    def hurry(self) -> None:
        """A second cancellation: skip what is left of the grace period."""
        self._hurried = True
        if self.stopping is not None:
            self.stopping.hurry()

    # ----------------------------------------------------------------- stopping

    async def _terminate(self, cause: _Cause) -> None:
        """SIGTERM the worker's process group, wait the grace period, SIGKILL the whole tree."""
        tree, stopping = self.tree, self.stopping
        assert tree is not None and stopping is not None
        if cause == "deadline":
            self.deadline_fired = True
        elif cause == "stop":
            self.stop_requested = True
        if self.stop_cause is None and cause != "budget":
            self.stop_cause = cause
        logger.info("rollout %s: %s; stopping the worker", self.rollout_id, cause)
        if stopping.phase is StopPhase.RUNNING and await stopping.terminate():
            tree.record(signal.SIGTERM, "group", cause)
            await stopping.wait_grace()
        if not tree.exited():
            await stopping.kill("grace_expired" if self.signals else cause)

    async def _stop_what_runs(self, tree: WorkerTree, stopping: TreeStop, *, cancelled: bool) -> None:
        """The worker still runs as the supervision ends: take the stop on from where it stands."""
        if cancelled and stopping.phase is StopPhase.RUNNING:
            await self._terminate("stop")
        elif stopping.phase is StopPhase.TERMINATING and stopping.grace_until is not None:
            # Cancelled during the grace period: the rest of it, unless cancelled again (hurry).
            await stopping.wait_grace()
            if not tree.exited():
                await stopping.kill("grace_expired")
        else:
            # The supervisor's own failure: no grace.
            await stopping.kill("stop")

    # ----------------------------------------------------------------- finish

    async def finish(self, *, cancelled: bool) -> SupervisorReceipt:
        """Stop what still runs, clean up, collect and write the receipt (shielded by the caller)."""
        tree, stopping = self.tree, self.stopping
        status: ExitStatus | None = None
        confirmed, killed = True, 0
        try:
            if tree is not None and stopping is not None:
                if not tree.exited():
                    await self._stop_what_runs(tree, stopping, cancelled=cancelled)
                confirmed = await stopping.sweep()
                killed = tree.stragglers_killed
                status = tree.child.release()
            elif cancelled and self.stop_cause is None:
                self.stop_requested = True
                self.stop_cause = "stop"
            await cancel_and_wait(self.budget_task)
            if self.budgets is not None:
                if not confirmed:
                    await asyncio.to_thread(self.budgets.kill)
                # The last reading, the workspace back into the rollout directory, mounts and cgroups gone.
                await asyncio.to_thread(self.budgets.finish)
                breach = self.budgets.breach
                if breach is not None and self.budget_exceeded is None:
                    # Seen only at the end (the worker was quicker than a poll, or the kernel killed it).
                    self.budget_exceeded = (breach[0], f"{breach[0]}: {breach[1]}")
        finally:
            await cancel_and_wait(self.budget_task, self.start_task)
            await self.launch.aclose()
            self._end_turn()
            if tree is not None:
                await tree.aclose()
            if self.log_fd is not None:
                os.close(self.log_fd)
                self.log_fd = None
            if self.proxy is not None:
                await self.proxy.aclose()
            if self.journal is not None:
                # After the proxy: every captured model call is journaled; then what the worker relayed.
                await self.journal.finish(self.relay_task)
            if self.private_dir is not None:
                with contextlib.suppress(OSError):
                    os.rmdir(self.private_dir)
            if self.image_root is not None:
                # Once nothing runs in it: unmounted, image.json written, changes/ kept as evidence.
                await asyncio.to_thread(self.image_root.finish)
        return await asyncio.to_thread(self._conclude, status, confirmed, killed)

    def _conclude(self, status: ExitStatus | None, confirmed: bool, killed: int) -> SupervisorReceipt:
        """Collect the evidence, classify and publish the receipt (blocking; runs in a thread)."""
        layout = self.layout
        present, result, problem = False, None, None
        swept = self.swept_at_start
        plan = self.launch.plan
        if plan is not None:
            present, result, problem = self._collect_result(plan)
            self.result = result
            swept += sum(map(sweep_temp_artifacts, {plan.result_dir, layout.root}))
        if layout.view is not None:
            # The private directory goes with its staged view, once the proxy socket and the budgets'
            # record are gone too (after a killed supervisor: by a later sweep).
            remove_staged_view(layout)
            with contextlib.suppress(OSError):
                layout.view.rmdir()
        if self.stop_cause is None and os.path.exists(layout.stop) and self.launch.child is not None:
            # The worker saw the stop file itself (it polls it too) and exited before we acted.
            self.stop_requested = True
            if result is None or result.error is not None:
                self.stop_cause = "stop"
        _remove_staging(layout, keep_record=self.budgets is not None and self.budgets.workspace_kept_mounted)
        journal = _journal_summary(layout.checkpoint)
        exit_code, exit_signal = self._exit(status)
        proxy = self.proxy
        evidence = OutcomeEvidence(
            stop_cause=self.stop_cause,
            deadline_s=self.config.deadline_s,
            exit_code=exit_code,
            exit_signal=exit_signal,
            signals_sent=tuple(event.signal for event in self.signals),
            result_present=present,
            result=result,
            result_problem=problem,
            setup_failure=self.setup_failure,
            log_tail=_log_tail(layout.log) if not present else None,
            budget_exceeded=None if self.budget_exceeded is None else self.budget_exceeded[1],
            journal_responses=max(journal.responses, proxy.captured["model"] if proxy is not None else 0),
            evidence_problem=self._evidence_problem(),
        )
        outcome, reason = classify_outcome(evidence)
        ended = time.time()
        receipt = SupervisorReceipt(
            rollout_id=self.rollout_id,
            outcome=outcome,
            outcome_reason=reason,
            sandbox=self.launcher.kind,
            exit_code=exit_code,
            exit_signal=exit_signal,
            deadline_s=self.config.deadline_s,
            grace_s=self.config.grace_s,
            deadline_fired=self.deadline_fired,
            stop_requested=self.stop_requested,
            signals_sent=list(self.signals),
            started_at=self.started_at,
            ended_at=ended,
            duration_s=ended - self.started_at,
            cleanup_confirmed=confirmed,
            descendants_killed=killed,
            temp_files_swept=swept,
            last_checkpoint_seq=journal.last_seq,
            result_present=present,
            result_valid=result is not None,
            result_error=None if result is None else result.error,
            model_calls_captured=None if proxy is None else proxy.captured["model"],
            capture_bytes=None if proxy is None else proxy.capture_bytes,
            capture_failures=None if proxy is None else proxy.capture_failures,
            proxy_connections_refused=None if proxy is None else proxy.refused,
            budget_exceeded=None if self.budget_exceeded is None else self.budget_exceeded[0],
            budgets=self.budgets.report() if self.budgets is not None else [],
            usage=self.budgets.usage() if self.budgets is not None else None,
        )
        try:
            retry_on_emfile(publish_json, layout.receipt, receipt, mode=0o644)
        except RollcageError as exc:
            raise SupervisorError(f"cannot write {layout.receipt}: {exc}") from exc
        logger.info("rollout %s: %s (%s)", self.rollout_id, outcome, reason)
        return receipt

    def _evidence_problem(self) -> str | None:
        """What of the evidence the supervisor could not keep on the disk (its own failure), in words."""
        problems = [self.result_keep_problem]
        if self.budgets is not None:
            problems.append(self.budgets.evidence_problem)
        found = [problem for problem in problems if problem is not None]
        return "; ".join(found) if found else None

    def _exit(self, status: ExitStatus | None) -> tuple[int | None, str | None]:
        if status is None:
            return None, None
        if status.signal is not None:
            return None, status.signal_name
        code = status.code
        if self.launcher.kind == "bwrap" and code is not None and code > 128:
            # bwrap reports a sandboxed process killed by signal N as exit code 128 + N.
            try:
                return None, signal.Signals(code - 128).name
            except ValueError:
                pass
        return code, None

    def _collect_result(self, plan: LaunchPlan) -> tuple[bool, WorkerResult | None, str | None]:
        """Move the worker's result.json into the rollout directory and validate it."""
        source = plan.result_dir / "result.json"
        try:
            info = os.lstat(source)
        except FileNotFoundError:
            return False, None, None
        if not stat.S_ISREG(info.st_mode):
            return True, None, "result.json is not a regular file (a link or special file is never followed)"
        try:
            fd = retry_on_emfile(os.open, source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as file:
                # Check the size first: read(n) allocates n bytes up front, whatever the file holds.
                if os.fstat(file.fileno()).st_size > _MAX_RESULT_BYTES:
                    return True, None, f"result.json is over {_MAX_RESULT_BYTES} bytes (not kept)"
                data = file.read()
        except OSError as exc:
            return True, None, f"cannot read result.json: {exc}"
        if len(data) > _MAX_RESULT_BYTES:
            return True, None, f"result.json is over {_MAX_RESULT_BYTES} bytes (not kept)"
        if source != self.layout.result:
            # Copied, byte for byte, from the staged view (another file system, as a rule) into R.
            # The file is synced here; the directory is synced once, by the receipt's publication
            # that follows in _conclude: nothing reads result.json as final before the receipt.
            try:
                publish_bytes(self.layout.result, data, mode=0o644, sync_directory=False)
            except RollcageError as exc:
                # The supervisor's own write failed (a disk full): the infrastructure's fault.
                self.result_keep_problem = (
                    f"the worker's result.json could not be kept in {self.layout.root}: {exc}"
                )
                return True, None, f"result.json could not be kept: {exc}"
        try:
            result = WorkerResult.model_validate_json(data)
        except ValidationError as exc:
            return True, None, describe_validation_error(exc)
        if result.rollout_id not in ("", self.rollout_id):
            return True, None, f"result.json is for rollout {result.rollout_id!r}, not {self.rollout_id!r}"
        return True, result, None


def _check_credential(value: str, variable: str) -> None:
    """Refuse a key the egress proxy could never send (a newline, a character beyond ISO-8859-1)."""
    try:
        header_value(f"Bearer {value}", what=f"the key in {variable}")
    except HeaderValueError as exc:
        raise ConfigError(f"{exc}; set {variable} to the key alone") from None


def _remove_staging(layout: RolloutLayout, *, keep_record: bool) -> None:
    """Remove the staging area; with ``keep_record``, all but the budgets' record (a mount it names stays)."""
    if not keep_record:
        shutil.rmtree(layout.staging, ignore_errors=True)
        return
    with contextlib.suppress(OSError), os.scandir(layout.staging) as entries:
        for entry in list(entries):
            if entry.name == BUDGETS_RECORD:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


_SUN_PATH_MAX = 107
"""The longest path a Unix socket can be bound at (``sun_path`` holds 108 bytes, NUL included)."""


def _private_dir_name(rollout_id: str, parent: str) -> dict[str, str]:
    """``mkdtemp``'s keywords for a supervisor's private directory under ``parent``.

    Named for the rollout (its mounts say whose they are, in a table of every rollout's) and
    its owner (:func:`owner_tag`), and short enough that the proxy socket in it fits
    ``sun_path``: the rollout's part is cut to the room a long ``TMPDIR`` (a Ray node's, say)
    leaves, and dropped when there is none; a parent too long even for that gives way to
    ``/tmp``, the socket being what the rollout cannot do without.
    """
    tag = owner_tag()
    fixed = len("/rollcage-") + len(f"-{tag}-") + 8 + len("/proxy.sock")  # 8: mkdtemp's suffix
    if len(os.fsencode(parent)) + fixed > _SUN_PATH_MAX:
        parent = "/tmp"
    room = _SUN_PATH_MAX - len(os.fsencode(parent)) - fixed - 1  # 1: the name's own "-"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", rollout_id)[: min(36, max(room, 0))]
    return {"prefix": f"rollcage-{name}-{tag}-" if name else f"rollcage-{tag}-", "dir": parent}


def _missing_harness_paths(original: WorkerInput) -> str | None:
    """The first path of the input's harness environment that does not exist here (blocking)."""
    env = original.harness_env
    if env is None:
        return None
    return next((path for path in [*env.mounts, env.python] if not os.path.exists(path)), None)


def _log_tail(path: Path) -> str | None:
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            size = file.tell()
            file.seek(max(0, size - _LOG_TAIL_BYTES))
            lines = [line.strip() for line in file.read().splitlines() if line.strip()]
    except OSError:
        return None
    if not lines:
        return None
    return lines[-1].decode("utf-8", "replace")[:300]


@dataclass(frozen=True)
class _JournalSummary:
    last_seq: int | None
    responses: int


def _journal_summary(path: Path) -> _JournalSummary:
    try:
        records = read_journal(path)
    except (OSError, JournalCorruptError) as exc:
        logger.warning("cannot read %s: %s", path, exc)
        return _JournalSummary(None, 0)
    if not records:
        return _JournalSummary(None, 0)
    seq = records[-1].get("seq")
    responses = sum(
        1
        for record in records
        if record.get("kind") == "model_call"
        and isinstance(record.get("model_call"), dict)
        and record["model_call"].get("status") != "failed"
    )
    return _JournalSummary(seq if isinstance(seq, int) else None, responses)
