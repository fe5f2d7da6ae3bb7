"""NeMo Gym's own ``terminal_bench_2_1`` resources server grades tasks in ``rollcage`` sandboxes, end to end.

Why this environment: it is the smallest of NeMo Gym's sandbox-backed environments that needs
nothing but a sandbox to grade (no model, no judge, no reattachment from another process): in its
golden-patch mode ``verify`` creates a sandbox from the task's ``docker_image``, runs its package
source set-up, uploads the task's ``solution/`` and runs ``solve.sh``, uploads ``tests/`` and runs
``test.sh``, and reads the reward the tests wrote to ``/logs/verifier/reward.txt``: exec, upload,
download, working directory, exit codes and close, all through NeMo Gym's ``AsyncSandbox``.

The image is pushed to a real local registry (Debian's docker-registry) and named as a NeMo Gym user
names one (``host:port/name:tag``); the provider comes from NeMo Gym's config (``NEMO_GYM_CONFIG_DICT``,
a ``sandbox: {rollcage: ...}`` block). A right solution must earn 1.0 and a wrong one 0.0, each
decided by NeMo Gym's server from what the tests wrote inside the sandbox.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.oci import Image, Registry, push
from tests.helpers.task_images import ENV, _layer
from tests.helpers.upstream import run_upstream

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the rollcage provider needs root")

GRADE = r"""
import asyncio, json, sys
from unittest.mock import MagicMock
from nemo_gym.server_utils import ServerClient
from resources_servers.terminal_bench_2_1.app import (
    TerminalBench21ResourcesServer, TerminalBench21ResourcesServerConfig, TerminalBench21VerifyRequest,
)

image, tasks = sys.argv[1], json.loads(sys.argv[2])
config = TerminalBench21ResourcesServerConfig(
    sandbox_provider="sandbox", sandbox_config={"resources": {"memory_mib": 512, "disk_gib": 1}},
    is_verifying_golden_patch=True, evaluation_timeout=120, host="", port=0, entrypoint="", name="tb",
)
server = TerminalBench21ResourcesServer(config=config, server_client=MagicMock(spec=ServerClient))

async def grade(name, folder):
    body = TerminalBench21VerifyRequest.model_validate({
        "responses_create_params": {"input": []},
        "response": {"output": [], "id": "", "created_at": 0, "model": "", "object": "response",
                     "parallel_tool_calls": False, "tool_choice": "auto", "tools": []},
        "task_name": name, "docker_image": image, "task_folder": folder,
    })
    result = await server.verify(None, body)
    return {"reward": result.reward, "completed": result.evaluation_completed,
            "test_output": result.test_output, "golden": result.golden_patch_output}

async def main():
    print(json.dumps({name: await grade(name, folder) for name, folder in tasks.items()}))

asyncio.run(main())
"""

SOLVE_RIGHT = "printf 'hello, rollcage\\n' > answer.txt\n"
SOLVE_WRONG = "printf 'something else\\n' > answer.txt\n"
TEST_SH = """mkdir -p /logs/verifier
if [ "$(cat /work/answer.txt)" = "hello, rollcage" ]; then echo PASS; echo 1 > /logs/verifier/reward.txt
else echo FAIL; echo 0 > /logs/verifier/reward.txt; fi
"""


def _task(root: Path, solve: str) -> str:
    (root / "solution").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "solution" / "solve.sh").write_text(solve)
    (root / "tests" / "test.sh").write_text(TEST_SH)
    return str(root)


@pytest.fixture
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    if shutil.which("docker-registry") is None:
        pytest.skip("docker-registry is not installed (scripts/system-deps test installs it)")
    server = Registry(tmp_path_factory.mktemp("registry"))
    try:
        yield server
    finally:
        server.stop()


def test_terminal_bench_grades_in_rollcage_sandboxes(
    tmp_path: Path, registry: Registry, state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # busybox's applets and the host's bash (the server runs its set-up and tests with bash).
    image = Image([_layer(False, ["/bin/bash"])], env=list(ENV), working_dir="/work", user="", compress=True)
    push(registry.base, "tasks/terminal", "1", image)
    tasks = {
        "rollcage/right": _task(tmp_path / "right", SOLVE_RIGHT),
        "rollcage/wrong": _task(tmp_path / "wrong", SOLVE_WRONG),
    }
    config = {"sandbox": {"rollcage": {"state_dir": str(state), "image_store": str(tmp_path / "store")}}}
    monkeypatch.setenv("NEMO_GYM_CONFIG_DICT", json.dumps(config))  # NeMo Gym's global config, inherited
    out = run_upstream(
        "nemo-gym-rollcage", GRADE, f"{registry.host}/tasks/terminal:1", json.dumps(tasks), timeout=600
    )
    right, wrong = out["rollcage/right"], out["rollcage/wrong"]
    assert right["completed"] and right["reward"] == 1.0, right
    assert "PASS" in right["test_output"]
    assert wrong["completed"] and wrong["reward"] == 0.0, wrong
    assert "FAIL" in wrong["test_output"]
    # Each task had a sandbox of its own, closed, with every command journaled.
    records = [json.loads((d / "sandbox.json").read_text()) for d in state.iterdir() if d.is_dir()]
    assert len(records) == 2 and all(r["closed_at"] for r in records)
    assert {r["image"]["ref"] for r in records} == {f"docker://{registry.host}/tasks/terminal:1"}
    for directory in state.iterdir():
        commands = [
            json.loads(line)["command"] for line in (directory / "execs.jsonl").read_text().splitlines()
        ]
        assert any("solve.sh" in c for c in commands) and any("/tests/test.sh" in c for c in commands)
    assert not any(
        line.split()[1].startswith(str(state)) for line in Path("/proc/mounts").read_text().splitlines()
    )
