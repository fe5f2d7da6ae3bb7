"""``ModelClient``: one async client per rollout for an OpenAI-compatible endpoint.

Every failure is classified where it enters, and nothing waits without a bound::

    attempt ──► 2xx, body parses ─────────────────────► ModelCall (completed / incomplete)
       │        2xx, body broken or truncated ───┐
       │        408 409 429 5xx ─────────────────┤ retry (≤ max_retries, backoff,
       │        connection error, reset ─────────┤        Retry-After honoured up to a cap)
       │        no answer within timeout_s ──────┘──► TransientModelError / ModelTimeoutError
       └──────► other 4xx, context length ──────────► FatalModelError (never retried)

A call therefore takes at most ``max_call_seconds(endpoint)``: every attempt
runs under ``asyncio.timeout(timeout_s)`` (on top of httpx's own connect/read
timeouts, so a server that accepts the connection and then says nothing is cut
off too), and every wait between attempts is capped by ``retry_wait_bounds``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import re
import time
from collections.abc import Mapping, Sequence
from email.utils import parsedate_to_datetime
from http.cookiejar import CookieJar, DefaultCookiePolicy
from http.cookies import CookieError, SimpleCookie
from types import TracebackType
from typing import Any, NoReturn, Self

import orjson

from rollcage.errors import FatalModelError, ModelError, ModelTimeoutError, TransientModelError
from rollcage.model._httpx import httpx, transport_for
from rollcage.model._stream import ServerEventError, assemble_stream, sse_events
from rollcage.model._wire import CallOutcome, WireError, build_request, parse_payload
from rollcage.protocol import ModelCall, ModelEndpoint, RunnerError

__all__ = ["ClientState", "ModelClient", "failed_call", "max_call_seconds", "retry_wait_bounds"]

logger = logging.getLogger("rollcage.model")

_RETRYABLE_STATUS = frozenset({408, 409, 429})
_RETRY_AFTER_CAP_S = 60.0
"""Retry-After is honoured up to min(timeout_s, this): a server may not park a rollout for an hour."""
_BACKOFF_CAP_S = 30.0
"""Exponential backoff stops growing here (unless retry_backoff_s itself is larger)."""
_CONTEXT_LENGTH = re.compile(
    r"context[ _-]?length|context window|maximum context|prompt is too long|input is too long"
    r"|longer than the model|exceeds the model",
    re.IGNORECASE,
)
_ERROR_SNIPPET = 500


class ClientState(enum.Enum):
    """Lifecycle of a ``ModelClient``: opened once, closed once."""

    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


def retry_wait_bounds(endpoint: ModelEndpoint) -> list[float]:
    """The longest wait before each retry (``max_retries`` values).

    Retry *i* (1-based) waits ``retry_backoff_s * 2**(i-1)`` (capped at 30 s, or
    at ``retry_backoff_s`` if larger), jittered down to half of that so that many
    rollouts do not retry in step; a ``Retry-After`` longer than that is honoured
    up to ``min(timeout_s, 60 s)``.
    """
    cap_retry_after = min(endpoint.timeout_s, _RETRY_AFTER_CAP_S)
    return [max(_backoff(endpoint, i), cap_retry_after) for i in range(1, endpoint.max_retries + 1)]


def max_call_seconds(endpoint: ModelEndpoint) -> float:
    """Upper bound on the duration of one ``ModelClient.call``.

    ``(max_retries + 1) * timeout_s + sum(retry_wait_bounds(endpoint))``.
    """
    return (endpoint.max_retries + 1) * endpoint.timeout_s + sum(retry_wait_bounds(endpoint))


def _backoff(endpoint: ModelEndpoint, retry: int) -> float:
    cap = max(_BACKOFF_CAP_S, endpoint.retry_backoff_s)
    return float(min(endpoint.retry_backoff_s * 2 ** (retry - 1), cap))


def failed_call(exc: BaseException) -> ModelCall | None:
    """The failed call's record carried by a ``ModelError`` raised by ``ModelClient.call``, if any.

    The same record is the exception's ``record`` attribute; this accessor is the
    typed way to read it.
    """
    record = getattr(exc, "record", None)
    return record if isinstance(record, ModelCall) else None


class _AttemptFailed(Exception):
    """One attempt failed; carries how to classify it and whether another attempt may help."""

    def __init__(
        self,
        error: type[ModelError],
        message: str,
        *,
        retry: bool,
        http_status: int | None = None,
        retry_after: float | None = None,
        response: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.error = error
        self.retry = retry
        self.http_status = http_status
        self.retry_after = retry_after
        self.response = response


class _Exchange:
    """A successful HTTP exchange: status, payload and when its first byte came."""

    __slots__ = ("first_byte_at", "http_status", "payload")

    def __init__(self, http_status: int, payload: dict[str, Any], first_byte_at: float | None) -> None:
        self.http_status = http_status
        self.payload = payload
        self.first_byte_at = first_byte_at


class _RejectAll(DefaultCookiePolicy):
    """httpx's cookie jar must not keep cookies: the client keeps them itself, one set per endpoint."""

    def set_ok(self, cookie: Any, request: Any) -> bool:
        return False


