"""Rollouts in task images, end to end: the controller, the supervisor (root), bubblewrap, the worker.

The images are made offline from the host's own busybox, bash and Python (tests/helpers/task_images.py)
and loaded through the store as ``oci:`` layouts. A rollout's bash commands and python cells must
see the image (its files, ``Env``, ``WorkingDir``, ``User``), never the host or rollcage; what they
write lands in the rollout's ``changes/``, never in the store; Python in an image without one is
refused before anything runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.cage import launcher
from rollcage.controller import Controller, RunConfig
from rollcage.controller._ids import rollout_id
from rollcage.durable import read_journal
from rollcage.errors import ConfigError
from rollcage.policy import PolicyServer
from rollcage.protocol import RolloutRecord, WorkerResult
from rollcage.supervisor import BwrapSandbox
from tests.helpers.oci import snapshot
from tests.helpers.supervisor_env import requires_bwrap
from tests.helpers.task_images import MARKER, OS_RELEASE, TaskImage, make_task_image
from tests.helpers.waiting import wait_for

pytestmark = [
    pytest.mark.bwrap,
    requires_bwrap(),
    pytest.mark.skipif(os.geteuid() != 0, reason="an image rollout mounts its root: root only"),
    pytest.mark.timeout(300),
]

PROBE_BASH = (
    'id -u; id -g; pwd; cat /etc/os-release; cat marker.txt; echo "mark=$TASK_IMAGE_MARK"; '
    "echo written > made-by-bash.txt; rm marker.txt; ls /usr/bin; "
    "ls {host} 2>&1 | head -1"
)
PROBE_PYTHON = (
    "import os, sys, importlib.util\n"
    "print('exe', sys.executable)\n"
    "print('cwd', os.getcwd())\n"
    "print('env', os.environ.get('TASK_IMAGE_MARK'))\n"
    "print('release', open('/etc/os-release').read().split()[0])\n"
    "print('rollcage', importlib.util.find_spec('rollcage'))\n"
    "print('host', os.path.exists('{host}'))\n"
    "open('made-by-python.txt', 'w').write('py')\n"
)


@pytest.fixture(scope="session")
def python_image(tmp_path_factory: pytest.TempPathFactory) -> TaskImage:
    """An image with bash and the host's Python (made once per test session, per worker)."""
    return make_task_image(tmp_path_factory.mktemp("python-image"), python=True)


@pytest.fixture(scope="session")
def busybox_image(tmp_path_factory: pytest.TempPathFactory) -> TaskImage:
    """An image with busybox only: no bash, no python3."""
    return make_task_image(tmp_path_factory.mktemp("busybox-image"), python=False)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh image store for the test (the controller's default store reads the variable)."""
    path = tmp_path / "store"
    monkeypatch.setenv("ROLLCAGE_IMAGE_STORE", str(path))
    return path


def _run(
    directory: Path, rows: list[dict[str, Any]], script: dict[str, Any], **config: Any
) -> tuple[list[RolloutRecord], RunConfig]:
    directory.mkdir(parents=True, exist_ok=True)
    dataset = directory / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / "policy.yaml").write_text(json.dumps(script))
    run = RunConfig(
        dataset=dataset, out=directory / "out", deadline_s=90, grace_s=2, max_infra_retries=0, **config
    )
    asyncio.run(Controller(run).run())
    lines = (run.out / "rollouts.jsonl").read_bytes().splitlines()
    return [RolloutRecord.model_validate_json(line) for line in lines], run


