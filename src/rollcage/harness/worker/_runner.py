"""Running a black-box harness inside the worker: NOOA or a command-line agent, with full evidence.

The worker's half of a harness rollout, in order::

    forwarder   127.0.0.1:PORT in the sandbox's network namespace, to the egress proxy (see _forwarder)
    harness     its own interpreter (HarnessEnvironment), in the executor's cage with the worker's
                network namespace: it sees the workspace, /tmp, its environment and the forwarder;
                never the worker's input, journal, result or the proxy socket
    evidence    every model exchange the forwarder saw becomes a ModelCall (with the tool calls it
                asks for, pending); the harness's events (NOOA's, or a command's on
                ROLLCAGE_EVENTS_FD) end those calls, marked reported_by: harness; each ended call is
                a boundary handed to the worker's sink (relayed to the supervisor, which journals it
                beside the model calls it takes from the capture)
    end         the harness's exit, its answer, and whose fault a failure was

Outcome rules (the same classes as the builtin loop):

* an answer and exit code 0: ``completed``;
* exit code 0 without an answer: a :class:`~rollcage.errors.HarnessError` (never ``completed``);
* a model call refused past ``max_policy_calls``, or more tool calls reported than
  ``max_tool_calls``: the harness is stopped (SIGTERM, its grace, SIGKILL) and the
  rollout ends with that termination reason, like the builtin loop;
* a non-zero exit right after the model endpoint failed (5xx, 429, no answer): a
  transient model error (infrastructure: retried); any other: a ``HarnessError``;
* a harness that cannot be started at all: a ``HarnessUnavailableError`` (infrastructure);
* cancellation (SIGTERM, the stop file): the harness gets SIGTERM and its grace to
  report its partial episode, then SIGKILL; the cancellation propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import stat
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

from rollcage.agent import AgentResult
from rollcage.errors import (
    ConfigError,
    HarnessError,
    HarnessUnavailableError,
    ModelEndpointNotFoundError,
    TransientModelError,
)
from rollcage.harness._calls import WireCalls, WireExchange
from rollcage.harness._events import (
    EVENTS_FD_ENV,
    GRACE_ENV,
    RELAY_FD_ENV,
    AnswerEvent,
    ErrorEvent,
    HarnessEvent,
    ToolEndEvent,
    ToolStartEvent,
    read_events,
)
from rollcage.harness._forwarder import Forwarder
from rollcage.harness._venvs import command_search_path
from rollcage.procs import (
    GroupTree,
    PidHandle,
    StopStrategy,
    command_name,
    first_of,
    live_members,
    shielded,
    stop_tree,
)
from rollcage.protocol import (
    BoundaryRecord,
    CommandHarness,
    ModelCall,
    NooaHarness,
    ResourceToolSpec,
    TerminationReason,
    ToolCall,
    WorkerInput,
)
from rollcage.tools import bound_middle
from rollcage.trajectory import TrajectoryRecorder, message_text

__all__ = ["NOOA_ADAPTER", "HarnessRunner", "HarnessSink", "task_text"]

logger = logging.getLogger("rollcage.harness")

HarnessSink = Callable[[BoundaryRecord, int], Awaitable[None]]
"""Receives each boundary the runner builds, with how many model calls preceded it."""

NOOA_ADAPTER = Path(__file__).with_name("_nooa_adapter.py")
"""The script NOOA's interpreter runs (standard library and NOOA only)."""

_LOG_BYTES = 4 * 1024 * 1024
_STDOUT_BYTES = 1024 * 1024
_ANSWER_CHARS = 1024 * 1024
_DRAIN_S = 2.0
_KILL_WAIT_S = 5.0
# Variables of the worker's own that the harness must not inherit.
_WORKER_ONLY = frozenset({RELAY_FD_ENV, GRACE_ENV, "ROLLCAGE_EXECUTOR_CAGE"})


def task_text(spec: WorkerInput) -> str:
    """The task's input as plain text (a Responses input list: its messages' text, one per paragraph)."""
    if isinstance(spec.input, str):
        return spec.input
    parts = [message_text(item) for item in spec.input if item.get("type", "message") == "message"]
    return "\n\n".join(part for part in parts if part)


