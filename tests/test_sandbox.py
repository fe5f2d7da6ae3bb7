"""The bubblewrap sandbox: the command line it builds, and what agent code inside can and cannot do.

The containment tests run a fake worker that tries to escape (``probe``), fork
without bound, or allocate without bound, under real bubblewrap. The bombs are
bounded themselves, so a sandbox that failed to contain them fails the test
instead of taking the machine down.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.errors import SandboxError
from rollcage.protocol import SupervisorReceipt
from rollcage.supervisor import BwrapSandbox, NoSandbox, RolloutLayout, supervise
from rollcage.supervisor.sandbox import BwrapTools, bwrap_argv
from tests.helpers.supervisor_env import config, fake, make_rollout, processes_with_token, requires_bwrap


def _bwrap(test: Any) -> Any:
    """Mark a test that needs a working bubblewrap."""
    return pytest.mark.bwrap(requires_bwrap()(test))


SECRET_VAR = "ROLLCAGE_TEST_SECRET_KEY"
TOOLS = BwrapTools(bwrap="/usr/bin/bwrap", prlimit="/usr/bin/prlimit", setpriv="/usr/bin/setpriv")


@pytest.fixture(autouse=True)
def _no_strays() -> Iterator[None]:
    yield
    assert processes_with_token() == [], "a sandboxed process outlived its test"


# --------------------------------------------------------------------------- the command line (pure)


def _argv(*, as_root: bool, **fields: Any) -> list[str]:
    layout = RolloutLayout(Path("/runs/r1"), Path("/tmp/rollcage-x/proxy.sock"))
    return bwrap_argv(
        BwrapSandbox(**fields),
        tools=TOOLS,
        layout=layout,
        worker_argv=["/venv/bin/python", "-m", "rollcage", "worker", "/rollout/input.json"],
        worker_env={"PATH": "/usr/bin", "HOME": "/tmp"},
        ro_paths=["/venv", "/venv/lib", "/src"],
        as_root=as_root,
    )


def _pairs(argv: list[str], option: str) -> list[tuple[str, str]]:
    return [(argv[i + 1], argv[i + 2]) for i, arg in enumerate(argv) if arg == option]


@pytest.mark.parametrize("as_root", [False, True], ids=["user", "root"])
def test_argv_unshares_everything_and_lays_out_the_rollout(as_root: bool) -> None:
    argv = _argv(as_root=as_root)
    for flag in (
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--unshare-net",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ):
        assert flag in argv, flag
    ro = _pairs(argv, "--ro-bind")
    rw = _pairs(argv, "--bind")
    assert ("/runs/r1/.sandbox/input.json", "/rollout/input.json") in ro
    assert ("/runs/r1/.sandbox/root", "/rollout") in rw
    assert ("/runs/r1/checkpoint.jsonl", "/rollout/checkpoint.jsonl") in rw
    assert ("/runs/r1/workspace", "/rollout/workspace") in rw
    assert ("/tmp/rollcage-x/proxy.sock", "/run/rollcage/proxy.sock") in rw
    assert ("/venv", "/venv") in ro and ("/src", "/src") in ro
    assert ("/venv/lib", "/venv/lib") not in ro  # inside /venv already
    # Nothing of the rollout directory itself, and nothing else, is writable.
    assert {dest for _, dest in rw} <= {
        "/rollout",
        "/rollout/checkpoint.jsonl",
        "/rollout/workspace",
        "/run/rollcage/proxy.sock",
        "/proc",
        "/",
    }
    # Parent directories are made traversable for the unprivileged sandbox.
    assert ["--perms", "0755", "--dir", "/run"] == argv[argv.index("/run") - 3 : argv.index("/run") + 1]


def test_argv_as_root_drops_to_the_unprivileged_uid_before_creating_the_namespaces() -> None:
    argv = _argv(as_root=True)
    setpriv = argv.index("/usr/bin/setpriv")
    assert argv[setpriv : setpriv + 8] == [
        "/usr/bin/setpriv",
        "--reuid",
        "65534",
        "--regid",
        "65534",
        "--clear-groups",
        "--no-new-privs",
        "--",
    ]
    outer, inner = argv[:setpriv], argv[setpriv:]
    assert "--unshare-user" not in outer and "--unshare-net" in inner
    # The outer stage's PID namespace takes the unprivileged stages with it when it dies.
    assert "--unshare-pid" in outer and "--die-with-parent" in outer
    assert outer[outer.index("--cap-drop") + 1] == "ALL"
    assert argv.count("/usr/bin/bwrap") == 2


def test_argv_as_a_user_is_one_stage() -> None:
    argv = _argv(as_root=False)
    assert "/usr/bin/setpriv" not in argv and argv.count("/usr/bin/bwrap") == 1
    assert "/usr/bin/setpriv" not in _argv(as_root=True, run_as_uid=None, run_as_gid=None)


def test_argv_sets_every_configured_limit_before_the_worker() -> None:
    argv = _argv(as_root=False, address_space_bytes=1 << 30, max_processes=64, cpu_seconds=60, open_files=256)
    prlimit = argv.index("/usr/bin/prlimit")
    limits = argv[prlimit + 1 : argv.index("--", prlimit)]
    assert limits == ["--as=1073741824", "--nproc=64", "--fsize=1073741824", "--cpu=60", "--nofile=256"]
    assert argv[argv.index("--", prlimit) + 1] == "/venv/bin/python"
    assert "--nproc" not in " ".join(_argv(as_root=False, max_processes=None))


# --------------------------------------------------------------------------- containment (real bwrap)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Run the escaping fake worker once under bwrap; yield what it found and what the host sees."""
    base = tmp_path_factory.mktemp("probe")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    ro_dir = base / "readonly-code"
    ro_dir.mkdir()
    outside = base / "outside"
    outside.mkdir()
    usr_probe = f"/usr/rollcage-probe-{secrets.token_hex(4)}"
    root = base / "r1"
    targets = [
        root / "receipt.json",
        root / "model_capture.jsonl",
        root / "input.json",
        root / "worker.log",
        outside / "x",
        ro_dir / "x",
        Path(usr_probe),
        Path("/rollout/input.json"),
        Path("/rollout/stray-file"),
        Path("/rollout/workspace/inside"),
    ]
    os.environ[SECRET_VAR] = "sk-do-not-leak-" + secrets.token_hex(8)
    try:
        make_rollout(base, "r1")
        command = fake("probe", str(port), SECRET_VAR, *map(str, targets))
        cfg = config("bwrap", *command, api_key_env=SECRET_VAR, limits={"extra_ro_paths": [str(ro_dir)]})
        receipt = asyncio.run(supervise(root, cfg))
        findings = json.loads((root / "workspace" / "probe.json").read_text())
        yield {
            "receipt": receipt,
            "findings": findings,
            "root": root,
            "outside": outside,
            "ro_dir": ro_dir,
            "secret": os.environ[SECRET_VAR],
        }
    finally:
        del os.environ[SECRET_VAR]
        listener.close()
        if os.path.exists(usr_probe):  # only if the sandbox failed: do not leave litter in /usr
            os.unlink(usr_probe)
            pytest.fail(f"the sandbox wrote {usr_probe} on the host")