def _outputs(record: RolloutRecord) -> list[str]:
    result = WorkerResult.model_validate_json((Path(record.rollout_dir) / "result.json").read_bytes())
    return [call.output for call in result.trajectory.tool_calls]


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_bash_and_python_see_the_image_and_their_writes_land_in_changes(
    tmp_path: Path, store: Path, python_image: TaskImage, start: str
) -> None:
    host = tmp_path / "host-only"
    host.mkdir()
    rows = [
        {"id": "probe", "input": "look", "tools": ["bash", "python"], "sandbox": {"image": python_image.ref}}
    ]
    script = {
        "tasks": {
            "probe": [
                {"tool_calls": [{"name": "bash", "arguments": {"command": PROBE_BASH.format(host=host)}}]},
                {
                    "tool_calls": [
                        {"name": "python", "arguments": {"code": PROBE_PYTHON.format(host=str(host))}}
                    ]
                },
                {"text": "done"},
            ]
        }
    }
    records, _ = _run(tmp_path / "run", rows, script, bwrap=BwrapSandbox(worker_start=start))
    (record,) = records
    assert record.outcome == "completed", record.receipt.outcome_reason
    bash, python = _outputs(record)
    assert bash.splitlines()[:3] == ["0", "0", python_image.working_dir]
    assert OS_RELEASE.splitlines()[0] in bash and MARKER.strip() in bash
    assert "mark=from-the-image-env" in bash
    assert "No such file" in bash.splitlines()[-1], bash  # the host's directory is not there
    assert f"exe /usr/bin/python3\ncwd {python_image.working_dir}\nenv from-the-image-env" in python
    assert "release ID=rollcage-task-image" in python
    assert "rollcage None" in python and "host False" in python
    rollout = Path(record.rollout_dir)
    changes = rollout / "changes"
    work = changes / python_image.working_dir.lstrip("/")
    assert (work / "made-by-bash.txt").read_text() == "written\n"
    assert (work / "made-by-python.txt").read_text() == "py"
    deleted = os.lstat(work / "marker.txt")  # an overlayfs whiteout: a 0:0 character device
    assert os.major(deleted.st_rdev) == 0 and os.minor(deleted.st_rdev) == 0
    image = json.loads((rollout / "image.json").read_text())
    assert image["ref"] == python_image.ref and image["working_dir"] == python_image.working_dir
    assert image["env"] == list(python_image.env) and image["user"] is None
    assert image["digest"].startswith("sha256:") and Path(image["root"]).is_relative_to(store)
    root = Path(image["root"])
    assert (root / "work" / "marker.txt").read_text() == MARKER  # the store kept its copy
    assert not (root / "work" / "made-by-bash.txt").exists()
    assert not (rollout / ".image").exists()
    with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
        assert str(rollout) not in mounts.read(), "the rollout's root is still mounted"


def test_the_store_is_never_written_by_a_rollout(
    tmp_path: Path, store: Path, python_image: TaskImage
) -> None:
    rows = [{"id": "w", "input": "write", "tools": ["bash"], "sandbox": {"image": python_image.ref}}]
    command = "mkdir /new; echo x > /etc/os-release; rm -rf /work /bin/busybox; echo ok"
    script = {
        "tasks": {"*": [{"tool_calls": [{"name": "bash", "arguments": {"command": command}}]}, {"text": "d"}]}
    }
    # Prepared once before, so that the snapshot sees the image's root.
    _run(tmp_path / "a", rows, {"tasks": {"*": [{"text": "d"}]}})
    roots = store / "roots"
    before = snapshot(roots)
    records, _ = _run(tmp_path / "b", rows, script)
    assert _outputs(records[0])[-1].strip().endswith("ok")
    assert snapshot(roots) == before
    assert (Path(records[0].rollout_dir) / "changes" / "new").is_dir()
    # An image rollout's launch must not send the launcher to the host's namespace for every later
    # launch (a failed bind of the image root once did: other rollouts' mounts were then copied).
    assert launcher().plain_reason is None


