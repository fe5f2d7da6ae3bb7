"""``rollcage run`` as users run it: a subprocess, its output, its exit code, signals and SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rollcage.durable import read_journal
from rollcage.protocol import RolloutRecord
from tests.helpers.paths import EXAMPLES
from tests.helpers.waiting import processes_mentioning, wait_for, wait_for_records

try:
    from rollcage.supervisor import supervise as _supervise  # noqa: F401

    HAVE_SUPERVISOR = True
except ImportError:  # pragma: no cover - only while the supervisor is being built
    HAVE_SUPERVISOR = False

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"),
    pytest.mark.skipif(not HAVE_SUPERVISOR, reason="rollcage.supervisor.supervise is not available yet"),
    pytest.mark.timeout(300),
]

SLOW_POLICY = """
tasks:
  "*":
    - tool_calls:
        - {name: python, arguments: {code: "import time; time.sleep(0.4); print(6 * 7)"}}
    - text: "42"
"""


def rollcage(*args: str, cwd: Path) -> subprocess.Popen[str]:
    args = (*args, "--sandbox", os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap"))
    return subprocess.Popen(
        [sys.executable, "-m", "rollcage", "run", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a signal to the test's group never reaches it by accident
    )


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out


def slow_dataset(directory: Path, tasks: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "policy.yaml").write_text(SLOW_POLICY)
    rows = [{"id": f"t{i:02d}", "input": "6*7?", "tools": ["python"], "expected": "42"} for i in range(tasks)]
    path = directory / "dataset.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rollout_in_flight(out: Path) -> bool:
    for directory in (out / "rollouts").iterdir():
        if (directory / "receipt.json").exists():
            continue
        try:
            kinds = [r["kind"] for r in read_journal(directory / "checkpoint.jsonl")]
        except (OSError, ValueError):
            continue
        if "model_call" in kinds and "tool_call" not in kinds:
            return True
    return False


def records(out: Path) -> list[RolloutRecord]:
    return [RolloutRecord.model_validate_json(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]


def test_first_line_names_the_embedded_policy_and_default_output_is_printed(tmp_path: Path) -> None:
    code, out = finish(rollcage(str(EXAMPLES / "calc-weather" / "dataset.jsonl"), "--quiet", cwd=tmp_path))
    lines = out.splitlines()
    assert code == 0, out
    assert lines[0].startswith("Model: the embedded scripted policy"), out
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("calc-weather-") and run_dir.name.endswith("Z")
    assert f"Output: runs/{run_dir.name}" in out
    assert "mean reward" in out and "pass@1" in out
    assert len(records(run_dir)) == 5


def test_malformed_rows_are_named_and_strict_refuses_to_start(tmp_path: Path) -> None:
    dataset = tmp_path / "d" / "dataset.jsonl"
    dataset.parent.mkdir()
    (dataset.parent / "policy.yaml").write_text("tasks:\n  '*':\n    - text: '42'\n")
    dataset.write_text('{"id": "a", "input": "x", "expected": "42"}\n{"id": "b"}\n')
    code, out = finish(rollcage(str(dataset), "--out", "o1", "--quiet", cwd=tmp_path))
    assert code == 0, out
    assert "Malformed row at line 2 (id 'b'): field 'input': Field required" in out
    assert len(records(tmp_path / "o1")) == 1
    code, out = finish(rollcage(str(dataset), "--out", "o2", "--strict", "--quiet", cwd=tmp_path))
    assert code == 2 and "line 2" in out and "--strict" in out
    assert not (tmp_path / "o2" / "rollouts.jsonl").exists()


def test_sigint_stops_in_flight_rollouts_then_rerun_resumes(tmp_path: Path) -> None:
    dataset = slow_dataset(tmp_path / "data", 8)
    out = tmp_path / "out"
    proc = rollcage(str(dataset), "--out", str(out), "--concurrency", "2", "--quiet", cwd=tmp_path)
    wait_for_records(out / "rollouts.jsonl", 1, proc)
    # Interrupt while a rollout is surely in flight: its model call is journaled, its slow cell runs.
    wait_for(lambda: rollout_in_flight(out), what="a rollout in flight")
    proc.send_signal(signal.SIGINT)
    code, text = finish(proc)
    assert code == 130, text
    assert "Interrupted" in text
    first = records(out)
    assert any(r.outcome == "cancelled" for r in first), [r.outcome for r in first]
    assert all(not r.graded for r in first if r.outcome == "cancelled")
    code, text = finish(
        rollcage(str(dataset), "--out", str(out), "--concurrency", "4", "--quiet", cwd=tmp_path)
    )
    assert code == 0, text
    done = Counter(r.task_id for r in records(out) if r.outcome == "completed")
    assert done == {f"t{i:02d}": 1 for i in range(8)}


def test_sigkill_then_rerun_finishes_every_sample_once_and_leaves_no_orphans(tmp_path: Path) -> None:
    dataset = slow_dataset(tmp_path / "data", 10)
    out = tmp_path / "out-sigkill"
    args = (str(dataset), "--out", str(out), "--attempts", "2", "--concurrency", "3", "--quiet")
    proc = rollcage(*args, cwd=tmp_path)
    try:
        wait_for_records(out / "rollouts.jsonl", 3, proc)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        finish(proc)
    # Workers die with their parent (bwrap --die-with-parent), except when the kill lands while a
    # sandbox is starting (its parent-death signal is not armed yet): the rerun kills those by
    # their supervision token before it starts anything.
    code, text = finish(rollcage(*args, cwd=tmp_path))
    assert code == 0, text
    assert processes_mentioning(str(out)) == []
    got = records(out)
    assert len({r.rollout_id for r in got}) == len(got), "a rollout id was recorded twice"
    final = Counter(
        (r.task_id, r.sample) for r in got if r.outcome in ("completed", "agent_error", "timeout")
    )
    assert final == {(f"t{i:02d}", s): 1 for i in range(10) for s in (0, 1)}
    assert json.loads((out / "metrics.json").read_text())["rollouts"] == len(got)


def test_rerun_kills_processes_an_interrupted_run_left_behind(tmp_path: Path) -> None:
    """A sandbox the killed run could not reap (its rollout still has a token) dies when the run resumes."""
    out = tmp_path / "out"
    staging = out / "rollouts" / "t00-s0-t0" / ".sandbox"
    staging.mkdir(parents=True)
    (staging / "token").write_text("leftover-token")
    env = {**os.environ, "ROLLCAGE_SUPERVISION_TOKEN": "leftover-token"}
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={**os.environ, "ROLLCAGE_SUPERVISION_TOKEN": "another-rollout"},
    )
    try:
        code, text = finish(
            rollcage(str(slow_dataset(tmp_path / "data", 1)), "--out", str(out), cwd=tmp_path)
        )
        assert code == 0, text
        assert leftover.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None, "a process of another rollout was killed"
        assert "left running by an earlier" in text
    finally:
        leftover.kill()
        bystander.kill()
        leftover.wait(timeout=10)
        bystander.wait(timeout=10)
