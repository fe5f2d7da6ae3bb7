"""``rollcage run`` against an environment that answers odd header bytes: every row ends with a record.

An environment is an external server: whatever cookies and header values it answers, the
controller must not crash (no traceback, every row recorded, a rerun finishes nothing twice),
and what is the environment's fault must never be graded as the policy's (``agent_error``).
Cookies that can be kept go back byte for byte; ids that are printable Unicode run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollcage.protocol import RolloutRecord
from tests.helpers.hostile_env import serve_hostile

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"),
    pytest.mark.timeout(400),
]

POLICY = """
tasks:
  "日本-1":
    - tool_calls:
        - {name: probe, arguments: {}}
    - text: "from the 日本-1 script"
  "*":
    - tool_calls:
        - {name: probe, arguments: {}}
    - text: "done"
"""

# mode -> (task id, the outcome it must end in)
ROWS: dict[str, tuple[str, str]] = {
    "seed-utf8": ("café", "completed"),
    "seed-latin1": ("seed-latin1", "completed"),
    "seed-many": ("seed-many", "completed"),
    "seed-bad-name": ("seed-bad-name", "infra_failure"),
    "seed-too-many": ("seed-too-many", "infra_failure"),
    "tool-utf8": ("日本-1", "completed"),
    "tool-bad-name": ("tool-bad-name", "infra_failure"),
    "tool-huge": ("tool-huge", "infra_failure"),
    "odd-headers": ("odd headers %41", "completed"),
    "verify-big-detail": ("verify-big-detail", "completed"),
    "tool-slow": ("tool-slow", "infra_failure"),
}


def _run(directory: Path, url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rollcage",
            "run",
            str(directory / "dataset.jsonl"),
            "--out",
            str(directory / "out"),
            "--policy",
            str(directory / "policy.yaml"),
            "--max-infra-retries",
            "1",
            "--concurrency",
            "4",
            "--quiet",
            "--sandbox",
            os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_odd_cookies_and_headers_never_crash_a_run_nor_count_against_the_policy(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text(POLICY, encoding="utf-8")
    with serve_hostile() as (env, url):
        rows = [
            {
                "id": task_id,
                "input": "call the probe",
                "environment": url,
                "tools": [{"type": "resource", "name": "probe"}],
                "grader": {"type": "verify"},
                "verifier": {"mode": mode},
                # A resource call is bounded by the agent's tool timeout, not only its endpoint's 30 s.
                "agent": {"tool_timeout_s": 2.0 if mode == "tool-slow" else 30.0},
            }
            for mode, (task_id, _) in ROWS.items()
        ]
        (tmp_path / "dataset.jsonl").write_text(
            "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8"
        )
        first = _run(tmp_path, url)
        after_first = (tmp_path / "out" / "rollouts.jsonl").read_bytes()
        again = _run(tmp_path, url)  # a rerun resumes: nothing crashes, nothing runs twice

    for done in (first, again):
        assert "Traceback" not in done.stderr + done.stdout, done.stderr[-3000:]
        assert done.returncode == 0, done.stderr[-3000:]
    lines = (tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines()
    records = [RolloutRecord.model_validate_json(line) for line in lines]
    final = {r.task_id: r for r in records}  # the last attempt of each
    assert set(final) == {task_id for task_id, _ in ROWS.values()}, "every row has a record"
    for mode, (task_id, outcome) in ROWS.items():
        record = final[task_id]
        assert record.outcome == outcome, (mode, record.receipt.outcome_reason)
        if outcome == "completed":
            assert record.reward == 1.0, (mode, record.grader)
    assert not [r for r in records if r.outcome == "agent_error"], (
        "an environment's fault is never the policy's"
    )
    reasons = {mode: final[task_id].receipt.outcome_reason or "" for mode, (task_id, _) in ROWS.items()}
    assert "cannot be kept" in reasons["seed-bad-name"] and "seed_session" in reasons["seed-bad-name"]
    assert "cannot be kept" in reasons["seed-too-many"]
    assert "cannot be sent back" in reasons["tool-bad-name"] and "cannot be sent back" in reasons["tool-huge"]
    assert "within 2 s (the agent's tool_timeout_s" in reasons["tool-slow"]
    # Kept cookies went back to /verify byte for byte, whatever their charset.
    sent = b"\n".join(c or b"" for c in env.cookies["verify"])
    assert "lat=café".encode() in sent and b"lat=caf\xe9" in sent and "t=日本".encode() in sent
    assert b"d=\xff\xfe\x80" in sent and b"b=quoted value" in sent
    # The id's own script answered it: X-Task-Id carried "日本-1" to the model, and back.
    assert {"mode": "tool-utf8", "task_id": "日本-1", "text": "from the 日本-1 script"} in env.verified
    # A verify detail of 2 MB is cut in the record, saying so.
    big = final["verify-big-detail"]
    assert "detail_cut" in (big.grader or {}) and "essay" not in (big.grader or {})
    assert max(len(line) for line in lines) < 1024 * 1024
    # Each infra_failure was retried once; the rerun ran nothing more.
    assert len(records) == sum(1 + (outcome == "infra_failure") for _, outcome in ROWS.values())
    assert (tmp_path / "out" / "rollouts.jsonl").read_bytes() == after_first
