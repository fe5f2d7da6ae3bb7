"""``ModelClient``: one async client per rollout for an OpenAI-compatible endpoint.

Every failure is classified where it enters, and nothing waits without a bound::

    attempt ──► 2xx, body parses ─────────────────────► ModelCall (completed / incomplete)
       │        2xx, body malformed in any way ──┐ (not JSON, wrong JSON types, bad SSE framing,
       │                                         │  truncated, only [DONE], too large, too deep)
       │        408 409 429 5xx ─────────────────┤ retry (≤ max_retries, backoff,
       │        connection error, reset ─────────┤        Retry-After honoured up to a cap)
       │        no answer within timeout_s ──────┘──► TransientModelError / ModelTimeoutError
       ├──────► 401 403 407, auth error codes ──────► TransientModelError, not retried: credentials
       │        404, 3xx, model not found                are infrastructure, never the policy's fault
       └──────► other 4xx, context length ──────────► FatalModelError (never retried)

Nothing a server sends can raise anything else: every surprise in a response is
classified here, at the edge, as a transient malformed response.

A call therefore takes at most ``max_call_seconds(endpoint)``: every attempt
runs under ``asyncio.timeout(timeout_s)`` (on top of httpx's own connect/read
timeouts, so a server that accepts the connection and then says nothing is cut
off too), and every wait between attempts is capped by ``retry_wait_bounds``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import random
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from email.utils import parsedate_to_datetime
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any, Literal, NoReturn, Self

import orjson

from rollcage.errors import (
    FatalModelError,
    ModelEndpointNotFoundError,
    ModelError,
    ModelTimeoutError,
    TransientModelError,
)
from rollcage.headers import cookie_header, cookie_problem, encode_id, update_cookies
from rollcage.http import DirectSend, httpx, transport_for
from rollcage.procs import AsyncClosing, shielded
from rollcage.protocol import (
    MAX_JSON_DEPTH,
    CallAttempt,
    CallTokens,
    ModelCall,
    ModelEndpoint,
    ResponseItem,
    RunnerError,
    TokenUsage,
    json_problem,
    kept_body,
)
from rollcage.wire import (
    CallOutcome,
    ServerEventError,
    WireError,
    assemble_stream,
    build_request,
    parse_payload,
    sse_events,
    sse_lines,
    without_lifted,
)

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
_AUTH_CODE = re.compile(
    r"api[_ ]?key|auth|unauthori[sz]ed|permission|forbidden|access[_ ]denied|insufficient[_ ]quota|billing",
    re.IGNORECASE,
)
"""Error codes that say the credentials, not the request, are wrong (OpenAI, vLLM, NIM, gateways)."""
_NOT_FOUND_CODE = re.compile(r"not[_ ]found|does[_ ]not[_ ]exist", re.IGNORECASE)
_ERROR_SNIPPET = 500
_ERROR_BODY_BYTES = 64 * 1024
"""Of a non-2xx answer only this much is read: enough for any error message."""
_MALFORMED = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    IndexError,
    LookupError,
    RecursionError,
    OverflowError,
    UnicodeError,
)
"""What reading a hostile body can raise: each is the server's fault (WireError is a ValueError)."""


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
        why: str = "",
    ) -> None:
        super().__init__(message)
        self.error = error
        self.retry = retry
        self.http_status = http_status
        self.retry_after = retry_after
        self.response = response
        self.why = why
        """Words on whose fault it is, appended to the message where that is not obvious."""
        self.body: bytes | None = None
        """The response body that came with the failure, if one did (kept, bounded, on the attempt)."""
        self.first_byte_at: float | None = None
        """Unix time the attempt's first response byte came, if one did."""


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