class HarnessRunner:
    """One harness run (see the module docstring); :meth:`run` is the episode.

    Args:
        spec: The worker's input; ``spec.agent.harness`` is ``nooa`` or ``command``.
        workspace: The harness's working directory.
        recorder: Where model and tool calls are recorded (shared with the worker).
        sink: Receives each boundary (see :data:`HarnessSink`); awaited.
        cage: The argv prefix of the harness's cage (``[]``: none).
        journal_model_calls: Also hand model-call boundaries to ``sink`` (when no supervisor
            journals them from the capture).
    """

    def __init__(
        self,
        spec: WorkerInput,
        *,
        workspace: Path,
        recorder: TrajectoryRecorder,
        sink: HarnessSink,
        cage: list[str],
        journal_model_calls: bool,
    ) -> None:
        harness = spec.agent.harness
        if not isinstance(harness, NooaHarness | CommandHarness):
            raise ValueError("HarnessRunner runs a nooa or command harness")
        self._spec = spec
        self._harness: NooaHarness | CommandHarness = harness
        self._workspace = workspace
        self._recorder = recorder
        self._sink = sink
        self._cage = cage
        self._journal_model_calls = journal_model_calls
        self._token = secrets.token_urlsafe(24)
        self._forwarder: Forwarder | None = None
        self._wire = WireCalls(spec.rollout_id)
        self._lock = asyncio.Lock()
        self._by_harness_id: dict[str, str] = {}
        self._harness_calls = 0
        self._tool_starts = 0
        self._answer: str | None = None
        self._reported_error: str | None = None
        self._invalid_events = 0
        self._stop_reason: TerminationReason | None = None
        self._stop = asyncio.Event()
        self._log_left = _LOG_BYTES
        self._stdout = bytearray()
        self._stderr_tail = b""

    @property
    def model_cookies(self) -> dict[str, str]:
        """The model cookies at the end (the forwarder's jar)."""
        return self._forwarder.model_cookies if self._forwarder else dict(self._spec.model_cookies)

    @property
    def resource_cookies(self) -> dict[str, str]:
        """The resource cookies at the end."""
        return self._forwarder.resource_cookies if self._forwarder else dict(self._spec.resource_cookies)

    async def run(self) -> AgentResult:
        """Run the harness to its end; the termination reason and its answer.

        Raises:
            HarnessError: It failed, or exited 0 without an answer (the policy's).
            HarnessUnavailableError: It could not be started (the machine's).
            ConfigError: A nooa harness without its environment in the input.
            TransientModelError: It failed right after the model endpoint did (infrastructure).

        Cancellation:
            The harness gets SIGTERM, its grace (``stop_grace_s``, kept under the
            supervisor's) to report its partial episode, then SIGKILL; its events so far
            are recorded and the cancellation propagates.
        """
        argv, stdin = await asyncio.to_thread(self._command)
        async with Forwarder(
            self._spec,
            token=self._token,
            on_model_exchange=self._on_model_exchange,
            on_refused=lambda: self._request_stop("max_policy_calls"),
        ) as forwarder:
            self._forwarder = forwarder
            events_r, events_w = os.pipe()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self._cage,
                    *argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    pass_fds=(events_w,),
                    cwd=self._workspace,
                    env=self._environment(forwarder, events_w),
                    start_new_session=True,
                )
            except OSError as exc:
                os.close(events_r)
                raise HarnessUnavailableError(f"cannot start the harness ({argv[0]}): {exc}") from exc
            finally:
                os.close(events_w)
            pumps = [
                asyncio.create_task(self._pump_events(events_r)),
                asyncio.create_task(self._pump_stdout(proc.stdout)),
                asyncio.create_task(self._pump_stderr(proc.stderr)),
                asyncio.create_task(self._feed(proc, stdin)),
            ]
            try:
                returncode = await self._wait(proc)
            except asyncio.CancelledError:
                await shielded(self._stop_and_drain(proc, pumps))
                raise
            await self._drain(pumps)
            self._recorder.stop_pending("incomplete", "[the harness did not report how this call ended]")
            return self._conclude(returncode)

    # ------------------------------------------------------------------ process

    def _command(self) -> tuple[list[str], bytes]:
        env = self._spec.harness_env
        if isinstance(self._harness, NooaHarness):
            if env is None:
                raise ConfigError(
                    "the nooa harness needs its Python environment (harness_env in input.json): install it "
                    "with 'rollcage harness install nooa' or give 'rollcage run --harness-env PATH'"
                )
            return [env.python, "-I", str(NOOA_ADAPTER)], self._nooa_task()
        harness = self._harness
        argv = list(harness.argv)
        if env is not None and "/" not in argv[0] and os.path.exists(os.path.join(env.bin, argv[0])):
            argv[0] = os.path.join(env.bin, argv[0])
        text = self._command_task()
        if harness.task == "argv":
            return [*argv, text], b""
        if harness.task == "file":
            path = self._workspace / ".rollcage-task.txt"
            path.write_text(text, encoding="utf-8")
            return [*argv, str(path)], b""
        return argv, text.encode("utf-8")

    def _command_task(self) -> str:
        instructions = self._spec.instructions
        text = task_text(self._spec)
        return f"{instructions}\n\n{text}" if instructions else text

    def _nooa_task(self) -> bytes:
        spec = self._spec
        sampling = spec.model.sampling
        return orjson.dumps(
            {
                "task": task_text(spec),
                "instructions": spec.instructions,
                "model": spec.model.model,
                "api": spec.model.api,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "max_tokens": sampling.max_output_tokens,
                "max_iterations": spec.agent.max_policy_calls,
                "tools": [
                    {"name": t.name, "description": t.description, "parameters": t.parameters}
                    for t in spec.tools
                    if isinstance(t, ResourceToolSpec)
                ],
            }
        )

    def _environment(self, forwarder: Forwarder, events_fd: int) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if name not in _WORKER_ONLY}
        harness_env = self._spec.harness_env
        tools = [
            {"name": t.name, "description": t.description, "parameters": t.parameters}
            for t in self._spec.tools
            if isinstance(t, ResourceToolSpec)
        ]
        env.update(
            {
                "PATH": command_search_path(harness_env),
                "OPENAI_BASE_URL": forwarder.base_url,
                "OPENAI_API_BASE": forwarder.base_url,
                "OPENAI_API_KEY": self._token,
                "ROLLCAGE_MODEL": self._spec.model.model,
                "ROLLCAGE_API": self._spec.model.api,
                "ROLLCAGE_TOOLS_URL": forwarder.tools_url,
                "ROLLCAGE_TOOLS": orjson.dumps(tools).decode(),
                EVENTS_FD_ENV: str(events_fd),
                # litellm fetches a price list from the internet at import unless told not to.
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "NO_PROXY": "127.0.0.1,localhost",
                "no_proxy": "127.0.0.1,localhost",
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    async def _feed(self, proc: asyncio.subprocess.Process, data: bytes) -> None:
        stdin = proc.stdin
        assert stdin is not None
        with contextlib.suppress(OSError):
            if data:
                stdin.write(data)
                async with asyncio.timeout(30.0):
                    await stdin.drain()
        with contextlib.suppress(OSError, TimeoutError):
            stdin.close()
            async with asyncio.timeout(5.0):
                await stdin.wait_closed()

    async def _wait(self, proc: asyncio.subprocess.Process) -> int:
        # A limit reached (the stop event) stops it now; a cancellation is the caller's to handle.
        exited, _ = await first_of(proc.wait(), self._stop.wait())
        if exited.cancelled():
            await shielded(self._stop_harness(proc))
        return await proc.wait()

    def _grace(self) -> float:
        grace = self._harness.stop_grace_s
        with contextlib.suppress(ValueError):
            supervisor = float(os.environ.get(GRACE_ENV, ""))
            # The worker needs time after the harness to publish its result within the supervisor's grace.
            grace = min(grace, max(supervisor * 0.6, 0.2))
        return grace

    async def _stop_harness(self, proc: asyncio.subprocess.Process) -> None:
        # Already gone: what it left in its group is killed at once; running: SIGTERM and its grace first.
        grace = 0.0 if proc.returncode is not None else self._grace()
        exited = asyncio.ensure_future(proc.wait())
        try:
            await stop_tree(
                _CagedHarness(proc.pid, exited), StopStrategy(grace_s=grace, kill_wait_s=_KILL_WAIT_S)
            )
        finally:
            exited.cancel()

    async def _stop_and_drain(
        self, proc: asyncio.subprocess.Process, pumps: list[asyncio.Task[None]]
    ) -> None:
        await self._stop_harness(proc)
        await self._drain(pumps)

    async def _drain(self, pumps: list[asyncio.Task[None]]) -> None:
        """Let the pumps read what the harness left in its pipes, briefly; then stop them."""
        done, pending = await asyncio.wait(pumps, timeout=_DRAIN_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                logger.warning("harness output reader failed: %r", task.exception())

    # ------------------------------------------------------------------ output

    async def _pump_stdout(self, stream: asyncio.StreamReader | None) -> None:
        assert stream is not None
        while chunk := await stream.read(65536):
            room = _STDOUT_BYTES - len(self._stdout)
            if room > 0:
                self._stdout += chunk[:room]
            self._log(chunk, b"harness stdout: ")

    async def _pump_stderr(self, stream: asyncio.StreamReader | None) -> None:
        assert stream is not None
        while chunk := await stream.read(65536):
            self._stderr_tail = (self._stderr_tail + chunk)[-4096:]
            self._log(chunk, b"harness: ")

    def _log(self, chunk: bytes, prefix: bytes) -> None:
        """Copy harness output into the worker's log, up to a bound (the rest is counted, not kept)."""
        if self._log_left <= 0:
            return
        data = chunk[: self._log_left]
        self._log_left -= len(data)
        lines = data.splitlines(keepends=True)
        out = b"".join(prefix + line for line in lines)
        if self._log_left <= 0:
            out += b"\n[rollcage: harness output past %d bytes is not logged]\n" % _LOG_BYTES
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.buffer.write(out)
            sys.stderr.buffer.flush()

    async def _pump_events(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        from rollcage.harness._events import MAX_EVENT_BYTES

        reader = asyncio.StreamReader(limit=MAX_EVENT_BYTES + 1)
        pipe = os.fdopen(fd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        try:
            async for event in read_events(reader):
                if event is None:
                    self._invalid_events += 1
                    if self._invalid_events == 1:
                        logger.warning("the harness reported an event that is not one; dropping such lines")
                    continue
                await self._on_event(event)
        finally:
            transport.close()

    # ------------------------------------------------------------------ evidence

    async def _on_model_exchange(self, exchange: WireExchange) -> None:
        async with self._lock:
            wire = await self._wire.next(exchange)
            self._recorder.start_turn(wire.turn)
            self._recorder.add_model_call(wire.call)
            for tool in wire.tools:
                self._recorder.apply(tool)
            if self._journal_model_calls:
                index = wire.call.index
                turn = BoundaryRecord(
                    kind="turn_start", at=wire.turn.started_at, turn=wire.turn, reported_by="worker"
                )
                await self._sink(turn, index)
                record = BoundaryRecord(
                    kind="model_call",
                    at=time.time(),
                    model_call=wire.call,
                    tool_calls=wire.tools,
                    reported_by="worker",
                )
                await self._sink(record, index)

    async def _on_event(self, event: HarnessEvent) -> None:
        async with self._lock:
            if isinstance(event, ToolStartEvent):
                self._tool_start(event)
            elif isinstance(event, ToolEndEvent):
                await self._tool_end(event)
            elif isinstance(event, AnswerEvent):
                self._answer = event.text[:_ANSWER_CHARS]
            elif isinstance(event, ErrorEvent):
                self._reported_error = event.message[:2000]

    def _tool_start(self, event: ToolStartEvent) -> None:
        if event.id in self._by_harness_id:
            return
        self._tool_starts += 1
        if self._tool_starts > self._spec.agent.max_tool_calls:
            # Past the budget nothing more is recorded (what a harness reports is bounded by it).
            self._request_stop("max_tool_calls")
            return
        match = None if event.synthetic else self._pending_for(event)
        if match is not None:
            self._recorder.mark_started(match.call_id)
            self._by_harness_id[event.id] = match.call_id
            return
        # A call no model response asked for: the harness's own (NOOA's first turn), or one we cannot place.
        calls = self._recorder.model_calls
        call_id = f"harness_{self._harness_calls}"
        self._harness_calls += 1
        self._recorder.apply(
            ToolCall(
                call_id=call_id,
                server_call_id=event.id,
                name=event.name,
                arguments=event.arguments,
                turn=max(len(calls) - 1, 0),
                status="pending",
                started_at=time.time(),
                origin="harness",
                reported_by="harness",
            )
        )
        self._by_harness_id[event.id] = call_id

    def _pending_for(self, event: ToolStartEvent) -> ToolCall | None:
        """The pending call of the latest model response this event reports on (by server id, else name)."""
        pending = [c for c in self._recorder.pending() if c.origin == "model"]
        claimed = set(self._by_harness_id.values())
        for call in reversed(pending):
            if call.server_call_id == event.id and call.call_id not in claimed:
                return call
        if not pending:
            return None
        latest = max(c.turn for c in pending)
        for call in pending:
            if call.turn == latest and call.name == event.name and call.call_id not in claimed:
                return call
        return None

    async def _tool_end(self, event: ToolEndEvent) -> None:
        call_id = self._by_harness_id.get(event.id)
        if call_id is None:
            self._tool_start(ToolStartEvent(type="tool_start", id=event.id, name=""))
            call_id = self._by_harness_id.get(event.id)
            if call_id is None:
                return
        if self._recorder.get(call_id).status != "pending":
            return
        output = bound_middle(event.output, self._spec.agent.tool_output_limit)
        done = self._recorder.finish_tool_call(call_id, event.status, output)
        record = BoundaryRecord(kind="tool_call", at=time.time(), tool_calls=[done], reported_by="harness")
        await self._sink(record, len(self._recorder.model_calls))

    def _request_stop(self, reason: TerminationReason) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
            logger.warning("stopping the harness: %s reached", reason)
            self._stop.set()

    # ------------------------------------------------------------------ the end

    def _final_answer(self) -> str | None:
        harness = self._harness
        answer: str | None
        if isinstance(harness, NooaHarness) or harness.answer == "events":
            answer = self._answer
        elif harness.answer == "stdout":
            answer = self._stdout.decode("utf-8", "replace")
        else:
            answer = _read_answer_file(self._workspace, harness.answer_file)
        if answer is None:
            return None
        answer = answer.strip()
        return answer or None

    def _conclude(self, returncode: int) -> AgentResult:
        answer = self._final_answer()
        if self._stop_reason is not None:
            return AgentResult(self._stop_reason, answer)
        if returncode == 0:
            if answer is None:
                raise HarnessError(
                    "the harness exited with code 0 without a final answer"
                    + (f" (it said: {self._reported_error})" if self._reported_error else "")
                )
            return AgentResult("completed", answer)
        how = _describe_exit(returncode)
        last = self._last_model_call()
        if (
            last is not None
            and last.status == "failed"
            and last.error is not None
            and last.error.kind == "transient"
        ):
            # The endpoint's 404 keeps its type: the controller stops the run on it.
            error = (
                ModelEndpointNotFoundError
                if last.error.type == ModelEndpointNotFoundError.__name__
                else TransientModelError
            )
            raise error(f"the harness ended ({how}) after the model endpoint failed: {last.error.message}")
        said = self._reported_error or self._stderr_hint()
        raise HarnessError(f"the harness ended with {how}" + (f": {said}" if said else ""))

    def _last_model_call(self) -> ModelCall | None:
        calls = self._recorder.model_calls
        return calls[-1] if calls else None

    def _stderr_hint(self) -> str | None:
        lines = [line.strip() for line in self._stderr_tail.decode("utf-8", "replace").splitlines()]
        last = [line for line in lines if line][-3:]
        return " | ".join(last)[-500:] or None


class _CagedHarness(GroupTree):
    """The harness's session: a :class:`GroupTree` whose polite signal spares bubblewrap's own processes."""

    async def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the harness's processes, not the cage's monitor (see :func:`_terminate_harness`).

        **Cancellation:** the signal may have reached some of them.
        """
        if await asyncio.to_thread(_terminate_harness, self.pgid, sig):
            return True
        return await super().signal_group(sig)


def _terminate_harness(session: int, sig: int = signal.SIGTERM) -> bool:
    """Send ``sig`` to every process of the harness's session but bubblewrap's own; whether /proc was read.

    The cage's monitor and init are bubblewrap: signalled, they die and the kernel kills the
    cage at once (``--die-with-parent``), so the harness would get no grace. Its own processes
    get the SIGTERM instead (each through a verified pidfd, so a reused PID is never hit), and
    SIGKILL to the whole group follows the grace.
    """
    members = live_members(session)
    if members is None:
        return False
    for info in members:
        if command_name(info.pid) == "bwrap":
            continue
        handle = PidHandle.open(info)
        if handle is not None:
            try:
                handle.send(sig)
            finally:
                handle.close()
    return True


def _read_answer_file(workspace: Path, name: str) -> str | None:
    """The answer file's text (a regular file inside the workspace, at most 1 MiB read), or ``None``.

    Read once the harness is gone: a link out of the workspace is refused, not followed.
    """
    path = workspace / name
    if not os.path.realpath(path).startswith(os.path.realpath(workspace) + os.sep):
        return None
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, _ANSWER_CHARS).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
        return f"signal {-returncode}"
    if returncode > 128:
        # bubblewrap reports a command killed by signal N as exit code 128 + N.
        with contextlib.suppress(ValueError):
            return f"exit code {returncode} ({signal.Signals(returncode - 128).name})"
    return f"exit code {returncode}"
