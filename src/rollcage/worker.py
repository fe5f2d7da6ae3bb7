"""The worker: one rollout, inside the sandbox. ``rollcage worker INPUT RESULT``.

Contract (what the supervisor relies on):

* ``result.json`` is published exactly once, atomically, with the configured mode,
  unless the process is SIGKILLed or the file system refuses every write;
* invalid input or a failure before the agent starts still publishes a result
  with ``error.kind == "fatal"`` naming the problem, and the exit code is non-zero;
* SIGTERM, SIGINT or a stop file cancel the rollout: tools and the executor are
  stopped, a result with ``error.kind == "cancelled"`` is published, and the exit
  code is non-zero; a stop file present at start means nothing is done and no
  result is written. A signal sent while the worker starts is held (blocked, from
  ``rollcage.cli``'s first step or, warm, from the fork) until the handlers are in
  place, and cancels the rollout then; a start that ends before the rollout does
  (that stop file, an invalid input) exits as that path says;
* a boundary record is appended to the checkpoint journal after every model
  response and every tool completion, and the agent waits for it to be durable;
  a failing append is logged and counted (``checkpoint_failures``), and the run
  goes on.

Exit codes: 0 completed without error; 1 the rollout ended with an error;
2 the input was invalid (or the command line: one line on stderr); 3 stopped before
starting (stop file); 128+N cancelled by signal N (143 for SIGTERM and for the stop
file, 130 for SIGINT).

The input is validated completely before anything runs: it must be a regular file
(a FIFO or a device is refused, never read) of at most ``MAX_INPUT_BYTES``, valid
JSON nested at most ``MAX_JSON_DEPTH`` deep, with no lone surrogate in any string,
and a valid ``WorkerInput`` (finite numbers, bounded timeouts). Any failure is one
line in the log and a ``fatal`` result naming the field.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rollcage.agent import Agent, AgentResult
from rollcage.checkpoint import BoundaryJournal
from rollcage.durable import publish_json, read_bounded
from rollcage.errors import BranchReplayError, ConfigError, ResumeRefusedError, RollcageError
from rollcage.filewatch import wait_for_file
from rollcage.procs import (
    release_cancel_signals,
    run_blocking_inline,
    shielded,
    wait_for_children_by_pidfd,
    wait_shared,
)
from rollcage.protocol import (
    MAX_INPUT_BYTES,
    SCHEMA_VERSION,
    BashToolSpec,
    BoundaryRecord,
    EditorToolSpec,
    PythonToolSpec,
    ResourceToolSpec,
    ResponseOutput,
    RunnerError,
    TerminationReason,
    ToolStatus,
    WorkerInput,
    WorkerResult,
    describe_validation_error,
    json_problem,
)
from rollcage.resume import Replay, ReplayPlan, load_replay
from rollcage.trajectory import INTERRUPTED, TrajectoryRecorder, final_text, project_output, sum_usage
from rollcage.wire import SUBMIT

if TYPE_CHECKING:
    from rollcage.harness import RelayWriter

__all__ = [
    "EXIT_CANCELLED",
    "EXIT_ERROR",
    "EXIT_INVALID_INPUT",
    "EXIT_OK",
    "EXIT_STOPPED_BEFORE_START",
    "MAX_INPUT_BYTES",
    "load_input",
    "parse_input",
    "run_worker",
    "warm_up",
    "worker_main",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID_INPUT = 2
EXIT_STOPPED_BEFORE_START = 3
EXIT_CANCELLED = 128 + signal.SIGTERM

STOP_POLL_S = 1.0
"""How often the stop file is looked for where no inotify watch can be made (:mod:`rollcage.filewatch`).

