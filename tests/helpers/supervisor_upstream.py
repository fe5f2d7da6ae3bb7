"""A tiny HTTP upstream for the egress-proxy tests: records every request, answers as told.

``with Upstream() as up:`` serves on a free loopback port in a thread with its
own event loop; ``up.base_url`` is its URL; ``up.requests`` lists what arrived
(method, path, headers, body). Behaviour by path suffix:

* ``.../chat/completions``: a chat completion (JSON);
* ``.../stream``: three server-sent events, ``up.sse_gap_s`` apart;
* ``.../hang``: never answers (until the client goes away or the server stops);
* ``.../big``: ``up.big_bytes`` bytes;
* anything else: echoes the JSON body back as ``{"echo": ...}``.

A path containing ``hang`` also hangs, so a model route can be made to hang by
pointing ``model.base_url`` at ``<base_url>/hang``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import h11

__all__ = ["Upstream", "UpstreamRequest"]


@dataclass
class UpstreamRequest:
    """One request as the upstream saw it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    arrived_at: float = 0.0
    """Unix time the whole request had arrived."""

    def json(self) -> Any:
        """The body, parsed."""
        return json.loads(self.body)


@dataclass
class Upstream:
    """See the module docstring."""

    sse_gap_s: float = 0.05
    big_bytes: int = 1 << 20
    requests: list[UpstreamRequest] = field(default_factory=list)
    hanging: int = 0
    disconnected: threading.Event = field(default_factory=threading.Event)
    connections: int = 0
    """Connections accepted so far (each is kept alive for the next request)."""

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Upstream:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        future.result(timeout=10)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = None, b""
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await reader.read(65536))
                    elif isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                assert request is not None
                seen = UpstreamRequest(
                    method=request.method.decode(),
                    path=request.target.decode(),
                    headers={k.decode().lower(): v.decode() for k, v in request.headers},
                    body=body,
                    arrived_at=time.time(),
                )
                self.requests.append(seen)
                await self._answer(conn, reader, writer, seen)
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _answer(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        seen: UpstreamRequest,
    ) -> None:
        if "hang" in seen.path:
            self.hanging += 1
            # Wait until the client goes away: that is what the proxy must notice.
            while await reader.read(65536):
                pass
            self.disconnected.set()
            raise ConnectionError("client went away")
        if seen.path.endswith("/stream"):
            writer.write(
                conn.send(h11.Response(status_code=200, headers=[("content-type", "text/event-stream")]))
                or b""
            )
            for i in range(3):
                writer.write(conn.send(h11.Data(data=f'data: {{"n": {i}}}\n\n'.encode())) or b"")
                await writer.drain()
                await asyncio.sleep(self.sse_gap_s)
            writer.write(conn.send(h11.Data(data=b"data: [DONE]\n\n")) or b"")
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
            return
        if seen.path.endswith("/big"):
            payload = b"x" * self.big_bytes
            content_type = "application/octet-stream"
        elif seen.path.endswith("/chat/completions"):
            payload = json.dumps(
                {
                    "id": f"chatcmpl-{len(self.requests)}",
                    "object": "chat.completion",
                    "model": "fake",
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "hello"},
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                }
            ).encode()
            content_type = "application/json"
        else:
            payload = json.dumps(
                {"echo": json.loads(seen.body) if seen.body else None, "path": seen.path}
            ).encode()
            content_type = "application/json"
        headers = [("content-type", content_type), ("content-length", str(len(payload)))]
        if seen.path.endswith("/set-cookie"):
            headers.append(("set-cookie", "sticky=node-4; Path=/"))
        writer.write(conn.send(h11.Response(status_code=200, headers=headers)) or b"")
        writer.write(conn.send(h11.Data(data=payload)) or b"")
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
