"""A command harness whose program cannot be found is refused before anything runs, as NOOA is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _run(tmp_path: Path, command: str) -> subprocess.CompletedProcess[str]:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(
        json.dumps({"id": "a", "input": "hi"}) + "\n" + json.dumps({"id": "b", "input": "yo"}) + "\n"
    )
    # A policy that would answer: without the refusal, every attempt would run (and fail).
    (tmp_path / "policy.yaml").write_text('tasks:\n  "*":\n    - text: "hi"\n')
    out = str(tmp_path / "out")
    return subprocess.run(
        [sys.executable, "-m", "rollcage", "run", str(dataset), "--out", out, "--quiet", *_harness(command)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _harness(command: str) -> list[str]:
    return ["--harness", "command", "--harness-command", command]


@pytest.mark.parametrize(
    ("command", "named"),
    [
        ("no-such-agent-rollcage-test --flag", "'no-such-agent-rollcage-test' is not on the harness's PATH"),
        ("/nonexistent/rollcage-agent", "/nonexistent/rollcage-agent is not an executable file"),
    ],
)
def test_a_missing_command_is_refused_up_front_naming_the_row_and_program(
    tmp_path: Path, command: str, named: str
) -> None:
    done = _run(tmp_path, command)
    assert done.returncode == 2, done.stderr
    assert "line 1 (task a): the command harness cannot start" in done.stderr
    assert named in done.stderr
    # Refused before any rollout: no attempt ran, none was recorded.
    assert not (tmp_path / "out" / "rollouts").exists() or not any((tmp_path / "out" / "rollouts").iterdir())
    records = tmp_path / "out" / "rollouts.jsonl"
    assert not records.exists() or not records.read_text().strip()
