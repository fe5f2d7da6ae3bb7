"""Values others supply become header bytes in one place, or a classified refusal: never a traceback.

Arbitrary Unicode and octets are driven through every place an external value becomes a header
(cookies an environment or a model sets, ids, credentials) and where an id becomes a directory
name. Each ends as bytes h11 itself accepts on the wire, or as the error its caller classifies:
``HeaderValueError`` here, ``ResourceUnavailableError`` (the environment's fault) in the worker's
resource tools and the controller's seed, a grader error at verify.
"""

from __future__ import annotations

import asyncio
import json
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollcage.controller._dataset import InvalidRow, Task, validate_value
from rollcage.controller._graders import verify_remote
from rollcage.controller._ids import rollout_id
from rollcage.controller._nemo_gym import seed_session
from rollcage.errors import HeaderValueError, ResourceUnavailableError
from rollcage.headers import (
    cookie_header,
    decode_id,
    encode_id,
    header_value,
    id_problem,
    update_cookies,
)
from rollcage.model import ModelClient
from rollcage.protocol import ModelEndpoint, ResourceEndpoint, ResourceToolSpec

PROPERTY = settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# Octets a server can put in a header value that h11 (under httpx) lets through: visible ASCII, space,
# tab, obs-text; drawn far more often where they break things (';', '=', '"', ',', high octets).
_OCTET = st.sampled_from([*range(0x20, 0x7F), 0x09, *range(0x80, 0x100)]) | st.sampled_from(
    [0x3B, 0x3D, 0x22, 0x2C, 0xC3, 0xA9, 0xE6, 0xFF, 0x09, 0x20]
)
_WIRE_VALUE = st.lists(_OCTET, max_size=40).map(lambda xs: bytes(xs).strip(b" \t"))
_TEXT = st.text(max_size=30) | st.sampled_from(
    [
        "café",
        "日本-1",
        "a\u2028b",
        "a\x00b",
        "\udfff",
        "a\r\nSet-Cookie: x=1",
        " lead",
        "trail\t",
        "%41",
        "é" * 3,
    ]
)


def on_the_wire(headers: list[tuple[bytes, bytes]]) -> None:
    """Send ``headers`` through h11 as a request would go out: raises if the wire would refuse them."""
    connection = h11.Connection(h11.CLIENT)
    if not any(name.lower() == b"host" for name, _ in headers):
        headers = [(b"host", b"x"), *headers]
    connection.send(h11.Request(method="POST", target="/", headers=headers))


@PROPERTY
@given(value=_TEXT | st.binary(max_size=30))
def test_a_header_value_is_bytes_the_wire_takes_or_a_header_value_error(value: str | bytes) -> None:
    try:
        encoded = header_value(value, what="X-Test")
    except HeaderValueError as exc:
        assert "X-Test cannot be sent in an HTTP header" in str(exc)
        return
    on_the_wire([(b"x-test", encoded)])
    assert encoded == (value if isinstance(value, bytes) else value.encode("latin-1"))


@PROPERTY
@given(
    name=st.text(max_size=12).filter(lambda n: ";" not in n and "=" not in n)
    | st.sampled_from(["lat", "a b"]),
    value=_WIRE_VALUE,
)
def test_a_kept_cookie_goes_back_byte_for_byte(name: str, value: bytes) -> None:
    raw = name.encode("utf-8", "surrogatepass") + b"=" + value + b"; Path=/"
    jar: dict[str, str] = {}
    problems = update_cookies(jar, [(b"set-cookie", raw)], strict=False)
    if problems:
        assert not jar and "cannot be kept" in problems[0]
        with pytest.raises(HeaderValueError):
            update_cookies({}, [(b"set-cookie", raw)], strict=True)
        return
    if not jar:  # no name at all: not a cookie
        assert not name.strip(" \t")
        return
    sent = cookie_header(jar)
    on_the_wire([(b"cookie", sent)])
    (kept,) = jar.values()
    octets = value.split(b";")[0].strip(b" \t")
    if len(octets) >= 2 and octets[:1] == octets[-1:] == b'"':
        octets = octets[1:-1]
    assert kept.encode("latin-1") == octets
    assert sent.endswith(b"=" + octets)


