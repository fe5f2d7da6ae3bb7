"""The SWE toolset end to end: the real worker, caged, fixing a bug with bash and the file editor.

The scripted policy plays a model that makes a project with bash, looks at it and fixes it with
the editor, then checks the fix with bash (which needs the shell's state and the edit). The
rollout is journaled, and a resume after a SIGKILL must re-run every bash command and edit (in
order) to rebuild the workspace and the shell, and then reproduce the uninterrupted run.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.cage import CAGE_ENV
from rollcage.policy import PolicyServer
from rollcage.protocol import WorkerInput, WorkerResult
from tests.helpers.supervisor_env import requires_bwrap
from tests.helpers.waiting import processes_mentioning
from tests.helpers.worker_env import RolloutDir, wait_for

pytestmark = [pytest.mark.bwrap, requires_bwrap()]

EDITOR = "str_replace_based_edit_tool"
CALLS = 8


def _marker(workspace: Path) -> str:
    """A sleep's argument unique to this test: how its background process is found."""
    return f"{abs(hash(str(workspace))) % 10**6}.{os.getpid()}"


def _turns(workspace: Path) -> list[dict[str, Any]]:
    calc = f"{workspace}/proj/calc.py"
    make = (
        # A background process that left the shell's session: it must still end with the rollout.
        f"setsid sleep {_marker(workspace)} >/dev/null 2>&1 & "
        "mkdir -p proj && cd proj && export STAGE=made && "
        "printf 'def add(a, b):\\n    return a - b\\n' > calc.py && echo ok"
    )
    check = f'echo "$STAGE $(basename "$PWD")"; {sys.executable} -c "import calc; print(calc.add(40, 2))"'
    return [
        {"tool_calls": [{"name": "bash", "arguments": {"command": make}}]},
        {"tool_calls": [{"name": EDITOR, "arguments": {"command": "view", "path": calc}}]},
        {
            "tool_calls": [
                {
                    "name": EDITOR,
                    "arguments": {
                        "command": "str_replace",
                        "path": calc,
                        "old_str": "a - b",
                        "new_str": "a + b",
                    },
                }
            ]
        },
        {"tool_calls": [{"name": EDITOR, "arguments": {"command": "view", "path": f"{workspace}/nope.py"}}]},
        {"tool_calls": [{"name": "bash", "arguments": {"command": check}}]},
        {"tool_calls": [{"name": "bash", "arguments": {"restart": True}}]},
        {"tool_calls": [{"name": "bash", "arguments": {"command": 'echo "[${STAGE:-unset}]"; exit 4'}}]},
        {"text": "fixed"},
    ]


