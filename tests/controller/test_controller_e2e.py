"""End to end: real supervisor, bubblewrap and worker, the scripted policy and the bundled environments."""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from rollcage.controller import Controller, ModelEndpointConfig, RunConfig, RunSummary
from rollcage.protocol import RolloutRecord
from tests.helpers.paths import EXAMPLES

# bwrap is what these tests are for; "none" is only for narrowing down a failure by hand.
SANDBOX: Any = os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")

try:
    from rollcage.supervisor import supervise as _supervise  # noqa: F401

    HAVE_SUPERVISOR = True
except ImportError:  # pragma: no cover - only while the supervisor is being built
    HAVE_SUPERVISOR = False

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"),
    pytest.mark.skipif(not HAVE_SUPERVISOR, reason="rollcage.supervisor.supervise is not available yet"),
    pytest.mark.timeout(300),
]


def records(out: Path) -> list[RolloutRecord]:
    return [RolloutRecord.model_validate_json(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]


async def run_example(tmp_path: Path, name: str, **overrides: Any) -> tuple[RunSummary, list[RolloutRecord]]:
    config = RunConfig(
        dataset=EXAMPLES / name / "dataset.jsonl",
        out=tmp_path / name,
        sandbox=SANDBOX,
        deadline_s=60,
        concurrency=4,
        **overrides,
    )
    summary = await Controller(config).run()
    return summary, records(config.out)


async def test_calc_weather_end_to_end_rewards_as_scripted(tmp_path: Path) -> None:
    summary, got = await run_example(tmp_path, "calc-weather")
    assert {r.task_id: (r.outcome, r.reward) for r in got} == {
        "oslo-sum": ("completed", 1.0),
        "cairo-sum": ("completed", 1.0),
        "london-sum": ("completed", 0.0),
        "paris-fahrenheit": ("completed", 1.0),
        "tokyo-codeact": ("completed", 1.0),
    }
    by_task = {r.task_id: r for r in got}
    assert by_task["paris-fahrenheit"].grader == {
        "name": "verify",
        "match": True,
        "answer": "mild;temp=63F",
        "lookups": ["paris"],  # the session cookie carried set_units over to get_weather
    }
    assert all(r.receipt.sandbox == SANDBOX and r.receipt.cleanup_confirmed for r in got)
    m = summary.metrics
    assert summary.exit_code == 0
    assert (m.tasks, m.rollouts, m.graded, m.retries, m.invalid_rows) == (5, 5, 5, 0, 0)
    assert m.mean_reward == pytest.approx(0.8) and m.pass_at_1 == pytest.approx(0.8)
    assert m.tokens.total_tokens and m.tokens.total_tokens == sum(r.metrics.total_tokens or 0 for r in got)
    assert {name: f.count for name, f in m.health.items() if f.count} == {}
    assert json.loads((tmp_path / "calc-weather" / "metrics.json").read_text())[
        "mean_reward"
    ] == pytest.approx(0.8)


async def test_code_fn_end_to_end_hidden_tests_grade_the_workspace(tmp_path: Path) -> None:
    summary, got = await run_example(tmp_path, "code-fn")
    assert {r.task_id: r.reward for r in got} == {
        "fizzbuzz": 1.0,
        "palindrome": 1.0,
        "running-sum": 0.25,  # the scripted solution has an off-by-one bug
        "word-count-codeact": 1.0,
    }
    assert all(r.outcome == "completed" for r in got)
    running = next(r for r in got if r.task_id == "running-sum")
    assert running.grader is not None and (running.grader["passed"], running.grader["total"]) == (1, 4)
    assert (Path(running.rollout_dir) / "workspace" / "solution.py").is_file()
    assert summary.metrics.pass_at_1 == pytest.approx(0.75)
    assert summary.metrics.mean_reward == pytest.approx(3.25 / 4)


async def test_controller_only_values_never_reach_any_rollout_file(tmp_path: Path) -> None:
    canaries = ["CANARY-expected-5d1e", "CANARY-pattern-a9b0", "CANARY-metadata-77c3"]
    dataset = tmp_path / "leak" / "dataset.jsonl"
    dataset.parent.mkdir()
    shutil.copy(EXAMPLES / "calc-weather" / "policy.yaml", dataset.parent / "policy.yaml")
    rows = [
        json.loads(line) for line in (EXAMPLES / "calc-weather" / "dataset.jsonl").read_text().splitlines()
    ]
    rows[0]["expected"] = canaries[0]
    rows[0]["metadata"] = {"note": canaries[2]}
    rows[1]["grader"] = {"type": "regex", "pattern": canaries[1]}
    rows.append({"id": "plain", "input": "hi", "expected": canaries[0], "metadata": {"n": canaries[2]}})
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = RunConfig(dataset=dataset, out=tmp_path / "out", sandbox=SANDBOX, deadline_s=60, concurrency=4)
    await Controller(config).run()
    checked = 0
    for path in (config.out / "rollouts").rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            checked += 1
            for canary in canaries:
                assert canary.encode() not in data, f"{canary} leaked into {path}"
    assert checked >= 5 * 4  # input, result, checkpoint, receipt per rollout at least


async def test_chaos_injected_faults_are_classified_exactly(tmp_path: Path) -> None:
    from rollcage.policy import PolicyServer

    dataset = tmp_path / "chaos.jsonl"
    rows = [
        {
            "id": f"c{i}",
            "input": "Compute 6*7 with Python, then answer with the number only.",
            "tools": ["python"],
            "agent": {"max_policy_calls": 6, "max_invalid_outputs": 3},
            "model": {"max_retries": 0, "timeout_s": 10},
            "expected": "42",
        }
        for i in range(10)
    ]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = {
        "tasks": {
            "*": [{"tool_calls": [{"name": "python", "arguments": {"code": "print(6*7)"}}]}, {"text": "42"}]
        }
    }
    infra_kinds = {"status", "rate_limit", "reset", "truncated", "malformed"}
    policy_kinds = {"length", "empty", "bad_arguments"}
    kinds = "500,503,429,reset,truncated,malformed,length,empty,bad_arguments"
    with PolicyServer(script, fault_rate=0.2, fault_kinds=kinds, seed=11) as server:
        config = RunConfig(
            dataset=dataset,
            out=tmp_path / "out",
            model=ModelEndpointConfig(base_url=server.base_url, model_name="scripted"),
            sandbox=SANDBOX,
            deadline_s=60,
            concurrency=1,  # one request order, so the seeded draws are the same every run
            max_infra_retries=20,
            retry_backoff_s=0,
        )
        summary = await Controller(config).run()
        injected = list(server.faults_injected)
    got = records(config.out)
    hit: dict[str, set[str]] = defaultdict(set)
    for fault in injected:
        hit[fault.rollout_id].add(fault.kind)
    expected_table = {
        r.rollout_id: "infra_failure" if hit[r.rollout_id] & infra_kinds else "graded" for r in got
    }
    classified = {r.rollout_id: "infra_failure" if r.outcome == "infra_failure" else "graded" for r in got}
    assert classified == expected_table
    assert all(r.graded for r in got if r.outcome != "infra_failure")
    assert any(hit[r.rollout_id] & infra_kinds for r in got), "the seed injected no infrastructure fault"
    assert any(hit[r.rollout_id] & policy_kinds for r in got), "the seed injected no policy fault"
    finals = {(r.task_id, r.sample): r for r in got}  # the last record of each sample
    assert all(r.outcome != "infra_failure" for r in finals.values())  # every sample retried to completion
    assert summary.metrics.retries == sum(1 for r in got if r.outcome == "infra_failure")
    assert summary.metrics.health["trajectory_capture_accounting"].count == 0


async def test_bundled_environments_served_by_url_keep_their_tools_and_verify_files(tmp_path: Path) -> None:
    """The multi-node recipe: a bundled environment's app served by URL (as `uvicorn.run(create_app(...))`
    serves it), the rows naming that URL. It offers the tools and reads the `/verify` files it does when
    the controller starts it: the rows name its tools, or none and get its defaults."""
    import yaml

    from rollcage.controller._servers import AppServer
    from rollcage.environments import create_app

    servers = {name: AppServer(create_app(name), name=name) for name in ("calc-weather", "code-fn")}
    urls = {name: server.start() for name, server in servers.items()}
    try:
        chosen = {"calc-weather": ("oslo-sum", "paris-fahrenheit"), "code-fn": ("fizzbuzz",)}
        rows, script = [], {"tasks": {}}
        for name, ids in chosen.items():
            for line in (EXAMPLES / name / "dataset.jsonl").read_text().splitlines():
                row = json.loads(line)
                if row["id"] in ids:
                    rows.append({**row, "environment": urls[name]})
            script["tasks"].update(yaml.safe_load((EXAMPLES / name / "policy.yaml").read_text())["tasks"])
        dataset = tmp_path / "data" / "dataset.jsonl"
        dataset.parent.mkdir()
        dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (dataset.parent / "policy.yaml").write_text(json.dumps(script))
        config = RunConfig(
            dataset=dataset, out=tmp_path / "out", sandbox=SANDBOX, deadline_s=60, concurrency=3
        )
        summary = await Controller(config).run()
    finally:
        for server in servers.values():
            server.stop()
    assert summary.metrics.invalid_rows == 0, summary.invalid_rows
    got = records(config.out)
    assert {r.task_id: (r.outcome, r.reward) for r in got} == {
        "oslo-sum": ("completed", 1.0),
        "paris-fahrenheit": ("completed", 1.0),
        "fizzbuzz": ("completed", 1.0),
    }, [(r.task_id, r.receipt.outcome_reason, r.grader) for r in got]
