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
import subprocess
import sys
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer

from rollcage.budgets import copy_tree, detect_cgroups, planned_mechanisms
from rollcage.cage import (
    CAGE_ENV,
    PYTHON,
    Bind,
    CageSpec,
    ContainedRun,
    NestedCage,
    RunLimits,
    Tmpfs,
    cage_argv,
    run_contained,
)
from rollcage.commands._config_options import parse_size
from rollcage.commands._sandbox_options import ExecutorCageChoice, bwrap_fields
from rollcage.environments import create_app
from rollcage.errors import SandboxError
from rollcage.procs import ensure_subreaper
from rollcage.protocol import BudgetName, ExecutorSettings, SupervisorReceipt
from rollcage.supervisor import (
    BwrapSandbox,
    NoSandbox,
    OutcomeEvidence,
    RolloutLayout,
    classify_outcome,
    supervise,
)
from rollcage.supervisor.sandbox import BwrapTools, bwrap_argv
from rollcage.tools import make_executor
from tests.helpers.supervisor_env import (
    HELPERS,
    config,
    fake,
    make_rollout,
    processes_with_token,
    requires_bwrap,
)
from tests.helpers.waiting import processes_mentioning, wait_for


def _bwrap(test: Any) -> Any:
    """Mark a test that needs a working bubblewrap."""
    return pytest.mark.bwrap(requires_bwrap()(test))


SECRET_VAR = "ROLLCAGE_TEST_SECRET_KEY"
TOOLS = BwrapTools(
    bwrap="/usr/bin/bwrap", prlimit="/usr/bin/prlimit", setpriv="/usr/bin/setpriv", disable_userns=True
)


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
        "/dev/shm",
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


def test_argv_as_a_user_seals_the_root_and_dev_once_the_tree_is_built() -> None:
    # One stage: the root, /run and /dev are tmpfs owned by the user the cage's uid maps to. Left
    # writable, a cell filled /dev with 1.5 GiB and 20,000 files and no budget saw it (issue 36).
    argv = _argv(as_root=False)
    runtime = argv.index("--chdir")
    assert argv[runtime - 4 : runtime] == ["--remount-ro", "/dev", "--remount-ro", "/"]
    building = argv[: runtime - 4]
    assert "--dev" in building and "/dev/shm" in building and "--proc" in building
    assert "--remount-ro" not in building


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
        "ROLLCAGE_EXECUTOR_CAGE",
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
async def test_fork_bomb_is_contained_by_the_process_budget(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    limit = 32
    cfg = config("bwrap", *fake("fork-bomb", str(limit * 8)), limits={"max_processes": limit})
    receipt = await supervise(root, cfg)
    forks, errno_name = (root / "workspace" / "forks.txt").read_text().split()
    assert int(forks) < limit and errno_name == "11"  # EAGAIN: the limit, not the bound of the fake
    budget = {use.budget: use for use in receipt.budgets}["processes"]
    if budget.mechanism == "rlimit":  # no cgroup here: RLIMIT_NPROC refused, nothing saw it
        assert receipt.outcome == "completed", receipt.outcome_reason
    else:
        assert receipt.outcome == "agent_error" and receipt.budget_exceeded == "processes"
        assert "process budget of 32" in receipt.outcome_reason and budget.exceeded
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


# --------------------------------------------------------------------------- the cage's command lines (pure)


def test_only_the_worker_that_cages_its_executor_may_make_a_user_namespace() -> None:
    assert "--disable-userns" not in _argv(as_root=False)  # executor_cage: bwrap (the default)
    assert "--disable-userns" in _argv(as_root=False, executor_cage="shared")
    inner = _argv(as_root=True, executor_cage="shared")
    assert "--disable-userns" in inner[inner.index("/usr/bin/setpriv") :]


def test_nested_cage_hides_the_workers_files_and_keeps_the_workspace() -> None:
    cage = NestedCage(
        bwrap="/usr/bin/bwrap", workspace="/rollout/workspace", hide=("/rollout", "/run/rollcage")
    )
    argv = cage.prefix()
    bwrap = argv[argv.index("/usr/bin/bwrap") :]
    for flag in ("--disable-userns", "--unshare-pid", "--unshare-net", "--die-with-parent"):
        assert flag in bwrap, flag
    hidden = [bwrap[i + 1] for i, arg in enumerate(bwrap) if arg == "--tmpfs"]
    assert hidden == ["/rollout", "/run/rollcage"]
    # The workspace is bound back after the cover, then the cover is sealed read-only.
    assert bwrap.index("/rollout/workspace") > bwrap.index("/run/rollcage")
    assert _pairs(bwrap, "--bind")[0] == ("/rollout/workspace", "/rollout/workspace")
    assert [bwrap[i + 1] for i, arg in enumerate(bwrap) if arg == "--remount-ro"] == [
        "/rollout",
        "/run/rollcage",
    ]
    # The interrupt (SIGINT to the group) must not kill bwrap's monitor: it starts with SIGINT ignored.
    assert argv[:3] == ["/bin/sh", "-c", 'trap "" INT; exec "$@"']


def test_nested_cage_refuses_to_hide_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CAGE_ENV, "bwrap")
    with pytest.raises(SandboxError, match="cannot hide"):
        NestedCage.from_environment(workspace="/w", worker_paths=["/result.json"])
    monkeypatch.setenv(CAGE_ENV, "none")
    assert NestedCage.from_environment(workspace="/w", worker_paths=["/result.json"]) is None


