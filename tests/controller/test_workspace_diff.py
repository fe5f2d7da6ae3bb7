"""``workspace.diff``: git's diff where the image's working directory is a repository, else file level."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rollcage.cli import _build_app
from rollcage.controller import Controller, LocalBackend, ModelEndpointConfig, RunConfig
from rollcage.controller._workspace_diff import DiffWritten, file_level_diff, write_workspace_diff
from rollcage.controller.testing import FakeSupervisor
from rollcage.export import export_run
from rollcage.protocol import FileSeal, RolloutRecord
from rollcage.viewer import load_rollout, render_rollout, render_text, write_report
from tests.helpers.image_rollouts import agent_session, make_image, needs_root
from tests.helpers.upstream import harbor_atif_errors
from tests.helpers.viewer_fixtures import write_run
from tests.helpers.waiting import wait_for

FILES = {
    "src/app.py": "def answer():\n    return 41\n",
    "README": "a task\n",
    "old/one.txt": "one\n",
    "old/two.txt": "two\n",
    "logo.bin": b"\x89PNG\0\0\0",
}
AGENT = """
sed -i s/41/42/ src/app.py
rm README
printf 'new\\n' > src/new_module.py
printf '\\0\\1\\2binary' > data.bin
printf '\\0\\1changed' > logo.bin
rm -r old && mkdir old && echo three > old/three.txt
"""


def _diff(rollout_dir: Path) -> str:
    written = asyncio.run(write_workspace_diff(rollout_dir))
    data = (rollout_dir / "workspace.diff").read_bytes()
    assert written.problem is None and written.seal == FileSeal.of(data)
    return data.decode()


@needs_root
def test_a_git_working_directory_gets_git_s_diff_against_the_image_s_head(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", FILES, git=True)
    with agent_session(image, tmp_path / "r", AGENT + "echo changed > /etc/hostname\n"):
        pass
    (tmp_path / "r/workspace").mkdir()
    (tmp_path / "r/workspace/notes.txt").write_text("kept in the workspace\n")
    diff = _diff(tmp_path / "r")
    assert diff.startswith("# git diff of /testbed against the image's HEAD ")
    assert "# also changed outside /testbed (1): /etc/hostname\n" in diff
    # The rollout's workspace, bound at /rollout/workspace in its root, is evidence too.
    assert diff.endswith("+++ b/rollout/workspace/notes.txt\n@@ -0,0 +1 @@\n+kept in the workspace\n")
    assert "diff --git a/src/app.py b/src/app.py" in diff and "-    return 41\n+    return 42\n" in diff
    assert "diff --git a/README b/README\ndeleted file mode 100644" in diff
    assert "+++ b/src/new_module.py\n@@ -0,0 +1 @@\n+new\n" in diff  # untracked, included
    assert "Binary files /dev/null and b/data.bin differ" in diff
    assert "Binary files a/logo.bin and b/logo.bin differ" in diff
    assert "deleted file mode 100644" in diff and "-one\n" in diff and "+three\n" in diff


@needs_root
def test_the_agent_s_git_config_and_attributes_are_never_used(tmp_path: Path) -> None:
    """A clean filter, an external diff and textconv set by the agent would run code and change the diff."""
    image = make_image(tmp_path / "image", FILES, git=True)
    agent = (
        "printf '* filter=evil diff=evil\\n' > .gitattributes\n"
        'printf \'[filter "evil"]\\n\\tclean = echo FILTERED\\n[diff "evil"]\\n\\ttextconv = echo TEXTCONV\\n'
        "[diff]\\n\\texternal = echo EXTERNAL\\n' >> .git/config\n"
        "sed -i s/41/42/ src/app.py\n"
    )
    with agent_session(image, tmp_path / "r", agent):
        pass
    diff = _diff(tmp_path / "r")
    assert "+    return 42\n" in diff
    assert "FILTERED" not in diff and "TEXTCONV" not in diff and "EXTERNAL" not in diff


@needs_root
def test_a_root_without_a_repository_gets_a_file_level_diff(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", FILES)
    with agent_session(image, tmp_path / "r", AGENT + "echo changed > /etc/hostname\n"):
        pass
    diff = _diff(tmp_path / "r")
    assert diff.startswith("# file-level diff of the rollout's changes against the image dir:")
    assert "--- a/testbed/src/app.py\n+++ b/testbed/src/app.py\n" in diff and "+    return 42\n" in diff
    # A whiteout is a deletion; an opaque directory deletes what the image had under it.
    assert "diff --git a/testbed/README b/testbed/README\ndeleted file mode 100644" in diff
    assert "--- a/testbed/old/one.txt\n+++ /dev/null\n" in diff
    assert "--- a/testbed/old/two.txt\n+++ /dev/null\n" in diff
    assert "+++ b/testbed/old/three.txt\n@@ -0,0 +1 @@\n+three\n" in diff
    assert "Binary files /dev/null and b/testbed/data.bin differ" in diff
    assert "Binary files a/testbed/logo.bin and b/testbed/logo.bin differ" in diff
    assert "\0" not in diff
    assert "-image\n+changed\n" in diff  # outside the working directory too


def test_a_rollout_without_an_image_diffs_its_workspace_against_the_empty_one(tmp_path: Path) -> None:
    rollout = tmp_path / "r"
    (rollout / "workspace/pkg").mkdir(parents=True)
    (rollout / "workspace/pkg/solution.py").write_text("print(42)\n")
    (rollout / "workspace/blob").write_bytes(b"\0\xff")
    (rollout / "workspace/escape").symlink_to("/etc/passwd")
    diff = _diff(rollout)
    assert "+++ b/pkg/solution.py\n@@ -0,0 +1 @@\n+print(42)\n" in diff
    assert "Binary files /dev/null and b/blob differ" in diff
    # A link is shown as git shows one (its target), never followed.
    assert "new file mode 120000" in diff and "+/etc/passwd\n" in diff and "root:" not in diff


def test_an_empty_workspace_without_an_image_gets_the_heading_alone(tmp_path: Path) -> None:
    rollout = tmp_path / "r"
    (rollout / "workspace").mkdir(parents=True)
    assert _diff(rollout) == "# the final workspace against the empty workspace the rollout started from\n"
    assert sorted(os.listdir(rollout)) == ["workspace", "workspace.diff"]  # no temporary file left


def test_a_rollout_directory_that_is_not_there_gets_no_diff(tmp_path: Path) -> None:
    assert asyncio.run(write_workspace_diff(tmp_path / "never-made")) == DiffWritten(seal=None, problem=None)
    assert os.listdir(tmp_path) == []


def test_an_unusable_image_json_leaves_a_note_in_the_diff(tmp_path: Path) -> None:
    rollout = tmp_path / "r"
    (rollout / "workspace").mkdir(parents=True)
    (rollout / "image.json").write_text("[1, 2]")
    written = asyncio.run(write_workspace_diff(rollout))
    problem = written.problem
    assert problem is not None and problem.startswith("workspace.diff could not be made: ValueError")
    assert (rollout / "workspace.diff").read_text() == f"# {problem}\n"
    assert written.seal == FileSeal.of(f"# {problem}\n".encode())


def test_a_large_diff_is_cut_with_a_note(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    for index in range(50):
        (tmp_path / "w" / f"f{index:02}.txt").write_text("line\n" * 100)
    diff = file_level_diff(tmp_path / "w", None, overlay=False, limit=10_000).decode()
    assert len(diff) < 10_200 and diff.endswith("# workspace.diff cut here: it is over 10000 bytes\n")


def test_show_and_the_atif_export_carry_the_diff(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    rollout = run.path / "rollouts" / "calc-1-s0-t0"
    (rollout / "workspace.diff").write_text(
        "diff --git a/answer.py b/answer.py\n--- a/answer.py\n+++ b/answer.py\n@@ -1 +1 @@\n-x = 3\n+x = 4\n"
    )
    text = render_text(render_rollout(load_rollout(rollout)), width=160)
    assert "workspace.diff" in text and "+x = 4" in text and "-x = 3" in text
    shown = CliRunner().invoke(_build_app(), ["show", str(rollout)])
    assert shown.exit_code == 0 and "+x = 4" in shown.output
    report = write_report(run.path).read_text()
    assert "workspace.diff (what the rollout changed)" in report and "+x = 4" in report
    export_run(run.path, "atif")
    document = json.loads((run.path / "export/atif/calc-1-s0-t0.json").read_text())
    assert document["extra"]["workspace_diff"].endswith("+x = 4\n")
    other = json.loads((run.path / "export/atif/calc-1-s1-t0.json").read_text())
    assert "workspace_diff" not in other["extra"]
    # Where the diff sits must be a place Harbor's own ATIF code accepts.
    assert harbor_atif_errors(sorted((run.path / "export/atif").glob("*.json"))) == {}


@pytest.mark.parametrize("size", [70 * 1024])
def test_show_holds_only_the_start_of_a_large_diff(tmp_path: Path, size: int) -> None:
    run = write_run(tmp_path / "run")
    rollout = run.path / "rollouts" / "calc-1-s0-t0"
    (rollout / "workspace.diff").write_text("+line\n" * (size // 6))
    view = load_rollout(rollout)
    assert view.workspace_diff is not None and len(view.workspace_diff) <= 64 * 1024 + 100
    assert "more bytes in workspace.diff" in view.workspace_diff


_NAMES = st.sampled_from(["a.py", "b.txt", "dir/c.py", "dir/sub/d.md", "e"])
_TEXT = st.lists(st.sampled_from(["x", "y = 1", "", "  indented", "z" * 30]), max_size=8).map(
    lambda lines: "\n".join(lines)
)


@needs_root
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    image=st.dictionaries(_NAMES, _TEXT, max_size=5),
    edits=st.dictionaries(_NAMES, st.one_of(st.none(), _TEXT), max_size=5),
)
def test_the_file_level_diff_applies_to_the_image_and_gives_the_rollout_s_tree(
    tmp_path_factory: pytest.TempPathFactory, image: dict[str, str], edits: dict[str, str | None]
) -> None:
    """``git apply`` of the diff on a copy of the image yields the tree the rollout left (None: deleted)."""
    base = tmp_path_factory.mktemp("prop")
    for name, text in image.items():
        _put(base / "image" / name, text)
    changes = base / "changes"
    changes.mkdir()
    expected = dict(image)
    for name, text in edits.items():
        if text is None:
            if name not in image:
                continue
            (changes / name).parent.mkdir(parents=True, exist_ok=True)
            os.mknod(changes / name, stat.S_IFCHR, 0)  # a whiteout, as overlayfs makes one
            expected.pop(name)
        else:
            _put(changes / name, text)
            expected[name] = text
    diff = file_level_diff(changes, base / "image")
    shutil.copytree(base / "image", base / "applied") if image else (base / "applied").mkdir()
    done = subprocess.run(
        ["git", "apply", "--allow-empty", "-"],
        cwd=base / "applied",
        input=diff,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, (done.stderr.decode(), diff.decode())
    got = {
        str(path.relative_to(base / "applied")): path.read_text()
        for path in (base / "applied").rglob("*")
        if path.is_file()
    }
    assert got == expected


def _put(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --------------------------------------------------------------------------- durability: the seal
#
# workspace.diff is derived, so the controller publishes it without a sync of its own: a killed
# controller never leaves it torn (it is renamed into place whole), but a machine crash may leave
# it missing, empty, cut or zeroed beside a record that did reach the disk. The record's seal tells.


class _AgentWrites:
    """The fake supervisor (``rollcage.controller.testing``), whose agent also leaves a file."""

    def __init__(self, answer: str = "42") -> None:
        self.fake = FakeSupervisor({"a": answer})

    async def __call__(self, rollout_dir: Path, config: Any, *, stop: asyncio.Event | None = None) -> Any:
        supervised = await self.fake(rollout_dir, config, stop=stop)
        await asyncio.to_thread((rollout_dir / "workspace" / "answer.py").write_text, "x = 42\n")
        return supervised


def _run_config(tmp_path: Path, grader: dict[str, Any] | None = None) -> RunConfig:
    dataset = tmp_path / "dataset.jsonl"
    row = {"id": "a", "input": "6*7?", "expected": "42", **({"grader": grader} if grader else {})}
    dataset.write_text(json.dumps(row) + "\n")
    return RunConfig(
        dataset=dataset,
        out=tmp_path / "out",
        model=ModelEndpointConfig(base_url="http://127.0.0.1:9/v1", model_name="fake"),
        sandbox="none",
        retry_backoff_s=0.0,
    )


def _records(out: Path) -> list[RolloutRecord]:
    path = out / "rollouts.jsonl"
    if not path.exists():
        return []
    return [RolloutRecord.model_validate_json(line) for line in path.read_bytes().splitlines()]


def _tear_cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


TEARS: dict[str, Callable[[Path], None]] = {
    "missing": lambda path: path.unlink(),  # the rename never reached the disk
    "empty": lambda path: path.write_bytes(b""),  # the name did, the data did not (delayed allocation)
    "cut": _tear_cut,
    "zeroed": lambda path: path.write_bytes(bytes(path.stat().st_size)),  # the size did, the blocks did not
}


@pytest.mark.parametrize("tear", sorted(TEARS))
def test_a_torn_workspace_diff_beside_its_durable_record_is_never_read_as_the_diff(
    tmp_path: Path, tear: str
) -> None:
    cfg = _run_config(tmp_path)
    asyncio.run(Controller(cfg, backend=LocalBackend(cfg.rollout_settings(), supervise=_AgentWrites())).run())
    [record] = _records(cfg.out)
    rollout = cfg.out / "rollouts" / record.rollout_id
    diff = rollout / "workspace.diff"
    assert record.workspace_diff == FileSeal.of(diff.read_bytes())
    shown = load_rollout(rollout)
    assert shown.workspace_diff is not None and "+x = 42\n" in shown.workspace_diff, shown.problems
    TEARS[tear](diff)
    view = load_rollout(rollout)
    assert view.workspace_diff is None
    assert [p for p in view.problems if p.startswith("workspace.diff: ") and p.endswith("not shown")], (
        view.problems
    )
    assert "+x = 42" not in CliRunner().invoke(_build_app(), ["show", str(rollout)]).output
    export_run(cfg.out, "atif")
    document = json.loads((cfg.out / "export/atif" / f"{record.rollout_id}.json").read_text())
    assert "workspace_diff" not in document["extra"]


_KILLED_CHILD = """
import asyncio, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.controller.test_workspace_diff import _AgentWrites, _run_config
from rollcage.controller import Controller, LocalBackend
cfg = _run_config(Path(sys.argv[2]), {"type": "regex", "pattern": "(a|a)+$", "timeout_s": 300})
backend = LocalBackend(cfg.rollout_settings(), supervise=_AgentWrites("a" * 60 + "b"))
asyncio.run(Controller(cfg, backend=backend).run())
"""


def test_a_controller_killed_between_the_diff_and_the_record_leaves_no_diff_read_as_a_record_s(
    tmp_path: Path,
) -> None:
    """SIGKILL after workspace.diff is published and before the record (the grader is stuck in a
    regex that backtracks for minutes): the rerun sets the attempt aside, and the record it writes
    seals the diff that is beside it."""
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, str(root), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    rollouts = tmp_path / "out" / "rollouts"
    try:
        wait_for(lambda: list(rollouts.glob("*/workspace.diff")), what="the diff published", timeout=60)
        assert child.poll() is None and _records(tmp_path / "out") == []  # the grade holds the record back
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, output.decode(errors="replace")
    cfg = _run_config(tmp_path, {"type": "regex", "pattern": "42"})
    asyncio.run(Controller(cfg, backend=LocalBackend(cfg.rollout_settings(), supervise=_AgentWrites())).run())
    [record] = _records(cfg.out)
    assert record.reward == 1.0
    [aside] = (cfg.out / "interrupted").iterdir()
    assert (aside / "workspace.diff").exists()  # the killed attempt's, kept as evidence, in no record
    diff = cfg.out / "rollouts" / record.rollout_id / "workspace.diff"
    assert record.workspace_diff == FileSeal.of(diff.read_bytes())
    view = load_rollout(cfg.out / "rollouts" / record.rollout_id)
    assert view.workspace_diff is not None and "+x = 42\n" in view.workspace_diff and view.problems == []
