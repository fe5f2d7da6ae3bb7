"""The persistent Python executor: one interface, two backends.

An :class:`Executor` owns one child process (a lean ``repl`` child or an
``ipykernel``) running a persistent namespace. Cells run one at a time; each has
a timeout. A cell past its timeout is interrupted (SIGINT to the child's process
group); if it does not stop within ``ExecutorSettings.interrupt_grace_s`` the
whole process group is killed and the next cell starts a fresh session, and the
model is told its state was lost (status ``restarted``).

The shared orchestration (lifecycle, timeouts, interrupt, kill, cancellation)
lives here; a backend supplies four primitives: launch, submit a cell,
interrupt, tear down. Backends are imported only when chosen, so the worker
never imports ``jupyter_client`` unless asked to.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import enum
import functools
import keyword
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict, Unpack

from rollcage.errors import ConfigError, ExecutorError, SandboxError
from rollcage.procs import AsyncClosing, shielded

if TYPE_CHECKING:
    from rollcage.protocol import ExecutorSettings

__all__ = [
    "BridgedTools",
    "CellResult",
    "CellStatus",
    "Executor",
    "ExecutorOptions",
    "ExecutorState",
    "ToolBridge",
    "bound_middle",
    "make_executor",
    "uncaged_leash",
]

BRIDGE_CANCEL_TIMEOUT_S = 5.0
"""How long a finished cell waits for its cancelled bridge calls."""

ToolBridge = Callable[[str, dict[str, Any]], Awaitable[str]]
"""``(tool name, keyword arguments) -> text result``, provided by the worker.

