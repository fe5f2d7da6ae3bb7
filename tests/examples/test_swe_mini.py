"""examples/swe-mini: the task images build offline, travel through a real registry, an OCI layout and a
docker archive to the same root, their planted tests fail as built, and the scripted policy's own tool calls
(the real bash session and file editor, in the image's root) make them pass.

The images are built once per session (all tests here run on one xdist worker); the Debian root and
the sdists are cached by content key in the user's cache (``SWE_MINI_CACHE`` to move it), so only a
first run on a machine pays for mmdebstrap (one to two minutes). A skip happens only when the Debian
mirror cannot be reached and nothing is cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from rollcage.images import ImageStore, PreparedImage, cow_root, parse_ref
from rollcage.policy import load_script
from rollcage.tools import FileEditor, ShellSession
from tests.helpers.paths import EXAMPLES

EXAMPLE = EXAMPLES / "swe-mini"

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.xdist_group("swe-mini"),
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="optional: mounting the rollout's overlay root needs root"),
]


def _load_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("swe_mini_build", EXAMPLE / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


build = _load_build()
TASKS = {task.name: task for task in build.TASKS}


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The images, built (or taken from the cache) once per session, exported under a session directory."""
    try:
        images = build.ensure_images(build.default_cache())
    except build.MirrorUnreachable as exc:
        pytest.skip(f"optional: {exc}")
    return build.export(images, tmp_path_factory.mktemp("swe-mini"))


@pytest.fixture(scope="session")
def registry(built: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, str]]]:
    """Debian's docker-registry on a loopback port with every task image pushed; stopped at the end."""
    server = build.LocalRegistry(tmp_path_factory.mktemp("swe-registry"))
    try:
        yield server, build.refs_for(built, "docker", server)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> ImageStore:
    return ImageStore(tmp_path_factory.mktemp("swe-store"))


def _tree(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry's type, mode, owner, size and link target; file contents under /testbed hashed."""
    seen: dict[str, tuple[Any, ...]] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top, name)
            st = path.lstat()
            rel = str(path.relative_to(root))
            target = os.readlink(path) if path.is_symlink() else None
            digest = None
            if rel.startswith("testbed/") and path.is_file() and not path.is_symlink():
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            seen[rel] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, target, digest)
    return seen


def test_the_images_come_through_the_registry_a_layout_and_an_archive_as_one_root(
    built: Any, registry: tuple[Any, dict[str, str]], store: ImageStore, tmp_path: Path
) -> None:
    server, refs = registry
    # A store of its own for each way in (the session's store takes the layout): each unpacks the
    # layers itself, so the roots compared were made apart. The tasks share their Debian layer.
    through_registry = ImageStore(tmp_path / "from-registry")
    through_archive = ImageStore(tmp_path / "from-archive")
    for name, task in TASKS.items():
        images = [
            through_registry.pull(refs[name]),
            store.pull(built.oci_ref(task)),
            through_archive.pull(built.archive_ref(task)),
        ]
        assert refs[name].startswith(f"docker://{server.host}/swe-mini/{name}:")
        assert len({image.digest for image in images}) == 1, [image.ref for image in images]
        assert len({image.root for image in images}) == 3
        for image in images:
            assert image.config.working_dir == "/testbed"
            assert "PYTHONDONTWRITEBYTECODE=1" in image.config.env
        first = _tree(images[0].root)
        assert first["testbed/.git"][0] & 0o170000 == 0o040000
        assert "usr/bin/python3" in first and "dev/null" not in first
        for other in images[1:]:
            assert _tree(other.root) == first
    log = (server.directory / "registry.log").read_text(errors="replace")
    assert "GET /v2/swe-mini/inflection/manifests/" in log


def _prefix(image: PreparedImage, root: Path, *, uid: int = 1000) -> list[str]:
    """bwrap into ``root`` as the sandbox does: its own namespaces, the image's Env and WorkingDir."""
    env: list[str] = []
    for item in image.config.env:
        name, _, value = item.partition("=")
        env += ["--setenv", name, value]
    bwrap = shutil.which("bwrap")
    assert bwrap is not None, "bubblewrap is not installed (scripts/system-deps test installs it)"
    return [
        bwrap,
        "--bind",
        str(root),
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--uid",
        str(uid),
        "--chdir",
        image.config.working_dir or "/",
        "--clearenv",
        *env,
    ]