A supervisor that watches the file itself (rollcage's does, every 0.2 s) stops the worker with SIGTERM
at once; this look serves the launchers that cannot signal."""
EXECUTOR_CLOSE_TIMEOUT_S = 10.0
_ID_MAX_CHARS = 512

log = logging.getLogger("rollcage.worker")


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit 2 (the worker's exit code for bad input)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_INVALID_INPUT, f"{self.prog}: {message} (see --help)\n")


WARM_MODULES: tuple[str, ...] = (
    "rollcage.model._client",  # the client itself: rollcage.model's face loads it on first use
    "rollcage.http",
    "rollcage.tools",
    "rollcage.tools._repl",
    "rollcage.cage",
    # A harness rollout's worker: its relay to the supervisor, the forwarder and the runner.
    "rollcage.harness",
    "rollcage.harness.worker",
    "json",
    "pydantic.plugin._loader",
    # asyncio's thread pool. (Plain HTTP goes through rollcage.http's h11 transport: no worker
    # behind the proxy loads httpcore or anyio, so the template carries neither.)
    "concurrent.futures.thread",
)
"""What a rollout's worker imports after its start (the rest it imports with this module)."""


def warm_up() -> int:
    """Import and build, once, what every worker would otherwise import and build itself; how many models.

    For a template whose forks run :func:`run_worker` (:mod:`rollcage.warm`): the
    lazy imports, the plain-HTTP transport (:func:`rollcage.http.transport_for`),
    one exchange through h11 in memory, httpx's cookie handling, the command-line parser, and every
    pydantic model of rollcage that defers its build to its first use (validators
    and serializers, and pydantic's one look for plugins). Nothing is opened,
    started or connected.
    """
    import importlib

    import pydantic

    # Through rollcage.http, which keeps httpx's command line (rich, click, pygments: ~80
    # modules, ~6 MB) out: a template that imported httpx first carried them into every fork.
    from rollcage.http import httpx

    for name in WARM_MODULES:
        importlib.import_module(name)
    from rollcage.http import exchange_in_memory, transport_for

    transport_for("http://warm-up", uds=None)  # builds nothing but objects; never connects
    exchange_in_memory()  # h11's first exchange builds what every later one reuses
    from rollcage.tools import prepare_repl

    prepare_repl()  # the executor's code, compiled once for every worker
    # A response's cookies are read through urllib's request, whose regular expressions compile on first use.
    request = httpx.Request("POST", "http://warm-up/v1")
    httpx.Cookies().extract_cookies(httpx.Response(200, request=request))
    # The command line, made and parsed once (argparse compiles its patterns as it goes): the sandbox's,
    # which every warm worker is given, is kept parsed.
    _PARSED[_SANDBOX_ARGV] = _parser().parse_args(_SANDBOX_ARGV)
    # Logging's levels as a worker sets them by default (_configure_logging): a fork that finds them
    # set does not sweep every logger of the template (each one's cache, its page copied on write).
    _set_levels(logging.INFO)
    built = 0
    pending: list[type[pydantic.BaseModel]] = [pydantic.BaseModel]
    seen: set[type[pydantic.BaseModel]] = set()
    while pending:
        for model in pending.pop().__subclasses__():
            if model in seen:
                continue
            seen.add(model)
            pending.append(model)
            if model.__module__.startswith("rollcage.") and not model.__pydantic_complete__:
                # A generic or a model with an unresolved name stays deferred: it is built where used.
                with contextlib.suppress(pydantic.PydanticUserError, NameError, TypeError):
                    built += bool(model.model_rebuild())
    return built


def run_worker(argv: list[str], *, forked_from: frozenset[str] | None = None) -> NoReturn:
    """Run the worker and end the process with its exit code, skipping the interpreter's teardown.

    :func:`worker_main` returns only once result.json is published (fsync'd) and the journal is
    closed; everything it writes goes through ``os.write``. Skipping module and object
    finalization saves every rollout tens of ms of CPU.

    Args:
        argv: The worker's command line (after ``rollcage worker``).
        forked_from: For a worker forked from the warm template, the modules the template had
            imported: at DEBUG the worker logs the ones it imported itself (each is paid again in
            every rollout, ~1 ms for even a small one: the template's warm-up should take it).
    """
    code = 1
    try:
        code = worker_main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1 if exc.code else 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        if forked_from is not None and log.isEnabledFor(logging.DEBUG):
            late = sorted(set(sys.modules) - forked_from)
            log.debug("imported after the fork from the template: %s", ", ".join(late) or "nothing")
        logging.shutdown()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


_SANDBOX_ARGV: tuple[str, ...] = (
    "/rollout/input.json",
    "/rollout/result.json",
    "--checkpoint",
    "/rollout/checkpoint.jsonl",
)
"""The worker's command line in the sandbox (``rollcage.supervisor.sandbox``'s ``BwrapLauncher``)."""

_PARSED: dict[tuple[str, ...], argparse.Namespace] = {}
"""Command lines parsed before a fork (:func:`warm_up`: ``_SANDBOX_ARGV``), so a worker given one
does not parse it again."""


def _parse_args(argv: list[str]) -> argparse.Namespace:
    """The worker's command line, parsed (a copy of the template's parse where :func:`warm_up` made one)."""
    known = _PARSED.get(tuple(argv))
    if known is not None:
        return argparse.Namespace(**vars(known))
    return _parser().parse_args(argv)


_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _configure_logging(level: int) -> None:
    """Log to stderr at ``level`` as ``logging.basicConfig`` would; httpx's requests only at DEBUG.

    Why not ``basicConfig``: it sets the root's level even where it is that level already, and every
    ``setLevel`` clears the cache of each logger the process has. In a fork of the warm template that
    touches (and so copies) a page for each of the template's loggers; :func:`warm_up` sets the
    default levels before the fork, and a level is set here only where it differs. As with
    ``basicConfig``, a root that has a handler already is left at its level.
    """
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        root.addHandler(handler)
        if root.level != level:
            root.setLevel(level)
    _quiet_httpx()


def _set_levels(level: int) -> None:
    """The levels :func:`_configure_logging` gives a process whose root is at ``level`` (the template's)."""
    logging.getLogger().setLevel(level)
    _quiet_httpx()


def _quiet_httpx() -> None:
    """httpx logs every request at INFO, and the proxy's capture holds each one already, whole: its
    logger is at WARNING unless the root's is at DEBUG (or below). Only a level that differs is set."""
    noisy = logging.getLogger("httpx")
    wanted = logging.WARNING if logging.getLogger().level > logging.DEBUG else logging.NOTSET
    if noisy.level != wanted:
        noisy.setLevel(wanted)


@functools.cache
def _parser() -> _ArgumentParser:
    """The worker's command line (made once: a warm template makes it for all its workers)."""
    parser = _ArgumentParser(prog="rollcage worker", description="Run one rollout (sandbox entrypoint).")
    parser.add_argument("input", type=Path, help="input.json (WorkerInput)")
    parser.add_argument("result", type=Path, help="where result.json is published")
    parser.add_argument(
        "--checkpoint", type=Path, help="journal path (default: checkpoint.jsonl beside RESULT)"
    )
    parser.add_argument("--stop-file", type=Path, help="stop file to poll (default: 'stop' beside RESULT)")
    parser.add_argument(
        "--workspace", type=Path, help="agent working directory (default: workspace/ beside RESULT)"
    )
    parser.add_argument(
        "--resume-journal",
        type=Path,
        help="an earlier attempt's journal, replayed when input.json asks to resume "
        "(default: resume.jsonl beside RESULT)",
    )
    return parser


def worker_main(argv: list[str]) -> int:
    """Run the worker with command-line arguments; return the exit code."""
    args = _parse_args(argv)
    name = os.environ.get("ROLLCAGE_LOG_LEVEL", "INFO").upper()
    _configure_logging(logging.getLevelNamesMapping().get(name, logging.INFO))
    base = args.result.parent
    paths = _Paths(
        input=args.input,
        result=args.result,
        checkpoint=args.checkpoint or base / "checkpoint.jsonl",
        stop=args.stop_file or base / "stop",
        workspace=args.workspace or base / "workspace",
        resume=args.resume_journal or base / "resume.jsonl",
    )
    wait_for_children_by_pidfd()  # the executor's, a harness's: no thread parked in waitpid() each
    # Its blocking calls (the result published with fsync, the workspace made, its executor's /proc
    # sweep through rollcage.procs) run on the loop's thread: the rollout waits for each of them, and a
    # thread hop would cost it more CPU than the call (a thread's start ~0.3 ms more).
    run_blocking_inline()
    loop = _WorkerLoop()
    # As asyncio.run does: the policy's loop, which Python 3.11's child watcher attaches to.
    asyncio.set_event_loop(loop)
    try:
        with asyncio.Runner(loop_factory=lambda: loop) as runner:
            return runner.run(_amain(paths))
    finally:
        asyncio.set_event_loop(None)


_VALID_SIGNALS = frozenset(int(number) for number in signal.valid_signals())
"""The signal numbers this platform has, as plain ints: made once (in a warm template, before every fork)."""


class _WorkerLoop(asyncio.SelectorEventLoop):
    """asyncio's own event loop, checking a signal number against :data:`_VALID_SIGNALS`.

    Why: asyncio checks every signal it adds or removes a handler for against
    ``signal.valid_signals()``, which makes an enum member of each of the platform's ~64
    signals at every call, four a rollout (SIGTERM and SIGINT, added and removed): ~0.35 ms of
    a warm worker's ~28 ms of CPU here, ~0.02 ms with the set (``bench/worker_signals.py``).
    The check is the same; where a Python version no longer has this hook, its own check runs.
    """

    def _check_signal(self, sig: int) -> None:
        if not isinstance(sig, int):
            raise TypeError(f"sig must be an int, not {sig!r}")
        if sig not in _VALID_SIGNALS:
            raise ValueError(f"invalid signal number {sig}")


class _Paths:
    def __init__(
        self, *, input: Path, result: Path, checkpoint: Path, stop: Path, workspace: Path, resume: Path
    ) -> None:
        self.resume = resume
        self.input = input
        self.result = result
        self.checkpoint = checkpoint
        self.stop = stop
        self.workspace = workspace


def load_input(path: Path) -> WorkerInput:
    """Read and validate ``input.json`` (see ``parse_input``).

    Raises:
        ConfigError: the file is not a readable regular file of at most
            ``MAX_INPUT_BYTES``, or its content is not a valid ``WorkerInput``; the
            message (one line) names the file and the offending field.
    """
    return parse_input(_read_input(path), path)


def _read_input(path: Path) -> bytes:
    try:
        return read_bounded(path, limit=MAX_INPUT_BYTES)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the input file: {exc.strerror or exc}") from exc


def parse_input(raw: bytes, where: Path | str = "input.json") -> WorkerInput:
    """Validate the bytes of an ``input.json``.

    Raises:
        ConfigError: not JSON, nested too deep, a lone surrogate in a string, or
            not a valid ``WorkerInput``; the message (one line) names the field.
    """
    from pydantic import ValidationError

    try:
        return WorkerInput.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        if first["type"] == "json_invalid":
            problem = _field_problem(raw)
            if problem is not None:
                raise ConfigError(f"{where}: invalid input: {problem}") from exc
            # Not JSON at all: there is no field to name, the parser's position is the best "where".
            raise ConfigError(
                f"{where}: not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}"
            ) from exc
        raise ConfigError(f"{where}: invalid input: {describe_validation_error(exc)}") from exc
    except RecursionError as exc:  # a validator recursing on a pathological document
        raise ConfigError(f"{where}: invalid input: nested too deeply") from exc


async def _amain(paths: _Paths) -> int:
    started = time.time()
    if paths.stop.exists():
        log.warning("stop file %s present at start: doing nothing, writing no result", paths.stop)
        return EXIT_STOPPED_BEFORE_START
    raw = b""
    try:
        raw = _read_input(paths.input)
        spec = parse_input(raw, paths.input)
    except ConfigError as exc:
        message = _printable(str(exc))
        log.error("%s", message)
        ids = _ids_from_raw(raw)
        _publish(
            paths.result,
            WorkerResult(
                rollout_id=ids[0],
                task_id=ids[1],
                response=None,
                termination_reason="error",
                error=RunnerError(kind="fatal", type=type(exc).__name__, message=message),
                started_at=started,
                ended_at=time.time(),
            ),
            mode=0o600,
        )
        return EXIT_INVALID_INPUT
    return await _Session(spec, paths, started).run()


def _field_problem(raw: bytes) -> str | None:
    """For JSON the strict parser refused: the field at fault, where a lenient parse can tell.

    Python's parser reads lone surrogates and moderate nesting that pydantic's refuses
    outright; ``json_problem`` then names the field (``field 'rollout_id': ...``).
    """
    import json

    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return json_problem(data)


def _ids_from_raw(raw: bytes) -> tuple[str, str]:
    """Best-effort ids from an input that failed validation, so the fatal result is attributable.

    Only ids that can be published are taken: strings of at most 512 characters
    (orjson refuses lone surrogates and nesting beyond its limit: no id then).
    """
    import orjson

    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "", ""
    if not isinstance(data, dict):
        return "", ""

    def usable(value: Any) -> str:
        return value if isinstance(value, str) and len(value) <= _ID_MAX_CHARS else ""

    return usable(data.get("rollout_id")), usable(data.get("task_id"))


def _printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a path's undecodable bytes) escaped: it can be published."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _publish(path: Path, result: WorkerResult, *, mode: int) -> bool:
    try:
        publish_json(path, result, mode=mode)
    except RollcageError as exc:
        log.error("could not publish %s: %s", path, exc)
        return False
    return True


class _Session:
    """One rollout's lifetime: journal, collaborators, agent task, signals, result."""

    def __init__(self, spec: WorkerInput, paths: _Paths, started: float) -> None:
        self.spec = spec
        self.paths = paths
        self.started = started
        self.recorder = TrajectoryRecorder()
        self.journal: BoundaryJournal | None = None
        self.checkpoint_failures = 0
        self.cancel_signal: int | None = None
        self.task: asyncio.Task[AgentResult] | None = None
        self.model_cookies = dict(spec.model_cookies)
        self.resource_cookies = dict(spec.resource_cookies)
        harness = spec.agent.harness
        self.harness = harness is not None and harness.type != "builtin"
        self.relay: RelayWriter | None = None
        self.replay_plan: ReplayPlan | None = None
        self.replaying: list[dict[str, Any]] | None = None
        """Boundaries of a replay, held back until the replay is over (a divergence discards them)."""
        self.boundary_lock = asyncio.Lock()
        self.unreplayable: str | None = None
        """Why a branch's journal cannot be replayed (its episode ends with it)."""

    async def _plan_resume(self) -> None:
        """Validate the earlier attempt's journal; an unusable one means a fresh start, with the reason."""
        request = self.spec.resume
        if request is None:
            return
        reason: str | None = None
        if self.harness:
            reason = "a harness rollout is not resumed: a harness cannot replay recorded answers"
        else:
            try:
                self.replay_plan = load_replay(self.paths.resume, request.previous_rollout_id)
            except ResumeRefusedError as exc:
                reason = str(exc)
            except Exception as exc:  # evidence from a sandbox: whatever is wrong with it, start fresh
                reason = f"the earlier attempt's journal is unusable: {type(exc).__name__}: {exc}"
        if reason is None:
            return
        if request.strict:
            # A branch: raised by its episode (so it ends with a result), never a fresh start.
            self.unreplayable = reason
            return
        self._refuse_resume(reason)

    def _refuse_resume(self, reason: str) -> None:
        """Start fresh, with the reason; a branch (a strict resume) ends instead.

        Raises:
            BranchReplayError: The resume is a branch's: a fresh start would not be its source's prefix.
        """
        if self.spec.resume is not None and self.spec.resume.strict:
            self.replay_plan = None
            self.replaying = None
            self.recorder = TrajectoryRecorder()
            self.recorder.resume_refused = reason
            raise BranchReplayError(f"the branch's prefix could not be replayed from its source: {reason}")
        log.warning("not resuming, starting fresh: %s", reason)
        self.replay_plan = None
        self.replaying = None
        self.recorder = TrajectoryRecorder()
        self.recorder.resume_refused = reason
        if self.journal is not None:
            self.journal.forget_calls()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._cancel, signum)
        # Held since the process began (rollcage.cli, rollcage.warm): one sent meanwhile reaches the
        # handler now. Before any child is started, which would inherit the blocked mask.
        release_cancel_signals()
        stop_watch = asyncio.create_task(self._watch_stop_file())
        try:
            await self._open_evidence()
            await self._plan_resume()
            self.task = asyncio.create_task(
                self._unreplayable(self.unreplayable)
                if self.unreplayable is not None
                else self._harness_episode()
                if self.harness
                else self._episode()
            )
            if self.cancel_signal is not None:
                self.task.cancel()  # the signal arrived while the journal was opening
            outcome: AgentResult | None = None
            error: RunnerError | None = None
            try:
                outcome = await self.task
            except asyncio.CancelledError:
                if self.cancel_signal is None:
                    raise  # we were cancelled from outside: not ours to swallow
                name = "stop file" if self.cancel_signal == 0 else signal.Signals(self.cancel_signal).name
                error = RunnerError(
                    kind="cancelled", type="Cancelled", message=f"rollout cancelled by {name}"
                )
            except RollcageError as exc:
                log.error("rollout failed: %s", exc)
                error = RunnerError(kind=exc.kind, type=type(exc).__name__, message=str(exc))
            except Exception as exc:  # the worker never exits without a result
                # Not raised on purpose: a failure of rollcage's own machinery (serialising evidence,
                # a bug), never the policy's doing. Transient, so it is retried and never graded.
                log.exception("unexpected failure")
                error = RunnerError(
                    kind="transient",
                    type=type(exc).__name__,
                    message=f"unexpected failure inside the worker (infrastructure, not the policy's): {exc}",
                )
            result = self._result(outcome, error)
            published = _publish(self.paths.result, result, mode=self.spec.result_mode)
            if not published:
                return EXIT_ERROR
            if error is None:
                return EXIT_OK
            if error.kind == "cancelled":
                return (
                    EXIT_CANCELLED
                    if self.cancel_signal in (0, signal.SIGTERM)
                    else 128 + (self.cancel_signal or 0)
                )
            return EXIT_ERROR
        finally:
            stop_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stop_watch
            if self.journal is not None:
                await self.journal.aclose()
            if self.relay is not None:
                await self.relay.aclose()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)

    def _cancel(self, signum: int) -> None:
        if self.cancel_signal is not None:
            return
        self.cancel_signal = signum
        log.warning(
            "cancelling the rollout (%s)", "stop file" if signum == 0 else signal.Signals(signum).name
        )
        if self.task is not None:
            self.task.cancel()

    async def _watch_stop_file(self) -> None:
        # For sandboxes whose controller cannot send signals. Watched, not polled: a look every 0.1 s
        # cost a waiting rollout ~3 ms of CPU a second (rollcage.filewatch).
        await wait_for_file(self.paths.stop, poll_s=STOP_POLL_S)
        self._cancel(0)

    async def _open_evidence(self) -> None:
        """The journal, or for a harness whose supervisor journals the capture, the relay to it."""
        if not self.harness:
            await self._open_journal()
            return
        from rollcage.harness import RELAY_FD_ENV, RelayWriter

        fd = os.environ.get(RELAY_FD_ENV)
        if fd is None:
            await self._open_journal()
            return
        try:
            self.relay = await RelayWriter(int(fd)).__aenter__()
        except (OSError, ValueError) as exc:
            self.checkpoint_failures += 1
            log.error("cannot relay boundaries to the supervisor (%s), continuing: %s", RELAY_FD_ENV, exc)

    async def _open_journal(self) -> None:
        if not self.spec.checkpoint.enabled:
            return
        # Inline: the rollout waits for each boundary before it goes on, so a writer thread would only
        # add two hand-overs an append (durable.CheckpointJournal).
        journal = BoundaryJournal(self.paths.checkpoint, inline=True)
        try:
            await journal.__aenter__()
        except RollcageError as exc:
            self.checkpoint_failures += 1
            log.error("checkpoint journal unavailable, continuing without it: %s", exc)
            return
        self.journal = journal
        await self._boundary(
            BoundaryRecord(
                kind="start", at=time.time(), schema_version=SCHEMA_VERSION, rollout_id=self.spec.rollout_id
            )
        )

    async def _boundary(self, record: BoundaryRecord) -> None:
        if self.journal is None:
            data = record.model_dump(mode="json", exclude_none=True)
        else:
            data = self.journal.line(record)
        async with self.boundary_lock:
            if self.replaying is not None:
                if record.kind != "resumed":
                    self.replaying.append(data)
                    return
                # The replay is over: what it rebuilt becomes this attempt's journal, then the marker,
                # queued in order so they share the journal's group commits.
                held, self.replaying = self.replaying, None
                await asyncio.gather(*(self._append(earlier) for earlier in [*held, data]))
                return
            await self._append(data)

    async def _append(self, data: dict[str, Any]) -> None:
        # Best effort by contract (checkpoint.BoundaryJournal): a lost boundary is logged and counted.
        if self.journal is not None and not await self.journal.write(data):
            self.checkpoint_failures += 1

    async def _unreplayable(self, reason: str) -> AgentResult:
        """A branch whose journal cannot be replayed: it ends as the infrastructure's failure."""
        self._refuse_resume(reason)
        raise AssertionError("unreachable: a strict resume raises")

    async def _episode(self) -> AgentResult:
        plan = self.replay_plan
        if plan is None:
            return await self._play(None)
        self.replaying = []
        replay = Replay(plan, self.spec.rollout_id)
        try:
            return await self._play(replay)
        except ResumeRefusedError as exc:
            self._refuse_resume(str(exc))
        except Exception as exc:
            if not replay.active:
                raise  # the rollout's own failure, after the replay: not the journal's
            # Evidence from a sandbox that the checks let through and the loop could not follow.
            self._refuse_resume(f"replay failed: {type(exc).__name__}: {exc}")
        # The replayed cells' effects on the workspace go with them; the executor went with its stack.
        _empty_workspace(self.paths.workspace)
        return await self._play(None)

    async def _play(self, replay: Replay | None) -> AgentResult:
        from rollcage.model import ModelClient
        from rollcage.tools import ResourceTools, tool_parameters

        spec = self.spec
        self.paths.workspace.mkdir(parents=True, exist_ok=True)
        resource_specs = [t for t in spec.tools if isinstance(t, ResourceToolSpec)]
        model_cookies, resource_cookies = spec.model_cookies, spec.resource_cookies
        if replay is not None:
            # The sessions go on where the journal left them.
            model_cookies = replay.plan.model_cookies or model_cookies
            resource_cookies = replay.plan.resource_cookies or resource_cookies
        async with contextlib.AsyncExitStack() as stack:
            client = ModelClient(
                spec.model, rollout_id=spec.rollout_id, task_id=spec.task_id, cookies=model_cookies
            )
            await stack.enter_async_context(client)
            resources = None
            if resource_specs:
                resources = ResourceTools(
                    spec.resources,
                    resource_specs,
                    rollout_id=spec.rollout_id,
                    cookies=resource_cookies,
                    timeout_s=spec.agent.tool_timeout_s,
                )
                await stack.enter_async_context(resources)
            cells: _Cells | None = None
            swe: _Swe | None = None
            if spec.image is not None and any(isinstance(t, BashToolSpec) for t in spec.tools):
                self._image_program("/bin/bash", "the bash tool")
            if any(isinstance(t, BashToolSpec | EditorToolSpec) for t in spec.tools):
                # In the executor's cage, as cells are; the shell in a session of its own, so the SIGINT
                # that interrupts a command never reaches the cage's monitor.
                swe = _Swe(
                    spec,
                    self.paths.workspace,
                    self._executor_cage(ignore_sigint=False, new_session=True),
                    python=self._image_program("python3", "the file editor")
                    if spec.image is not None and any(isinstance(t, EditorToolSpec) for t in spec.tools)
                    else None,
                )
                stack.push_async_callback(swe.aclose)
            agent = Agent(
                spec,
                model=client,
                resources=resources,
                cells=None,
                recorder=self.recorder,
                boundary=self._boundary,
                replay=replay,
                swe=swe,
            )
            if any(isinstance(t, PythonToolSpec) for t in spec.tools) or spec.agent.mode == "codeact":
                bridged: dict[str, list[str]] = {}
                if spec.agent.mode == "codeact":
                    # Parameter names let agent code call get_weather("Oslo"), not only keywords.
                    bridged = {SUBMIT: ["answer"], **{t.name: tool_parameters(t) for t in resource_specs}}
                # The repl executor starts its cage with SIGINT blocked: no sh to ignore it first.
                cage = self._executor_cage(ignore_sigint=spec.executor.backend != "repl")
                python = None
                if spec.image is not None:
                    if spec.executor.backend != "repl":
                        raise ConfigError(
                            f"the {spec.executor.backend} executor cannot run in an image "
                            f"({spec.image.ref}): use the repl backend, which needs only the image's python3"
                        )
                    python = self._image_program("python3", "the python tool")
                cells = _Cells(spec, self.paths.workspace, agent.bridge, bridged, cage, python=python)
                stack.push_async_callback(cells.aclose)
                agent.attach_cells(cells)
            try:
                return await agent.run()
            finally:
                self.model_cookies = dict(client.cookies)
                if resources is not None:
                    self.resource_cookies = dict(resources.cookies)

    async def _harness_episode(self) -> AgentResult:
        """A nooa or command harness's episode (see :mod:`rollcage.harness`)."""
        from rollcage.harness.worker import HarnessRunner

        self.paths.workspace.mkdir(parents=True, exist_ok=True)
        runner = HarnessRunner(
            self.spec,
            workspace=self.paths.workspace,
            recorder=self.recorder,
            sink=self._harness_boundary,
            # The harness reaches the worker's loopback forwarder, so its cage keeps the network namespace.
            cage=self._executor_cage(share_net=True),
            journal_model_calls=self.relay is None,
        )
        try:
            return await runner.run()
        finally:
            self.model_cookies = runner.model_cookies
            self.resource_cookies = runner.resource_cookies

    async def _harness_boundary(self, record: BoundaryRecord, after: int) -> None:
        if self.relay is None:
            await self._boundary(record)
        elif not await self.relay.send(record, after=after):
            self.checkpoint_failures += 1

    def _image_program(self, name: str, needed_by: str) -> str:
        """The image's ``name`` (on the image's ``PATH``), as agent code's cage sees it.

        Raises:
            ConfigError: The image has none: ``needed_by`` cannot run in it (said at the start,
                before the model is asked anything).
        """
        from rollcage.cage import IMAGE_ROOT, image_environment
        from rollcage.images import find_program

        image = self.spec.image
        assert image is not None
        search = image_environment(image)["PATH"]
        # An absolute name is looked for at that place only (bash at /bin/bash, as the bash tool runs it).
        where = os.path.dirname(name) if "/" in name else search
        found = find_program(IMAGE_ROOT, os.path.basename(name), where)
        if found is None:
            raise ConfigError(
                f"the image {image.ref} has no {name} on its PATH ({where}), so {needed_by} cannot run "
                f"in it: offer only tools the image can run (bash needs /bin/bash), or add {name} to it"
            )
        return found

    def _executor_cage(
        self, *, share_net: bool = False, ignore_sigint: bool = True, new_session: bool = False
    ) -> list[str]:
        """The executor's cage, when the supervisor asked for one (see :mod:`rollcage.cage`).

        Everything only the worker may touch (its input, journal, result and the proxy
        socket) is hidden from the executor; the workspace stays. ``ignore_sigint``: see
        :meth:`rollcage.cage.NestedCage.prefix`, as is ``new_session``.
        """
        from rollcage.cage import NestedCage, image_cage_env, image_prefix

        if self.spec.image is not None:
            # Agent code in the rollout's image root: nothing of the worker's view is there.
            return image_prefix(
                image_cage_env(os.environ),
                self.spec.image,
                workspace=str(self.paths.workspace),
                share_net=share_net,
                ignore_sigint=ignore_sigint,
                new_session=new_session,
            )
        paths = self.paths
        private = [paths.input, paths.result, paths.checkpoint, paths.stop, paths.resume]
        private += [
            Path(p) for p in (self.spec.model.uds, *(r.uds for r in self.spec.resources.values())) if p
        ]
        cage = NestedCage.from_environment(
            workspace=str(paths.workspace), worker_paths=map(str, private), share_net=share_net
        )
        return [] if cage is None else cage.prefix(ignore_sigint=ignore_sigint, new_session=new_session)

    def _result(self, outcome: AgentResult | None, error: RunnerError | None) -> WorkerResult:
        if error is not None:
            reason = "cancelled" if error.kind == "cancelled" else "error"
            self.recorder.stop_pending(
                "cancelled" if error.kind == "cancelled" else "incomplete", f"[{reason}: {error.message}]"
            )
        trajectory = self.recorder.snapshot(final=True)
        answered = [
            c for c in trajectory.model_calls if c.status != "failed" and c.incomplete_reason != INTERRUPTED
        ]
        response = None
        if answered:
            items = project_output(trajectory, partial=False)
            status: Any
            if error is not None:
                status = "cancelled" if error.kind == "cancelled" else "failed"
            elif outcome is not None and outcome.termination_reason == "completed":
                status = "completed"
            else:
                status = "incomplete"
            text = outcome.final_answer if outcome is not None and outcome.final_answer is not None else None
            response = ResponseOutput(
                id=self.spec.rollout_id,
                model=self.spec.model.model,
                status=status,
                output=items,
                output_text=text if text is not None else final_text(items),
                usage=sum_usage(answered),
            )
        termination: TerminationReason
        if error is not None:
            termination = "cancelled" if error.kind == "cancelled" else "error"
        else:
            assert outcome is not None
            termination = outcome.termination_reason
        return WorkerResult(
            rollout_id=self.spec.rollout_id,
            task_id=self.spec.task_id,
            response=response,
            trajectory=trajectory,
            model_cookies=self.model_cookies,
            resource_cookies=self.resource_cookies,
            termination_reason=termination,
            error=error,
            checkpoint_failures=self.checkpoint_failures,
            started_at=self.started,
            ended_at=time.time(),
        )


