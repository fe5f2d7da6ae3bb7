"""The model client: one async client for OpenAI-compatible endpoints (Chat Completions and Responses).

Built on httpx, pydantic and orjson only; it runs in every worker process, so
importing it must stay cheap (``bench/imports.py`` measures it). The official
``openai`` SDK is the reference in the tests, never a dependency here::

    from rollcage.model import ModelClient

    async with ModelClient(endpoint, rollout_id="r-1", task_id="t-1", cookies=cookies) as client:
        record = await client.call(input=items, instructions=None, tools=tools, index=0)
    record.output        # Responses items: message / function_call / reasoning, whatever the API style
    client.cookies       # updated from Set-Cookie

Failures raise ``TransientModelError``, ``ModelTimeoutError`` or
``FatalModelError`` (``rollcage.errors``), each with a ``record`` attribute
holding the ``failed`` ``ModelCall`` (``failed_call(exc)`` reads it, typed).
One call never takes longer than ``max_call_seconds(endpoint)``.
"""

from rollcage.model._client import ClientState, ModelClient, failed_call, max_call_seconds, retry_wait_bounds
from rollcage.model._wire import (
    CallOutcome,
    WireError,
    build_request,
    chat_messages,
    parse_chat_completion,
    parse_payload,
)

__all__ = [
    "CallOutcome",
    "ClientState",
    "ModelClient",
    "WireError",
    "build_request",
    "chat_messages",
    "failed_call",
    "max_call_seconds",
    "parse_chat_completion",
    "parse_payload",
    "retry_wait_bounds",
]