def test_writes_in_the_image_root_are_bounded_like_the_workspace(
    tmp_path: Path, store: Path, python_image: TaskImage
) -> None:
    rows = [{"id": "fill", "input": "x", "tools": ["bash"], "sandbox": {"image": python_image.ref}}]
    command = "dd if=/dev/zero of=/usr/fill bs=1M count=64 2>&1; echo rc=$?"
    call = {"tool_calls": [{"name": "bash", "arguments": {"command": command}}]}
    script = {"tasks": {"*": [call, {"text": "d"}]}}
    records, _ = _run(tmp_path / "run", rows, script, bwrap=BwrapSandbox(workspace_bytes=8 << 20))
    out = _outputs(records[0])[0]
    assert "No space left on device" in out and "rc=1" in out, out
    kept = Path(records[0].rollout_dir) / "changes" / "usr" / "fill"
    assert kept.stat().st_size <= 8 << 20


def test_the_run_image_is_the_default_and_a_row_user_is_the_images(
    tmp_path: Path, store: Path, python_image: TaskImage
) -> None:
    agent_image = make_task_image(tmp_path / "agent-image", python=True, user="agent")
    rows = [
        {"id": "default", "input": "x", "tools": ["bash"]},
        {"id": "agent", "input": "x", "tools": ["bash"], "sandbox": {"image": agent_image.ref}},
    ]
    probe = {"tool_calls": [{"name": "bash", "arguments": {"command": "id -u; touch /mine && echo wrote"}}]}
    records, _ = _run(
        tmp_path / "run", rows, {"tasks": {"*": [probe, {"text": "d"}]}}, image=python_image.ref
    )
    by_task = {r.task_id: r for r in records}
    assert _outputs(by_task["default"])[0].split() == ["0", "wrote"]
    # The image's User is who agent code is: uid 1234, who owns none of the image's root-owned files.
    out = _outputs(by_task["agent"])[0]
    assert out.splitlines()[0] == "1234" and "wrote" not in out
    assert json.loads((Path(by_task["agent"].rollout_dir) / "image.json").read_text())["user"] == "agent"


def test_the_editor_and_a_command_harness_work_in_the_image(
    tmp_path: Path, store: Path, python_image: TaskImage, busybox_image: TaskImage
) -> None:
    editor = "str_replace_based_edit_tool"
    marker = f"{python_image.working_dir}/marker.txt"
    command = ["/bin/sh", "-c", "(head -1 /etc/os-release; pwd; echo $TASK_IMAGE_MARK) > made.txt; echo done"]
    rows = [
        {"id": "edit", "input": "x", "tools": [editor], "sandbox": {"image": python_image.ref}},
        {
            "id": "harness",
            "input": "x",
            "tools": [],
            "agent": {"harness": {"type": "command", "argv": command}},
            "sandbox": {"image": busybox_image.ref},
        },
    ]
    edit = {"command": "str_replace", "path": marker, "old_str": "in-the", "new_str": "edited-in-the"}
    calls = [
        {"tool_calls": [{"name": editor, "arguments": edit}]},
        {"tool_calls": [{"name": editor, "arguments": {"command": "view", "path": marker}}]},
        {"text": "d"},
    ]
    records, _ = _run(tmp_path / "run", rows, {"tasks": {"edit": calls}})
    by_task = {r.task_id: r for r in records}
    edited, viewed = _outputs(by_task["edit"])
    assert "edited-in-the-image" in viewed, (edited, viewed)
    changes = Path(by_task["edit"].rollout_dir) / "changes"
    assert (changes / marker.lstrip("/")).read_text() == "edited-in-the-image\n"
    harness = by_task["harness"]
    assert harness.outcome == "completed", harness.receipt.outcome_reason
    made = Path(harness.rollout_dir) / "changes" / busybox_image.working_dir.lstrip("/") / "made.txt"
    seen = made.read_text().splitlines()
    assert seen == ["ID=rollcage-task-image", busybox_image.working_dir, "from-the-image-env"], seen