@_bwrap
def test_probe_rollout_completed(probe: dict[str, Any]) -> None:
    receipt: SupervisorReceipt = probe["receipt"]
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert receipt.cleanup_confirmed


@_bwrap
def test_agent_cannot_connect_to_a_listener_on_the_host_loopback(probe: dict[str, Any]) -> None:
    assert probe["findings"]["tcp_loopback"].startswith("refused"), probe["findings"]["tcp_loopback"]


@_bwrap
def test_agent_cannot_resolve_names_or_reach_anything_else(probe: dict[str, Any]) -> None:
    assert probe["findings"]["dns"].startswith("refused")
    assert probe["findings"]["tcp_external"].startswith("refused")


@_bwrap
def test_agent_cannot_read_the_secret_from_the_supervisors_environment(probe: dict[str, Any]) -> None:
    findings = probe["findings"]
    assert findings["secret"] is None
    assert findings["secret_in_proc"] == []
    assert probe["secret"] not in json.dumps(findings)
    # Only the sandbox's own processes are visible (bwrap's init and the worker), not the host's.
    assert len(findings["visible_pids"]) <= 3
    assert set(findings["env"]) <= {
        "PATH",
        "HOME",
        "TMPDIR",
        "PWD",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TZ",
        "ROLLCAGE_LOG_LEVEL",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        "ROLLCAGE_SUPERVISION_TOKEN",
    }


