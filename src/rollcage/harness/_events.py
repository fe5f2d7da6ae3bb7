"""Harness events: what a harness may report of itself, and how the worker relays it to the supervisor.

A harness writes one JSON object a line to the descriptor named by
``ROLLCAGE_EVENTS_FD`` (NOOA's adapter always does; a command-line agent may)::

    {"type": "tool_start", "id": "call_abc", "name": "execute_python", "arguments": "{...}"}
    {"type": "tool_end", "id": "call_abc", "status": "completed", "output": "42\\n"}
    {"type": "answer", "text": "cold;sum=42"}
    {"type": "error", "message": "GenerationError: ..."}

``id`` is the harness's id of the call (the model server's, when the model asked
for it); ``"synthetic": true`` on ``tool_start`` marks a call the harness made on
its own (NOOA's first turn). Everything here is the harness's own account: the worker bounds it
(:data:`MAX_EVENT_BYTES` a line, :data:`MAX_EVENTS` in all), drops what does not
parse, and marks what it keeps ``reported_by: harness``.

The worker relays the tool boundaries it builds from them to the supervisor (one
line each, :func:`relay_line`), which journals them beside the model calls it
takes from the egress proxy's capture.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from rollcage.procs import AsyncClosing
from rollcage.protocol import BoundaryRecord

__all__ = [
    "EVENTS_FD_ENV",
    "GRACE_ENV",
    "MAX_EVENTS",
    "MAX_EVENT_BYTES",
    "RELAY_FD_ENV",
    "AnswerEvent",
    "ErrorEvent",
    "HarnessEvent",
    "RelayWriter",
    "ToolEndEvent",
    "ToolStartEvent",
    "parse_relay_line",
    "read_events",
    "read_lines",
    "relay_line",
]

logger = logging.getLogger("rollcage.harness")

EVENTS_FD_ENV = "ROLLCAGE_EVENTS_FD"
"""The harness's environment variable naming the descriptor it may write its events to."""

RELAY_FD_ENV = "ROLLCAGE_JOURNAL_FD"
"""The worker's environment variable naming the descriptor its relayed boundaries go to (supervisor)."""

GRACE_ENV = "ROLLCAGE_GRACE_S"
"""The worker's environment variable holding the supervisor's SIGTERM → SIGKILL grace (seconds)."""

MAX_EVENT_BYTES = 1 << 20
"""The longest event line kept; a longer one is dropped."""

MAX_EVENTS = 100_000
"""Events read from one harness at most; later ones are dropped."""

_ID_CHARS = 512
_NAME_CHARS = 256


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ToolStartEvent(_Event):
    """The harness started a tool call."""

    type: Literal["tool_start"] = Field(description="Event kind.")
    id: str = Field(min_length=1, max_length=_ID_CHARS, description="The harness's id of the call.")
    name: str = Field(max_length=_NAME_CHARS, description="The tool's name.")
    arguments: str = Field(default="", description="Its arguments as the model wrote them (JSON text).")
    synthetic: bool = Field(
        default=False, description="The harness made the call on its own (no model response asked for it)."
    )


class ToolEndEvent(_Event):
    """A tool call ended."""

    type: Literal["tool_end"] = Field(description="Event kind.")
    id: str = Field(min_length=1, max_length=_ID_CHARS, description="The harness's id of the call.")
    status: Literal["completed", "failed"] = Field(description="How it ended.")
    output: str = Field(default="", description="What the model is shown of its result.")


class AnswerEvent(_Event):
    """The harness's final answer."""

    type: Literal["answer"] = Field(description="Event kind.")
    text: str = Field(description="The answer.")


class ErrorEvent(_Event):
    """The harness failed; its own words."""

    type: Literal["error"] = Field(description="Event kind.")
    message: str = Field(description="What went wrong.")


HarnessEvent = Annotated[
    ToolStartEvent | ToolEndEvent | AnswerEvent | ErrorEvent, Field(discriminator="type")
]
"""One line a harness reports, tagged by ``type``."""

_EVENT: TypeAdapter[ToolStartEvent | ToolEndEvent | AnswerEvent | ErrorEvent] = TypeAdapter(HarnessEvent)