class ModelClient(AsyncClosing):
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
        # Ids are any printable text (a dataset's 'café'): sent percent-encoded, reversibly.
        self._identity = [(b"X-Rollout-Id", encode_id(rollout_id)), (b"X-Task-Id", encode_id(task_id))]
        # Initial cookies that could never be sent are left out here, not at every request.
        self._cookies: dict[str, str] = {
            name: value for name, value in (cookies or {}).items() if cookie_problem(name, value) is None
        }
        self._transport = transport
        self._state = ClientState.UNOPENED
        self._send: DirectSend | None = None
        self._target: httpx.URL | None = None
        self._interrupted: ModelCall | None = None
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

        **Cancellation:** the client stays unopened (no connection is made before a call).
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
        self._send = DirectSend(client, transport)
        self._state = ClientState.OPENED
        return self

    async def aclose(self) -> None:
        """Close the connection pool; later calls raise ``RuntimeError``. Closing twice is a no-op.

        **Cancellation:** the pool is closed even if cancelled while closing (shielded), then
        ``CancelledError`` propagates.
        """
        send, self._send = self._send, None
        self._state = ClientState.CLOSED
        if send is not None:
            await shielded(send.aclose())

    async def call(
        self,
        input: str | Sequence[Mapping[str, Any]],
        *,
        instructions: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        index: int = 0,
        id: str | None = None,
        turn: int | None = None,
    ) -> ModelCall:
        """Make one model call, retrying transient failures, and return its record.

        Args:
            input: Responses-API input items (``message``, ``function_call``,
                ``function_call_output``, ``reasoning``), or a text taken as one
                user message. Converted to chat messages for ``api: chat``.
            instructions: System instructions; ``None`` sends none.
            tools: Responses-style function tools; converted for ``api: chat``.
            index: The call's position in the rollout (``ModelCall.index``).
            id: The call's id (``ModelCall.id``); ``None``: ``<rollout_id>:m<index>``.
            turn: The turn that owns the call (``ModelCall.turn``); ``None``: ``index``.

        Returns:
            The record of a ``completed`` or ``incomplete`` call: the exact request,
            the Responses-shaped input (chat), the raw (or assembled) response, output
            as Responses items, token counts and token data as reported, timings and
            every attempt.

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
        request in flight is abandoned (its connection closed) and ``CancelledError``
        propagates. The record of the interrupted call (status ``incomplete``, reason
        ``interrupted``, its attempts so far) is kept as ``interrupted``. The call
        never takes longer than ``max_call_seconds(endpoint)``.
        """
        if self._state is not ClientState.OPENED or self._send is None:
            raise RuntimeError(f"ModelClient is {self._state.value}; use it inside 'async with'")
        endpoint = self._endpoint
        self._interrupted = None
        items: list[dict[str, Any]] | None = None
        if endpoint.api == "chat" and not isinstance(input, str):
            items = [item if isinstance(item, dict) else dict(item) for item in input]
        call = _Call(
            id=id if id is not None else f"{self._rollout_id}:m{index}",
            index=index,
            turn=index if turn is None else turn,
            payload={"input": _jsonable(input)},
            items=items,
            started_at=time.time(),
        )
        try:
            call.payload = build_request(endpoint, input, instructions=instructions, tools=tools)
            body = orjson.dumps(call.payload)
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            failure = _AttemptFailed(
                FatalModelError, f"cannot build the request (none sent): {exc!r}", retry=False
            )
            call.attempts.append(_failed_attempt(failure, 0, call.started_at))
            self._fail(failure, call)
        try:
            return await self._attempts(call, body)
        except asyncio.CancelledError:
            self._interrupted = self._interrupted_record(call)
            raise

    @property
    def interrupted(self) -> ModelCall | None:
        """The record of the last call cancelled while in flight (``incomplete``, ``interrupted``); else None.

        Reset by every ``call``: it belongs to the call that was cancelled last.
        """
        return self._interrupted

    async def _attempts(self, call: _Call, body: bytes) -> ModelCall:
        endpoint = self._endpoint
        while True:
            call.attempt_started = time.time()
            try:
                exchange = await self._attempt(body)
                outcome = self._interpret(exchange)
            except _AttemptFailed as failure:
                call.attempts.append(_failed_attempt(failure, len(call.attempts), call.attempt_started))
                call.attempt_started = None
                if not failure.retry or len(call.attempts) > endpoint.max_retries:
                    self._fail(failure, call)
                wait = self._wait_before_retry(len(call.attempts), failure.retry_after)
                logger.info(
                    "model call %s attempt %d failed (%s); retrying in %.2fs",
                    call.id,
                    len(call.attempts),
                    failure,
                    wait,
                )
                await asyncio.sleep(wait)
                continue
            call.attempts.append(
                CallAttempt(
                    index=len(call.attempts),
                    status="completed",
                    http_status=exchange.http_status,
                    started_at=call.attempt_started,
                    first_byte_at=exchange.first_byte_at,
                    ended_at=time.time(),
                )
            )
            return self._record(
                call,
                status="incomplete" if outcome.status == "incomplete" else "completed",
                response=without_lifted(endpoint.api, exchange.payload),
                incomplete_reason=outcome.incomplete_reason,
                output=outcome.output,
                usage=outcome.usage,
                tokens=outcome.tokens,
            )

    def _record(
        self,
        call: _Call,
        *,
        status: Literal["completed", "incomplete", "failed"],
        response: dict[str, Any] | None = None,
        incomplete_reason: str | None = None,
        output: list[ResponseItem] | None = None,
        usage: TokenUsage | None = None,
        tokens: CallTokens | None = None,
        error: RunnerError | None = None,
    ) -> ModelCall:
        last = call.attempts[-1]
        first_bytes = [a.first_byte_at for a in call.attempts if a.first_byte_at is not None]
        return ModelCall(
            id=call.id,
            index=call.index,
            turn=call.turn,
            api=self._endpoint.api,
            request=call.payload,
            input=call.items,
            response=response,
            status=status,
            incomplete_reason=incomplete_reason,
            output=output or [],
            usage=usage or TokenUsage(),
            tokens=tokens or CallTokens(),
            http_status=last.http_status,
            attempts=list(call.attempts),
            started_at=call.started_at,
            first_byte_at=first_bytes[-1] if first_bytes else None,
            ended_at=last.ended_at,
            error=error,
        )

    def _interrupted_record(self, call: _Call) -> ModelCall:
        """The record of a call cancelled in flight: its attempts so far, the one in flight incomplete."""
        if call.attempt_started is not None or not call.attempts:
            started = call.attempt_started if call.attempt_started is not None else call.started_at
            call.attempts.append(
                CallAttempt(
                    index=len(call.attempts), status="incomplete", started_at=started, ended_at=time.time()
                )
            )
            call.attempt_started = None
        return self._record(call, status="incomplete", incomplete_reason="interrupted")

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
        assert self._send is not None
        endpoint = self._endpoint
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Accept", b"text/event-stream" if endpoint.stream else b"application/json"),
            *self._identity,
        ]
        if self._cookies:
            # Every cookie in the jar can be sent: the jar keeps no other (rollcage.headers).
            headers.append((b"Cookie", cookie_header(self._cookies)))
        try:
            self._target = target = self._target or httpx.URL(self._url)
            response = await self._send("POST", target, headers=headers, content=body)
        except httpx.HTTPError as exc:
            _raise_transport(exc)
        first_byte_at = time.time()
        try:
            self._keep_cookies(response)
            status = response.status_code
            if not 200 <= status < 300:
                error_body = await _read_body(response, _ERROR_BODY_BYTES, cut=True)
                raise _status_failure(status, error_body, response.headers)
            limit = endpoint.max_response_bytes
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise _malformed(f"the answer declares {declared} bytes, over the {limit}-byte bound", status)
            raw: bytes | None = None  # a plain answer's body, kept (bounded) on the attempt if it fails
            try:
                if endpoint.stream and "text/event-stream" in response.headers.get("content-type", ""):
                    chunks = _bounded(response.aiter_bytes(), limit)
                    streamed = await assemble_stream(endpoint.api, sse_events(sse_lines(chunks)))
                    payload, first = streamed.payload, streamed.first_event_at or first_byte_at
                else:
                    raw = await _read_body(response, limit)
                    payload, first = _json_object(raw), first_byte_at
                problem = json_problem(payload, max_depth=MAX_JSON_DEPTH)
                if problem is not None:
                    raise WireError(f"the answer cannot be kept: {problem}")
            except ServerEventError as exc:
                failure = _classify(None, exc.code, str(exc), http_status=status)
                failure.args = (f"the server reported an error in the stream: {exc}{failure.why}",)
                raise failure from exc
            except _MALFORMED as exc:
                malformed = _malformed(str(exc) if isinstance(exc, WireError) else _unexpected(exc), status)
                malformed.body = raw
                raise malformed from exc
            return _Exchange(status, payload, first)
        except _AttemptFailed as failure:
            failure.first_byte_at = first_byte_at
            raise
        except httpx.HTTPError as exc:
            try:
                _raise_transport(exc)
            except _AttemptFailed as failure:
                failure.first_byte_at = first_byte_at
                raise
        finally:
            await response.aclose()

    def _interpret(self, exchange: _Exchange) -> CallOutcome:
        error = exchange.payload.get("error")
        if isinstance(error, dict) and not {"choices", "output"} & exchange.payload.keys():
            # An error object in a 2xx answer (gateways and some servers do this): it says whose fault it is.
            code, message = _error_detail(orjson.dumps(exchange.payload))
            failure = _classify(None, code, message, http_status=exchange.http_status)
            failure.args = (
                f"the server answered with an error: {code or 'no code'}: {message}{failure.why}",
            )
            failure.response = exchange.payload
            failure.body = orjson.dumps(exchange.payload)
            raise failure
        try:
            outcome = parse_payload(self._endpoint.api, exchange.payload)
        except _MALFORMED as exc:
            detail = str(exc) if isinstance(exc, WireError) else _unexpected(exc)
            failure = _malformed(
                f"the server's answer is not a valid {self._endpoint.api} response: {detail}",
                exchange.http_status,
            )
            failure.response = exchange.payload
            failure.body = orjson.dumps(exchange.payload)
            raise failure from exc
        if outcome.status == "failed":
            failure = _classify(
                None, outcome.error_code, outcome.error_message or "", http_status=exchange.http_status
            )
            failure.args = (
                f"the response failed: {outcome.error_code or 'no code'}: {outcome.error_message or ''}"
                f"{failure.why}",
            )
            failure.response = exchange.payload
            failure.body = orjson.dumps(exchange.payload)
            raise failure
        return outcome

    def _wait_before_retry(self, retry: int, retry_after: float | None) -> float:
        endpoint = self._endpoint
        base = _backoff(endpoint, retry)
        wait = base * random.uniform(0.5, 1.0)
        if retry_after is not None and math.isfinite(retry_after):
            wait = max(wait, min(retry_after, endpoint.timeout_s, _RETRY_AFTER_CAP_S))
        return wait

    def _keep_cookies(self, response: httpx.Response) -> None:
        for problem in update_cookies(self._cookies, response.headers.raw, strict=False):
            # Echoing it would break the next request (a newline in a header) or grow every
            # request and journal line without bound; the server's word is in the capture.
            logger.warning("ignoring a cookie from the model endpoint: %s", problem)

    def _fail(self, failure: _AttemptFailed, call: _Call) -> NoReturn:
        count = len(call.attempts)
        error = failure.error(
            f"{failure} (after {count} attempt{'s' if count > 1 else ''}; {self._endpoint.api} "
            f"endpoint {self._url})"
        )
        record = self._record(
            call,
            status="failed",
            response=failure.response,
            error=RunnerError(kind=error.kind, type=type(error).__name__, message=str(error)),
        )
        error.record = record
        raise error from failure.__cause__


