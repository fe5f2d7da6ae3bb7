"""NeMo Gym's own resource servers, from the upstream package, run unchanged under rollcage.

Each server runs from NeMo Gym 0.7.0's wheel in its side environment
(``tests/helpers/upstream.py``), and its own ``data/example.jsonl`` is rollcage's dataset,
read where the package put it. The model is the scripted policy replaying, turn by turn,
the actions of NeMo Gym's own reference rollouts (``data/example_rollouts.jsonl``: each
run of function calls is one turn, each message a final answer). rollcage must then get
the rewards NeMo Gym's reference rollouts got, from the server's own ``/verify``, with a
session per rollout (seeded, carried in cookies to the tools, verified, closed) and no
``/close_session`` error: the 0.7.0 close body is what the server's pydantic model takes.

This supersedes, where upstream code can check it, the restated models of
``test_nemo_gym_conformance.py``.
"""

from __future__ import annotations

import json
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.controller import Controller, RunConfig, iter_dataset
from rollcage.controller._config import EmbeddedPolicyConfig
from rollcage.controller._dataset import Task
from rollcage.protocol import RolloutRecord
from tests.helpers.upstream import UPSTREAM_DIR, upstream_python

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"),
    pytest.mark.timeout(600),
]

# The server's module and class in the package, and why it is here.
SERVERS = {
    # Stateful: the counter lives in the session the seed opens (initial_count), tools change it.
    "example_session_state_mgmt": "StatefulCounterResourcesServer",
    # Stateless tools; verify reads the answer.
    "example_single_tool_call": "SimpleWeatherResourcesServer",
    # Several tools over several steps; verify reads the calls the model made.
    "example_multi_step": "ExampleMultiStepResourcesServer",
}

SERVE = r"""
import json, socket, sys
from importlib import import_module
from unittest.mock import MagicMock

import uvicorn
from nemo_gym.server_utils import ServerClient

name, cls = sys.argv[1], sys.argv[2]
module = import_module(f"resources_servers.{name}.app")
server_cls = getattr(module, cls)
config_cls = server_cls.model_fields["config"].annotation
server = server_cls(
    config=config_cls(host="127.0.0.1", port=0, entrypoint="", name=name),
    server_client=MagicMock(spec=ServerClient),
)
app = server.setup_webserver()
@app.middleware("http")
async def record_closes(request, call_next):
    response = await call_next(request)
    if request.url.path == "/close_session":
        print(json.dumps({"close": response.status_code}), flush=True)
    return response

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
"""


def _package_dir() -> Path:
    found = sorted((UPSTREAM_DIR / "nemo-gym" / "lib").glob("python3.*/site-packages/resources_servers"))
    assert found, f"no resources_servers in the nemo-gym side environment under {UPSTREAM_DIR}"
    return found[0]


def _read_line(process: subprocess.Popen[str], bound_s: float) -> dict[str, Any]:
    assert process.stdout is not None
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = process.stdout.readline()
            assert line, f"the server exited: {process.stderr.read() if process.stderr else ''}"
            return dict(json.loads(line))
    raise AssertionError(f"the server said nothing within {bound_s} s")


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[subprocess.Popen[str]] = []

    def start(name: str) -> tuple[str, subprocess.Popen[str]]:
        python = upstream_python("nemo-gym")
        process = subprocess.Popen(
            [str(python), "-c", SERVE, name, SERVERS[name]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=UPSTREAM_DIR,
        )
        started.append(process)
        port = _read_line(process, 120)["port"]
        return f"http://127.0.0.1:{port}", process

    try:
        yield start
    finally:
        for process in started:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _turns(reference: dict[str, Any]) -> list[dict[str, Any]]:
    """The reference rollout's actions as scripted-policy turns (each run of calls is one turn)."""
    turns: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for item in reference["response"]["output"]:
        if item["type"] == "function_call":
            calls.append({"name": item["name"], "arguments": json.loads(item["arguments"])})
            continue
        if calls:
            turns.append({"tool_calls": calls})
            calls = []
        if item["type"] == "message":
            turns.append({"text": "".join(part.get("text", "") for part in item["content"])})
    if calls:
        turns.append({"tool_calls": calls})
    return turns


def _prompt(params: dict[str, Any]) -> str:
    given = params["input"]
    return given if isinstance(given, str) else json.dumps([item.get("content") for item in given])


@pytest.mark.parametrize("name", sorted(SERVERS))
async def test_upstream_resource_server_gives_the_reference_rollouts_rewards(
    name: str, serve: Any, tmp_path: Path
) -> None:
    data = _package_dir() / name / "data"
    url, process = serve(name)
    references = {
        _prompt(row["responses_create_params"]): row
        for row in map(json.loads, (data / "example_rollouts.jsonl").read_text().splitlines())
    }
    tasks = [t for t in iter_dataset(data / "example.jsonl", format="nemo-gym", environment=url)]
    assert tasks and all(isinstance(t, Task) for t in tasks), tasks
    script: dict[str, list[dict[str, Any]]] = {}
    expected: dict[str, float] = {}
    for task in tasks:
        assert isinstance(task, Task) and task.create_params is not None
        reference = references[_prompt(task.create_params)]
        script[task.id] = _turns(reference)
        expected[task.id] = reference["reward"]
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"model": "replay", "tasks": script}))
    config = RunConfig(
        dataset=data / "example.jsonl",  # NeMo Gym's own file, where its package put it, unchanged
        out=tmp_path / "out",
        environment=url,
        model=EmbeddedPolicyConfig(script=policy),
        deadline_s=120,
        concurrency=2,
    )
    await Controller(config).run()
    records = [
        RolloutRecord.model_validate_json(x)
        for x in (config.out / "rollouts.jsonl").read_bytes().split(b"\n")
        if x
    ]
    assert {r.task_id: (r.outcome, r.reward) for r in records} == {
        task_id: ("completed", reward) for task_id, reward in expected.items()
    }
    # Every rollout's session was closed, and the server took the close body (no 422).
    # The server printed each close's status as it answered it; stopping it flushes the rest of its output.
    process.terminate()
    out, _ = process.communicate(timeout=60)
    closes = [json.loads(line)["close"] for line in out.splitlines() if line.strip()]
    assert closes == [200] * len(records)