class ModelClient:
    """Async client for one rollout's model endpoint (Chat Completions or Responses API).

    Use as ``async with ModelClient(endpoint, rollout_id=..., task_id=...) as client``.
    Every request carries ``X-Rollout-Id`` and ``X-Task-Id`` and the current
    cookies; cookies the server sets are kept (``cookies``). No ``Authorization``
    header is ever sent and the environment is not consulted (no ``.netrc``, no
    proxy variables): credentials are added outside the sandbox.

    Args:
        endpoint: Where and how to call the model.
        rollout_id: Sent as ``X-Rollout-Id``.
        task_id: Sent as ``X-Task-Id``.
        cookies: Initial cookies (``model_cookies``); ``None`` means none.
        transport: An httpx transport to use instead of TCP or ``endpoint.uds``
            (e.g. ``httpx.MockTransport`` in tests); ``None`` picks by endpoint.
    """

    def __init__(
        self,
        endpoint: ModelEndpoint,
        *,
        rollout_id: str,
        task_id: str,
        cookies: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._rollout_id = rollout_id
        self._task_id = task_id
        self._cookies: dict[str, str] = dict(cookies or {})
        self._transport = transport
        self._state = ClientState.UNOPENED
        self._http: httpx.AsyncClient | None = None
        path = "/chat/completions" if endpoint.api == "chat" else "/responses"
        self._url = endpoint.base_url.rstrip("/") + path

    @property
    def state(self) -> ClientState:
        """Where the client is in its lifecycle."""
        return self._state

    @property
    def cookies(self) -> dict[str, str]:
        """The current cookies (a copy): the initial ones, updated by every ``Set-Cookie``."""
        return dict(self._cookies)

    @property
    def endpoint(self) -> ModelEndpoint:
        """The endpoint this client calls."""
        return self._endpoint

    async def __aenter__(self) -> Self:
        """Open the HTTP connection pool.

        Raises:
            RuntimeError: the client was opened before (a client is opened once).
        """
        if self._state is not ClientState.UNOPENED:
            raise RuntimeError(f"ModelClient is {self._state.value}; a client can be opened only once")
        endpoint = self._endpoint
        transport = self._transport or transport_for(endpoint.base_url, uds=endpoint.uds)
        client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(endpoint.timeout_s, connect=endpoint.connect_timeout_s),
            trust_env=False,
            follow_redirects=False,
            cookies=CookieJar(policy=_RejectAll()),
            headers={"User-Agent": "rollcage"},
        )
        await client.__aenter__()
        self._http = client
        self._state = ClientState.OPENED
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the connection pool (see ``aclose``)."""
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool; later calls raise ``RuntimeError``. Closing twice is a no-op.

        **Cancellation:** the pool is closed even if cancelled while closing (shielded).
        """
        http, self._http = self._http, None
        self._state = ClientState.CLOSED
        if http is not None:
            await asyncio.shield(http.aclose())

    async def call(
        self,
        input: str | Sequence[Mapping[str, Any]],
        *,
        instructions: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        index: int = 0,
    ) -> ModelCall:
        """Make one model call, retrying transient failures, and return its record.

        Args:
            input: Responses-API input items (``message``, ``function_call``,
                ``function_call_output``, ``reasoning``), or a text taken as one
                user message. Converted to chat messages for ``api: chat``.
            instructions: System instructions; ``None`` sends none.
            tools: Responses-style function tools; converted for ``api: chat``.
            index: The call's position in the rollout (``ModelCall.index``).

        Returns:
            The record of a ``completed`` or ``incomplete`` call: the exact request,
            the raw (or assembled) response, output as Responses items, token
            counts as reported, timings and the number of attempts.

        Raises:
            TransientModelError: retries exhausted on connection errors, 408, 409,
                429, 5xx, or bodies that are not JSON / not the API's shape /
                truncated streams.
            ModelTimeoutError: retries exhausted and the last attempt got no
                complete answer within ``timeout_s``.
            FatalModelError: any other 4xx, a context-length error, or input that
                cannot be expressed in the endpoint's API.
            RuntimeError: the client is not open.

            Every ``ModelError`` raised here has a ``record`` attribute: the
            ``failed`` ``ModelCall`` (see ``failed_call``).

        **Cancellation:** cancellable at any point, also during a backoff wait; the
        request in flight is abandoned (its connection closed), no record is made,
        and ``CancelledError`` propagates. The call never takes longer than
        ``max_call_seconds(endpoint)``.
        """
        if self._state is not ClientState.OPENED or self._http is None:
            raise RuntimeError(f"ModelClient is {self._state.value}; use it inside 'async with'")
        endpoint = self._endpoint
        started_at = time.time()
        try:
            payload = build_request(endpoint, input, instructions=instructions, tools=tools)
            body = orjson.dumps(payload)
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            failure = _AttemptFailed(
                FatalModelError, f"cannot build the request (none sent): {exc!r}", retry=False
            )
            self._fail(failure, index, {"input": _jsonable(input)}, started_at, None, 1)
        attempts = 0
        first_byte_at: float | None = None
        while True:
            attempts += 1
            try:
                exchange = await self._attempt(body)
                first_byte_at = exchange.first_byte_at
                outcome = self._interpret(exchange)
            except _AttemptFailed as failure:
                if not failure.retry or attempts > endpoint.max_retries:
                    self._fail(failure, index, payload, started_at, first_byte_at, attempts)
                wait = self._wait_before_retry(attempts, failure.retry_after)
                logger.info(
                    "model call %s/%d attempt %d failed (%s); retrying in %.2fs",
                    self._rollout_id,
                    index,
                    attempts,
                    failure,
                    wait,
                )
                await asyncio.sleep(wait)
                continue
            return ModelCall(
                index=index,
                api=endpoint.api,
                request=payload,
                response=exchange.payload,
                status="incomplete" if outcome.status == "incomplete" else "completed",
                incomplete_reason=outcome.incomplete_reason,
                output=outcome.output,
                usage=outcome.usage,
                http_status=exchange.http_status,
                attempts=attempts,
                started_at=started_at,
                first_byte_at=first_byte_at,
                ended_at=time.time(),
            )

    # ------------------------------------------------------------------ one attempt

    async def _attempt(self, body: bytes) -> _Exchange:
        """Send one request and read its whole answer, all within ``timeout_s``."""
        try:
            async with asyncio.timeout(self._endpoint.timeout_s):
                return await self._exchange(body)
        except TimeoutError as exc:
            raise _AttemptFailed(
                ModelTimeoutError, f"no complete answer within {self._endpoint.timeout_s}s", retry=True
            ) from exc

    async def _exchange(self, body: bytes) -> _Exchange:
        assert self._http is not None
        endpoint = self._endpoint
        headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream" if endpoint.stream else "application/json",
            "X-Rollout-Id": self._rollout_id,
            "X-Task-Id": self._task_id,
        }
        if self._cookies:
            headers["Cookie"] = "; ".join(f"{name}={value}" for name, value in self._cookies.items())
        request = self._http.build_request("POST", self._url, content=body, headers=headers)
        try:
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            _raise_transport(exc)
        try:
            first_byte_at = time.time()
            self._keep_cookies(response)
            status = response.status_code
            if not 200 <= status < 300:
                raw = await response.aread()
                raise _status_failure(status, raw, response.headers)
            if endpoint.stream and "text/event-stream" in response.headers.get("content-type", ""):
                try:
                    streamed = await assemble_stream(endpoint.api, sse_events(response.aiter_lines()))
                except WireError as exc:
                    raise _AttemptFailed(
                        TransientModelError,
                        f"bad stream from the server: {exc}",
                        retry=True,
                        http_status=status,
                    ) from exc
                except ServerEventError as exc:
                    fatal = exc.code == "context_length_exceeded" or bool(_CONTEXT_LENGTH.search(str(exc)))
                    raise _AttemptFailed(
                        FatalModelError if fatal else TransientModelError,
                        f"the server reported an error in the stream: {exc}",
                        retry=not fatal,
                        http_status=status,
                    ) from exc
                return _Exchange(status, streamed.payload, streamed.first_event_at or first_byte_at)
            raw = await response.aread()
            return _Exchange(status, _json_object(raw, status), first_byte_at)
        except httpx.HTTPError as exc:
            _raise_transport(exc)
        finally:
            await response.aclose()

    def _interpret(self, exchange: _Exchange) -> CallOutcome:
        try:
            outcome = parse_payload(self._endpoint.api, exchange.payload)
        except WireError as exc:
            raise _AttemptFailed(
                TransientModelError,
                f"the server's answer is not a valid {self._endpoint.api} response: {exc}",
                retry=True,
                http_status=exchange.http_status,
                response=exchange.payload,
            ) from exc
        if outcome.status == "failed":
            message = f"the response failed: {outcome.error_code or 'no code'}: {outcome.error_message or ''}"
            fatal = bool(
                (outcome.error_code and ("invalid" in outcome.error_code or "context" in outcome.error_code))
                or _CONTEXT_LENGTH.search(outcome.error_message or "")
            )
            raise _AttemptFailed(
                FatalModelError if fatal else TransientModelError,
                message,
                retry=not fatal,
                http_status=exchange.http_status,
                response=exchange.payload,
            )
        return outcome

    def _wait_before_retry(self, retry: int, retry_after: float | None) -> float:
        endpoint = self._endpoint
        base = _backoff(endpoint, retry)
        wait = base * random.uniform(0.5, 1.0)
        if retry_after is not None:
            wait = max(wait, min(retry_after, endpoint.timeout_s, _RETRY_AFTER_CAP_S))
        return wait

    def _keep_cookies(self, response: httpx.Response) -> None:
        for header in response.headers.get_list("set-cookie"):
            jar = SimpleCookie()
            try:
                jar.load(header)
            except CookieError:
                logger.warning("ignoring a malformed Set-Cookie header from the model endpoint: %r", header)
                continue
            for name, morsel in jar.items():
                if _expired(morsel["max-age"], morsel["expires"]):
                    self._cookies.pop(name, None)
                else:
                    self._cookies[name] = morsel.value

    def _fail(
        self,
        failure: _AttemptFailed,
        index: int,
        payload: dict[str, Any],
        started_at: float,
        first_byte_at: float | None,
        attempts: int,
    ) -> NoReturn:
        error = failure.error(
            f"{failure} (after {attempts} attempt{'s' if attempts > 1 else ''}; {self._endpoint.api} "
            f"endpoint {self._url})"
        )
        record = ModelCall(
            index=index,
            api=self._endpoint.api,
            request=payload,
            response=failure.response,
            status="failed",
            http_status=failure.http_status,
            attempts=attempts,
            started_at=started_at,
            first_byte_at=first_byte_at,
            ended_at=time.time(),
            error=RunnerError(kind=error.kind, type=type(error).__name__, message=str(error)),
        )
        error.record = record
        raise error from failure.__cause__