def _empty_workspace(workspace: Path) -> None:
    """Remove what a diverged replay's cells left in the workspace (the controller lays it out empty).""" ""
    if not workspace.is_dir():
        return
    for entry in workspace.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()


class _Cells:
    """The agent's view of the Python executor: started lazily, text out, always closed."""

    def __init__(
        self,
        spec: WorkerInput,
        workspace: Path,
        bridge: Any,
        bridged: dict[str, list[str]],
        cage: list[str],
        *,
        python: str | None = None,
    ) -> None:
        from rollcage.tools import make_executor

        self._executor = make_executor(
            spec.executor,
            cwd=workspace,
            bridge=bridge if bridged else None,
            bridged_tools=bridged,
            output_limit=spec.agent.tool_output_limit,
            prefix=cage,
            python=python,
        )
        self._start: asyncio.Task[None] | None = None

    def prestart(self) -> None:
        if self._start is None:
            self._start = asyncio.create_task(self._executor.start())

    async def run_cell(self, code: str, timeout_s: float) -> tuple[ToolStatus, str]:
        self.prestart()
        assert self._start is not None
        # Shared with aclose: a cell cancelled while the executor starts leaves the start running.
        await wait_shared(self._start)
        result = await self._executor.run(code, timeout_s)
        status: ToolStatus = "completed" if result.status == "ok" else "failed"
        return status, result.text

    async def aclose(self) -> None:
        if self._start is not None:
            if not self._start.done():
                self._start.cancel()
            with contextlib.suppress(asyncio.CancelledError, RollcageError):
                await self._start
        # Shielded: a cancelled rollout must still stop its executor and reap it. Bounded: a close
        # that hangs is left behind (it is itself shielded) rather than holding up the result.
        close = asyncio.ensure_future(self._executor.aclose())
        done, _ = await shielded(asyncio.wait({close}, timeout=EXECUTOR_CLOSE_TIMEOUT_S))
        if not done:
            log.error("executor did not close within %.0fs", EXECUTOR_CLOSE_TIMEOUT_S)


