"""HTTP resource tools against a real starlette app served by uvicorn, over TCP loopback and a Unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollcage.errors import ConfigError, ResourceUnavailableError
from rollcage.protocol import ResourceEndpoint, ResourceToolSpec
from rollcage.tools import ResourceTools, tool_parameters
from tests.helpers.waiting import wait_for

ROLLOUT_ID = "rollout-7"
SLOW_HANDLER_S = 5.0
"""How long /slow takes to answer: far beyond the client timeout used against it."""


def weather_app() -> Starlette:
    """A weather resource: "cold" for any city, with a per-session visit count kept through a cookie."""
    visits: dict[str, int] = {}
    ids = itertools.count(1)

    async def get_weather(request: Request) -> Response:
        body = await request.json()
        session = request.cookies.get("session") or f"s{next(ids)}"
        visits[session] = visits.get(session, 0) + 1
        response = JSONResponse(
            {
                "city": body.get("city"),
                "weather": "cold",
                "visits": visits[session],
                "rollout": request.headers.get("x-rollout-id"),
                "cookies": dict(request.cookies),
            }
        )
        response.set_cookie("session", session)
        return response

    async def forecast(request: Request) -> Response:
        body = await request.json()
        return PlainTextResponse(f"forecast for {body['city']}: cold")

    async def boom(request: Request) -> Response:
        return PlainTextResponse("city must be a string", status_code=500)

    async def unavailable(request: Request) -> Response:
        return PlainTextResponse("upstream down", status_code=503)

    async def slow(request: Request) -> Response:
        await asyncio.sleep(SLOW_HANDLER_S)  # simulates a hung resource; not test synchronisation
        return PlainTextResponse("too late")

    async def logout(request: Request) -> Response:
        response = PlainTextResponse("bye")
        response.delete_cookie("session")
        return response

    async def big(request: Request) -> Response:
        return PlainTextResponse("z" * 3_000_000)

    return Starlette(
        routes=[
            Route("/get_weather", get_weather, methods=["POST"]),
            Route("/custom/forecast", forecast, methods=["POST"]),
            Route("/boom", boom, methods=["POST"]),
            Route("/unavailable", unavailable, methods=["POST"]),
            Route("/slow", slow, methods=["POST"]),
            Route("/logout", logout, methods=["POST"]),
            Route("/big", big, methods=["POST"]),
        ]
    )


@contextlib.contextmanager
def _serve(config: uvicorn.Config, sockets: list[socket.socket] | None = None) -> Iterator[None]:
    """Run uvicorn in a thread until the fixture ends; wait (bounded) until it accepts."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), what="uvicorn to start")
        if not server.started:
            raise RuntimeError("uvicorn did not start")
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def _config(**kwargs: Any) -> uvicorn.Config:
    return uvicorn.Config(
        weather_app(),
        lifespan="off",
        log_level="warning",
        loop="asyncio",
        http="h11",
        timeout_graceful_shutdown=1,
        **kwargs,
    )


@pytest.fixture(scope="module")
def tcp_url() -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    with sock, _serve(_config(), sockets=[sock]):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def uds_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = str(tmp_path_factory.mktemp("uds") / "weather.sock")
    with _serve(_config(uds=path)):
        yield path


def spec(name: str, *, resource: str = "weather", path: str | None = None) -> ResourceToolSpec:
    return ResourceToolSpec(
        name=name,
        resource=resource,
        path=path,
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    )


SPECS = [
    spec("get_weather"),
    spec("forecast", path="/custom/forecast"),
    spec("boom"),
    spec("unavailable"),
    spec("slow"),
    spec("logout"),
    spec("big"),
    spec("missing"),
]


async def _ok(tools: ResourceTools, name: str, arguments: dict[str, Any]) -> str:
    """The text of a call that must have succeeded (status completed)."""
    status, text = await tools.call(name, arguments)
    assert status == "completed", text
    return text


def tools_for(
    url: str, *, uds: str | None = None, timeout_s: float = 30.0, cookies: dict[str, str] | None = None
) -> ResourceTools:
    endpoint = ResourceEndpoint(base_url=url, uds=uds, timeout_s=timeout_s)
    return ResourceTools({"weather": endpoint}, SPECS, rollout_id=ROLLOUT_ID, cookies=cookies or {})


async def test_call_posts_json_and_returns_the_response_text(tcp_url: str) -> None:
    async with tools_for(tcp_url) as tools:
        answer = json.loads(await _ok(tools, "get_weather", {"city": "Oslo"}))
    assert (answer["city"], answer["weather"]) == ("Oslo", "cold")


async def test_session_cookie_from_set_cookie_is_kept_and_sent_back(tcp_url: str) -> None:
    async with tools_for(tcp_url) as tools:
        first = json.loads(await _ok(tools, "get_weather", {"city": "Oslo"}))
        session = tools.cookies["session"]
        second = json.loads(await _ok(tools, "get_weather", {"city": "Oslo"}))
    assert (first["visits"], second["visits"]) == (1, 2)
    assert second["cookies"] == {"session": session}
    assert tools.cookies == {"session": session}  # still readable after close, for the result


async def test_initial_cookies_and_rollout_id_are_sent(tcp_url: str) -> None:
    async with tools_for(tcp_url, cookies={"session": "resumed", "tenant": "t1"}) as tools:
        answer = json.loads(await _ok(tools, "get_weather", {"city": "Oslo"}))
    assert answer["rollout"] == ROLLOUT_ID
    assert answer["cookies"] == {"session": "resumed", "tenant": "t1"}
    assert tools.cookies == {"session": "resumed", "tenant": "t1"}


