"""``rollcage branch`` end to end: real supervisor, bubblewrap, worker, and the scripted policy.

A finished source rollout is branched at each kind of boundary (the end of a model call, of a
turn's tool calls, of one of two parallel cells): every branch replays the source's prefix from
its journal (the model server never sees a prefix call), re-runs the prefix's cells, continues
live, and is graded. Also: a branch of a branch, a replay that diverges (infra_failure, never a
fresh start), a SIGKILLed branch run continued by its rerun, and the refusals.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollcage.controller import Controller, ModelEndpointConfig, RunConfig
from rollcage.controller._branch import branch, branch_id, parse_boundary, plan_branches
from rollcage.controller._ids import rollout_id
from rollcage.durable import read_journal
from rollcage.errors import ConfigError
from rollcage.policy import PolicyServer
from rollcage.protocol import RolloutRecord, WorkerResult
from tests.helpers.waiting import wait_for
from tests.images.test_image_rollouts import python_image, store  # noqa: F401 - fixtures

SANDBOX: Any = os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")
pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"),
    pytest.mark.timeout(300),
]

CALLS = 4
SCRIPT = {
    "tasks": {
        "*": [
            {"tool_calls": [{"name": "python", "arguments": {"code": "x = 6\nprint(x)"}}]},
            {
                "tool_calls": [
                    {"name": "python", "arguments": {"code": "y = x * 7\nprint(y)"}},
                    {"name": "python", "arguments": {"code": "open('y.txt', 'w').write('42')"}},
                ]
            },
            {"tool_calls": [{"name": "python", "arguments": {"code": "print(open('y.txt').read())"}}]},
            {"text": "42"},
        ],
        "oops": [
            {"tool_calls": [{"name": "python", "arguments": {"code": "x = 6\nprint(x)"}}]},
            {"tool_calls": [{"name": "nope", "arguments": {}}]},
            {"text": "42"},
        ],
        "noisy": [
            {
                "tool_calls": [
                    {"name": "python", "arguments": {"code": "import os\nprint(os.urandom(8).hex())"}}
                ]
            },
            {"text": "42"},
        ],
    }
}
SOURCE = rollout_id("t0", 0, 0)


def _rows(task: str = "t0") -> list[dict[str, Any]]:
    return [
        {
            "id": task,
            "input": "6*7?",
            "tools": ["python"],
            "model": {"max_retries": 0, "timeout_s": 30},
            "expected": "42",
        }
    ]


def _dataset(directory: Path, task: str = "t0") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "dataset.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(task)))
    return path


def _records(out: Path) -> list[RolloutRecord]:
    return [RolloutRecord.model_validate_json(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]


async def _source(tmp_path: Path, server: PolicyServer, task: str = "t0") -> tuple[Path, RolloutRecord]:
    """Run the one-row dataset once: the source rollout, completed and graded."""
    config = RunConfig(
        dataset=_dataset(tmp_path / "data", task),
        out=tmp_path / "run",
        model=ModelEndpointConfig(base_url=server.base_url, model_name="scripted"),
        sandbox=SANDBOX,
        deadline_s=60,
        retry_backoff_s=0,
    )
    await Controller(config).run()
    (record,) = _records(config.out)
    assert record.outcome == "completed", record.receipt.outcome_reason
    return config.out, record


def _result(record: RolloutRecord) -> WorkerResult:
    result = record.result()
    assert result is not None, record.receipt.outcome_reason
    return result


def _seq_of(run: Path, rollout: str, kind: str, nth: int = 0, turn: int | None = None) -> int:
    """seq of the ``nth`` journal record of ``kind`` (of model call ``turn``'s tool calls, with ``turn``)."""
    found = [
        int(r["seq"])
        for r in read_journal(run / "rollouts" / rollout / "checkpoint.jsonl")
        if r.get("kind") == kind
        and (
            turn is None
            or (kind == "model_call" and r["model_call"]["index"] == turn)
            or (kind == "tool_call" and r["tool_calls"][0]["turn"] == turn)
        )
    ]
    return found[nth]


def _prefix(result: WorkerResult, turns: int) -> list[str]:
    """The model-visible prefix, byte for byte: each turn's question and its answer, in order."""
    trajectory = result.trajectory
    return [json.dumps(t.input, sort_keys=True) for t in trajectory.turns[:turns]] + [
        json.dumps(c.output, sort_keys=True) for c in trajectory.model_calls[:turns]
    ]


async def _branches(source: RolloutRecord, out: Path, data: Path, **options: Any) -> list[RolloutRecord]:
    got = [r async for r in branch(source, out=out, tasks=data, sandbox=SANDBOX, deadline_s=60, **options)]
    return sorted(got, key=lambda r: r.sample)


@pytest.mark.parametrize("kind", ["model call", "tool call", "cell"])
async def test_branches_at_each_kind_of_boundary_share_the_prefix_and_never_ask_for_it(
    tmp_path: Path, serve_policy: Any, kind: str
) -> None:
    server = serve_policy(keep_bodies=False)
    run, source = await _source(tmp_path, server)
    at = {
        # Model call 1 answered, its two cells still to run: the branches run them live.
        "model call": f"seq:{_seq_of(run, SOURCE, 'model_call', turn=1)}",
        # Turn 1's tool calls all ended: the branches ask model call 2 live.
        "tool call": "turn:2",
        # One of turn 1's two parallel cells ended: the other runs live.
        "cell": f"seq:{_seq_of(run, SOURCE, 'tool_call', turn=1)}",
    }[kind]
    out = tmp_path / "branches"
    k = 3
    got = await _branches(source, out, tmp_path / "data" / "dataset.jsonl", at=at, k=k)
    assert [r.sample for r in got] == list(range(k))
    live = 2  # turns 0 and 1 answered from the journal, whichever the boundary
    source_result = _result(source)
    for record in got:
        assert (record.outcome, record.graded, record.reward) == ("completed", True, 1.0), record
        link = record.branched_from
        assert link is not None
        assert (link.rollout_id, link.run, link.turn) == (SOURCE, str(run), live)
        assert link.boundary == (
            int(at[4:]) if at.startswith("seq:") else _seq_of(run, SOURCE, "turn_start", 2) - 1
        )
        # The server was asked only for the live part: never a prefix call.
        assert server.requests[record.rollout_id] == CALLS - live
        assert {r.turn for r in server.request_log if r.rollout_id == record.rollout_id} == set(
            range(live, CALLS)
        )
        result = _result(record)
        assert _prefix(result, live) == _prefix(source_result, live)
        assert len(result.trajectory.model_calls) == CALLS
        resumed = result.trajectory.resumed_from
        assert resumed is not None and len(resumed.replayed_model_calls) == live
        assert resumed.rerun_cells  # the prefix's cells ran again in the branch's own sandbox
        assert (record.metrics.model_calls, record.metrics.replayed_model_calls) == (CALLS - live, live)
        assert (Path(record.rollout_dir) / "workspace" / "y.txt").read_text() == "42"
        assert record.receipt.resumed_from == SOURCE
    # The records are on disk before they are yielded, and the tree holds the prefix once.
    assert [r.rollout_id for r in sorted(_records(out), key=lambda r: r.sample)] == [
        r.rollout_id for r in got
    ]
    tree = json.loads((out / "tree.json").read_bytes())
    assert tree["source"]["rollout_id"] == SOURCE and tree["boundary"]["turn"] == live
    assert tree["prefix"] and all(b["suffix"] for b in tree["branches"])
    assert [b["advantage"] for b in tree["branches"]] == [0.0] * k
    # The source's directory is evidence: untouched.
    assert not (run / "rollouts" / SOURCE / "resume.jsonl").exists()


async def test_a_branch_of_a_branch_replays_its_parent(tmp_path: Path, serve_policy: Any) -> None:
    server = serve_policy()
    _, source = await _source(tmp_path, server)
    data = tmp_path / "data" / "dataset.jsonl"
    (first,) = await _branches(source, tmp_path / "b1", data, at="turn:1", k=1)
    assert first.outcome == "completed"
    (second,) = await _branches(first, tmp_path / "b2", data, at="last-turn", k=1)
    assert (second.outcome, second.reward) == ("completed", 1.0)
    assert second.branched_from is not None
    assert (second.branched_from.rollout_id, second.branched_from.turn) == (first.rollout_id, CALLS - 1)
    assert server.requests[second.rollout_id] == 1
    assert _prefix(_result(second), CALLS - 1) == _prefix(_result(source), CALLS - 1)


async def test_a_replay_that_diverges_ends_the_branch_as_infra_failure(
    tmp_path: Path, serve_policy: Any
) -> None:
    server = serve_policy()
    _, source = await _source(tmp_path, server, task="noisy")
    (got,) = await _branches(source, tmp_path / "b", tmp_path / "data" / "dataset.jsonl", at="last-turn", k=1)
    assert (got.outcome, got.graded) == ("infra_failure", False)
    assert (
        "BranchReplayError" in got.receipt.outcome_reason and "diverged at cell" in got.receipt.outcome_reason
    )
    # Never a silent fresh start: the model was not asked anything.
    assert server.requests.get(got.rollout_id, 0) == 0
    result = _result(got)
    assert result.trajectory.resume_refused is not None and not result.trajectory.model_calls


def _journal_reaches(path: Path, model_calls: int) -> bool:
    try:
        records = read_journal(path)
    except (OSError, ValueError):
        return False
    return sum(r.get("kind") == "model_call" for r in records) >= model_calls and any(
        r.get("kind") == "turn_start" and r["turn"]["index"] == model_calls for r in records
    )


def test_a_sigkilled_branch_run_is_continued_by_its_rerun(tmp_path: Path, serve_policy: Any) -> None:
    server = serve_policy()
    run, source = asyncio.run(_source(tmp_path, server))
    data = tmp_path / "data" / "dataset.jsonl"
    out = tmp_path / "b"
    plan = plan_branches(source, at="turn:1", k=2, out=out, tasks=data)
    hung = plan.prepared[0].rollout_id
    server.stop()
    # The same script again, with branch 0's second live call (turn 2) hanging.
    server = serve_policy(faults=[f"rollout={hung}:call=2:kind=hang"])
    args = [
        sys.executable, "-m", "rollcage", "branch", str(run), SOURCE, "--at", "turn:1", "-k", "2",
        "--out", str(out), "--tasks", str(data), "--sandbox", SANDBOX, "--model", server.base_url,
        "--deadline", "60", "--quiet",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: server.faults_injected, what="branch 0's hung model call")
        wait_for(
            lambda: _journal_reaches(out / "rollouts" / hung / "checkpoint.jsonl", 2), what="its journal"
        )
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    by_sample: dict[int, list[RolloutRecord]] = {}
    for record in _records(out):
        by_sample.setdefault(record.sample, []).append(record)
    assert sorted(by_sample) == [0, 1] and all(len(v) == 1 for v in by_sample.values()), by_sample
    (resumed,) = by_sample[0]
    assert (resumed.rollout_id, resumed.outcome, resumed.reward) == (
        branch_id(SOURCE, plan.point, 0, 1),
        "completed",
        1.0,
    )
    link = resumed.resume
    assert link is not None and link.resumed, link
    assert link.previous_rollout_id == hung and Path(link.previous_dir).parent == out / "interrupted"
    # Turn 0 from the source's journal, turn 1 from the killed attempt's: only turns 2 and 3 asked.
    assert link.replayed_model_calls == 2
    assert server.requests[resumed.rollout_id] == CALLS - 2
    assert resumed.branched_from is not None and resumed.branched_from.rollout_id == SOURCE
    assert _prefix(_result(resumed), 1) == _prefix(_result(source), 1)


@pytest.mark.parametrize(
    ("at", "words"),
    [
        ("turn:9", "its journal holds turns 0 to 3"),
        ("seq:999", "is not in its journal"),
        ("first-failed-tool", "no tool call failed"),
        ("sideways", "name a boundary as"),
    ],
)
async def test_a_boundary_the_journal_does_not_hold_is_refused_up_front(
    tmp_path: Path, serve_policy: Any, at: str, words: str
) -> None:
    _, source = await _source(tmp_path, serve_policy())
    with pytest.raises(ConfigError, match=words):
        plan_branches(source, at=at, k=2, out=tmp_path / "b")
    assert not (tmp_path / "b").exists()


async def test_a_harness_rollout_is_refused_naming_the_row(tmp_path: Path, serve_policy: Any) -> None:
    run, source = await _source(tmp_path, serve_policy())
    path = run / "rollouts" / SOURCE / "input.json"
    data = json.loads(path.read_bytes())
    data["agent"] = {**data["agent"], "harness": {"type": "nooa"}}
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"row 't0' runs the nooa harness, which cannot replay"):
        plan_branches(source, at="turn:1", k=1, out=tmp_path / "b")


