"""The supervisor's journal of a harness rollout: every model call from the capture, outside the sandbox.

A black-box harness writes nothing rollcage can trust, and may write nothing at
all. For such a rollout the supervisor owns ``checkpoint.jsonl`` (the sandbox
cannot even see it) and appends through the journal's one writer
(:class:`rollcage.checkpoint.BoundaryJournal`, the worker's too), durably and in
the record format ``rollcage.load_checkpoint`` reads:

* a ``start`` record when the rollout starts;
* per model exchange the egress proxy captured, a ``turn_start`` record (one
  turn per call: a black box's turns are not visible) and a ``model_call`` record
  (``reported_by: supervisor``), with the tool calls its response asks for as
  pending calls named ``call_<index>_<k>`` — the worker numbers and names them the
  same way (``WireCalls``);
* the tool calls the harness reported ending (``reported_by: harness``), relayed
  by the worker through a pipe; each waits (briefly) for the model calls the
  worker had seen before it, so the journal keeps the order things happened in.

So a harness SIGKILLed after k model calls leaves k model-call boundaries, and
nothing inside the sandbox can forge or remove one. Appends are best effort (a
failure is logged and counted); the relayed bytes are bounded per rollout.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from pathlib import Path
from typing import Any, Self

import orjson

from rollcage.checkpoint import BoundaryJournal
from rollcage.harness._calls import WireCalls, WireExchange, model_call_api
from rollcage.harness._events import parse_relay_line, read_lines
from rollcage.procs import AsyncClosing, shielded, wait_shared, within
from rollcage.protocol import BoundaryRecord

__all__ = ["CaptureJournal"]

logger = logging.getLogger("rollcage.harness")

_RELAY_LINE_BYTES = 16 * 1024 * 1024
_RELAYED_BYTES = 64 * 1024 * 1024
_ORDER_WAIT_S = 1.0


class CaptureJournal(AsyncClosing):
    """``checkpoint.jsonl`` of a harness rollout, written by the supervisor (see the module docstring).

    Example::

        async with CaptureJournal(layout.checkpoint, rollout_id=rid, model_prefix="/model/v1") as journal:
            proxy = EgressProxy(..., on_capture=journal.on_capture)
            pump = asyncio.ensure_future(journal.pump(read_fd))
            ...                                   # the worker runs
            await proxy.aclose(); await journal.finish(pump)

    Args:
        path: The journal file.
        rollout_id: Written on the ``start`` record.
        model_prefix: The proxy's path prefix of the model route (``/model/v1``).
        max_relayed_bytes: Relayed bytes kept per rollout; past it, relayed boundaries are dropped.
    """

    def __init__(
        self, path: Path, *, rollout_id: str, model_prefix: str, max_relayed_bytes: int = _RELAYED_BYTES
    ) -> None:
        self._journal = BoundaryJournal(path)
        self._rollout_id = rollout_id
        self._prefix = model_prefix.rstrip("/")
        self._relay_left = max_relayed_bytes
        self._wire = WireCalls(rollout_id)
        self._lock = asyncio.Lock()
        self._advanced = asyncio.Condition()
        self._calls = 0
        self._closing = False
        self._open = False
        self.dropped = 0
        """Relayed boundaries dropped (malformed, too long, past the byte bound)."""

    @property
    def failures(self) -> int:
        """Boundaries that could not be appended."""
        return self._journal.failures

    @property
    def model_calls(self) -> int:
        """Model calls journaled so far."""
        return self._calls

    async def __aenter__(self) -> Self:
        """Open the journal and append its ``start`` record.

        **Cancellation:** the journal is closed again.

        Raises:
            DurableWriteError: The journal cannot be opened.
        """
        await self._journal.__aenter__()
        self._open = True
        start = BoundaryRecord(
            kind="start", at=time.time(), rollout_id=self._rollout_id, reported_by="supervisor"
        )
        await self._append(start)
        return self

    async def aclose(self) -> None:
        """Stop waiting for model calls that will not come, write what is queued and close.

        **Cancellation:** the journal is closed at once; queued lines are still written.
        """
        self._closing = True
        async with self._advanced:
            self._advanced.notify_all()
        if self._open:
            self._open = False
            await self._journal.aclose()

    async def on_capture(self, record: dict[str, Any]) -> None:
        """Journal one capture line if it is a model call forwarded upstream (the proxy's hook).

        **Cancellation:** the boundary may or may not be on disk.
        """
        exchange = self._exchange(record)
        if exchange is None:
            return
        async with self._lock:
            wire = await self._wire.next(exchange)
            turn = BoundaryRecord(
                kind="turn_start", at=wire.turn.started_at, turn=wire.turn, reported_by="supervisor"
            )
            await self._append(turn)
            await self._append(
                BoundaryRecord(
                    kind="model_call",
                    at=time.time(),
                    model_call=wire.call,
                    tool_calls=wire.tools,
                    reported_by="supervisor",
                )
            )
            self._calls += 1
        async with self._advanced:
            self._advanced.notify_all()

    async def pump(self, fd: int) -> None:
        """Journal the boundaries the worker relays on ``fd`` (a pipe's read end, taken over) until it closes.

        **Cancellation:** stops reading; the descriptor is closed.
        """
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_RELAY_LINE_BYTES + 1)
        pipe = os.fdopen(fd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        try:
            async for line in read_lines(reader, _RELAY_LINE_BYTES):
                if line is None or len(line) > self._relay_left:
                    self._drop("a relayed boundary over the bound")
                    continue
                self._relay_left -= len(line)
                parsed = parse_relay_line(line)
                if parsed is None:
                    self._drop("a relayed line that is not a boundary")
                    continue
                record, after = parsed
                await self._in_order(after)
                # Whatever the line says, what comes through this pipe is the harness's account.
                await self._append(record.model_copy(update={"reported_by": "harness"}))
        finally:
            transport.close()

    async def finish(self, pump: asyncio.Future[None] | None, *, timeout_s: float = 2.0) -> None:
        """Read what the worker relayed before it ended (bounded), then close.

        **Cancellation:** the relay's reader is cancelled and the journal closed before
        ``CancelledError`` propagates.
        """
        self._closing = True
        async with self._advanced:
            self._advanced.notify_all()
        try:
            if pump is not None:
                await _await_relay(pump, timeout_s)
        finally:
            await shielded(self.aclose())

    async def _in_order(self, after: int) -> None:
        """Wait (briefly) until the model calls the worker had seen before this boundary are journaled."""
        async with self._advanced:
            await within(
                self._advanced.wait_for(lambda: self._calls >= after or self._closing), _ORDER_WAIT_S
            )

    async def _append(self, record: BoundaryRecord) -> None:
        await self._journal.append(record)  # best effort: a failure is logged and counted there

    def _drop(self, what: str) -> None:
        self.dropped += 1
        if self.dropped == 1:
            logger.warning("dropping %s (and any more like it)", what)

    def _exchange(self, record: dict[str, Any]) -> WireExchange | None:
        """The model exchange a capture line holds, or ``None`` when it is no model call sent upstream."""
        path = record.get("path")
        if record.get("route") != "model" or not isinstance(path, str) or record.get("upstream_url") is None:
            return None
        if not path.startswith(self._prefix):
            return None
        api = model_call_api(str(record.get("method")), path[len(self._prefix) :])
        if api is None:
            return None
        request = record.get("request") or {}
        response = record.get("response")
        content_type = None
        body: bytes | None = None
        if isinstance(response, dict):
            content_type = _header(response.get("headers"), "content-type")
            body = _body_bytes(response.get("body"))
        started = float(record.get("started_at") or time.time())
        return WireExchange(
            api=api,
            request=_body_bytes(request.get("body") if isinstance(request, dict) else None) or b"",
            status=record.get("status") if isinstance(record.get("status"), int) else None,
            content_type=content_type,
            response=body,
            started_at=started,
            first_byte_at=record.get("first_byte_at"),
            ended_at=float(record.get("ended_at") or started),
            error=record.get("error") if isinstance(record.get("error"), str) else None,
        )


def _header(headers: Any, name: str) -> str | None:
    if isinstance(headers, list):
        for pair in headers:
            if isinstance(pair, list | tuple) and len(pair) == 2 and str(pair[0]).lower() == name:
                return str(pair[1])
    return None


def _body_bytes(body: Any) -> bytes | None:
    """A captured body's bytes again; ``None`` when the capture kept only a part of it."""
    if not isinstance(body, dict) or body.get("truncated"):
        return None
    if "json" in body:
        return orjson.dumps(body["json"])
    if isinstance(body.get("text"), str):
        return str(body["text"]).encode("utf-8")
    if isinstance(body.get("base64"), str):
        return base64.b64decode(body["base64"])
    return b""


async def _await_relay(pump: asyncio.Future[None], timeout_s: float) -> None:
    """Let the relay's reader finish within ``timeout_s``; cancel it if it does not (or on cancellation)."""
    try:
        await within(wait_shared(pump), timeout_s)
    except Exception as exc:
        logger.warning("reading the worker's relay failed: %r", exc)
    finally:
        if not pump.done():
            logger.warning("the worker's relay did not close within %gs; not waiting for it", timeout_s)
            pump.cancel()
    await asyncio.gather(pump, return_exceptions=True)
