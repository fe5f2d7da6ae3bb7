"""Running the real worker as a subprocess against real loopback servers, for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from rollcage.controller._servers import AppServer
from rollcage.durable import read_journal
from rollcage.protocol import WorkerInput, WorkerResult
from tests.helpers.waiting import DEADLINE_S, wait_for

__all__ = ["RolloutDir", "serve_asgi", "wait_for", "worker_input"]


@contextlib.contextmanager
def serve_asgi(app: Any) -> Iterator[str]:
    """Serve an ASGI app on a free loopback port in a thread (the controller's server); always stop it."""
    server = AppServer(app, name="test")
    try:
        yield server.start()
    finally:
        server.stop()


def worker_input(
    *,
    model_url: str,
    task_id: str,
    resource_url: str | None = None,
    mode: str = "function_calling",
    **agent: Any,
) -> dict[str, Any]:
    """A WorkerInput (as JSON data) for the weather + python smoke task."""
    tools: list[dict[str, Any]] = [{"type": "python"}]
    resources = {}
    if resource_url is not None:
        tools.append(
            {
                "type": "resource",
                "name": "get_weather",
                "description": "Weather of a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
                "resource": "weather",
            }
        )
        resources["weather"] = {"base_url": resource_url, "timeout_s": 10}
    data: dict[str, Any] = {
        "rollout_id": f"{task_id}-r0",
        "task_id": task_id,
        "input": "Is it cold in Oslo, and what is sum([40, 2])? Answer like cold;sum=42",
        "model": {"base_url": model_url, "model": "scripted", "timeout_s": 20, "max_retries": 0},
        "agent": {"mode": mode, "tool_timeout_s": 20, **agent},
        "tools": tools,
        "resources": resources,
    }
    WorkerInput.model_validate(data)  # a test that writes an invalid input should say so explicitly
    return data


class RolloutDir:
    """A rollout directory with a worker process running in it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.input = root / "input.json"
        self.result = root / "result.json"
        self.checkpoint = root / "checkpoint.jsonl"
        self.log = root / "worker.log"
        self.proc: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)

    def write_input(self, data: dict[str, Any] | bytes) -> None:
        self.input.write_bytes(data if isinstance(data, bytes) else orjson.dumps(data))

    def start(self, *extra: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "ROLLCAGE_LOG_LEVEL": "DEBUG"}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollcage", "worker", str(self.input), str(self.result), *extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return self.proc

    def wait(self, timeout: float = DEADLINE_S) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"worker did not exit within {timeout}s; log:\n{self.log_text()}") from None

    def run(self, *extra: str, timeout: float = DEADLINE_S) -> int:
        self.start(*extra)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def records(self) -> list[dict[str, Any]]:
        return read_journal(self.checkpoint)

    def result_model(self) -> WorkerResult:
        assert self.result.exists(), f"no result.json; log:\n{self.log_text()}"
        return WorkerResult.model_validate_json(self.result.read_bytes())

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def listing(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir())