# --------------------------------------------------------------------------- classification at the edge


def _raise_transport(exc: Exception) -> NoReturn:
    """Translate an httpx error of one attempt."""
    if isinstance(exc, httpx.TimeoutException):
        raise _AttemptFailed(
            ModelTimeoutError, f"timed out: {type(exc).__name__}: {exc}", retry=True
        ) from exc
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.LocalProtocolError | httpx.InvalidURL):
        # Our own request cannot be sent (bad base_url): no retry can fix that.
        raise _AttemptFailed(FatalModelError, f"cannot send the request: {exc}", retry=False) from exc
    raise _AttemptFailed(
        TransientModelError,
        f"connection failed: {type(exc).__name__}: {str(exc) or 'no detail (reset?)'}",
        retry=True,
    ) from exc


def _status_failure(status: int, raw: bytes, headers: httpx.Headers) -> _AttemptFailed:
    """Classify a non-2xx answer: 408/409/429/5xx are worth retrying, context length never is."""
    code, message = _error_detail(raw)
    text = f"HTTP {status}: {code + ': ' if code else ''}{message}"
    context_length = code == "context_length_exceeded" or bool(_CONTEXT_LENGTH.search(message))
    if (status in _RETRYABLE_STATUS or status >= 500) and not context_length:
        return _AttemptFailed(
            TransientModelError, text, retry=True, http_status=status, retry_after=_retry_after(headers)
        )
    return _AttemptFailed(FatalModelError, text, retry=False, http_status=status)