def test_a_grader_cage_is_never_root_and_sees_no_host_tree() -> None:
    spec = CageSpec(
        argv=["/usr/bin/python3", "-I", "-S", "x.py"],
        env={"PATH": "/usr/bin"},
        cwd="/work",
        mounts=[Bind("/usr", "/usr"), Tmpfs("/work", 1 << 20)],
        run_as=(65534, 65534),
    )
    argv = cage_argv(spec, tools=TOOLS, as_root=True)
    setpriv = argv.index("/usr/bin/setpriv")
    outer, inner = argv[:setpriv], argv[setpriv:]
    # Root drops to an unprivileged uid before the user namespace is made: uid 0 inside is never host root.
    assert inner[1:3] == ["--reuid", "65534"] and "--unshare-user" in inner and "--unshare-user" not in outer
    assert "--disable-userns" in inner and "--unshare-net" in inner
    assert [dest for _, dest in _pairs(outer, "--ro-bind")] == ["/usr"]
    assert ("/", "/") not in _pairs(outer, "--ro-bind") + _pairs(outer, "--bind")


def test_a_host_environment_under_tmp_is_mounted_over_the_scratch_tmp() -> None:
    # A harness's virtualenv (or rollcage's own) may live under /tmp: the cage's /tmp is a fresh one, so
    # the path must be mounted over it, with parents the unprivileged uid can traverse.
    spec = CageSpec(
        argv=["/tmp/envs/nooa/bin/python"],
        env={},
        cwd="/",
        mounts=[Bind("/usr", "/usr"), Bind("/usr/lib", "/usr/lib"), Bind("/tmp/envs/nooa", "/tmp/envs/nooa")],
        tmp=Tmpfs("/tmp", 1 << 20),
    )
    argv = cage_argv(spec, tools=TOOLS, as_root=False)
    assert [dest for _, dest in _pairs(argv, "--ro-bind")] == ["/usr", "/tmp/envs/nooa"]
    made = argv.index("/tmp/envs")
    assert argv[made - 3 : made] == ["--perms", "0755", "--dir"]


# --------------------------------------------------------------------------- run_contained (graders' cage)


