"""Running the scripted policy: in a background thread (``PolicyServer``) or in the foreground (``serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypedDict, Unpack

import uvicorn

from rollcage.errors import ConfigError
from rollcage.policy._app import PolicyApp, PolicyState, RequestRecord
from rollcage.policy._faults import FaultPlan, FaultRecord, FaultRule
from rollcage.policy._script import PolicyScript, load_script
from rollcage.protocol import ModelEndpoint

__all__ = ["PolicyServer", "ServeOptions", "bind_socket", "serve"]

_GRACEFUL_S = 5
"""Backstop for uvicorn's graceful shutdown; hanging requests are released before it matters."""


class _Uvicorn(uvicorn.Server):
    """uvicorn, telling us when it listens and releasing hanging requests before it drains."""

    def __init__(self, config: uvicorn.Config, state: PolicyState) -> None:
        super().__init__(config)
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._state = state

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()

    async def main_loop(self) -> None:
        # uvicorn's loop, except that a stop request wakes it at once instead of at the next 0.1 s poll.
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self._state.shutting_down.wait()
            should_exit = await self.on_tick(counter) or self._state.shutting_down.is_set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Without this, uvicorn would wait for hung requests until its graceful timeout.
        self._state.shutting_down.set()
        await super().shutdown(sockets=sockets)


def bind_socket(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    uds: str | os.PathLike[str] | None = None,
    backlog: int = 256,
) -> socket.socket:
    """A listening socket: TCP on ``host:port`` (0: a free port), or a Unix socket at ``uds``.

    Binding before the server starts means the port is known (and connectable:
    connections wait in the backlog) as soon as this returns. A TCP socket names its
    protocol (``IPPROTO_TCP``): asyncio turns Nagle's algorithm off only on connections
    whose socket says TCP, and with it on, every answer written in two parts (uvicorn
    writes the head, then the body) waited for the client's delayed ACK: ~40 ms a
    request, and ~0.7 ms more of the client's CPU.

    Raises:
        ConfigError: the address cannot be bound.
    """
    try:
        if uds is not None:
            path = Path(uds)
            if path.is_socket():
                path.unlink()  # a stale socket from an earlier run; anything else is left alone
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path))
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        sock.listen(backlog)
    except (OSError, OverflowError, ValueError) as exc:  # a port out of range, a NUL in a path
        raise ConfigError(f"cannot listen on {uds or f'{host}:{port}'}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


def _config(app: PolicyApp, *, quiet: bool) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http="h11",  # the reset fault reaches the transport through h11's request cycle
        ws="none",
        lifespan="off",
        loop="asyncio",
        access_log=not quiet,
        log_level="warning" if quiet else "info",
        # In-process servers must not reconfigure the host program's logging.
        log_config=None if quiet else uvicorn.config.LOGGING_CONFIG,
        timeout_graceful_shutdown=_GRACEFUL_S,
    )


class ServeOptions(TypedDict, total=False):
    """Where the scripted policy listens and which faults it injects (for ``PolicyServer`` and ``serve``)."""

    host: str
    """TCP host (ignored with ``uds``); default ``127.0.0.1``."""
    uds: str | os.PathLike[str] | None
    """Serve on this Unix socket path instead of TCP."""
    faults: FaultPlan | Sequence[FaultRule | str]
    """Schedule rules (``FaultRule`` or ``--fault`` strings), or a whole ``FaultPlan``."""
    fault_rate: float
    """Probability of a random fault per request; default 0."""
    fault_kinds: Sequence[FaultRule] | str | None
    """What random faults are drawn from (see ``parse_fault_kinds``); None: the default set."""
    seed: int
    """Seed of the random fault draws; default 0."""
    fault_log: str | os.PathLike[str] | None
    """Append every injected fault as a JSON line to this file."""


def _plan(options: ServeOptions) -> FaultPlan:
    faults = options.get("faults", ())
    if isinstance(faults, FaultPlan):
        return faults
    return FaultPlan(
        faults,
        rate=options.get("fault_rate", 0.0),
        kinds=options.get("fault_kinds"),
        seed=options.get("seed", 0),
    )