def test_python_in_an_image_without_python3_is_refused_before_anything_runs(
    tmp_path: Path, store: Path, busybox_image: TaskImage
) -> None:
    rows = [
        {"id": "sh", "input": "x", "tools": [], "sandbox": {"image": busybox_image.ref}},
        {"id": "py", "input": "x", "tools": ["python"], "sandbox": {"image": busybox_image.ref}},
    ]
    with pytest.raises(ConfigError) as refused:
        _run(tmp_path / "run", rows, {"tasks": {"*": [{"text": "d"}]}})
    message = str(refused.value)
    assert "line 2 (task py)" in message and "python3" in message and "\n" not in message
    assert not (tmp_path / "run" / "out" / "rollouts").exists()
    rows[1] = {"id": "sh", "input": "x", "tools": ["bash"], "sandbox": {"image": busybox_image.ref}}
    rows[0]["id"] = "quiet"
    with pytest.raises(ConfigError, match=r"line 2 \(task sh\): image .* has no /bin/bash .* the bash tool"):
        _run(tmp_path / "run2", rows, {"tasks": {"*": [{"text": "d"}]}})


def test_a_bad_image_reference_is_refused_up_front_naming_the_row(tmp_path: Path, store: Path) -> None:
    rows = [
        {"id": "ok", "input": "x", "tools": []},
        {"id": "bad", "input": "x", "tools": [], "sandbox": {"image": f"oci:{tmp_path / 'nowhere'}:1"}},
    ]
    with pytest.raises(ConfigError) as refused:
        _run(tmp_path / "run", rows, {"tasks": {"*": [{"text": "d"}]}})
    assert "line 2 (task bad)" in str(refused.value) and "nowhere" in str(refused.value)
    assert not (tmp_path / "run" / "out" / "rollouts").exists()


# --------------------------------------------------------------------------- resume

CALLS = 5
FAILS_AT = 4
FIRST = rollout_id("t0", 0, 0)
RESUME_SCRIPT = {
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


@pytest.fixture
def server() -> Iterator[PolicyServer]:
    with PolicyServer(RESUME_SCRIPT, faults=[f"rollout={FIRST}:call={FAILS_AT}:kind=hang"]) as srv:
        yield srv


def _in_flight_at(out: Path, rollout: str, calls: int) -> bool:
    try:
        records = read_journal(out / "rollouts" / rollout / "checkpoint.jsonl")
    except (OSError, ValueError):
        return False
    return sum(r.get("kind") == "model_call" for r in records) >= calls


def test_an_image_rollout_killed_mid_way_resumes_in_a_fresh_root(
    tmp_path: Path, store: Path, python_image: TaskImage, server: PolicyServer
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    dataset = data / "dataset.jsonl"
    row = {
        "id": "t0",
        "input": "6*7?",
        "tools": ["python", "bash"],
        "model": {"max_retries": 0, "timeout_s": 30},
    }
    dataset.write_text(json.dumps({**row, "expected": "42"}) + "\n")
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "rollcage", "run", str(dataset), "--out", str(out), "--quiet",
        "--model", server.base_url, "--model-name", "scripted", "--resume-rollouts",
        "--image", python_image.ref,
    ]  # fmt: skip
    env = {**os.environ, "ROLLCAGE_IMAGE_STORE": str(store)}
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    try:
        wait_for(lambda: server.faults_injected, what="the hung model call of t0")
        wait_for(lambda: _in_flight_at(out, FIRST, FAILS_AT - 1), what="its calls in the journal")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    records = [
        RolloutRecord.model_validate_json(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()
    ]
    (resumed,) = records
    assert (resumed.outcome, resumed.reward) == ("completed", 1.0), resumed.receipt.outcome_reason
    assert resumed.resume is not None and resumed.resume.resumed
    assert "42 ID=rollcage-task-image" in _outputs(resumed)[-1]
    rollout = Path(resumed.rollout_dir)
    assert (rollout / "changes" / "work" / "seven.txt").read_text() == "7\n"
    assert (rollout / "image.json").is_file()
    with open("/proc/self/mountinfo", encoding="utf-8") as mounts:
        left = [line for line in mounts if str(out) in line]
    assert left == [], f"the killed run's image root is still mounted: {left}"