class _Call:
    """What one ``ModelClient.call`` knows so far (its record is built from it, however it ends)."""

    __slots__ = ("attempt_started", "attempts", "id", "index", "items", "payload", "started_at", "turn")

    def __init__(
        self,
        *,
        id: str,
        index: int,
        turn: int,
        payload: dict[str, Any],
        items: list[dict[str, Any]] | None,
        started_at: float,
    ) -> None:
        self.id = id
        self.index = index
        self.turn = turn
        self.payload = payload
        self.items = items
        self.started_at = started_at
        self.attempts: list[CallAttempt] = []
        self.attempt_started: float | None = None
        """Unix time the attempt in flight started; None between attempts."""


def _failed_attempt(failure: _AttemptFailed, index: int, started_at: float) -> CallAttempt:
    error = failure.error(str(failure))
    body, truncated = kept_body(failure.body)
    return CallAttempt(
        index=index,
        status="failed",
        http_status=failure.http_status,
        error=RunnerError(kind=error.kind, type=type(error).__name__, message=str(failure)),
        response_body=body,
        response_body_truncated=truncated,
        started_at=started_at,
        first_byte_at=failure.first_byte_at,
        ended_at=time.time(),
    )


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
    """Classify a non-2xx answer (see ``_classify``)."""
    code, message = _error_detail(raw)
    failure = _classify(status, code, message, http_status=status, retry_after=_retry_after(headers))
    failure.args = (f"HTTP {status}: {code + ': ' if code else ''}{message}{failure.why}",)
    failure.body = raw
    return failure