async def read_lines(reader: asyncio.StreamReader, limit: int) -> AsyncIterator[bytes | None]:
    """Lines of a stream, each at most ``limit`` bytes; ``None`` for a longer one (skipped to its end).

    A last line without its newline still counts.

    **Cancellation:** safe; stops reading.
    """
    skipping = False
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial and not skipping:
                yield exc.partial if len(exc.partial) <= limit else None
            return
        except asyncio.LimitOverrunError as exc:
            # Drop what is buffered of the long line, and the rest of it as it comes.
            await reader.readexactly(exc.consumed)
            if not skipping:
                skipping = True
                yield None
            continue
        if skipping:
            skipping = False
            continue
        yield line if len(line) <= limit + 1 else None


async def read_events(reader: asyncio.StreamReader) -> AsyncIterator[HarnessEvent | None]:
    """The harness's events; ``None`` for a line that is too long or not a valid event.

    Stops after :data:`MAX_EVENTS` lines (the rest is drained and dropped).

    **Cancellation:** safe; stops reading.
    """
    seen = 0
    async for line in read_lines(reader, MAX_EVENT_BYTES):
        seen += 1
        if seen > MAX_EVENTS:
            continue
        if line is None or not line.strip():
            if line is None:
                yield None
            continue
        try:
            yield _EVENT.validate_json(line)
        except ValidationError:
            yield None


def relay_line(record: BoundaryRecord, *, after: int) -> bytes:
    """One line for the supervisor: a harness-reported boundary, and how many model calls preceded it."""
    return orjson.dumps({"after": after, "record": record.model_dump(mode="json", exclude_none=True)}) + b"\n"


def parse_relay_line(line: bytes) -> tuple[BoundaryRecord, int] | None:
    """A relayed boundary and its ``after``; ``None`` (logged) when the line is not one."""
    try:
        value: Any = orjson.loads(line)
        after = value["after"]
        record = BoundaryRecord.model_validate(value["record"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValidationError) as exc:
        logger.warning("dropping a relayed boundary that is not one: %s", str(exc)[:200])
        return None
    if type(after) is not int or after < 0 or record.kind != "tool_call":
        logger.warning("dropping a relayed boundary that is not a tool call")
        return None
    return record, after


class RelayWriter(AsyncClosing):
    """The worker's end of the relay to the supervisor: one line per boundary, in order.

    The descriptor is a pipe the supervisor reads (see ``rollcage.harness.CaptureJournal``).
    A write that cannot finish within ``timeout_s`` (the supervisor stopped reading) is
    counted as a failure and the run goes on: evidence is best effort, the rollout is not.

    Args:
        fd: The pipe's write end (taken over: closed by :meth:`aclose`).
        timeout_s: The longest one boundary may wait for room in the pipe.
    """

    def __init__(self, fd: int, *, timeout_s: float = 10.0) -> None:
        self._fd = fd
        self._timeout_s = timeout_s
        self._writer: asyncio.StreamWriter | None = None
        self.failures = 0
        """Boundaries that could not be relayed."""

    async def __aenter__(self) -> RelayWriter:
        """Take over the descriptor.

        **Cancellation:** the descriptor is closed.

        Raises:
            OSError: It is not a pipe this process can write.
        """
        loop = asyncio.get_running_loop()
        pipe = os.fdopen(self._fd, "wb", buffering=0)
        try:
            transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, pipe)
        except BaseException:
            pipe.close()
            raise
        self._writer = asyncio.StreamWriter(transport, protocol, None, loop)
        return self

    async def send(self, record: BoundaryRecord, *, after: int) -> bool:
        """Relay one boundary; whether it went out.

        **Cancellation:** the line may or may not have been written.
        """
        writer = self._writer
        if writer is None or writer.is_closing():
            self.failures += 1
            return False
        try:
            writer.write(relay_line(record, after=after))
            async with asyncio.timeout(self._timeout_s):
                await writer.drain()
        except (OSError, TimeoutError) as exc:
            self.failures += 1
            logger.error("cannot relay a boundary to the supervisor (%d so far): %s", self.failures, exc)
            return False
        return True

    async def aclose(self) -> None:
        """Close the pipe; the supervisor reads what was sent, then its end.

        **Cancellation:** the pipe is closed at once.
        """
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(OSError):
                # A pipe transport flushes what is buffered before it closes the descriptor.
                writer.close()
            await asyncio.sleep(0)
