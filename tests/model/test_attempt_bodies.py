"""Failed attempts keep the body the server sent, bounded and marked when cut, in the trajectory."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcage.errors import TransientModelError
from rollcage.harness import WireCalls, WireExchange
from rollcage.model import ModelClient, failed_call
from rollcage.policy import PolicyServer
from rollcage.protocol import ATTEMPT_BODY_BYTES, ModelEndpoint, kept_body

USER = [{"type": "message", "role": "user", "content": "What is 6 * 7?"}]
SCRIPT = {"tasks": {"*": [{"text": "42"}]}}


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3 * ATTEMPT_BODY_BYTES) | st.text(max_size=ATTEMPT_BODY_BYTES).map(str.encode))
def test_a_kept_body_is_within_the_cap_and_says_when_it_was_cut(body: bytes) -> None:
    text, truncated = kept_body(body)
    assert text is not None and len(text.encode()) <= ATTEMPT_BODY_BYTES and "\x00" not in text
    if len(body) > ATTEMPT_BODY_BYTES:
        assert truncated
    if not truncated and b"\x00" not in body:
        try:
            assert text == body.decode()  # whole and valid: kept exactly
        except UnicodeDecodeError:
            pass
    assert kept_body(None) == (None, False)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_retried_calls_earlier_attempt_keeps_the_error_body_it_got(api: str, stream: bool) -> None:
    with PolicyServer(SCRIPT, faults=["call=1:status=503"]) as server:
        endpoint = server.endpoint(api=api, stream=stream, max_retries=2, retry_backoff_s=0.01)  # type: ignore[arg-type]
        async with ModelClient(endpoint, rollout_id="r-retried", task_id="t") as client:
            record = await client.call(USER)
    first, second = record.attempts
    assert (first.status, first.http_status, second.status) == ("failed", 503, "completed")
    assert first.response_body is not None and not first.response_body_truncated
    assert isinstance(orjson.loads(first.response_body), dict)  # the server's own error object
    # The answer the call used is ModelCall.response, not repeated on its attempt.
    assert second.response_body is None and record.response is not None


class _BigError(BaseHTTPRequestHandler):
    body = b'{"error": {"message": "' + "é".encode() * ATTEMPT_BODY_BYTES + b'"}}'

    def do_POST(self) -> None:  # the standard library's name
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def big_error_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BigError)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


async def test_a_large_error_body_is_kept_cut_at_the_cap_and_marked(big_error_server: str) -> None:
    endpoint = ModelEndpoint(
        base_url=big_error_server, model="m", api="responses", max_retries=1, retry_backoff_s=0.01
    )
    async with ModelClient(endpoint, rollout_id="r-big", task_id="t") as client:
        with pytest.raises(TransientModelError) as raised:
            await client.call(USER)
    record = failed_call(raised.value)
    assert record is not None and len(record.attempts) == 2
    for attempt in record.attempts:
        assert attempt.response_body is not None and attempt.response_body_truncated
        assert len(attempt.response_body.encode()) <= ATTEMPT_BODY_BYTES
        assert attempt.response_body.startswith('{"error": {"message": "éé')


@pytest.mark.parametrize(
    ("status", "answer"),
    [(502, b"<html>bad gateway</html>"), (200, b'{"not": "a chat completion"'), (200, b"x" * 40_000)],
    ids=["http-error", "malformed", "large"],
)
async def test_a_harness_call_that_failed_keeps_its_body_too(status: int, answer: bytes) -> None:
    request = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    exchange = WireExchange(
        api="chat",
        request=request,
        status=status,
        content_type="application/json",
        response=answer,
        started_at=1.0,
        first_byte_at=1.5,
        ended_at=2.0,
    )
    wire = await WireCalls("r1").next(exchange)
    (attempt,) = wire.call.attempts
    assert wire.call.status == "failed" and attempt.response_body is not None
    assert attempt.response_body_truncated is (len(answer) > ATTEMPT_BODY_BYTES)
    assert answer.decode().startswith(attempt.response_body)


async def test_a_harness_call_answered_404_says_the_endpoint_has_no_such_route() -> None:
    request = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    exchange = WireExchange(
        api="chat",
        request=request,
        status=404,
        content_type="application/json",
        response=b'{"detail": "Not Found"}',
        started_at=1.0,
        first_byte_at=1.5,
        ended_at=2.0,
    )
    wire = await WireCalls("r1").next(exchange)
    assert wire.call.error is not None
    # The type the controller stops the run on, as for the builtin loop's client; still infrastructure.
    assert (wire.call.error.type, wire.call.error.kind) == ("ModelEndpointNotFoundError", "transient")