class PolicyServer:
    """The scripted policy, served by uvicorn in a background thread with its own event loop.

    ``with PolicyServer(script) as srv:`` starts it on a free port (or a Unix
    socket) and returns once it accepts connections; leaving the block stops it
    (hanging requests are released) and joins the thread, also when the block
    raised. ``srv.base_url`` is what a client's ``base_url`` should be.

    Args:
        script: A ``PolicyScript``, a mapping, or a YAML/JSON file path.
        port: TCP port; 0 picks a free one.
        keep_bodies: Keep each request's JSON body in ``request_log`` (tests; memory grows with traffic).
        request_log_limit: Keep only the latest this many records in ``request_log``; None: all.
        start_timeout_s: How long ``start`` waits for the server to listen.
        stop_timeout_s: How long ``stop`` waits for the thread to end.
        **options: Where it listens and which faults it injects (:class:`ServeOptions`).
    """

    def __init__(
        self,
        script: PolicyScript | Mapping[str, Any] | str | os.PathLike[str],
        *,
        port: int = 0,
        keep_bodies: bool = False,
        request_log_limit: int | None = None,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 10.0,
        **options: Unpack[ServeOptions],
    ) -> None:
        self.script = load_script(script)
        self.state = PolicyState(
            options.get("fault_log"), keep_bodies=keep_bodies, log_limit=request_log_limit
        )
        """Counters and logs (also exposed as ``requests``, ``request_log``, ``faults_injected``)."""
        self.app = PolicyApp(self.script, faults=_plan(options), state=self.state)
        uds = options.get("uds")
        self._host, self._port = options.get("host", "127.0.0.1"), port
        self._uds = None if uds is None else str(uds)
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._phase: Literal["new", "running", "stopped"] = "new"
        self._sock: socket.socket | None = None
        self._server: _Uvicorn | None = None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ addresses

    @property
    def uds(self) -> str | None:
        """The Unix socket path, if serving on one."""
        return self._uds

    @property
    def port(self) -> int:
        """The TCP port (known once started; 0 on a Unix socket)."""
        if self._sock is None or self._uds is not None:
            return 0
        return int(self._sock.getsockname()[1])

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/v1``; on a Unix socket ``http://policy/v1`` (the host is not used)."""
        if self._uds is not None:
            return "http://policy/v1"
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}/v1"

    def endpoint(self, *, api: Literal["chat", "responses"] = "chat", **settings: Any) -> ModelEndpoint:
        """A ``ModelEndpoint`` pointing at this server (``uds`` set when serving on a socket).

        Args:
            api: API style.
            **settings: Any other ``ModelEndpoint`` field (``timeout_s``, ``stream``...).
        """
        return ModelEndpoint(
            base_url=self.base_url, model=self.script.model, api=api, uds=self._uds, **settings
        )

    # ------------------------------------------------------------------ logs

    @property
    def requests(self) -> dict[str, int]:
        """Model requests per rollout id ('' for requests without ``X-Rollout-Id``)."""
        return self.state.requests_by_rollout

    @property
    def request_log(self) -> list[RequestRecord]:
        """Every model request, in arrival order."""
        return self.state.requests

    @property
    def faults_injected(self) -> list[FaultRecord]:
        """Every injected fault, in order."""
        return self.state.faults

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Bind, start the server thread and wait until it listens.

        Raises:
            RuntimeError: started before, or the server failed or did not start in time.
            ConfigError: the address cannot be bound.
        """
        if self._phase != "new":
            raise RuntimeError(f"PolicyServer is {self._phase}; a server can be started only once")
        self._phase = "running"
        self._sock = bind_socket(host=self._host, port=self._port, uds=self._uds)
        self._server = _Uvicorn(_config(self.app, quiet=True), self.state)
        self._thread = threading.Thread(target=self._run, name="rollcage-policy-server", daemon=True)
        self._thread.start()
        started = self._server.ready.wait(self._start_timeout_s) and self._server.started
        if not started:
            self.stop()
            raise RuntimeError(
                f"the policy server did not start within {self._start_timeout_s}s"
            ) from self._failure
        return self

    def _run(self) -> None:
        assert self._server is not None and self._sock is not None
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:
            self._failure = exc
        finally:
            self._server.ready.set()

    def stop(self) -> None:
        """Stop the server: release hanging requests, drain, join the thread.

        Raises:
            RuntimeError: the thread did not end within ``stop_timeout_s`` (even after a forced exit).

        Idempotent.
        """
        if self._phase != "running":
            self._phase = "stopped"
            return
        self._phase = "stopped"
        server, thread = self._server, self._thread
        try:
            if server is not None:
                server.should_exit = True
                if server.loop is not None and not server.loop.is_closed():
                    with contextlib.suppress(RuntimeError):  # the loop may close between check and call
                        server.loop.call_soon_threadsafe(self.state.shutting_down.set)
            if thread is not None:
                thread.join(self._stop_timeout_s)
                if thread.is_alive() and server is not None:
                    server.force_exit = True
                    thread.join(self._stop_timeout_s)
                if thread.is_alive():
                    raise RuntimeError(
                        f"the policy server thread did not stop within {2 * self._stop_timeout_s}s"
                    )
        finally:
            if self._sock is not None:
                self._sock.close()
            if self._uds is not None:
                with contextlib.suppress(FileNotFoundError):
                    Path(self._uds).unlink()

    def __enter__(self) -> Self:
        """Start (see ``start``)."""
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop (see ``stop``); a failure to stop is raised only if the block itself did not raise."""
        try:
            self.stop()
        except RuntimeError:
            if exc is None:
                raise


