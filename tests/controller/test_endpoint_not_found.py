"""A model endpoint's 404 is final, as NOOA treats it: the run stops at the first; no retry, no grade."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollcage.policy import PolicyServer
from rollcage.protocol import RolloutRecord

SANDBOX: Any = os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")
SCRIPT = {
    "tasks": {
        "*": [
            {"tool_calls": [{"name": "python", "arguments": {"code": "print(6 * 7)"}}]},
            {"text": "42"},
        ]
    }
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["status=404", "call=1:status=404"], ids=["first-call", "after-an-answer"])
def test_a_404_stops_the_run_at_the_first_attempt_as_infrastructure(tmp_path: Path, fault: str) -> None:
    dataset = tmp_path / "d.jsonl"
    rows = [
        {"id": f"t{n}", "input": "six times seven?", "tools": ["python"], "expected": "42"} for n in range(3)
    ]
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    with PolicyServer(SCRIPT, faults=[fault]) as server:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollcage",
                "run",
                str(dataset),
                "--out",
                str(out),
                "--quiet",
                "--model",
                server.base_url,
                "--model-name",
                "scripted",
                "--sandbox",
                SANDBOX,
                "--concurrency",
                "1",
                "--max-infra-retries",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "no such route or model" in said and "--model-name" in said
    records = [
        RolloutRecord.model_validate_json(line) for line in (out / "rollouts.jsonl").read_text().splitlines()
    ]
    # One attempt, not retried, and infrastructure: nothing graded on the endpoint's answer.
    assert [(r.try_index, r.outcome, r.graded) for r in records] == [(0, "infra_failure", False)]
    error = records[0].receipt.result_error
    assert error is not None and error.type == "ModelEndpointNotFoundError"