@_bwrap
async def test_run_contained_runs_the_files_given_and_nothing_of_the_host(tmp_path: Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("do-not-read")
    code = (
        "import os\n"
        "print(open('data/in.txt').read(), os.getuid(), sorted(os.listdir('/')))\n"
        f"print(os.path.exists({str(secret)!r}), os.path.exists('/etc'), os.path.exists('/home'))\n"
        "print('x' * 5000)\n"
    )
    run: ContainedRun = await run_contained(
        [PYTHON, "-I", "-S", "-c", code],
        files={"data/in.txt": "hello"},
        timeout_s=30,
        limits=RunLimits(output_limit=200),
    )
    assert run.exit_code == 0 and run.contained and not run.timed_out, run
    first, second = run.stdout.decode().splitlines()[:2]
    assert first.startswith("hello 1000 ") and "'work'" in first and "'home'" not in first
    assert second == "False False False"
    assert run.truncated and len(run.stdout) <= 200


@_bwrap
async def test_run_contained_kills_the_whole_cage_at_the_timeout(tmp_path: Path) -> None:
    marker = f"rollcage-contained-{secrets.token_hex(4)}"
    code = f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)  # {marker}\n"
    code += "time.sleep(600)"
    run = await run_contained([PYTHON, "-I", "-S", "-c", code], timeout_s=1)
    assert run.timed_out and run.exit_code is None
    assert processes_mentioning(marker) == []


async def test_run_contained_refuses_without_bubblewrap_unless_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(**_: Any) -> BwrapTools:
        raise SandboxError("bubblewrap (bwrap) is not installed")

    monkeypatch.setattr("rollcage.cage._run_contained.find_tools", missing)
    with pytest.raises(SandboxError, match="not installed"):
        await run_contained([PYTHON, "-I", "-S", "-c", "print(1)"], timeout_s=10)
    run = await run_contained([PYTHON, "-I", "-S", "-c", "print(1)"], timeout_s=10, allow_uncontained=True)
    assert run.stdout == b"1\n" and not run.contained


async def test_a_cage_that_cannot_be_made_is_an_error_not_the_commands_failure(
    monkeypatch: pytest.MonkeyPatch, broken_bwrap: Path
) -> None:
    tools = BwrapTools(bwrap=str(broken_bwrap), prlimit="/usr/bin/prlimit", setpriv="/usr/bin/setpriv")
    monkeypatch.setattr("rollcage.cage._run_contained.find_tools", lambda **_: tools)
    with pytest.raises(SandboxError, match=r"could not be made.*uid map"):
        await run_contained([PYTHON, "-I", "-S", "-c", "print(1)"], timeout_s=10)


async def test_code_fn_answers_a_grader_error_when_its_cage_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    async def failing(*_: Any, **__: Any) -> Any:
        raise SandboxError("bubblewrap cannot create a sandbox here")

    monkeypatch.setattr("rollcage.environments.code_fn.run_contained", failing)
    app = create_app("code-fn", verify_token="t")
    body = {
        "expected": {"tests": [{"call": "f()", "expect": "1"}]},
        "workspace_files": {"solution.py": "def f():\n    return 1\n"},
    }
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://env") as client:
        answer = await client.post("/verify", json=body, headers={"authorization": "Bearer t"})
    assert answer.status_code == 503 and "cannot create a sandbox" in answer.json()["error"]
    assert "reward" not in answer.json()


# --------------------------------------------------------------------------- budgets


@_bwrap
@pytest.mark.timeout(60)
@pytest.mark.parametrize("disk", ["auto", "poll"])
async def test_workspace_budget_ends_the_rollout_as_the_policys_fault(tmp_path: Path, disk: str) -> None:
    root = make_rollout(tmp_path)
    limits = {"workspace_bytes": 4 << 20, "disk_budgets": disk, "budget_poll_s": 0.1}
    receipt = await supervise(
        root, config("bwrap", *fake("fill", "/rollout/workspace/fill.bin", "32"), limits=limits)
    )
    assert receipt.outcome == "agent_error" and receipt.budget_exceeded == "workspace_bytes", (
        receipt.outcome_reason
    )
    use = {u.budget: u for u in receipt.budgets}["workspace_bytes"]
    assert use.exceeded and use.limit == 4 << 20
    assert use.mechanism == ("tmpfs" if disk == "auto" and os.geteuid() == 0 else "poll")
    # The workspace stays on the host as evidence; a hard bound kept it at the budget.
    size = (root / "workspace" / "fill.bin").stat().st_size
    assert size > 0 and (size <= 4 << 20 or use.mechanism == "poll")


