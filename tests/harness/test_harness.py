"""Harnesses end to end: NOOA and command-line agents through ``rollcage run``/``supervise`` in bwrap.

Every rollout here is real: the scripted policy server, the bundled calc-weather
environment, the supervisor with its egress proxy and capture journal, the worker
with its loopback forwarder, and the harness (NOOA 0.0.10 on its own Python, a
small openai-SDK agent, mini-swe-agent, or a black-box Python script) in the
executor's cage. The harness environment is installed once per machine
(``tests/helpers/harness_env.py``); every run shares it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from rollcage import load_checkpoint
from rollcage.durable import read_journal
from rollcage.protocol import RolloutRecord, RunMetrics, SupervisorReceipt, WorkerResult
from tests.environments.test_nemo_gym_conformance import GymVerifyResponse
from tests.helpers.formats import AtifTrajectory, NgTrajectoryRecord, check_training_items
from tests.helpers.harness_env import HarnessEnvs, prepare_harness_envs
from tests.helpers.paths import REPO
from tests.helpers.supervisor_env import requires_bwrap
from tests.helpers.waiting import wait_for

EXAMPLES = REPO / "examples"

pytestmark = [
    pytest.mark.bwrap,
    requires_bwrap(),
    pytest.mark.xdist_group("harness"),
    # The first test also waits for the one-time install of NOOA on a fresh machine (about 40 s).
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="session")
def envs() -> HarnessEnvs:
    """The harness environment (NOOA, cli-agent, mini-swe-agent), installed once and cached."""
    return prepare_harness_envs()


def rollcage(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run the rollcage CLI in a fresh process, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "rollcage", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


def records(out: Path) -> dict[str, RolloutRecord]:
    lines = (out / "rollouts.jsonl").read_bytes().splitlines()
    return {r.task_id: r for r in (RolloutRecord.model_validate_json(line) for line in lines)}


def result_of(record: RolloutRecord) -> WorkerResult:
    return WorkerResult.model_validate_json((Path(record.rollout_dir) / "result.json").read_bytes())


def journal(rollout_dir: Path) -> list[dict[str, Any]]:
    return read_journal(rollout_dir / "checkpoint.jsonl")


def capture(rollout_dir: Path) -> list[dict[str, Any]]:
    path = rollout_dir / "model_capture.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def model_lines(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [x for x in lines if x["route"] == "model" and x["upstream_url"] is not None]


# --------------------------------------------------------------------------- NOOA on calc-weather


@pytest.fixture(scope="module")
def nooa_run(envs: HarnessEnvs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``rollcage run`` of the NOOA example (chat and Responses), finding the installed NOOA by itself."""
    out = tmp_path_factory.mktemp("nooa") / "out"
    done = rollcage(
        "run",
        str(EXAMPLES / "nooa-calc-weather" / "dataset.jsonl"),
        "--sandbox",
        "bwrap",
        "--out",
        str(out),
        "--quiet",
        "--deadline",
        "240",
        "--max-infra-retries",
        "0",
        env={"ROLLCAGE_HARNESS_HOME": str(envs.home)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_nooa_answers_calc_weather_and_is_graded(nooa_run: Path) -> None:
    got = records(nooa_run)
    assert {task: (r.outcome, r.reward, r.termination_reason) for task, r in got.items()} == {
        "oslo-sum": ("completed", 1.0, "completed"),
        "cairo-sum": ("completed", 1.0, "completed"),
    }
    metrics = RunMetrics.model_validate_json((nooa_run / "metrics.json").read_bytes())
    assert metrics.mean_reward == 1.0 and metrics.retries == 0
    for record in got.values():
        result = result_of(record)
        assert result.error is None and result.response is not None
        assert (
            result.response.output_text
            == {"oslo-sum": "cold;sum=42", "cairo-sum": "hot;sum=56"}[record.task_id]
        )
        # The tool call went to the environment through the forwarder, with the seeded session's cookie.
        assert "cw_session" in result.resource_cookies
        assert record.receipt.sandbox == "bwrap" and record.receipt.cleanup_confirmed


def test_nooa_model_calls_are_journaled_by_the_supervisor_from_the_capture(nooa_run: Path) -> None:
    for record in records(nooa_run).values():
        root = Path(record.rollout_dir)
        forwarded = model_lines(capture(root))
        entries = journal(root)
        calls = [e for e in entries if e["kind"] == "model_call"]
        assert entries[0]["kind"] == "start" and entries[0]["reported_by"] == "supervisor"
        assert len(calls) == len(forwarded) == 2 == record.receipt.model_calls_captured
        assert {e["reported_by"] for e in calls} == {"supervisor"}
        # The same calls, the same ids, in the journal and in the worker's result.
        checkpoint = load_checkpoint(root / "checkpoint.jsonl")
        result = result_of(record)
        assert [c.output for c in checkpoint.trajectory.model_calls] == [
            c.output for c in result.trajectory.model_calls
        ]
        assert [c.api for c in result.trajectory.model_calls] == [
            "responses" if record.task_id == "cairo-sum" else "chat"
        ] * 2


def test_nooa_evidence_is_as_rl_grade_as_a_native_rollout(nooa_run: Path) -> None:
    for record in records(nooa_run).values():
        rid = record.rollout_id
        result = result_of(record)
        trajectory = result.trajectory
        calls = trajectory.model_calls
        # One turn per model call, owning exactly it, with the wire's one attempt.
        assert [(c.id, c.turn) for c in calls] == [(f"{rid}:m0", 0), (f"{rid}:m1", 1)]
        assert [(t.id, t.model_calls, t.resolution) for t in trajectory.turns] == [
            (f"{rid}:t0", [f"{rid}:m0"], "acted"),
            (f"{rid}:t1", [f"{rid}:m1"], "acted"),
        ]
        assert all([(a.status, a.http_status) for a in c.attempts] == [("completed", 200)] for c in calls)
        # Turn 0 asks the task; turn 1 only what the harness added since (the cell's output).
        assert "Oslo" in json.dumps(trajectory.turns[0].input) or "Cairo" in json.dumps(
            trajectory.turns[0].input
        )
        assert trajectory.turns[1].input and all(
            i.get("role") != "assistant" and i.get("type") != "function_call"
            for i in trajectory.turns[1].input
        )
        # The supervisor's journal has the same turns (journaled from the capture, outside the sandbox).
        checkpoint = load_checkpoint(Path(record.rollout_dir) / "checkpoint.jsonl")
        assert [(t.id, t.model_calls) for t in checkpoint.trajectory.turns] == [
            (t.id, t.model_calls) for t in trajectory.turns
        ]
        assert [c.tokens for c in checkpoint.trajectory.model_calls] == [c.tokens for c in calls]
        # Health ran every check (none unobserved): the turns own their calls, the capture agrees.
        assert record.health.verdict == "healthy" and not record.health.unobserved, record.health


def test_nooa_export_is_read_by_nemo_gym_s_own_models_and_converter(nooa_run: Path, tmp_path: Path) -> None:
    from rollcage.export import export_run
    from tests.controller.test_upstream_nemo import NEMO_SCRIPT
    from tests.helpers.upstream import run_upstream

    target = tmp_path / "nemo-gym.jsonl"
    assert export_run(nooa_run, "nemo-gym", target).exported == 2
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    # NeMo Gym's models take every row (the script validates each before converting it) ...
    given = json.dumps({"rows": rows, "close": [], "verify": []})
    answer = run_upstream("nemo-gym", NEMO_SCRIPT, stdin=given)
    # ... and its strict ATIF converter refuses them for what NOOA did: it feeds each execution's result
    # back as a user message, a later user turn ATIF v1.7 cannot hold; never for the shape rollcage wrote.
    assert {task: outcome.get("refused", "")[-44:] for task, outcome in answer["rows"].items()} == {
        "oslo-sum": "later system or user turns are not supported",
        "cairo-sum": "later system or user turns are not supported",
    }


def test_nooa_steps_are_harness_reported_with_the_synthetic_first_turn_given_its_origin(
    nooa_run: Path,
) -> None:
    for record in records(nooa_run).values():
        result = result_of(record)
        tools = result.trajectory.tool_calls
        assert {t.reported_by for t in tools} == {"harness"}
        prefill, cell, answer = tools
        # NOOA's first turn prints the task's inputs before any model call: its own, not the model's.
        assert (prefill.origin, prefill.name, prefill.status, prefill.turn) == (
            "harness",
            "execute_python",
            "completed",
            0,
        )
        assert "Task: solve()" in (prefill.output or "")
        assert prefill.started_at < result.trajectory.model_calls[0].started_at
        assert (cell.call_id, cell.origin, cell.name, cell.status) == (
            "call_0_0",
            "model",
            "execute_python",
            "completed",
        )
        expected = {"oslo-sum": "cold 42", "cairo-sum": "hot 56"}[record.task_id]
        assert expected in (cell.output or "")
        assert (answer.call_id, answer.name, answer.status) == ("call_1_0", "return_result", "completed")
        # The response shows the synthetic turn first, every call with its output.
        assert result.response is not None
        kinds = [(i["type"], i.get("call_id")) for i in result.response.output]
        assert kinds[:2] == [("function_call", prefill.call_id), ("function_call_output", prefill.call_id)]
        # The journal has the same tool calls, relayed as the harness reported them.
        relayed = [e for e in journal(Path(record.rollout_dir)) if e["kind"] == "tool_call"]
        assert {e["reported_by"] for e in relayed} == {"harness"}
        assert sorted(t["call_id"] for e in relayed for t in e["tool_calls"]) == sorted(
            t.call_id for t in tools
        )


def test_run_refuses_up_front_when_the_nooa_environment_is_missing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = rollcage(
        "run",
        str(EXAMPLES / "nooa-calc-weather" / "dataset.jsonl"),
        "--out",
        str(out),
        "--quiet",
        env={"ROLLCAGE_HARNESS_HOME": str(tmp_path / "empty")},
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("rollcage run: the nooa harness is not installed")
    assert "rollcage harness install nooa" in lines[-1]
    assert not out.exists()


# --------------------------------------------------------------------------- command-line agents


_MINI_ARGV = [
    "env",
    "MSWEA_COST_TRACKING=ignore_errors",
    "MSWEA_CONFIGURED=true",
    "mini",
    "--yolo",
    "--exit-immediately",
    "--cost-limit",
    "0",
    "--model",
    "openai/rollcage-scripted",
    "--output",
    "/tmp/mini-trajectory.json",
    "--task",
]

_MINI_POLICY = {
    "mini-oslo": [
        {
            "text": "Looking up the weather and computing the sum.",
            "tool_calls": [
                {
                    "name": "bash",
                    "arguments": {
                        "command": 'curl -s -X POST "$ROLLCAGE_TOOLS_URL/get_weather" '
                        "-H \"Authorization: Bearer $OPENAI_API_KEY\" -H 'Content-Type: application/json' "
                        "-d '{\"city\": \"Oslo\"}' && python3 -c 'print(sum([40, 2]))'"
                    },
                }
            ],
        },
        {
            "text": "Writing the answer.",
            "tool_calls": [{"name": "bash", "arguments": {"command": "echo 'cold;sum=42' > answer.txt"}}],
        },
        {
            "text": "Done.",
            "tool_calls": [
                {"name": "bash", "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}
            ],
        },
    ],
}


@pytest.fixture(scope="module")
def command_run(envs: HarnessEnvs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``rollcage run``: the cli-agent example's rows, and mini-swe-agent's where it installed."""
    base = tmp_path_factory.mktemp("command")
    rows = (EXAMPLES / "command-agent" / "dataset.jsonl").read_text().splitlines()
    policy = json.loads(json.dumps(_yaml(EXAMPLES / "command-agent" / "policy.yaml")))
    if envs.mini is None:
        rows.append(
            json.dumps(
                {
                    "id": "mini-oslo",
                    "environment": "calc-weather",
                    "input": "Is it cold in Oslo? Also compute sum([40, 2]). "
                    "Write <condition>;sum=<n> to answer.txt.",
                    "tools": ["get_weather"],
                    "agent": {
                        "harness": {"type": "command", "argv": _MINI_ARGV, "task": "argv", "answer": "file"},
                        "max_policy_calls": 4,
                    },
                    "model": {"max_retries": 0},
                    "expected": "cold;sum=42",
                }
            )
        )
        policy["tasks"].update(_MINI_POLICY)
    (base / "dataset.jsonl").write_text("\n".join(rows) + "\n")
    (base / "policy.json").write_text(json.dumps(policy))
    done = rollcage(
        "run",
        str(base / "dataset.jsonl"),
        "--policy",
        str(base / "policy.json"),
        "--harness-env",
        str(envs.env),
        "--out",
        str(base / "out"),
        "--quiet",
        "--max-infra-retries",
        "0",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return base / "out"


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def test_command_harness_runs_an_openai_sdk_agent_with_its_tool_calls_in_evidence(command_run: Path) -> None:
    got = records(command_run)
    for task, answer in (("oslo-sum", "cold;sum=42"), ("cairo-sum", "hot;sum=56")):
        record = got[task]
        assert (record.outcome, record.reward) == ("completed", 1.0)
        result = result_of(record)
        assert result.response is not None and result.response.output_text == answer
        tools = {t.name: t for t in result.trajectory.tool_calls}
        assert set(tools) == {"get_weather", "python"}
        assert all(
            t.reported_by == "harness" and t.origin == "model" and t.status == "completed"
            for t in tools.values()
        )
        assert tools["get_weather"].call_id == "call_0_0" and "temperature" in (
            tools["get_weather"].output or ""
        )
        root = Path(record.rollout_dir)
        assert len(model_lines(capture(root))) == 2
        # The environment's tool route was reached through the forwarder: captured outside the sandbox.
        assert [x["route"] for x in capture(root)].count("resource") == 1


def test_a_command_harness_rollout_has_token_data_and_exports_in_both_formats(
    command_run: Path, tmp_path: Path
) -> None:
    record = records(command_run)["oslo-sum"]
    result = result_of(record)
    calls = result.trajectory.model_calls
    # cli-agent asks for token ids and log probabilities as an RL harness does; they are read off the wire.
    assert [c.tokens.status for c in calls] == ["observed", "observed"]
    assert all(c.response is not None and "prompt_token_ids" not in c.response for c in calls)
    checkpoint = load_checkpoint(Path(record.rollout_dir) / "checkpoint.jsonl")
    assert [c.tokens for c in checkpoint.trajectory.model_calls] == [c.tokens for c in calls]
    assert [t.resolution for t in result.trajectory.turns] == ["acted", "answered"]
    assert record.health.verdict == "healthy", record.health
    atif = rollcage("export", str(command_run), "--format", "atif", "--out", str(tmp_path / "atif"))
    assert atif.returncode == 0, atif.stderr
    document = json.loads((tmp_path / "atif" / f"{record.rollout_id}.json").read_text())
    AtifTrajectory.model_validate(document)
    nemo = rollcage("export", str(command_run), "--format", "nemo-gym", "--out", str(tmp_path / "ng.jsonl"))
    assert nemo.returncode == 0, nemo.stderr
    rows = {
        row["_ng_rollout_id"]: row
        for row in map(json.loads, (tmp_path / "ng.jsonl").read_text().splitlines())
    }
    row = rows[record.rollout_id]
    GymVerifyResponse.model_validate(row)
    trajectory = NgTrajectoryRecord.model_validate(row["ng_trajectory"])
    # Each model call's token arrays ride on its output, as NeMo Gym trains on them.
    assert check_training_items(row["response"]["output"]) == len(trajectory.model_calls) == 2
    refs = [ref.model_call_id for turn in trajectory.turns for ref in turn.model_calls]
    assert refs == [call.model_call_id for call in trajectory.model_calls] == [c.id for c in calls]


def test_command_harness_runs_mini_swe_agent(envs: HarnessEnvs, command_run: Path) -> None:
    if envs.mini is not None:
        pytest.skip(f"optional: {envs.mini}")
    record = records(command_run)["mini-oslo"]
    assert (record.outcome, record.reward, record.termination_reason) == ("completed", 1.0, "completed")
    result = result_of(record)
    assert result.response is not None and result.response.output_text == "cold;sum=42"
    # A black box that reports nothing: its calls are journaled from the capture all the same.
    entries = journal(Path(record.rollout_dir))
    assert [e["reported_by"] for e in entries if e["kind"] == "model_call"] == ["supervisor"] * 3
    assert all(t.status == "incomplete" and t.reported_by == "harness" for t in result.trajectory.tool_calls)


# --------------------------------------------------------------------------- black boxes under supervise


_PRELUDE = """
import json, os, socket, sys, time, urllib.error, urllib.request
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def http(method, url, body=None, token=os.environ["OPENAI_API_KEY"]):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = "Bearer " + token
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with OPENER.open(request, timeout=30) as response:
            response.read()  # the whole answer: a harness that hangs up after the status interrupts the call
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except Exception as exc:
        return type(exc).__name__
def ask():
    body = {"model": os.environ["ROLLCAGE_MODEL"], "messages": [{"role": "user", "content": "hi"}]}
    return http("POST", os.environ["OPENAI_BASE_URL"] + "/chat/completions", body)
"""


def _prepare(
    parent: Path, name: str, policy_url: str, code: str, envs: HarnessEnvs, *, max_policy_calls: int = 8
) -> Path:
    from rollcage.harness import resolve_environment

    root = parent / name
    (root / "workspace").mkdir(parents=True)
    env = resolve_environment("command", envs.env)
    assert env is not None
    data = {
        "rollout_id": name,
        "task_id": name,
        "input": "go",
        "model": {"base_url": policy_url, "model": "m", "max_retries": 0},
        "agent": {
            "max_policy_calls": max_policy_calls,
            "harness": {"type": "command", "argv": ["python", "-c", _PRELUDE + textwrap.dedent(code)]},
        },
        "harness_env": env.model_dump(),
    }
    (root / "input.json").write_text(json.dumps(data))
    return root


def _supervise(root: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollcage", "supervise", str(root), "--deadline", "120", "--json", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def _receipt(proc: subprocess.Popen[str]) -> SupervisorReceipt:
    out, err = proc.communicate(timeout=240)
    assert out.strip(), err[-3000:]
    return SupervisorReceipt.model_validate_json(out)


@pytest.fixture
def policy(serve_policy: Any) -> str:
    server = serve_policy({"tasks": {"*": [{"text": "again"}]}})
    return str(server.base_url)


def _pids_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                if marker.encode() in file.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("victims", ["harness", "sandbox"])
def test_sigkill_after_k_model_calls_leaves_k_boundaries_in_the_journal(
    envs: HarnessEnvs, policy: str, tmp_path: Path, victims: str
) -> None:
    marker = f"rollcage-blackbox-{secrets.token_hex(6)}"
    code = f"""
    # {marker}: three model calls, writing nothing of its own, then it waits to be killed.
    for _ in range(3):
        assert ask() == 200
    time.sleep(600)
    """
    root = _prepare(tmp_path, "killed", policy, code, envs)
    proc = _supervise(root)
    try:
        wait_for(lambda: len(model_lines(capture(root))) >= 3, what="three captured model calls", timeout=180)
        targets = _pids_with(marker)
        if victims == "sandbox":
            token = (root / ".sandbox" / "token").read_text().splitlines()[0]
            # The worker first: one that outlived its harness by a moment (a busy machine between two
            # kills) would record the harness's death as the policy's failure.
            targets = [pid for pid in _pids_with("worker") if _has_token(pid, token)] + targets
        assert targets
        for pid in targets:
            # The harness cage's bubblewrap carries the marker too: killed, it takes the harness with it.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        receipt = _receipt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    calls = [e for e in journal(root) if e["kind"] == "model_call"]
    assert len(calls) >= 3 and {e["reported_by"] for e in calls} == {"supervisor"}
    assert len(load_checkpoint(root / "checkpoint.jsonl").trajectory.model_calls) >= 3
    # A killed harness is the policy's failure (it answered); a killed worker is infrastructure's.
    assert receipt.outcome == ("agent_error" if victims == "harness" else "infra_failure"), (
        receipt.outcome_reason
    )


def _has_token(pid: int, token: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            return f"ROLLCAGE_SUPERVISION_TOKEN={token}".encode() in file.read().split(b"\0")
    except OSError:
        return False


def test_a_harness_that_exits_0_without_an_answer_is_not_completed(
    envs: HarnessEnvs, policy: str, tmp_path: Path
) -> None:
    root = _prepare(tmp_path, "silent", policy, "assert ask() == 200\n", envs)
    receipt = _receipt(_supervise(root))
    assert receipt.outcome == "agent_error"
    assert receipt.result_error is not None and receipt.result_error.type == "HarnessError"
    assert "without a final answer" in receipt.result_error.message


def test_max_policy_calls_stops_a_black_box_and_the_call_never_leaves_the_sandbox(
    envs: HarnessEnvs, policy: str, tmp_path: Path
) -> None:
    code = """
    while ask() == 200:
        pass
    print("refused")
    time.sleep(600)  # the worker stops it: its answer would come too late
    """
    root = _prepare(tmp_path, "budget", policy, code, envs, max_policy_calls=2)
    receipt = _receipt(_supervise(root))
    result = WorkerResult.model_validate_json((root / "result.json").read_bytes())
    assert (receipt.outcome, result.termination_reason, result.error) == (
        "completed",
        "max_policy_calls",
        None,
    )
    assert len(result.trajectory.model_calls) == 2
    assert len(model_lines(capture(root))) == 2 == receipt.model_calls_captured


def test_a_stopped_harness_gets_its_grace_before_sigkill(
    envs: HarnessEnvs, policy: str, tmp_path: Path
) -> None:
    code = """
    import signal
    def on_term(*_):
        time.sleep(1)  # SIGKILL now (bubblewrap's monitor dying of the SIGTERM) would lose this
        open("said-goodbye", "w").close()
        raise SystemExit(143)
    signal.signal(signal.SIGTERM, on_term)
    open("started", "w").close()
    time.sleep(600)
    """
    root = _prepare(tmp_path, "graceful", policy, code, envs)
    receipt = _stopped_once_started(root, "the harness")
    assert receipt.outcome == "cancelled"
    assert (root / "workspace" / "said-goodbye").exists()


def test_the_harness_reaches_nothing_but_the_model_and_the_tool_routes(
    envs: HarnessEnvs, tmp_path: Path
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    probe = f"""
    def connect(host, port):
        try:
            socket.create_connection((host, port), timeout=5).close()
            return "connected"
        except Exception as exc:
            return type(exc).__name__
    def resolve(name):
        try:
            socket.getaddrinfo(name, 80)
            return "resolved"
        except Exception as exc:
            return type(exc).__name__
    base, tools = os.environ["OPENAI_BASE_URL"], os.environ["ROLLCAGE_TOOLS_URL"]
    found = {{
        "model": ask(),
        "tool": http("POST", tools + "/get_weather", {{"city": "Oslo"}}),
        "model_without_token": http("POST", base + "/chat/completions", {{}}, token=None),
        "not_a_tool": http("POST", tools + "/verify", {{}}),
        "around_the_forwarder": http("POST", base.replace("/v1", "/resource/calc-weather/verify"), {{}}),
        "model_files": http("DELETE", base + "/files/file-1"),
        "fine_tuning": http("POST", base + "/fine_tuning/jobs", {{}}),
        "host_loopback": connect("127.0.0.1", {port}),
        "internet": connect("1.1.1.1", 80),
        "dns": resolve("example.com"),
        "proxy_socket": os.path.exists("/run/rollcage/proxy.sock"),
        "worker_input": os.path.exists("/rollout/input.json"),
    }}
    print(json.dumps(found))
    """
    row = {
        "id": "probe",
        "environment": "calc-weather",
        "input": "probe",
        "tools": ["get_weather"],
        "agent": {
            "harness": {"type": "command", "argv": ["python", "-c", _PRELUDE + textwrap.dedent(probe)]}
        },
        "expected": "anything",
    }
    (tmp_path / "dataset.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "policy.json").write_text(json.dumps({"tasks": {"*": [{"text": "hello"}]}}))
    try:
        done = rollcage(
            "run",
            str(tmp_path / "dataset.jsonl"),
            "--policy",
            str(tmp_path / "policy.json"),
            "--harness-env",
            str(envs.env),
            "--out",
            str(tmp_path / "out"),
            "--quiet",
        )
    finally:
        listener.close()
    assert done.returncode == 0, done.stderr[-3000:]
    record = records(tmp_path / "out")["probe"]
    assert record.outcome == "completed"
    result = result_of(record)
    assert result.response is not None
    found = json.loads(result.response.output_text)
    assert found == {
        "model": 200,
        "tool": 200,
        "model_without_token": 401,
        "not_a_tool": 404,
        "around_the_forwarder": 404,
        "model_files": 403,
        "fine_tuning": 403,
        "host_loopback": "ConnectionRefusedError",
        "internet": "OSError",
        "dns": "gaierror",
        "proxy_socket": False,
        "worker_input": False,
    }
    # Outside the sandbox: one model call, one tool call, two refusals; nothing else left it.
    routes = sorted(x["route"] for x in capture(Path(record.rollout_dir)))
    assert routes == ["denied", "denied", "model", "resource"]


# --------------------------------------------------------------------------- NOOA cancelled


def test_nooa_stopped_mid_episode_publishes_its_partial_episode(
    envs: HarnessEnvs, serve_policy: Any, tmp_path: Path
) -> None:
    from rollcage.harness import resolve_environment

    script = {
        "tasks": {
            "*": [
                {"text": "never played: NOOA's first turn is its own"},
                {
                    "tool_calls": [
                        {
                            "name": "execute_python",
                            "arguments": {"code": "open('started', 'w').close()\nawait asyncio.sleep(300)"},
                        }
                    ]
                },
            ]
        }
    }
    server = serve_policy(script)
    root = tmp_path / "stopped"
    (root / "workspace").mkdir(parents=True)
    env = resolve_environment("nooa", envs.env)
    assert env is not None
    data = {
        "rollout_id": "stopped",
        "task_id": "stopped",
        "input": "wait",
        "model": {"base_url": str(server.base_url), "model": "m", "max_retries": 0},
        "agent": {"harness": {"type": "nooa"}},
        "harness_env": env.model_dump(),
    }
    (root / "input.json").write_text(json.dumps(data))
    receipt = _stopped_once_started(root, "NOOA's cell")
    assert receipt.outcome == "cancelled"
    result = WorkerResult.model_validate_json((root / "result.json").read_bytes())
    assert result.error is not None and result.error.kind == "cancelled"
    prefill, cell = result.trajectory.tool_calls
    assert (prefill.origin, prefill.status) == ("harness", "completed")
    # NOOA unwound and reported the cell it was in; the worker did not have to guess.
    assert (cell.call_id, cell.status, cell.reported_by) == ("call_0_0", "failed", "harness")
    relayed = [t["call_id"] for e in journal(root) if e["kind"] == "tool_call" for t in e["tool_calls"]]
    assert relayed == [prefill.call_id, "call_0_0"]


def _stopped_once_started(root: Path, who: str) -> SupervisorReceipt:
    """Supervise ``root`` (grace 10 s), touch the stop file once ``workspace/started`` exists: the receipt."""
    proc = _supervise(root, "--grace", "10")
    try:
        wait_for(lambda: (root / "workspace" / "started").exists(), what=f"{who} to start", timeout=180)
        (root / "stop").touch()
        return _receipt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