def serve(
    script: PolicyScript | Mapping[str, Any] | str | os.PathLike[str],
    *,
    port: int = 8000,
    announce: Any = print,
    **options: Unpack[ServeOptions],
) -> PolicyState:
    """Serve in the foreground until SIGINT/SIGTERM; return the final counters and logs.

    Args:
        script: As for ``PolicyServer``.
        port: TCP port (0: a free one, announced).
        announce: Called with one line saying where the server listens.
        **options: Where it listens and which faults it injects (:class:`ServeOptions`).

    Raises:
        ConfigError: bad script, fault rules or address.

    **Cancellation:** SIGINT or SIGTERM stops the server gracefully; hanging requests are released.
    """
    loaded = load_script(script)
    state = PolicyState(options.get("fault_log"))
    app = PolicyApp(loaded, faults=_plan(options), state=state)
    host, uds = options.get("host", "127.0.0.1"), options.get("uds")
    sock = bind_socket(host=host, port=port, uds=uds)
    try:
        where = f"unix:{uds}" if uds is not None else f"http://{host}:{sock.getsockname()[1]}/v1"
        tasks = ", ".join(sorted(loaded.tasks))
        announce(f"rollcage serve-policy: model {loaded.model!r} on {where} (tasks: {tasks})")
        with _stop_signals_end_quietly():
            _Uvicorn(_config(app, quiet=False), state).run(sockets=[sock])
    finally:
        sock.close()
        if uds is not None:
            with contextlib.suppress(FileNotFoundError):
                Path(uds).unlink()
    return state


class _Stopped(Exception):
    """SIGTERM arrived (replayed by uvicorn after its graceful shutdown)."""


@contextlib.contextmanager
def _stop_signals_end_quietly() -> Iterator[None]:
    """Make SIGINT and SIGTERM a normal end of ``serve``.

    uvicorn shuts down gracefully on either signal and then re-raises it, so the
    process would die of it (SIGTERM) or with ``KeyboardInterrupt`` (SIGINT)
    before the caller can report what was served.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: object) -> None:
        raise _Stopped

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except (_Stopped, KeyboardInterrupt):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