async def test_a_row_with_an_environment_is_refused_naming_the_row(tmp_path: Path, serve_policy: Any) -> None:
    run, source = await _source(tmp_path, serve_policy())
    path = run / "rollouts" / SOURCE / "input.json"
    data = json.loads(path.read_bytes())
    data["resources"] = {"weather": {"base_url": "http://127.0.0.1:9/"}}
    path.write_text(json.dumps(data))
    with pytest.raises(
        ConfigError, match=r"row 't0' uses the environment weather.*cannot recreate its session"
    ):
        plan_branches(source, at="turn:1", k=1, out=tmp_path / "b")


def test_the_cli_refuses_a_bad_boundary_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "run" / "rollouts" / SOURCE).mkdir(parents=True)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollcage",
            "branch",
            str(tmp_path / "run"),
            "../x",
            "--at",
            "1",
            "--out",
            "o",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.startswith("rollcage branch: rollout id '../x'"), done.stderr
    assert parse_boundary("3") == ("turn", 3) and parse_boundary("seq:12") == ("seq", 12)


async def test_the_live_part_uses_the_model_and_sampling_asked_for(tmp_path: Path, serve_policy: Any) -> None:
    server = serve_policy(keep_bodies=True)
    _, source = await _source(tmp_path, server)
    data = tmp_path / "data" / "dataset.jsonl"
    (got,) = await _branches(
        source, tmp_path / "b", data, at="turn:3", k=1, model_name="other", temperature=0.5
    )
    assert (got.outcome, got.reward) == ("completed", 1.0), got.receipt.outcome_reason
    (asked,) = [r for r in server.request_log if r.rollout_id == got.rollout_id]
    assert asked.turn == 3 and asked.body is not None
    assert (asked.body["model"], asked.body["temperature"]) == ("other", 0.5)
    assert _prefix(_result(got), 3) == _prefix(_result(source), 3)