@PROPERTY
@given(cookies=st.dictionaries(_TEXT, _TEXT, max_size=4))
def test_any_jar_is_sent_whole_or_refused_naming_the_cookie(cookies: dict[str, str]) -> None:
    try:
        sent = cookie_header(cookies)
    except HeaderValueError as exc:
        assert "cookie" in str(exc)
        return
    on_the_wire([(b"cookie", sent)] if sent else [])


@PROPERTY
@given(task_id=_TEXT)
def test_an_id_crosses_its_header_and_comes_back_whole(task_id: str) -> None:
    try:
        encoded = encode_id(task_id)
    except HeaderValueError:
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in task_id)
        return
    on_the_wire([(b"x-task-id", encoded)])
    assert decode_id(encoded) == task_id
    if task_id.isascii() and task_id.isprintable() and "%" not in task_id and " " not in task_id:
        assert encoded == task_id.encode()  # plain ids are sent as they always were


@PROPERTY
@given(task_id=_TEXT | st.integers())
def test_a_row_id_is_refused_with_its_line_or_is_a_safe_directory_name(tmp_path: Path, task_id: Any) -> None:
    row = validate_value(7, {"id": task_id, "input": "hi"})
    if isinstance(row, InvalidRow):
        assert row.line == 7 and "id" in row.reason
        assert isinstance(task_id, str) and (not task_id or len(task_id) > 256 or id_problem(task_id))
        return
    assert isinstance(row, Task)
    on_the_wire([(b"x-task-id", encode_id(row.id))])
    name = rollout_id(row.id, 0, 0)
    assert "/" not in name and "\0" not in name and len(name.encode()) <= 255 and name not in (".", "..")
    (tmp_path / name).mkdir(exist_ok=True)


# --------------------------------------------------------------------------- the clients


def _raw_cookie(request: httpx.Request) -> bytes | None:
    """The request's Cookie header as its octets (httpx's str view guesses a charset)."""
    return next((value for name, value in request.headers.raw if name.lower() == b"cookie"), None)


def _completion() -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    }


@PROPERTY
@given(
    task_id=_TEXT, cookies=st.dictionaries(_TEXT, _TEXT, max_size=3), answer=st.lists(_WIRE_VALUE, max_size=3)
)
def test_the_model_client_sends_any_id_and_keeps_only_cookies_it_can_send(
    task_id: str, cookies: dict[str, str], answer: list[bytes]
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        on_the_wire(list(request.headers.raw))
        seen.append(request)
        set_cookies = [(b"set-cookie", b"k" + str(i).encode() + b"=" + v) for i, v in enumerate(answer)]
        return httpx.Response(
            200, headers=[(b"content-type", b"application/json"), *set_cookies], json=_completion()
        )

    async def go() -> None:
        endpoint = ModelEndpoint(base_url="http://model.test/v1", model="m", max_retries=0)
        client = ModelClient(
            endpoint, rollout_id="r", task_id=task_id, cookies=cookies, transport=httpx.MockTransport(handler)
        )
        async with client:
            await client.call([{"type": "message", "role": "user", "content": "hi"}])
            await client.call([{"type": "message", "role": "user", "content": "hi"}])
        cookie_header(client.cookies)  # whatever it kept, it can send

    try:
        asyncio.run(go())
    except HeaderValueError:
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in task_id)
        return
    assert decode_id(
        seen[0].headers.raw[[k.lower() for k, _ in seen[0].headers.raw].index(b"x-task-id")][1]
    ) == (task_id)


