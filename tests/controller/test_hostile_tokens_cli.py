"""The hostile-token family through ``rollcage run`` as a user runs it: no traceback, a record per row.

A scripted policy server sends, per row, one variant of ``bad_tokens`` (a
``token_id:N`` beyond 64 bits, ids as strings or booleans, negative ids, ids of 2^63
and beyond, positive log probabilities, logprobs of the wrong shape) on every call,
in both API styles, streamed and not. The answer is the policy's and stands: each
row is ``completed`` and graded; its token data is dropped and said so
(``model_call_token_data_dropped``, never ``observed``); and the run exports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollcage.policy import PolicyServer
from rollcage.policy._hostile import BAD_TOKENS
from rollcage.protocol import RolloutRecord, RunMetrics

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"),
    pytest.mark.timeout(600),
]

SCRIPT = {
    "tasks": {
        "*": [
            {
                "reasoning": "compute",
                "tool_calls": [{"name": "python", "arguments": {"code": "print(6 * 7)"}}],
            },
            {"text": "42"},
        ]
    }
}
MODES = [("chat", False), ("responses", True), ("chat", True), ("responses", False)]


def _rows() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = [{"id": "clean", "input": "6*7?", "tools": ["python"], "expected": "42"}]
    for n, (name, _) in enumerate(BAD_TOKENS):
        # Each variant in two of the four modes, in rotation: every mode sees every second variant.
        for api, stream in (MODES[n % 4], MODES[(n + 1) % 4]):
            rows.append(
                {
                    "id": f"{name}-{api}-{'stream' if stream else 'plain'}",
                    "input": "6*7?",
                    "tools": ["python"],
                    "expected": "42",
                    "model": {"api": api, "stream": stream},
                }
            )
    return rows


def _rollcage(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollcage", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=480,
        start_new_session=True,
    )


def test_the_hostile_token_family_runs_through_the_cli_classified_with_a_record_per_row(
    tmp_path: Path,
) -> None:
    rows = _rows()
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    variants = {name: n for n, (name, _) in enumerate(BAD_TOKENS)}
    rules = [
        f"task={row['id']}:kind=bad_tokens:variant={variants[str(row['id']).rsplit('-', 2)[0]]}"
        for row in rows
        if row["id"] != "clean"
    ]
    out = tmp_path / "out"
    with PolicyServer(SCRIPT, faults=rules) as server:
        sandbox = os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")
        ran = _rollcage(
            "run",
            str(dataset),
            "--out",
            str(out),
            "--model",
            server.base_url,
            "--model-name",
            "scripted-policy",
            "--sandbox",
            sandbox,
            "--concurrency",
            "4",
            "--quiet",
            cwd=tmp_path,
        )
    assert "Traceback" not in ran.stderr and "Traceback" not in ran.stdout, ran.stderr[-4000:]
    assert ran.returncode == 0, (ran.stdout[-2000:], ran.stderr[-2000:])
    records = {
        r.task_id: r
        for r in (
            RolloutRecord.model_validate_json(line)
            for line in (out / "rollouts.jsonl").read_text().splitlines()
        )
    }
    assert set(records) == {str(row["id"]) for row in rows}
    for task_id, record in records.items():
        # The answer is the policy's and stands: never an infra_failure, never agent_error.
        assert (record.outcome, record.reward) == ("completed", 1.0), (task_id, record.receipt.outcome_reason)
        dropped = record.health.findings.get("model_call_token_data_dropped", 0)
        if task_id == "clean":
            assert dropped == 0 and record.health.verdict == "healthy"
        else:
            assert dropped >= 1 and record.health.verdict == "unhealthy", (task_id, record.health)
            assert record.metrics.token_ids != "complete", task_id
    metrics = RunMetrics.model_validate_json((out / "metrics.json").read_text())
    assert metrics.health["model_call_token_data_dropped"].evaluated == len(rows)
    assert len(metrics.health["model_call_token_data_dropped"].rollouts) == len(rows) - 1
    assert "model_call_token_data_dropped" in ran.stdout  # the run's summary says so
    for format in ("atif", "nemo-gym"):
        exported = _rollcage(
            "export", str(out), "--format", format, "--out", str(tmp_path / f"x-{format}"), cwd=tmp_path
        )
        assert "Traceback" not in exported.stderr, exported.stderr[-4000:]
        assert exported.returncode == 0, (format, exported.stdout[-2000:], exported.stderr[-2000:])