def _error_detail(raw: bytes) -> tuple[str | None, str]:
    """The error code and message of an error body (OpenAI, vLLM and FastAPI shapes), else a snippet."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, raw[:_ERROR_SNIPPET].decode("utf-8", "replace") or "(empty body)"
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        message = error.get("message") or error.get("detail") or orjson.dumps(error).decode()
        return (None if code is None else str(code)), str(message)[:_ERROR_SNIPPET]
    return None, str(error)[:_ERROR_SNIPPET]


def _retry_after(headers: httpx.Headers) -> float | None:
    """Seconds the server asks us to wait (``retry-after-ms``, ``retry-after`` seconds or date)."""
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            return max(0.0, float(value) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _json_object(raw: bytes, status: int) -> dict[str, Any]:
    """Parse a 2xx body; a body that is not a JSON object is the server's fault (transient)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        snippet = raw[:200].decode("utf-8", "replace")
        raise _AttemptFailed(
            TransientModelError,
            f"the server's answer is not JSON ({len(raw)} bytes, {exc}): {snippet!r}",
            retry=True,
            http_status=status,
        ) from exc
    if not isinstance(body, dict):
        raise _AttemptFailed(
            TransientModelError, "the server's answer is not a JSON object", retry=True, http_status=status
        )
    return body


def _expired(max_age: str, expires: str) -> bool:
    if max_age:
        try:
            return int(max_age) <= 0
        except ValueError:
            return False
    if expires:
        try:
            return parsedate_to_datetime(expires).timestamp() <= time.time()
        except (TypeError, ValueError):
            return False
    return False


def _jsonable(value: Any) -> Any:
    """The input as JSON-compatible data for a record of a request that could not be built."""
    try:
        return orjson.loads(orjson.dumps(value))
    except TypeError:
        return repr(value)