def _classify(
    status: int | None,
    code: str | None,
    message: str,
    *,
    http_status: int | None,
    retry_after: float | None = None,
) -> _AttemptFailed:
    """Whose fault an error the server reported is, and whether another attempt may help.

    ``status`` is the HTTP status of an error answer, ``None`` for an error inside
    a 2xx answer (a Responses ``failed`` status, an error event in a stream).
    The message of the returned failure is set by the caller; ``why`` is appended.
    """
    if code == "context_length_exceeded" or _CONTEXT_LENGTH.search(message):
        return _AttemptFailed(FatalModelError, message, retry=False, http_status=http_status)
    if status in (401, 403, 407) or (code is not None and _AUTH_CODE.search(code)):
        return _AttemptFailed(
            TransientModelError,
            message,
            retry=False,
            http_status=http_status,
            why=" (the endpoint refused the credentials: infrastructure, not the policy)",
        )
    if status == 404 or (code is not None and _NOT_FOUND_CODE.search(code)):
        return _AttemptFailed(
            ModelEndpointNotFoundError,
            message,
            retry=False,
            http_status=http_status,
            why=" (no such endpoint or model where the configuration says: infrastructure, not the policy; "
            "final, as NOOA treats it)",
        )
    if status is not None and status < 400:
        return _AttemptFailed(
            TransientModelError,
            message,
            retry=False,
            http_status=http_status,
            why=" (no such endpoint or model where the configuration says: infrastructure, not the policy)",
        )
    if status is None:
        fatal = code is not None and "invalid" in code
        return _AttemptFailed(
            FatalModelError if fatal else TransientModelError,
            message,
            retry=not fatal,
            http_status=http_status,
        )
    if status in _RETRYABLE_STATUS or status >= 500:
        return _AttemptFailed(
            TransientModelError, message, retry=True, http_status=http_status, retry_after=retry_after
        )
    return _AttemptFailed(FatalModelError, message, retry=False, http_status=http_status)