Called by the executor when agent code calls a bridged tool function. It returns
the text the function returns in the cell (HTTP errors included, as text). It
raises only when the infrastructure failed (e.g. ``ResourceUnavailableError``):
the cell then sees an exception, and :meth:`Executor.run` re-raises the bridge's
exception once the cell has stopped, so an infrastructure failure is never
mistaken for the agent's.
"""

BridgedTools = Sequence[str] | Mapping[str, Sequence[str]]
"""Tool functions to define in the namespace: names, or names mapped to their
positional parameter names (e.g. ``{"submit": ["answer"], "get_weather": ["city"]}``,
so that ``submit("x")`` is sent as ``{"answer": "x"}``). With a bare name,
positional arguments are sent as ``arg0``, ``arg1``, ...; keyword arguments are
always sent by name. Arguments must be JSON values."""

CellStatus = Literal["ok", "error", "timeout", "restarted"]
"""How a cell ended: ``ok``; ``error`` (an exception, traceback in ``error``);
``timeout`` (interrupted at its timeout, state kept); ``restarted`` (the process
was killed or died, the session's state is lost)."""


class ExecutorOptions(TypedDict):
    """How an executor's child is started and bounded (the keyword arguments of every backend)."""

    cwd: Path
    """Working directory of the child (the rollout's workspace)."""
    bridge: ToolBridge | None
    """Called for bridged tool calls made by agent code."""
    bridged_tools: BridgedTools
    """Tool functions to define in the namespace."""
    output_limit: int
    """Bound, in characters, of each stream, the value, the traceback and the cell's text."""
    env: Mapping[str, str] | None
    """Environment of the child; None: the worker's own."""
    start_timeout_s: float
    """How long the child may take to become ready."""
    prefix: NotRequired[Sequence[str]]
    """A command-line prefix the child is started under (its cage); absent or empty: none."""
    python: NotRequired[str | None]
    """Another interpreter for the child, as its cage sees it (a task image's ``python3``): started
    cold with the child's source, never forked from rollcage's; absent or ``None``: rollcage's own."""


class ExecutorState(enum.Enum):
    """Lifecycle of an executor: misuse (running a closed executor) fails loudly."""

    UNOPENED = "unopened"
    """Created; no process yet (or the last one was killed and the next cell starts one)."""
    RUNNING = "running"
    """A child process is up and ready for cells."""
    CLOSED = "closed"
    """Closed for good; ``run`` and ``start`` raise ``ExecutorError``."""


@dataclasses.dataclass(frozen=True, slots=True)
class CellResult:
    """What one cell produced.

    ``stdout`` and ``stderr`` are each bounded while they are produced (the first
    ``output_limit`` bytes are kept, the rest counted and replaced by a visible
    marker); ``value`` and ``error`` are bounded too. :attr:`text` is what the
    model sees.
    """

    status: CellStatus
    """How the cell ended."""
    stdout: str = ""
    """Everything the cell (and processes it started) wrote to stdout, bounded."""
    stderr: str = ""
    """Everything written to stderr, bounded."""
    value: str | None = None
    """Display text of the last expression; None if the cell did not end in an
    expression or its value was None."""
    error: str | None = None
    """Traceback text when the cell raised (status ``error``, or ``timeout``'s KeyboardInterrupt)."""
    note: str | None = None
    """A sentence for the model about what the executor did (timeout, restart); None otherwise."""
    truncated: bool = False
    """Some output was cut (a stream, the value, the traceback, or ``text`` itself)."""
    duration_s: float = 0.0
    """Wall time from submitting the cell to its result."""
    output_limit: int = 16_384
    """Bound on :attr:`text`, in characters."""

    @property
    def text(self) -> str:
        """The text shown to the model: output, value, traceback and note, at most ``output_limit`` chars.

        When the parts are longer, the middle is cut and replaced by a visible
        ``…[truncated N chars]…`` marker, so the start of the output and the end
        of a traceback (and the note, which comes last) stay visible.
        """
        parts = [p for p in (self.stdout, self.stderr, self.value, self.error, self.note) if p]
        joined = "\n".join(p.rstrip("\n") for p in parts)
        return bound_middle(joined, self.output_limit)

    def with_note(self, status: CellStatus, note: str) -> CellResult:
        """A copy with another status and note (used when a timeout or a restart is reported)."""
        return dataclasses.replace(self, status=status, note=note)


@functools.cache
def uncaged_leash() -> tuple[str, ...]:
    """The prefix a tool's child starts under where it has no cage: ``setpriv --pdeathsig KILL --``.

    Why: with ``--sandbox none`` nothing contains the agent's processes. The worker dies with
    its supervisor's thread (``PR_SET_PDEATHSIG``), but the executor, the bash session and the
    editor's steps are the worker's children: killed with it (the supervisor SIGKILLed, say),
    they went on running the agent's code. Under this prefix each dies with the worker's thread
    that started it, as the worker does with its supervisor's; in a cage, the cage's PID
    namespace ends them instead. Empty where ``setpriv`` (util-linux) is missing.
    """
    from rollcage.cage import which

    setpriv = which("setpriv")
    return () if setpriv is None else (setpriv, "--pdeathsig", "KILL", "--")


def truncation_marker(count: int) -> str:
    """The visible marker put where ``count`` characters were cut."""
    return f"…[truncated {count} chars]…"


def mark_dropped(text: str, dropped: int) -> str:
    """``text`` followed, on a line of its own, by the marker for ``dropped`` characters (if any)."""
    if not dropped:
        return text
    return text + ("" if text.endswith("\n") or not text else "\n") + truncation_marker(dropped) + "\n"


def bound_middle(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters by removing its middle, with a marker there."""
    if len(text) <= limit:
        return text
    # The marker's own length depends on the count; size it for the worst case.
    marker_len = len(truncation_marker(len(text))) + 2
    keep = max(limit - marker_len, 0)
    head = keep // 2
    tail = keep - head
    cut = len(text) - head - tail
    end = text[len(text) - tail :] if tail else ""
    return f"{text[:head]}\n{truncation_marker(cut)}\n{end}"[:limit]


def bound_tail(text: str, limit: int) -> tuple[str, bool]:
    """Keep the last ``limit`` characters of ``text`` (the useful end of a traceback)."""
    if len(text) <= limit:
        return text, False
    marker = truncation_marker(len(text) - limit) + "\n"
    return marker + text[len(text) - max(limit - len(marker), 0) :], True


def normalise_bridged_tools(tools: BridgedTools) -> dict[str, tuple[str, ...]]:
    """Validate bridged tool names and return ``{name: positional parameter names}``.

    Raises:
        ConfigError: a name is not a Python identifier, is a keyword, or repeats.
        TypeError: ``tools`` is a bare string (a common slip for a one-element list).
    """
    if isinstance(tools, str):
        raise TypeError("bridged_tools must be a sequence or mapping of names, not a string")
    items: list[tuple[str, tuple[str, ...]]]
    if isinstance(tools, Mapping):
        items = [(name, tuple(params)) for name, params in tools.items()]
    else:
        items = [(name, ()) for name in tools]
    result: dict[str, tuple[str, ...]] = {}
    for name, params in items:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ConfigError(f"bridged tool name {name!r} is not a valid Python function name")
        if name in result:
            raise ConfigError(f"bridged tool {name!r} is given twice")
        if len(set(params)) != len(params):
            raise ConfigError(f"bridged tool {name!r} repeats a parameter name: {list(params)}")
        result[name] = params
    return result


@dataclasses.dataclass(slots=True)
class CellOutput:
    """What a backend collected for one cell (internal, mutable while it is built)."""

    status: Literal["ok", "error"] = "ok"
    stdout: str = ""
    stderr: str = ""
    value: str | None = None
    error: str | None = None
    truncated: bool = False
    interrupted: bool = False
    """The cell ended with a KeyboardInterrupt (our SIGINT, most likely)."""


class ProcessDied(Exception):
    """Raised by a backend's cell handle when the child process exited mid-cell."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PendingCell(abc.ABC):
    """A backend's handle on a submitted cell."""

    @abc.abstractmethod
    async def wait(self) -> CellOutput:
        """Wait for the cell to end; may be called again after a timeout cancelled it.

        Raises:
            ProcessDied: the child process exited before the cell ended.
            BaseException: whatever the bridge raised while the cell ran.

        **Cancellation:** safe; the cell keeps running and ``wait`` can be called again.
        """

    @abc.abstractmethod
    def partial(self) -> CellOutput:
        """The output collected so far, for a cell whose process is being killed."""

    def __init__(self, executor: Executor) -> None:
        """Bind the cell to its executor; bridge bookkeeping starts empty."""
        self._executor = executor
        self.bridge_tasks: set[asyncio.Task[None]] = set()
        """Bridged tool calls this cell has in flight."""
        self.bridge_failure: BaseException | None = None
        """The first exception a bridged call raised during this cell."""

    def bridge_error(self) -> BaseException | None:
        """The first exception a bridged tool call raised during this cell, if any."""
        return self.bridge_failure

    def cancel_bridges(self) -> None:
        """Cancel the cell's in-flight bridge calls (without waiting)."""
        for task in self.bridge_tasks:
            task.cancel()

    async def finish(self) -> None:
        """Cancel the cell's in-flight bridge calls and wait for them (bounded).

        **Cancellation:** runs shielded by the caller.
        """
        self.cancel_bridges()
        if self.bridge_tasks:
            await asyncio.wait(self.bridge_tasks, timeout=BRIDGE_CANCEL_TIMEOUT_S)
        if self._executor._current is self:
            self._executor._current = None


def fail_future(future: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail a future and mark its exception seen (nobody may be waiting for it any more)."""
    if not future.done():
        future.set_exception(exc)
        future.add_done_callback(lambda f: f.exception())


class Executor(abc.ABC, AsyncClosing):
    """A persistent Python session in a child process; one cell at a time.

    Use it as an async context manager, or call :meth:`start` and
    :meth:`aclose` explicitly. ``start`` is idempotent and may run in a
    background task while the worker does other work; :meth:`run` starts the
    executor itself if needed. Build one with :func:`make_executor`.
    """

    backend: Literal["repl", "jupyter"]
    """Which backend this is."""

    _current: PendingCell | None = None

    def __init__(self, settings: ExecutorSettings, **options: Unpack[ExecutorOptions]) -> None:
        if options["output_limit"] < 64:
            raise ValueError(f"output_limit must be at least 64 characters, got {options['output_limit']}")
        self._settings = settings
        self._cwd = Path(options["cwd"])
        self._bridge = options["bridge"]
        self._tools = normalise_bridged_tools(options["bridged_tools"])
        if self._tools and self._bridge is None:
            raise ValueError("bridged_tools were given without a bridge to call")
        self._output_limit = options["output_limit"]
        env = options["env"]
        self._env = dict(os.environ if env is None else env)
        self._start_timeout_s = options["start_timeout_s"]
        self._prefix = list(options.get("prefix", ()))
        self._state = ExecutorState.UNOPENED
        self._closed = False
        self._restarts = 0
        self._start_lock = asyncio.Lock()
        self._run_lock = asyncio.Lock()
        self._teardown_lock = asyncio.Lock()

    # ------------------------------------------------------------------ public

    @property
    def caged(self) -> bool:
        """Whether the child runs in a cage of its own (see :mod:`rollcage.cage`)."""
        return bool(self._prefix)

    def cage_failure(self, stderr: str) -> SandboxError | None:
        """The error to raise when the child died during start-up with ``stderr``, if its cage failed.

        Start-up output is trusted: no agent code has run in the new child yet. A cage
        that cannot be made is the infrastructure's failure (transient), never the agent's.
        """
        if self._prefix and "bwrap:" in stderr:
            return SandboxError(f"the Python executor's sandbox could not be made: {stderr.strip()[-1000:]}")
        return None

    @property
    def restarts(self) -> int:
        """How many times the session was killed (timeout not honoured, or the process died)."""
        return self._restarts

    @property
    def state(self) -> ExecutorState:
        """The lifecycle state."""
        return self._state

    @property
    @abc.abstractmethod
    def pid(self) -> int | None:
        """Pid (and process group id) of the current child process; None when there is none."""

    async def __aenter__(self) -> Executor:
        """Start the executor (see :meth:`start`).

        **Cancellation:** as for :meth:`start`.
        """
        await self.start()
        return self

    async def start(self) -> None:
        """Start the child process and wait until it is ready; a no-op when it already is.

        Raises:
            ExecutorError: the process could not be started or did not become
                ready within the start timeout (the message says why), or the
                executor is closed.

        **Cancellation:** a half-started process is killed and reaped (shielded)
        before ``CancelledError`` propagates.
        """
        async with self._start_lock:
            if self._closed:
                raise ExecutorError("the Python executor is closed")
            if self._state is ExecutorState.RUNNING:
                return
            try:
                await self._launch()
            except BaseException:
                await shielded(self._locked_teardown(graceful=False))
                raise
            self._state = ExecutorState.RUNNING

    async def run(self, code: str, timeout_s: float) -> CellResult:
        """Run one cell and return what it produced.

        Cells run one at a time, in call order. A cell past ``timeout_s`` is
        interrupted (status ``timeout``, state kept); if it does not stop within
        the interrupt grace, the process group is killed (status ``restarted``,
        state lost, the next cell starts a fresh session). A process that dies
        mid-cell also gives ``restarted``. An exception in the cell is an
        ordinary result (status ``error``).

        Raises:
            ExecutorError: the executor could not (re)start, or is closed.
            BaseException: whatever the tool bridge raised during the cell (an
                infrastructure failure), once the cell has stopped.
            ValueError: ``timeout_s`` is not positive.

        **Cancellation:** the cell is interrupted; if it does not stop within
        the grace the process group is killed; then ``CancelledError``
        propagates. The executor stays usable afterwards.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        async with self._run_lock:
            # A process that died between cells (a background thread called
            # os._exit, the OOM killer) is replaced, and the model is told.
            lost = self._state is ExecutorState.RUNNING and not self._alive()
            if lost:
                await self._kill_for_restart()
            await self.start()
            started = time.monotonic()
            # Synchronous: no cancellation can fall between sending a cell and supervising it.
            cell = self._submit(code)
            try:
                result = await self._supervise(cell, timeout_s, started)
            except asyncio.CancelledError:
                await shielded(self._stop_cell(cell))
                raise
            finally:
                await shielded(cell.finish())
            bridge_error = cell.bridge_error()
            if bridge_error is not None:
                raise bridge_error
            if self._closed and result.status == "restarted":
                raise ExecutorError("the Python executor was closed while a cell was running")
            if lost:
                note = (
                    "Before this cell ran, the Python process had exited and was restarted: "
                    "the session's state (variables, imports, definitions) was lost."
                )
                result = dataclasses.replace(result, note=f"{note} {result.note}" if result.note else note)
            return result

    async def aclose(self) -> None:
        """Kill the process group (SIGTERM, grace, SIGKILL) and reap it; idempotent.

        **Cancellation:** shielded: the process is always stopped and reaped
        before a cancellation propagates.
        """
        self._closed = True
        await shielded(self._close())

    # --------------------------------------------------------------- internals

    async def _close(self) -> None:
        # A start in progress finishes (bounded by its timeout) before it is torn down.
        async with self._start_lock:
            await self._locked_teardown(graceful=True)
            self._state = ExecutorState.CLOSED

    async def _locked_teardown(self, *, graceful: bool) -> None:
        # A cell's restart and a concurrent aclose must not tear down the same process twice.
        async with self._teardown_lock:
            await self._teardown(graceful=graceful)

    async def _supervise(self, cell: PendingCell, timeout_s: float, started: float) -> CellResult:
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    output = await cell.wait()
            except TimeoutError:
                pass
            else:
                return self._result(output, started)
            await self._interrupt()
            async with asyncio.timeout(self._settings.interrupt_grace_s):
                output = await cell.wait()
        except ProcessDied as died:
            partial = cell.partial()
            await self._kill_for_restart()
            return self._result(partial, started).with_note(
                "restarted",
                f"The Python process exited unexpectedly ({died.reason}) and was restarted: "
                "the session's state (variables, imports, definitions) was lost.",
            )
        except TimeoutError:
            partial = cell.partial()
            await self._kill_for_restart()
            return self._result(partial, started).with_note(
                "restarted",
                f"The cell ran past its {timeout_s:g} s timeout and did not stop when interrupted, "
                "so the Python process was killed and restarted: the session's state "
                "(variables, imports, definitions) was lost.",
            )
        return self._result(output, started).with_note(
            "timeout",
            f"The cell was interrupted after exceeding its {timeout_s:g} s timeout; "
            "the session's state is kept.",
        )

    async def _stop_cell(self, cell: PendingCell) -> None:
        """Stop a cell whose ``run`` was cancelled: interrupt, then kill if it will not stop."""
        if self._state is not ExecutorState.RUNNING:
            return
        with contextlib.suppress(ProcessDied):
            await self._interrupt()
            try:
                async with asyncio.timeout(self._settings.interrupt_grace_s):
                    await cell.wait()
                return
            except TimeoutError:
                pass
        await self._kill_for_restart()

    async def _kill_for_restart(self) -> None:
        self._restarts += 1
        await shielded(self._locked_teardown(graceful=False))
        if not self._closed:
            self._state = ExecutorState.UNOPENED

    def _result(self, output: CellOutput, started: float) -> CellResult:
        return CellResult(
            status=output.status,
            stdout=output.stdout,
            stderr=output.stderr,
            value=output.value,
            error=output.error,
            truncated=output.truncated,
            duration_s=time.monotonic() - started,
            output_limit=self._output_limit,
        )

    # ---------------------------------------------------------------- backends

    @abc.abstractmethod
    async def _launch(self) -> None:
        """Start the child process and wait until it is ready (bounded by the start timeout).

        Raises:
            ExecutorError: it could not start.
        """

    @abc.abstractmethod
    def _submit(self, code: str) -> PendingCell:
        """Send a cell to the running child (buffered, never blocks)."""

    @abc.abstractmethod
    async def _interrupt(self) -> None:
        """Send SIGINT to the child's process group (bounded, never raises for a dead child)."""

    @abc.abstractmethod
    def _alive(self) -> bool:
        """Whether the child process is still running."""

    @abc.abstractmethod
    async def _teardown(self, *, graceful: bool) -> None:
        """Kill the child's process group and reap it; release pipes and tasks.

        ``graceful``: SIGTERM, the interrupt grace, then SIGKILL; otherwise
        SIGKILL at once. Idempotent; safe after a failed or partial launch.
        Called shielded.
        """


def make_executor(
    settings: ExecutorSettings,
    *,
    cwd: Path,
    bridge: ToolBridge | None = None,
    bridged_tools: BridgedTools = (),
    output_limit: int = 16_384,
    env: Mapping[str, str] | None = None,
    start_timeout_s: float | None = None,
    prefix: Sequence[str] = (),
    python: str | None = None,
) -> Executor:
    """Build the executor ``settings.backend`` names; nothing starts until :meth:`Executor.start`.

    Args:
        settings: Backend and interrupt grace.
        cwd: Working directory of the child (the rollout's workspace).
        bridge: Called for bridged tool calls made by agent code.
        bridged_tools: Tool functions to define in the namespace (see :data:`BridgedTools`).
        output_limit: Bound, in characters, of each stream, the value, the
            traceback, and of :attr:`CellResult.text`.
        env: Environment of the child; None means the worker's own.
        start_timeout_s: How long the child may take to become ready; None
            means the backend's default (20 s for ``repl``, 60 s for ``jupyter``).
        prefix: A command-line prefix the child is started under: the executor's cage
            (:meth:`rollcage.cage.NestedCage.prefix`); empty: the child runs beside the worker.
        python: See :attr:`ExecutorOptions.python` (``repl`` only).

    Raises:
        ConfigError: a bridged tool name is not a valid function name.
        ValueError: bridged tools without a bridge, or ``output_limit`` below 64.
    """
    options = ExecutorOptions(
        cwd=cwd,
        bridge=bridge,
        bridged_tools=bridged_tools,
        output_limit=output_limit,
        env=env,
        start_timeout_s=(20.0 if settings.backend == "repl" else 60.0)
        if start_timeout_s is None
        else start_timeout_s,
        prefix=prefix,
        python=python,
    )
    if settings.backend == "repl":
        from rollcage.tools._repl import ReplExecutor

        return ReplExecutor(settings, **options)
    from rollcage.tools._jupyter import JupyterExecutor

    return JupyterExecutor(settings, **options)