IMAGE_SCRIPT = {
    "tasks": {
        "*": [
            {"tool_calls": [{"name": "python", "arguments": {"code": "x = 6\nprint(x)"}}]},
            {"tool_calls": [{"name": "bash", "arguments": {"command": "echo 7 > seven.txt"}}]},
            {"tool_calls": [{"name": "python", "arguments": {"code": "x *= int(open('seven.txt').read())"}}]},
            {
                "tool_calls": [
                    {"name": "python", "arguments": {"code": "print(x, open('/etc/os-release').read())"}}
                ]
            },
            {"text": "42"},
        ]
    }
}


async def test_an_image_row_branch_rebuilds_its_root_by_rerunning_the_cells(
    tmp_path: Path,
    serve_policy: Any,
    store: Path,  # noqa: F811
    python_image: Any,  # noqa: F811
) -> None:
    server = serve_policy(IMAGE_SCRIPT)
    data = tmp_path / "data"
    data.mkdir()
    row = {**_rows()[0], "tools": ["python", "bash"]}
    (data / "dataset.jsonl").write_text(json.dumps(row) + "\n")
    config = RunConfig(
        dataset=data / "dataset.jsonl",
        out=tmp_path / "run",
        model=ModelEndpointConfig(base_url=server.base_url, model_name="scripted"),
        image=python_image.ref,
        deadline_s=90,
        retry_backoff_s=0,
    )
    await Controller(config).run()
    (source,) = _records(config.out)
    assert source.outcome == "completed", source.receipt.outcome_reason
    notices: list[str] = []
    got = [
        r
        async for r in branch(
            source,
            at="turn:3",
            k=2,
            out=tmp_path / "b",
            tasks=data / "dataset.jsonl",
            deadline_s=90,
            notice=notices.append,
        )
    ]
    assert any("rebuilt by re-running the prefix's cells" in n for n in notices), notices
    for record in got:
        assert (record.outcome, record.reward) == ("completed", 1.0), record.receipt.outcome_reason
        assert server.requests[record.rollout_id] == 2
        result = _result(record)
        # The live cell saw the state the re-run prefix rebuilt, in the image's own root.
        assert "42 ID=rollcage-task-image" in result.trajectory.tool_calls[-1].output
        assert (Path(record.rollout_dir) / "changes" / "work" / "seven.txt").read_text() == "7\n"


async def test_first_failed_tool_reasks_the_model_call_that_asked_for_it(
    tmp_path: Path, serve_policy: Any
) -> None:
    server = serve_policy()
    _, source = await _source(tmp_path, server, task="oops")
    failed = [t for t in _result(source).trajectory.tool_calls if t.status == "failed"]
    assert [t.turn for t in failed] == [1]
    data = tmp_path / "data" / "dataset.jsonl"
    (got,) = await _branches(source, tmp_path / "b", data, at="first-failed-tool", k=1)
    assert (got.outcome, got.reward) == ("completed", 1.0), got.receipt.outcome_reason
    assert got.branched_from is not None and got.branched_from.turn == 1
    assert {r.turn for r in server.request_log if r.rollout_id == got.rollout_id} == {1, 2}
    assert _prefix(_result(got), 1) == _prefix(_result(source), 1)
