"""Bundled environments: tools, sessions by cookie, verify (guarded), hidden tests outside the sandbox."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollcage.controller._dataset import EnvironmentRef
from rollcage.controller._servers import EnvironmentPool
from rollcage.environments import bundled_environments, create_app, get_environment
from rollcage.environments.code_fn import run_hidden_tests
from rollcage.errors import ConfigError
from rollcage.supervisor.warm import KEEPER_NAME

TOKEN = "test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def weather() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app("calc-weather", verify_token=TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://env") as client:
        yield client


@pytest.fixture
async def code_fn() -> AsyncIterator[httpx.AsyncClient]:
    app = create_app("code-fn", verify_token=TOKEN)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://env") as client:
        yield client


def test_registry_lists_both_bundled_environments() -> None:
    assert set(bundled_environments()) >= {"calc-weather", "code-fn"}
    with pytest.raises(ConfigError, match="unknown environment 'nope'"):
        get_environment("nope")


async def test_weather_session_keeps_units_by_cookie(weather: httpx.AsyncClient) -> None:
    first = await weather.post("/set_units", json={"units": "F"})
    assert first.status_code == 200 and "cw_session" in first.cookies
    hot = await weather.post("/get_weather", json={"city": "Cairo"})
    assert hot.json() == {"city": "Cairo", "temperature": 88, "units": "F", "condition": "hot"}
    weather.cookies.clear()
    fresh = await weather.post("/get_weather", json={"city": "oslo"})
    assert fresh.json()["units"] == "C" and fresh.json()["condition"] == "cold"


async def test_weather_tool_errors_are_explained(weather: httpx.AsyncClient) -> None:
    assert (await weather.post("/get_weather", json={})).status_code == 400
    missing = await weather.post("/get_weather", json={"city": "Atlantis"})
    assert missing.status_code == 404 and "known:" in missing.json()["error"]
    assert (await weather.post("/get_weather", content=b"{nope")).status_code == 400


async def test_weather_verify_needs_the_token_and_grades_the_answer(weather: httpx.AsyncClient) -> None:
    lookup = await weather.post("/get_weather", json={"city": "Oslo"})
    assert "cw_session" in weather.cookies  # the client sends it back as a Cookie header
    body = {"output_text": " Cold; sum = 42 ", "expected": "cold;sum=42"}
    assert lookup.status_code == 200
    assert (await weather.post("/verify", json=body)).status_code == 403
    graded = (await weather.post("/verify", json=body, headers=AUTH)).json()
    assert graded == {
        "reward": 1.0,
        "detail": {"match": True, "answer": " Cold; sum = 42 ", "lookups": ["oslo"]},
    }
    wrong = (await weather.post("/verify", json={**body, "output_text": "hot;sum=42"}, headers=AUTH)).json()
    assert wrong["reward"] == 0.0


EXPECTED = {
    "tests": [
        {"call": "add(1, 2)", "expect": "3"},
        {"call": "add('a', 'b')", "expect": "'ab'"},
        {"call": "add(0, 0)", "expect": "0"},
    ],
    "timeout_s": 5,
}


async def test_code_fn_verify_runs_hidden_tests_on_the_workspace_file(code_fn: httpx.AsyncClient) -> None:
    good = {"expected": EXPECTED, "workspace_files": {"solution.py": "def add(a, b):\n    return a + b\n"}}
    assert (await code_fn.post("/verify", json=good)).status_code == 403
    answer = (await code_fn.post("/verify", json=good, headers=AUTH)).json()
    assert answer == {"reward": 1.0, "detail": {"passed": 3, "total": 3, "failures": []}}
    buggy = {"expected": EXPECTED, "workspace_files": {"solution.py": "def add(a, b):\n    return a * b\n"}}
    partial = (await code_fn.post("/verify", json=buggy, headers=AUTH)).json()
    assert partial["reward"] == pytest.approx(1 / 3)
    assert [f["call"] for f in partial["detail"]["failures"]] == ["add(1, 2)", "add('a', 'b')"]
    missing = (await code_fn.post("/verify", json={"expected": EXPECTED}, headers=AUTH)).json()
    assert missing["reward"] == 0.0 and "no solution.py" in missing["detail"]["error"]


async def test_hidden_tests_cannot_print_their_way_to_a_reward() -> None:
    forged = (
        "import sys\n"
        'print(\'ROLLCAGE-RESULTS 0000 \' + \'{"results": [{"repr": "3"}]}\')\n'
        "def add(a, b):\n    return None\n"
    )
    outcome = await run_hidden_tests(forged, EXPECTED["tests"], timeout_s=5)  # type: ignore[arg-type]
    assert outcome.reward == 0.0


async def test_hidden_tests_time_out_and_leave_no_process() -> None:
    source = "import os, time\nif os.fork() == 0:\n    time.sleep(600)\nwhile True:\n    pass\n"
    started = time.monotonic()
    outcome = await run_hidden_tests(source, EXPECTED["tests"], timeout_s=1)  # type: ignore[arg-type]
    assert outcome.reward == 0.0 and outcome.detail["error"] == "timed out"
    assert time.monotonic() - started < 8


async def test_hidden_tests_have_no_network() -> None:
    source = (
        "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\ndef add(a, b): return a + b\n"
    )
    outcome = await run_hidden_tests(source, EXPECTED["tests"], timeout_s=5)  # type: ignore[arg-type]
    if "error" in outcome.detail:  # under bubblewrap there is no route at all
        assert "import" in outcome.detail["error"]
    else:  # without bubblewrap the connection may simply be refused
        assert outcome.detail["total"] == 3


async def test_pool_serves_bundled_environments_on_loopback_and_stops_them() -> None:
    refs = [EnvironmentRef(key="calc-weather", bundled=get_environment("calc-weather"), url=None)]
    with EnvironmentPool() as pool:
        endpoints = await asyncio.to_thread(pool.start, refs)
        endpoint = endpoints["calc-weather"]
        assert endpoint.url.startswith("http://127.0.0.1:") and endpoint.token
        async with httpx.AsyncClient(base_url=endpoint.url, trust_env=False) as client:
            answer = await client.post("/get_weather", json={"city": "Lima"})
            assert answer.json()["condition"] == "mild"
            assert (await client.post("/verify", json={"expected": "x"})).status_code == 403
        await asyncio.to_thread(pool.close)
    # The warm template keeper lives with the process (a daemon), not with a pool: a rollout run earlier
    # in this test process may have started it.
    left = [t for t in threading.enumerate() if t.name.startswith("rollcage-") and t.name != KEEPER_NAME]
    assert not left


# --------------------------------------------------------------------------- external environments by URL


def _tagged_environment(tag: str, seen: list[str]) -> Any:
    """A minimal external environment that says who it is and logs every request it gets."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def lookup(request: Request) -> JSONResponse:
        seen.append("lookup")
        return JSONResponse({"server": tag})

    async def verify(request: Request) -> JSONResponse:
        seen.append("verify")
        return JSONResponse({"reward": 1.0, "detail": {"server": tag}})

    return Starlette(
        routes=[Route("/lookup", lookup, methods=["POST"]), Route("/verify", verify, methods=["POST"])]
    )


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)")
async def test_rows_naming_different_urls_reach_their_own_server(tmp_path: Path) -> None:
    from rollcage.controller import Controller, ModelEndpointConfig, RunConfig
    from rollcage.controller._servers import AppServer
    from rollcage.policy import PolicyServer
    from rollcage.protocol import RolloutRecord

    seen: dict[str, list[str]] = {"A": [], "B": []}
    servers = {tag: AppServer(_tagged_environment(tag, seen[tag]), name=f"env-{tag}") for tag in seen}
    script = {"tasks": {"*": [{"tool_calls": [{"name": "lookup", "arguments": {}}]}, {"text": "done"}]}}
    try:
        urls = {tag: await asyncio.to_thread(server.start) for tag, server in servers.items()}
        tool = {"type": "resource", "name": "lookup"}
        dataset = tmp_path / "d.jsonl"
        dataset.write_text(
            "".join(
                json.dumps({"id": f"row-{tag}", "input": "go", "environment": urls[tag], "tools": [tool]})
                + "\n"
                for tag in ("A", "B")
            )
        )
        with PolicyServer(script) as policy:
            config = RunConfig(
                dataset=dataset,
                out=tmp_path / "out",
                model=ModelEndpointConfig(base_url=policy.base_url, model_name="scripted"),
                deadline_s=60,
                concurrency=1,
            )
            summary = await Controller(config).run()
    finally:
        for server in servers.values():
            await asyncio.to_thread(server.stop)
    records = [
        RolloutRecord.model_validate_json(line)
        for line in (config.out / "rollouts.jsonl").read_bytes().splitlines()
    ]
    assert summary.exit_code == 0
    assert {r.task_id: (r.reward, (r.grader or {}).get("server")) for r in records} == {
        "row-A": (1.0, "A"),
        "row-B": (1.0, "B"),
    }
    # Each server got exactly its own row's tool call and verify, nothing of the other's.
    assert seen == {"A": ["lookup", "verify"], "B": ["lookup", "verify"]}
    inputs = [json.loads((Path(r.rollout_dir) / "input.json").read_text()) for r in records]
    keys = [next(iter(i["resources"])) for i in inputs]
    assert len(set(keys)) == 2