def _malformed(detail: str, status: int | None) -> _AttemptFailed:
    """A 2xx answer that cannot be read: the server's fault, worth another attempt."""
    return _AttemptFailed(
        TransientModelError, f"malformed response from the server: {detail}", retry=True, http_status=status
    )


def _unexpected(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:_ERROR_SNIPPET]}"


async def _bounded(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """Pass decoded body chunks through until more than ``limit`` bytes came: then a ``WireError``."""
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise WireError(f"the answer is over the {limit}-byte bound (max_response_bytes)")
        yield chunk


async def _read_body(response: httpx.Response, limit: int, *, cut: bool = False) -> bytes:
    """The decoded body, at most ``limit`` bytes: over it a ``WireError``, or with ``cut`` the first bytes."""
    parts: list[bytes] = []
    total = 0
    async for chunk in response.aiter_bytes():
        total += len(chunk)
        if total > limit:
            if cut:
                parts.append(chunk[: len(chunk) - (total - limit)])
                break
            raise WireError(f"the answer is over the {limit}-byte bound (max_response_bytes)")
        parts.append(chunk)
    return b"".join(parts)


def _error_detail(raw: bytes) -> tuple[str | None, str]:
    """The error code and message of an error body (OpenAI, vLLM and FastAPI shapes), else a snippet."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, raw[:_ERROR_SNIPPET].decode("utf-8", "replace") or "(empty body)"
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        message = error.get("message") or error.get("detail") or error
        return (None if code is None else str(code)[:200]), _snippet(message)
    return None, _snippet(error)


def _snippet(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value, default=repr).decode()
    return text[:_ERROR_SNIPPET]


def _retry_after(headers: httpx.Headers) -> float | None:
    """Seconds the server asks us to wait (``retry-after-ms``, ``retry-after`` seconds or date)."""
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            return _finite_seconds(float(value) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return _finite_seconds(float(value))
    except ValueError:
        pass
    try:
        return _finite_seconds(parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


def _finite_seconds(value: float) -> float | None:
    return max(0.0, value) if math.isfinite(value) else None


def _json_object(raw: bytes) -> dict[str, Any]:
    """Parse a 2xx body; a body that is not a JSON object is a ``WireError`` (the server's fault)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        snippet = raw[:200].decode("utf-8", "replace")
        raise WireError(f"the answer is not JSON ({len(raw)} bytes, {exc}): {snippet!r}") from exc
    if not isinstance(body, dict):
        raise WireError("the answer is not a JSON object")
    return body


def _jsonable(value: Any) -> Any:
    """The input as JSON-compatible data for a record of a request that could not be built."""
    try:
        return orjson.loads(orjson.dumps(value))
    except TypeError:
        return repr(value)
