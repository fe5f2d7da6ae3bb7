"""The egress proxy: allow-list routing, injected credentials, streaming, bounds, and the capture.

The proxy is driven directly over its Unix socket with httpx (and raw bytes where
httpx would tidy a malicious request up), against a small recording upstream;
the last tests go end to end through ``supervise()`` with a fake worker.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollcage.protocol import CaptureExchange, WorkerInput, WorkerResult
from rollcage.supervisor import ProxyConfig, supervise
from rollcage.supervisor.proxy import EgressProxy, Route, sandbox_input
from tests.helpers.supervisor_env import bwrap_usable, config, fake, make_rollout, processes_with_token
from tests.helpers.supervisor_upstream import Upstream
from tests.helpers.waiting import wait_for_async

KEY = "sk-test-" + "0123456789abcdef"


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with Upstream() as up:
        yield up


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # A Unix socket path must fit in ~107 bytes; pytest's tmp_path may not.
    path = Path(tempfile.mkdtemp(prefix="rc-proxy-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Harness:
    def __init__(self, proxy: EgressProxy, client: httpx.AsyncClient, capture: Path) -> None:
        self.proxy = proxy
        self.client = client
        self.capture = capture

    def records(self) -> list[dict[str, Any]]:
        lines = self.capture.read_text().splitlines()
        for line in lines:
            CaptureExchange.model_validate_json(line)  # every line keeps the published contract
        return [json.loads(line) for line in lines]

    async def settled(self, count: int = 1) -> list[dict[str, Any]]:
        """The capture once it holds ``count`` lines (each is written just after its exchange ends)."""

        def enough() -> list[dict[str, Any]] | None:
            records = self.records()
            return records if len(records) >= count else None

        return await wait_for_async(enough, within_s=10, what=f"{count} capture lines")

    async def raw(self, request: bytes) -> bytes:
        """Send raw bytes (for requests httpx would normalise) and read the whole answer."""
        reader, writer = await asyncio.open_unix_connection(str(self.proxy.socket_path))
        try:
            writer.write(request)
            await writer.drain()
            async with asyncio.timeout(10):
                return await reader.read(65536)
        finally:
            writer.close()


@pytest.fixture
async def harness(
    upstream: Upstream, short_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Harness]:
    limits: dict[str, Any] = getattr(request, "param", {})
    routes = [
        Route(
            kind="model", name="model", prefix="/model/v1", upstream=f"{upstream.base_url}/v1", credential=KEY
        ),
        Route(
            kind="resource",
            name="weather",
            prefix="/resource/weather",
            upstream=f"{upstream.base_url}/weather",
        ),
        Route(kind="resource", name="stuck", prefix="/resource/stuck", upstream=f"{upstream.base_url}/hang"),
        Route(kind="resource", name="down", prefix="/resource/down", upstream="http://127.0.0.1:1"),
    ]
    capture = short_dir / "model_capture.jsonl"
    proxy = EgressProxy(
        short_dir / "proxy.sock", routes, capture_path=capture, rollout_id="r1", config=ProxyConfig(**limits)
    )
    async with proxy:
        transport = httpx.AsyncHTTPTransport(uds=str(proxy.socket_path))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://rollcage-proxy", timeout=10
        ) as client:
            yield Harness(proxy, client, capture)


# --------------------------------------------------------------------------- routing and credentials


async def test_model_request_carries_the_injected_credential_upstream(
    harness: Harness, upstream: Upstream
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    response = await harness.client.post(
        "/model/v1/chat/completions", json=body, headers={"Authorization": "Bearer from-the-sandbox"}
    )
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "hello"
    (seen,) = upstream.requests
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    assert seen.headers["accept-encoding"] == "identity"
    assert seen.json() == body


async def test_resource_request_keeps_its_path_query_and_cookies(
    harness: Harness, upstream: Upstream
) -> None:
    response = await harness.client.post(
        "/resource/weather/forecast?city=Oslo", json={"a": 1}, headers={"Cookie": "session=abc"}
    )
    assert response.status_code == 200
    (seen,) = upstream.requests
    assert seen.path == "/weather/forecast?city=Oslo"
    assert seen.headers["cookie"] == "session=abc"
    assert "authorization" not in seen.headers  # no credential configured for this resource


@pytest.mark.parametrize(
    "target",
    [
        b"/admin",
        b"/model/v2/chat/completions",
        b"/model/v1x/chat/completions",
        b"/resource/other/x",
        b"/model/v1/../../admin",
        b"/model/v1/%2e%2e/admin",
        b"/resource/weather/a%2Fb",
        b"http://169.254.169.254/latest/meta-data",
    ],
)
async def test_anything_off_the_allow_list_gets_403_with_a_message(
    harness: Harness, upstream: Upstream, target: bytes
) -> None:
    answer = await harness.raw(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403"), answer[:100]
    assert b"rollcage egress proxy" in answer and b"allowed: /model/v1/..." in answer
    assert upstream.requests == []
    (record,) = await harness.settled()
    assert record["route"] == "denied" and record["status"] == 403 and record["upstream_url"] is None


async def test_unreachable_upstream_is_a_502_with_the_reason(harness: Harness) -> None:
    response = await harness.client.post("/resource/down/x", json={})
    assert response.status_code == 502 and "unreachable" in response.text
    (record,) = await harness.settled()
    assert record["status"] == 502 and "ConnectError" in record["error"]


# --------------------------------------------------------------------------- streaming and bounds


async def test_server_sent_events_stream_through_as_they_are_produced(
    harness: Harness, upstream: Upstream
) -> None:
    upstream.sse_gap_s = 0.3
    arrivals: list[float] = []
    async with harness.client.stream("POST", "/model/v1/stream", json={"stream": True}) as response:
        assert response.headers["content-type"] == "text/event-stream"
        async for _ in response.aiter_raw():
            arrivals.append(time.monotonic())
    # Four events, 0.3 s apart at the source: had the proxy buffered, they would arrive at once.
    assert len(arrivals) >= 2 and arrivals[-1] - arrivals[0] >= 0.5
    (record,) = await harness.settled()
    assert record["response"]["body"]["text"].count("data:") == 4
    assert record["first_byte_at"] < record["ended_at"]


@pytest.mark.parametrize("harness", [{"max_request_bytes": 1024}], indirect=True)
async def test_request_body_over_the_bound_is_refused(harness: Harness, upstream: Upstream) -> None:
    response = await harness.client.post("/model/v1/chat/completions", content=b"x" * 4096)
    assert response.status_code == 413
    assert upstream.requests == []


@pytest.mark.parametrize("harness", [{"max_response_bytes": 64 * 1024}], indirect=True)
async def test_response_body_over_the_bound_is_not_passed_back(harness: Harness, upstream: Upstream) -> None:
    response = await harness.client.post("/resource/weather/big", json={})
    assert response.status_code == 502 and "bound" in response.text
    (record,) = await harness.settled()
    assert "over the 65536-byte bound" in record["error"]


async def test_a_client_that_goes_away_abandons_the_upstream_request(
    harness: Harness, upstream: Upstream
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        await harness.client.post("/resource/stuck/x", json={}, timeout=0.5)
    assert await asyncio.to_thread(upstream.disconnected.wait, 10), "the upstream request was left hanging"
    (record,) = await harness.settled()
    assert record["status"] is None and "closed the connection" in record["error"]


# --------------------------------------------------------------------------- capture


async def test_capture_has_exactly_one_line_per_exchange_and_never_the_key(
    harness: Harness, upstream: Upstream
) -> None:
    for _ in range(3):
        assert (await harness.client.post("/model/v1/chat/completions", json={"n": 1})).status_code == 200
    assert (await harness.client.post("/resource/weather/x", json={"n": 2})).status_code == 200
    assert (await harness.client.get("/elsewhere")).status_code == 403
    records = await harness.settled(5)
    assert [r["seq"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["route"] for r in records] == ["model", "model", "model", "resource", "denied"]
    assert harness.proxy.exchanges == {"model": 3, "resource": 1, "denied": 1}
    first = records[0]
    assert first["rollout_id"] == "r1" and first["credential_added"] is True
    assert first["request"]["body"]["json"] == {"n": 1}
    assert first["response"]["body"]["json"]["object"] == "chat.completion"
    assert first["started_at"] <= first["first_byte_at"] <= first["ended_at"]
    assert KEY not in harness.capture.read_text()


def test_the_workers_input_points_every_endpoint_at_the_proxy() -> None:
    original = WorkerInput.model_validate(
        {
            "rollout_id": "r",
            "task_id": "t",
            "input": "hi",
            "model": {"base_url": "https://api.example.com/v1", "model": "m"},
            "resources": {"weather": {"base_url": "http://127.0.0.1:8001"}},
        }
    )
    view = sandbox_input(original, "/run/rollcage/proxy.sock")
    assert (
        view.model.base_url == "http://rollcage-proxy/model/v1"
        and view.model.uds == "/run/rollcage/proxy.sock"
    )
    assert view.resources["weather"].base_url == "http://rollcage-proxy/resource/weather"
    assert view.resources["weather"].uds == "/run/rollcage/proxy.sock"
    assert original.model.base_url == "https://api.example.com/v1"  # the controller's copy is untouched
    WorkerInput.model_validate_json(view.model_dump_json())


# --------------------------------------------------------------------------- end to end


SANDBOX = "bwrap" if bwrap_usable() is None else "none"


@pytest.fixture
def _no_strays() -> Iterator[None]:
    yield
    assert processes_with_token() == []


@pytest.mark.usefixtures("_no_strays")
@pytest.mark.timeout(60)
async def test_worker_calls_model_and_resource_through_the_proxy_with_the_credential(
    tmp_path: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLCAGE_TEST_MODEL_KEY", KEY)
    model = make_rollout(tmp_path, "m1", model_url=f"{upstream.base_url}/v1")
    receipt = await supervise(model, config(SANDBOX, *fake("model"), api_key_env="ROLLCAGE_TEST_MODEL_KEY"))
    assert receipt.outcome == "completed", receipt.outcome_reason
    (seen,) = upstream.requests
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    result = WorkerResult.model_validate_json((model / "result.json").read_bytes())
    captured = [json.loads(line) for line in (model / "model_capture.jsonl").read_text().splitlines()]
    # One exchange per model request the trajectory records.
    assert receipt.model_calls_captured == len(result.trajectory.model_calls) == len(captured) == 1
    assert captured[0]["response"]["body"]["json"] == result.trajectory.model_calls[0].response
    assert KEY not in (model / "model_capture.jsonl").read_text()

    monkeypatch.setenv("ROLLCAGE_TEST_RESOURCE_KEY", "rk-" + KEY)
    resource = make_rollout(tmp_path, "r1", resources={"weather": f"{upstream.base_url}/weather"})
    cfg = config(
        SANDBOX,
        *fake("resource", "weather", "/forecast"),
        resource_api_key_envs={"weather": "ROLLCAGE_TEST_RESOURCE_KEY"},
    )
    receipt = await supervise(resource, cfg)
    assert receipt.outcome == "completed", receipt.outcome_reason
    reply = json.loads((resource / "workspace" / "resource.json").read_text())
    assert reply == {"status": 200, "reply": {"echo": {"city": "Oslo"}, "path": "/weather/forecast"}}
    assert upstream.requests[-1].headers["authorization"] == f"Bearer rk-{KEY}"
    assert receipt.model_calls_captured == 0


@pytest.mark.usefixtures("_no_strays")
@pytest.mark.timeout(60)
async def test_fatal_error_after_a_model_response_is_the_agents(tmp_path: Path, upstream: Upstream) -> None:
    root = make_rollout(tmp_path, model_url=f"{upstream.base_url}/v1")
    receipt = await supervise(root, config(SANDBOX, *fake("model-then-fatal")))
    assert receipt.outcome == "agent_error", receipt.outcome_reason
    assert receipt.result_error is not None and receipt.result_error.type == "ToolError"
