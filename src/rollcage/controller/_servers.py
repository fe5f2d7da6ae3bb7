"""Loopback servers the controller runs for a job: bundled environments and the embedded policy.

Each runs in its own thread with its own event loop, so a slow grader or tool
endpoint never stalls the scheduler's loop, and each is stopped (and its thread
joined, with a timeout) when the run ends, however it ends.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from rollcage.controller._dataset import EnvironmentRef, known_served_environment
from rollcage.controller._unit import EnvironmentEndpoint
from rollcage.environments import create_app
from rollcage.errors import ConfigError

__all__ = ["AppServer", "EmbeddedPolicy", "EnvironmentPool"]

logger = logging.getLogger("rollcage.controller")

_STOP_TIMEOUT_S = 10.0


class AppServer:
    """An ASGI app served by uvicorn on ``127.0.0.1:<free port>`` from a background thread.

    The listening socket is bound before the thread starts, so the URL is usable
    as soon as ``start`` returns: early connections wait in the backlog.
    """

    def __init__(self, app: Any, *, name: str) -> None:
        """Prepare to serve ``app``; ``name`` appears in the thread's name and in logs."""
        self._app = app
        self._name = name
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._url: str | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (only after ``start``)."""
        if self._url is None:
            raise RuntimeError(f"{self._name} server is not started")
        return self._url

    def start(self) -> str:
        """Bind, start serving, and return the base URL (blocking, brief).

        Raises:
            ConfigError: No loopback port could be bound.
        """
        import uvicorn

        from rollcage.policy import bind_socket

        try:
            sock = bind_socket(host="127.0.0.1", port=0, backlog=1024)
        except ConfigError as exc:
            raise ConfigError(f"cannot open a loopback port for {self._name}: {exc}") from exc
        port = sock.getsockname()[1]
        config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        server = self._server

        def serve() -> None:
            try:
                server.run(sockets=[sock])
            except Exception:  # pragma: no cover - logged for the user; the run goes on without it
                logger.exception("%s server stopped unexpectedly", self._name)
            finally:
                sock.close()

        self._thread = threading.Thread(target=serve, name=f"rollcage-{self._name}", daemon=True)
        self._thread.start()
        self._url = f"http://127.0.0.1:{port}"
        return self._url

    def stop(self) -> None:
        """Ask the server to exit and join its thread (blocking, bounded)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("%s server did not stop within %.0f s", self._name, _STOP_TIMEOUT_S)
        self._thread = None


class EnvironmentPool:
    """The environments of a run: bundled ones started on loopback, external ones by URL.

    Use as ``with EnvironmentPool() as pool: endpoints = pool.start(refs)`` (blocking).
    """

    def __init__(self) -> None:
        """No environment is running yet."""
        self._servers: list[AppServer] = []
        self._endpoints: dict[str, EnvironmentEndpoint] = {}

    def __enter__(self) -> Self:
        """Enter; environments start with ``start``."""
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop every environment this pool started."""
        self.close()

    def start(self, refs: Iterable[EnvironmentRef]) -> dict[str, EnvironmentEndpoint]:
        """Start each bundled environment once; return every endpoint by resource key.

        Each bundled environment gets a fresh random ``/verify`` token that only this
        controller knows.
        """
        for ref in refs:
            if ref.key in self._endpoints:
                continue
            if ref.bundled is None:
                assert ref.url is not None
                # A bundled app served by URL: its /verify reads the same files as when started here.
                serves = ref.serves or known_served_environment(ref.url)
                files = serves.verify_files if serves is not None else ()
                self._endpoints[ref.key] = EnvironmentEndpoint(url=ref.url, verify_files=files)
                continue
            token = secrets.token_urlsafe(24)
            server = AppServer(create_app(ref.bundled.name, verify_token=token), name=ref.bundled.name)
            url = server.start()
            self._servers.append(server)
            self._endpoints[ref.key] = EnvironmentEndpoint(
                url=url, token=token, verify_files=ref.bundled.verify_files
            )
            logger.info("environment %s on %s", ref.bundled.name, url)
        return dict(self._endpoints)

    def close(self) -> None:
        """Stop every started environment (blocking, bounded per server)."""
        servers, self._servers = self._servers, []
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()


class EmbeddedPolicy:
    """The scripted policy server (``rollcage.policy.PolicyServer``) run in-process for a job."""

    def __init__(self, script: Path) -> None:
        """Prepare to serve ``script`` (a policy YAML/JSON)."""
        self._script = script
        self._server: Any = None

    def start(self) -> str:
        """Start the server and return its base URL (``http://127.0.0.1:PORT/v1``; blocking).

        Raises:
            ConfigError: The script is missing or invalid, or the server cannot start.
        """
        if not self._script.is_file():
            raise ConfigError(
                f"no policy script at {self._script}: put a policy.yaml beside the dataset, "
                "pass --policy SCRIPT, or use a real endpoint with --model URL --model-name NAME"
            )
        from rollcage.policy import PolicyServer

        # A run may send millions of requests: keep counts, not every record.
        server = PolicyServer(self._script, port=0, request_log_limit=1000)
        try:
            server.__enter__()
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"cannot start the scripted policy on {self._script}: {exc}") from exc
        self._server = server
        url: str = server.base_url
        return url

    def stop(self) -> None:
        """Stop the server (blocking, bounded by the server's own shutdown)."""
        server, self._server = self._server, None
        if server is not None:
            server.__exit__(None, None, None)