class _Swe:
    """The agent's ``bash`` tool and file editor: both in the executor's cage, both closed at the end."""

    def __init__(
        self, spec: WorkerInput, workspace: Path, cage: list[str], *, python: str | None = None
    ) -> None:
        from rollcage.tools import FileEditor, ShellSession

        editor = next((t for t in spec.tools if isinstance(t, EditorToolSpec)), None)
        self._shell = ShellSession(
            cwd=workspace,
            prefix=cage,
            output_limit=spec.agent.tool_output_limit,
            interrupt_grace_s=spec.executor.interrupt_grace_s,
        )
        self._editor = FileEditor(
            cwd=workspace,
            prefix=cage,
            name=editor.name if editor is not None else "str_replace_based_edit_tool",
            output_limit=spec.agent.tool_output_limit,
            python=python or sys.executable,
        )

    async def run_bash(self, command: str | None, restart: bool, timeout_s: float) -> tuple[ToolStatus, str]:
        if restart:
            await self._shell.restart()
            if command is None:
                return "completed", "The bash session was restarted: a fresh shell now runs in the workspace."
        result = await self._shell.run(command or "", timeout_s)
        return ("completed" if result.status == "ok" else "failed"), result.text

    async def edit(self, arguments: dict[str, Any], timeout_s: float) -> tuple[ToolStatus, str]:
        ok, text = await self._editor.call(arguments, timeout_s)
        return ("completed" if ok else "failed"), text

    async def aclose(self) -> None:
        # Shielded inside: a cancelled rollout still kills its shell and everything it started.
        await self._shell.aclose()