@_bwrap
@pytest.mark.timeout(60)
@pytest.mark.parametrize("disk", ["auto", "poll"])
async def test_tmp_budget_ends_the_rollout(tmp_path: Path, disk: str) -> None:
    root = make_rollout(tmp_path)
    limits = {"tmp_size_bytes": 4 << 20, "budget_poll_s": 0.1, "disk_budgets": disk}
    # The worker stays: with a poll, the budget is seen while the sandbox lives (then it is ended).
    receipt = await supervise(root, config("bwrap", *fake("fill-hang", "/tmp/fill.bin", "32"), limits=limits))
    assert receipt.outcome == "agent_error" and receipt.budget_exceeded == "tmp_bytes", receipt.outcome_reason
    uses = {u.budget: u for u in receipt.budgets}
    assert uses["tmp_bytes"].mechanism == "tmpfs" and uses["tmp_bytes"].peak == 4 << 20
    assert uses["tmp_inodes"].mechanism == ("tmpfs" if disk == "auto" and os.geteuid() == 0 else "poll")
    assert not list(root.glob(".sandbox")), "the staging area outlived the rollout"


@_bwrap
def test_every_budget_is_in_the_receipt_with_its_mechanism(probe: dict[str, Any]) -> None:
    receipt: SupervisorReceipt = probe["receipt"]
    assert [use.budget for use in receipt.budgets] == list(typing.get_args(BudgetName))
    assert all(use.mechanism != "none" and not use.exceeded for use in receipt.budgets)
    assert receipt.budget_exceeded is None


@_bwrap
def test_the_mechanisms_planned_before_the_run_are_the_receipts(probe: dict[str, Any]) -> None:
    # What a run names as weak at its start (and refuses under require_budgets) is what a rollout gets.
    receipt: SupervisorReceipt = probe["receipt"]
    config = BwrapSandbox()
    assert {use.budget: use.mechanism for use in receipt.budgets} == planned_mechanisms(config)


def test_budget_breach_is_the_policys_fault_only_after_it_acted() -> None:
    words = "workspace_bytes: the workspace_bytes budget of 1 GiB was exhausted"
    acted = OutcomeEvidence(
        budget_exceeded=words, journal_responses=1, exit_signal="SIGKILL", signals_sent=("SIGKILL",)
    )
    assert classify_outcome(acted)[0] == "agent_error"
    assert "workspace_bytes" in classify_outcome(acted)[1]
    # The kernel's OOM kill of the worker for the memory budget is the agent's doing, not infrastructure.
    oom = OutcomeEvidence(budget_exceeded="memory_bytes: ...", journal_responses=2, exit_signal="SIGKILL")
    assert classify_outcome(oom)[0] == "agent_error"
    before = OutcomeEvidence(budget_exceeded=words, journal_responses=0)
    assert classify_outcome(before)[0] == "infra_failure"


def test_copy_tree_never_follows_a_link_and_keeps_to_its_bounds(tmp_path: Path) -> None:
    source, dest = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    dest.mkdir()
    (source / "link").symlink_to("/etc/passwd")
    (source / "big").write_bytes(b"x" * 4096)
    os.link(source / "big", source / "big-again")
    (source / "suid").write_text("x")
    (source / "suid").chmod(0o4755)
    os.mkfifo(source / "fifo")
    (source / "sub").mkdir()
    (source / "sub" / "a").write_text("a")
    report = copy_tree(source, dest, max_bytes=4096 + 1, max_inodes=100)
    assert os.readlink(dest / "link") == "/etc/passwd"  # the link, not the host file it names
    assert os.stat(dest / "big").st_ino == os.stat(dest / "big-again").st_ino  # one file, copied once
    assert (dest / "suid").stat().st_mode & 0o7777 == 0o755
    assert not (dest / "fifo").exists() and any("fifo" in s for s in report.skipped)
    # The byte bound: big (4096) fits, then "sub/a" (1 byte) fits, "suid" (1 more) does not.
    assert report.bytes <= 4096 + 1 and any("bound" in s for s in report.skipped)
    small = tmp_path / "small"
    small.mkdir()
    assert len(copy_tree(source, small, max_bytes=1 << 20, max_inodes=2).skipped) >= 3


