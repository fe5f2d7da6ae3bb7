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

What the client sends and reads is :mod:`rollcage.wire`'s. The client is the
worker's, behind the sandbox's wall: this face loads it on first use, so importing
``rollcage.model`` alone does not load the client. The transport the supervisor's
egress proxy shares lives in :mod:`rollcage.http`.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollcage.model._client import (
        ClientState,
        ModelClient,
        failed_call,
        max_call_seconds,
        retry_wait_bounds,
    )

__all__ = ["ClientState", "ModelClient", "failed_call", "max_call_seconds", "retry_wait_bounds"]


def __getattr__(name: str) -> object:
    """The client's names, loaded with the client on first use (see the module docstring)."""
    if name in __all__:
        from rollcage.model import _client

        return getattr(_client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