async def test_cookie_deleted_by_the_resource_is_dropped(tcp_url: str) -> None:
    async with tools_for(tcp_url, cookies={"session": "s-old", "tenant": "t1"}) as tools:
        assert await _ok(tools, "logout", {}) == "bye"
    assert tools.cookies == {"tenant": "t1"}


async def test_http_error_statuses_come_back_as_text_for_the_model_and_fail_the_call(tcp_url: str) -> None:
    async with tools_for(tcp_url) as tools:
        missing = await tools.call("missing", {"city": "Oslo"})
        boom = await tools.call("boom", {"city": 3})
    assert missing[0] == "failed" and missing[1].startswith("error: HTTP 404 from missing")
    assert boom == ("failed", "error: HTTP 500 from boom: city must be a string")


async def test_unavailable_status_raises_an_infrastructure_error(tcp_url: str) -> None:
    async with tools_for(tcp_url) as tools:
        with pytest.raises(ResourceUnavailableError, match="503"):
            await tools.call("unavailable", {})


async def test_timeout_raises_an_infrastructure_error(tcp_url: str) -> None:
    async with tools_for(tcp_url, timeout_s=0.2) as tools:
        with pytest.raises(ResourceUnavailableError, match=r"within 0\.2 s"):
            await tools.call("slow", {})


async def test_connection_refused_raises_an_infrastructure_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        async with tools_for(f"http://127.0.0.1:{port}") as tools:
            with pytest.raises(ResourceUnavailableError, match="could not be reached") as info:
                await tools.call("get_weather", {"city": "Oslo"})
    assert info.value.kind == "transient"


async def test_missing_unix_socket_raises_an_infrastructure_error(tmp_path: Path) -> None:
    async with tools_for("http://weather", uds=str(tmp_path / "nobody.sock")) as tools:
        with pytest.raises(ResourceUnavailableError):
            await tools.call("get_weather", {"city": "Oslo"})


async def test_calls_go_over_a_unix_socket_when_uds_is_set(uds_path: str) -> None:
    async with tools_for("http://weather", uds=uds_path) as tools:
        answer = json.loads(await _ok(tools, "get_weather", {"city": "Bergen"}))
        again = json.loads(await _ok(tools, "get_weather", {"city": "Bergen"}))
    assert (answer["weather"], answer["rollout"], again["visits"]) == ("cold", ROLLOUT_ID, 2)


async def test_spec_path_overrides_the_tool_name(tcp_url: str) -> None:
    async with tools_for(tcp_url) as tools:
        assert await _ok(tools, "forecast", {"city": "Oslo"}) == "forecast for Oslo: cold"


async def test_concurrent_calls_each_get_their_answer(tcp_url: str) -> None:
    cities = [f"city-{i}" for i in range(5)]
    async with tools_for(tcp_url) as tools:
        answers = await asyncio.gather(*(tools.call("forecast", {"city": c}) for c in cities))
    assert answers == [("completed", f"forecast for {c}: cold") for c in cities]


async def test_huge_response_is_cut_with_a_marker(tcp_url: str) -> None:
    endpoint = ResourceEndpoint(base_url=tcp_url)
    tools = ResourceTools(
        {"weather": endpoint}, SPECS, rollout_id=ROLLOUT_ID, cookies={}, max_response_bytes=1000
    )
    async with tools:
        text = await _ok(tools, "big", {})
    assert text.startswith("z" * 1000) and text.endswith("…[truncated 2999000 bytes]…")


async def test_unknown_tool_is_error_text_for_the_model(tcp_url: str) -> None:
    async with tools_for(tcp_url) as tools:
        status, text = await tools.call("get_wether", {})
    assert (
        status == "failed" and text.startswith("error: unknown tool 'get_wether'") and "get_weather" in text
    )


def test_specs_must_name_defined_resources_and_be_unique() -> None:
    endpoint = ResourceEndpoint(base_url="http://weather")
    with pytest.raises(ConfigError, match="'nowhere'"):
        ResourceTools({"weather": endpoint}, [spec("a", resource="nowhere")], rollout_id="r", cookies={})
    with pytest.raises(ConfigError, match="twice"):
        ResourceTools({"weather": endpoint}, [spec("a"), spec("a")], rollout_id="r", cookies={})


async def test_calling_outside_the_context_fails_loudly(tcp_url: str) -> None:
    tools = tools_for(tcp_url)
    with pytest.raises(RuntimeError, match="unopened"):
        await tools.call("get_weather", {})
    async with tools:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        await tools.call("get_weather", {})


def test_tool_parameters_follow_the_schema_order() -> None:
    schema = {"type": "object", "properties": {"city": {}, "unit": {}}}
    assert tool_parameters(ResourceToolSpec(name="w", resource="r", parameters=schema)) == ["city", "unit"]
    assert tool_parameters(ResourceToolSpec(name="w", resource="r")) == []


async def test_the_agents_tool_timeout_bounds_a_call_below_the_endpoints(tcp_url: str) -> None:
    endpoint = ResourceEndpoint(base_url=tcp_url, timeout_s=30.0)
    tools = ResourceTools({"weather": endpoint}, SPECS, rollout_id=ROLLOUT_ID, cookies={}, timeout_s=0.2)
    async with tools:
        with pytest.raises(ResourceUnavailableError, match=r"within 0\.2 s \(the agent's tool_timeout_s"):
            await tools.call("slow", {})