@pytest.fixture
def caged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker cages its executor, its shell and its editor, as under the supervisor."""
    monkeypatch.setenv(CAGE_ENV, "bwrap")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """One workspace path for every attempt (in the sandbox it is always /rollout/workspace)."""
    path = tmp_path / "ws"
    path.mkdir()
    return path


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[Callable[[str], RolloutDir]]:
    made: list[RolloutDir] = []

    def make(name: str) -> RolloutDir:
        made.append(RolloutDir(tmp_path / name))
        return made[-1]

    try:
        yield make
    finally:
        for rd in made:
            rd.kill()


def _input(server: PolicyServer, rollout_id: str, **extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "rollout_id": rollout_id,
        "task_id": "swe",
        "input": "Fix calc.add.",
        "model": {"base_url": server.base_url, "model": "scripted", "timeout_s": 20, "max_retries": 0},
        "agent": {"tool_timeout_s": 60},
        "tools": [{"type": "bash"}, {"type": "editor"}],
        **extra,
    }
    WorkerInput.model_validate(data)
    return data


def _run(rd: RolloutDir, data: dict[str, Any], workspace: Path) -> WorkerResult:
    rd.write_input(data)
    code = rd.run("--workspace", str(workspace))
    assert code == 0, rd.log_text()
    return rd.result_model()


def _empty(workspace: Path) -> None:
    """What the controller does for a new attempt: an empty workspace."""
    shutil.rmtree(workspace)
    workspace.mkdir()


def _comparable(result: WorkerResult) -> dict[str, Any]:
    t = result.trajectory
    assert result.response is not None
    return {
        "tools": [(c.call_id, c.name, c.arguments, c.turn, c.status, c.output) for c in t.tool_calls],
        "calls": [(c.index, c.output) for c in t.model_calls],
        "text": result.response.output_text,
    }


def test_a_rollout_fixes_a_bug_with_bash_and_the_editor_and_journals_each_call(
    caged: None, serve_policy: Callable[..., PolicyServer], dirs: Callable[[str], RolloutDir], workspace: Path
) -> None:
    server = serve_policy({"tasks": {"swe": _turns(workspace)}}, keep_bodies=True)
    rd = dirs("r0")
    result = _run(rd, _input(server, "swe-0"), workspace)

    assert result.termination_reason == "completed" and result.error is None
    # Nothing the agent started outlives its rollout.
    wait_for(lambda: not processes_mentioning(_marker(workspace)), what="the background sleep to end")
    calls = result.trajectory.tool_calls
    assert [c.name for c in calls] == ["bash", EDITOR, EDITOR, EDITOR, "bash", "bash", "bash"]
    assert [c.status for c in calls] == [
        "completed",
        "completed",
        "completed",
        "failed",
        "completed",
        "completed",
        "failed",
    ]
    assert calls[0].output == "ok"
    assert calls[1].output is not None and "     2\t    return a - b" in calls[1].output
    assert calls[2].output is not None and calls[2].output.startswith(
        f"The file {workspace}/proj/calc.py has been"
    )
    assert calls[3].output == f"The path {workspace}/nope.py does not exist. Please provide a valid path."
    # The shell kept its directory and variable; the edit reached the file the shell runs.
    assert calls[4].output == "made proj\n42"
    assert (workspace / "proj" / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    # restart: true gave a fresh shell; a command's exit status reaches the model.
    assert calls[5].output is not None and "restarted" in calls[5].output
    assert calls[6].output is not None and calls[6].output.startswith("[unset]\n")
    assert "exit" in calls[6].output and "lost" in calls[6].output
    # Each call is a tool boundary in the journal, with the output the model saw.
    journaled = {
        tool["call_id"]: tool["output"]
        for record in rd.records()
        if record.get("kind") == "tool_call"
        for tool in record["tool_calls"]
    }
    assert journaled == {c.call_id: c.output for c in calls}
    # The model was offered both tools with the arguments those editors take.
    body = server.request_log[0].body
    assert body is not None
    offered = body["tools"]
    names = [t.get("name") or t.get("function", {}).get("name") for t in offered]
    assert names == ["bash", EDITOR]


def test_a_killed_swe_rollout_resumes_by_rerunning_its_commands_and_edits(
    caged: None, serve_policy: Callable[..., PolicyServer], dirs: Callable[[str], RolloutDir], workspace: Path
) -> None:
    turns = _turns(workspace)
    baseline_server = serve_policy({"tasks": {"swe": turns}})
    baseline = _run(dirs("base"), _input(baseline_server, "swe-base"), workspace)
    _empty(workspace)

    server = serve_policy({"tasks": {"swe": turns}}, faults=["rollout=swe-0:call=5:kind=hang"])
    first, second = dirs("try0"), dirs("try1")
    first.write_input(_input(server, "swe-0"))
    first.start("--workspace", str(workspace))
    wait_for(
        lambda: any(f.rollout_id == "swe-0" for f in server.faults_injected), what="the hung 5th request"
    )
    wait_for(lambda: any(r.get("kind") == "turn_start" and r["turn"]["index"] == 4 for r in first.records()))
    assert first.proc is not None
    os.killpg(first.proc.pid, signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL

    _empty(workspace)
    shutil.copyfile(first.checkpoint, second.root / "resume.jsonl")
    result = _run(second, _input(server, "swe-1", resume={"previous_rollout_id": "swe-0"}), workspace)

    assert result.trajectory.resume_refused is None
    resumed = result.trajectory.resumed_from
    assert resumed is not None
    # Every command and edit the journal held was run again, in order: none answered from the journal.
    assert resumed.rerun_cells == ["call_0_0", "call_1_0", "call_2_0", "call_3_0"]
    assert resumed.replayed_tool_calls == []
    assert server.requests.get("swe-1", 0) == CALLS - 4
    assert _comparable(result) == _comparable(baseline)
    assert result.trajectory.tool_calls[4].output == "made proj\n42"


def test_a_rollout_cancelled_mid_command_stops_its_shell_and_everything_in_it(
    caged: None, serve_policy: Callable[..., PolicyServer], dirs: Callable[[str], RolloutDir], workspace: Path
) -> None:
    marker = _marker(workspace)
    command = f"setsid sleep {marker}1 >/dev/null 2>&1 & sleep {marker}2"
    server = serve_policy(
        {"tasks": {"swe": [{"tool_calls": [{"name": "bash", "arguments": {"command": command}}]}]}}
    )
    rd = dirs("r0")
    rd.write_input(_input(server, "swe-0"))
    rd.start("--workspace", str(workspace))
    wait_for(lambda: len(processes_mentioning(marker)) == 2, what="the command and its background process")
    rd.signal(signal.SIGTERM)
    assert rd.wait() == 128 + signal.SIGTERM
    result = rd.result_model()
    assert result.error is not None and result.error.kind == "cancelled"
    (call,) = result.trajectory.tool_calls
    assert call.name == "bash" and call.status == "cancelled"
    wait_for(lambda: not processes_mentioning(marker), what="the shell's processes to end")