def _grade(image: PreparedImage, root: Path, task: Any) -> tuple[int, set[str], set[str]]:
    """Run the task's grader command in ``root``; its exit status, and the test ids failed and passed."""
    junit = root / build.JUNIT.lstrip("/")
    junit.unlink(missing_ok=True)
    done = subprocess.run(
        [*_prefix(image, root, uid=0), "/bin/sh", "-c", task.test_command()],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert junit.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    failed: set[str] = set()
    passed: set[str] = set()
    for case in ET.parse(junit).iter("testcase"):
        # classname is the module path dotted, then the class: "tests.test_more.IlenTests".
        parts = (case.get("classname") or "").split(".")
        module_parts = task.test_file.removesuffix(".py").split("/")
        cls = parts[len(module_parts) :]
        test_id = "::".join([task.test_file, *cls, case.get("name") or ""])
        bad = case.find("failure") is not None or case.find("error") is not None
        (failed if bad else passed).add(test_id)
    return done.returncode, failed, passed


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_planted_test_fails_on_the_image_as_built(
    name: str, built: Any, store: ImageStore, tmp_path: Path
) -> None:
    task = TASKS[name]
    image = store.prepare(built.oci_ref(task))
    with cow_root(image, tmp_path / "overlay", tmp_path / "root") as root:
        status, failed, passed = _grade(image, root.path, task)
        assert status != 0
        assert failed == set(task.fail_to_pass)
        assert set(task.pass_to_pass) <= passed
        log = subprocess.run(
            [*_prefix(image, root.path), "git", "log", "--format=%s"], capture_output=True, text=True
        )
        assert log.stdout.splitlines() == [f"{task.project} {task.version}"], log.stderr
        assert (root.path / "testbed" / task.path).read_text().split("\n").count(task.bad) == 1


def _script(name: str) -> list[dict[str, Any]]:
    tasks = yaml.safe_load((EXAMPLE / "policy.yaml").read_text())["tasks"]
    calls: list[dict[str, Any]] = []
    for turn in tasks[name]:
        calls += turn.get("tool_calls", [])
    return calls


async def _replay(image: PreparedImage, root: Path, name: str) -> list[tuple[str, bool, str]]:
    """Carry out the policy's tool calls with rollcage's own bash session and editor, in the image root
    as the sandbox's uid (1000): what a rollout of the scripted policy does in its cage."""
    prefix = _prefix(image, root)
    env = dict(item.partition("=")[::2] for item in image.config.env)
    answers: list[tuple[str, bool, str]] = []
    editor = FileEditor(cwd=Path("/"), prefix=prefix, env=env, python="python3")
    async with ShellSession(cwd=Path("/"), prefix=prefix, env=env) as shell:
        for call in _script(name):
            arguments = call["arguments"]
            if call["name"] == "bash":
                result = await shell.run(arguments["command"], timeout_s=300)
                answers.append(("bash", result.exit_code == 0, result.text))
            else:
                assert call["name"] == "str_replace_based_edit_tool"
                ok, text = await editor.call(arguments, timeout_s=60)
                answers.append((arguments["command"], ok, text))
    return answers


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_scripted_policy_fixes_the_bug_with_bash_and_the_editor(
    name: str, built: Any, store: ImageStore, tmp_path: Path
) -> None:
    task = TASKS[name]
    image = store.prepare(built.oci_ref(task))
    with cow_root(image, tmp_path / "overlay", tmp_path / "root") as root:
        answers = asyncio.run(_replay(image, root.path, name))
        edits = [a for a in answers if a[0] == "str_replace"]
        assert edits and all(ok for _, ok, _ in edits), answers
        assert "has been edited" in edits[0][2]
        # The policy's last bash call ran the tests after the fix; its output says they passed.
        assert answers[-1][0] == "bash" and " passed" in answers[-1][2] and "failed" not in answers[-1][2]
        diff = subprocess.run(
            [*_prefix(image, root.path), "git", "diff", "--numstat"], capture_output=True, text=True
        )
        assert diff.stdout.split() == ["1", "1", task.path], diff.stderr
        status, failed, passed = _grade(image, root.path, task)
        assert (status, failed) == (0, set())
        assert set(task.fail_to_pass) | set(task.pass_to_pass) <= passed
        # Only the rollout's upper directory changed: the store's root still has the bug.
        assert (image.root / "testbed" / task.path).read_text().split("\n").count(task.bad) == 1


def test_a_second_build_with_the_same_inputs_comes_from_the_cache(
    built: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    empty = tmp_path / "no-tools"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no mmdebstrap, umoci, skopeo or pip to run
    again = build.ensure_images(build.default_cache())
    assert again.key == built.key
    assert (again.layout / "index.json").read_bytes() == (built.layout / "index.json").read_bytes()


def test_the_dataset_and_the_policy_agree_with_the_tasks() -> None:
    script = load_script(EXAMPLE / "policy.yaml")  # the scripted policy server's own reading of it
    assert [(script.turns_for(name) or ("",))[0] for name in TASKS] == list(TASKS)
    refs = {name: f"docker://127.0.0.1:5000/swe-mini/{name}:{t.tag}" for name, t in TASKS.items()}
    rows = [build.dataset_row(task, refs[task.name]) for task in build.TASKS]
    for row in rows:
        task = TASKS[row["id"]]
        assert parse_ref(row["sandbox"]["image"]).transport == "docker"
        assert set(row["tools"]) == {"bash", "str_replace_based_edit_tool"}
        grader = row["grader"]
        assert grader["type"] == "tests" and grader["junit_xml"] == build.JUNIT
        assert grader["fail_to_pass"] and grader["pass_to_pass"]
        assert not set(grader["fail_to_pass"]) & set(grader["pass_to_pass"])
        ids = grader["fail_to_pass"] + grader["pass_to_pass"]
        assert all(i.startswith(task.test_file + "::") for i in ids)
        calls = [c["arguments"] for c in _script(task.name)]
        replaces = [c for c in calls if c.get("command") == "str_replace"]
        assert [(r["old_str"], r["new_str"]) for r in replaces] == [(task.bad, task.good)]
        assert all(r["path"] == f"/testbed/{task.path}" for r in replaces)
        assert len(_script(task.name)) < row["agent"]["max_policy_calls"]