def test_budget_flags_are_the_config_fields() -> None:
    assert (
        parse_size("512M") == 512 << 20 and parse_size("4GiB") == 4 << 30 and parse_size("1048576") == 1 << 20
    )
    with pytest.raises(typer.BadParameter, match="not a size"):
        parse_size("lots")
    flags = {
        "memory_budget": "1G",
        "max_processes": 64,
        "workspace_budget": "8M",
        "shm_inodes": 500,
        "cgroups": "off",
        "executor_cage": ExecutorCageChoice.shared,
        "tmp_budget": None,
        "unrelated": "ignored",
    }
    fields = bwrap_fields(flags, sandbox="bwrap")
    sandbox = BwrapSandbox(**fields)
    assert (sandbox.memory_bytes, sandbox.max_processes, sandbox.workspace_bytes) == (1 << 30, 64, 8 << 20)
    assert (sandbox.shm_inodes, sandbox.cgroups, sandbox.executor_cage) == (500, "off", "shared")
    assert sandbox.tmp_size_bytes == BwrapSandbox().tmp_size_bytes  # flags left out keep the defaults


async def test_an_executor_cage_that_cannot_be_made_is_the_infrastructures_failure(
    tmp_path: Path, broken_bwrap: Path
) -> None:
    cage = NestedCage(bwrap=str(broken_bwrap), workspace=str(tmp_path), hide=("/nonexistent-rollout",))
    executor = make_executor(ExecutorSettings(), cwd=tmp_path, prefix=cage.prefix(), start_timeout_s=30)
    try:
        with pytest.raises(SandboxError, match="executor's sandbox could not be made") as caught:
            await executor.start()
        assert caught.value.kind == "transient"  # retried, never the agent's fault
    finally:
        await executor.aclose()


@_bwrap
@pytest.mark.timeout(90)
def test_what_a_killed_supervisor_left_is_released_by_the_next_one(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("optional: only root mounts bounded file systems (and can leave them behind)")
    ensure_subreaper()
    root = make_rollout(tmp_path)
    kept = root / "workspace" / "kept.bin"
    worker = " ".join(fake("fill-hang", "/rollout/workspace/kept.bin", "1"))
    argv = [sys.executable, "-m", "rollcage", "supervise", str(root), "--worker-command", worker]
    proc = subprocess.Popen(
        [*argv, "--ro-path", str(HELPERS)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_for(lambda: kept.exists() and kept.stat().st_size == 1 << 20, what="the worker's file")
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: not processes_with_token(), what="the sandbox to die with its supervisor")
    assert os.path.ismount(root / "workspace"), "the test needs a supervisor that left its mounts"
    # Its records may be gone too (a half-done cleanup removed the staging area): the mounts' names say.
    shutil.rmtree(root / ".sandbox")
    mine = f"rollcage-{proc.pid}."
    support = detect_cgroups()
    parents = [found[1] for found in (support.memory, support.pids) if found is not None]
    # Another supervisor (a fresh process: the sweep runs once per process) releases them.
    sweep = "from rollcage.budgets import sweep_orphans; sweep_orphans()"
    subprocess.run([sys.executable, "-c", sweep], check=True, timeout=60)
    assert not os.path.ismount(root / "workspace")
    assert kept.stat().st_size == 1 << 20  # the agent's files, kept on the disk as evidence
    with open("/proc/self/mountinfo", encoding="utf-8") as file:
        assert f"-{proc.pid}." not in file.read(), "a mount of the killed supervisor is left"
    assert not [c for parent in parents for c in parent.iterdir() if c.name.startswith(mine)]
