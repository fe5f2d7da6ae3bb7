"""The model's wire: what an OpenAI-compatible endpoint is sent and what it answers, read without I/O.

Request payloads for both API styles (Chat Completions and Responses), their
answers read back as Responses items with token data, server-sent event streams
assembled into one payload, and the tools the agent offers with the names it gives
the calls it gets back.

Both sides of the sandbox's wall read the wire, so it lives below both: the
worker's model client (:mod:`rollcage.model`) sends requests and reads answers with
it, and the supervisor reads the egress proxy's capture of a black-box harness's
model calls with it (:class:`rollcage.harness.CaptureJournal`), to vouch for them
from outside the sandbox. Nothing here opens a connection, retries or keeps
state; that is the client's, which stays on the worker's side of the wall.
"""

from rollcage.wire._offer import SUBMIT, function_tools, own_call_ids
from rollcage.wire._payloads import (
    CallOutcome,
    WireError,
    build_request,
    chat_input_items,
    chat_messages,
    parse_payload,
    without_lifted,
)
from rollcage.wire._stream import ServerEventError, assemble_stream, sse_events, sse_lines

__all__ = [
    "SUBMIT",
    "CallOutcome",
    "ServerEventError",
    "WireError",
    "assemble_stream",
    "build_request",
    "chat_input_items",
    "chat_messages",
    "function_tools",
    "own_call_ids",
    "parse_payload",
    "sse_events",
    "sse_lines",
    "without_lifted",
]