@_bwrap
def test_agent_cannot_write_receipt_or_capture_or_anything_outside_the_workspace(
    probe: dict[str, Any],
) -> None:
    writes: dict[str, str] = probe["findings"]["writes"]
    root: Path = probe["root"]
    allowed = {"/rollout/stray-file", "/rollout/workspace/inside"}
    for path, what in writes.items():
        if path not in allowed:
            assert what.startswith("refused"), (path, what)
    assert writes["/rollout/workspace/inside"].startswith("succeeded")
    # The host's view: the supervisor's artifacts are its own, nothing landed outside.
    assert SupervisorReceipt.model_validate_json((root / "receipt.json").read_bytes()) == probe["receipt"]
    assert b"pwned" not in (root / "model_capture.jsonl").read_bytes()
    assert b"pwned" not in (root / "input.json").read_bytes()
    assert list(probe["outside"].iterdir()) == [] and list(probe["ro_dir"].iterdir()) == []
    # /rollout is a staging area: what the agent leaves there never reaches the rollout directory.
    assert not (root / "stray-file").exists() and not (root / ".sandbox").exists()
    assert (root / "workspace" / "inside").read_text() == "pwned\n"


@_bwrap
def test_agent_runs_as_an_unprivileged_user(probe: dict[str, Any]) -> None:
    assert probe["findings"]["uid"] == 1000
    if os.geteuid() == 0:
        # On the host the sandbox is not root either (so RLIMIT_NPROC holds).
        assert (probe["root"] / "workspace" / "probe.json").stat().st_uid == 65534


@_bwrap
@pytest.mark.timeout(60)
async def test_fork_bomb_is_contained_by_the_process_limit(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    limit = 32
    cfg = config("bwrap", *fake("fork-bomb", str(limit * 8)), limits={"max_processes": limit})
    receipt = await supervise(root, cfg)
    forks, errno_name = (root / "workspace" / "forks.txt").read_text().split()
    assert int(forks) < limit and errno_name == "11"  # EAGAIN: the limit, not the bound of the fake
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert receipt.cleanup_confirmed
    # The supervisor's side is still healthy: it can start processes.
    proc = await asyncio.create_subprocess_exec("true")
    assert await proc.wait() == 0


@_bwrap
@pytest.mark.timeout(60)
async def test_memory_bomb_is_contained_by_the_address_space_limit(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    limit_mib = 256
    cfg = config("bwrap", *fake("memory-bomb", "2048"), limits={"address_space_bytes": limit_mib << 20})
    receipt = await supervise(root, cfg)
    allocated = int((root / "workspace" / "memory.txt").read_text())
    assert allocated < limit_mib
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert receipt.cleanup_confirmed


async def test_none_sandbox_says_loudly_that_nothing_is_contained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = make_rollout(tmp_path)
    with caplog.at_level("WARNING", logger="rollcage.supervisor"):
        receipt = await supervise(root, config("none", *fake("ok")))
    assert receipt.sandbox == "none" and receipt.outcome == "completed"
    assert "SANDBOX DISABLED" in caplog.text and "uncontained" in caplog.text


def test_none_sandbox_is_a_choice_not_a_fallback() -> None:
    assert isinstance(config("bwrap", "x").sandbox, BwrapSandbox)
    assert isinstance(config("none", "x").sandbox, NoSandbox)


@pytest.fixture
def broken_bwrap() -> Iterator[Path]:
    """A 'bwrap' that reports a version but cannot create namespaces (as a restricted host would)."""
    # Somewhere the unprivileged uid the sandbox drops to (when root) can execute it.
    scripts = Path(tempfile.mkdtemp(prefix="rc-bwrap-"))
    try:
        scripts.chmod(0o755)
        broken = scripts / "bwrap"
        broken.write_text(
            "#!/bin/sh\n"
            '[ "$1" = --version ] && echo "bubblewrap 0.8.0" && exit 0\n'
            'echo "bwrap: setting up uid map: Permission denied" >&2\n'
            "exit 1\n"
        )
        broken.chmod(0o755)
        yield broken
    finally:
        shutil.rmtree(scripts)


async def test_a_bubblewrap_that_cannot_create_namespaces_is_refused_before_anything_is_written(
    tmp_path: Path, broken_bwrap: Path
) -> None:
    root = make_rollout(tmp_path)
    cfg = config("bwrap", *fake("ok"), limits={"bwrap_path": str(broken_bwrap)})
    with pytest.raises(SandboxError, match=r"cannot create a sandbox here.*uid map.*--sandbox none"):
        await supervise(root, cfg)
    assert sorted(p.name for p in root.iterdir()) == ["input.json", "workspace"]