@PROPERTY
@given(answers=st.lists(st.lists(st.tuples(_TEXT, _WIRE_VALUE), max_size=3), min_size=1, max_size=3))
def test_a_tool_answers_cookies_are_kept_and_sent_back_or_the_environment_is_at_fault(
    monkeypatch: pytest.MonkeyPatch, answers: list[list[tuple[str, bytes]]]
) -> None:
    from rollcage.tools import ResourceTools, _resources

    sent: list[bytes | None] = []
    script = iter(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        on_the_wire(list(request.headers.raw))
        sent.append(_raw_cookie(request))
        raw = [
            (b"set-cookie", name.encode("utf-8", "surrogatepass") + b"=" + v) for name, v in next(script, [])
        ]
        return httpx.Response(200, headers=raw, content=b"{}")

    monkeypatch.setattr(_resources, "transport_for", lambda *_a, **_k: httpx.MockTransport(handler))
    spec = ResourceToolSpec(name="probe", resource="env")
    endpoint = ResourceEndpoint(base_url="http://env.test")

    async def go() -> dict[str, str]:
        async with ResourceTools({"env": endpoint}, [spec], rollout_id="r", cookies={}) as tools:
            for _ in answers:
                status, _text = await tools.call("probe", {})
                assert status == "completed"
            await tools.call("probe", {})
            return tools.cookies

    try:
        jar = asyncio.run(go())
    except ResourceUnavailableError as exc:
        assert "cannot be sent back" in str(exc)
        return
    if jar:
        assert sent[-1] == cookie_header(jar)  # the last call carried every kept cookie, as kept


@PROPERTY
@given(cookies=st.lists(st.tuples(_TEXT, _WIRE_VALUE), max_size=4))
def test_seed_cookies_become_a_session_or_the_environments_infra_failure(
    cookies: list[tuple[str, bytes]],
) -> None:
    verify_cookie: list[bytes | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        on_the_wire(list(request.headers.raw))
        if request.url.path == "/seed_session":
            raw = [(b"set-cookie", n.encode("utf-8", "surrogatepass") + b"=" + v) for n, v in cookies]
            return httpx.Response(200, headers=raw, content=b"{}")
        verify_cookie.append(_raw_cookie(request))
        return httpx.Response(200, json={"reward": 1.0})

    async def go() -> None:
        # As the controller makes it (_unit.py): a client jar that accepts nothing, the session's
        # cookies are sent explicitly.
        refusing = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), cookies=refusing) as client:
            try:
                jar = await seed_session(client, "http://env.test", token=None, body=b"{}", timeout_s=10)
            except ResourceUnavailableError as exc:
                assert "/seed_session" in str(exc)
                return
            grade = await verify_remote(
                "http://env.test", token=None, payload=b"{}", timeout_s=10, cookies=jar, client=client
            )
            assert grade.reward == 1.0 and grade.error is None
            assert verify_cookie == [cookie_header(jar) or None]

    asyncio.run(go())


@PROPERTY
@given(cookies=st.dictionaries(_TEXT, _TEXT, max_size=3))
def test_a_results_cookies_that_cannot_be_sent_make_a_grader_error_not_a_crash(
    cookies: dict[str, str],
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        on_the_wire(list(request.headers.raw))
        return httpx.Response(200, json={"reward": 0.5})

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            grade = await verify_remote(
                "http://env.test", token=None, payload=b"{}", timeout_s=10, cookies=cookies, client=client
            )
        try:
            cookie_header(cookies)
        except HeaderValueError:
            assert grade.reward is None and "verify was not asked" in (grade.error or "")
            return
        assert grade.reward == 0.5

    asyncio.run(go())


def test_verify_detail_is_bounded_in_the_record_and_says_it_was_cut() -> None:
    from rollcage.controller._graders import parse_verify_answer

    grade = parse_verify_answer(
        200, json.dumps({"reward": 1.0, "detail": {"essay": "x" * 10**6, "n": 1}}).encode()
    )
    assert grade.reward == 1.0
    assert "essay" not in grade.detail and "essay" in grade.detail["detail_cut"]
    assert len(json.dumps(grade.detail)) < 2000
