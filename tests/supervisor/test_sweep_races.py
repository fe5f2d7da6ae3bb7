"""A killed supervisor's workspace survives every sweeper: concurrent ones, and ones in other namespaces.

Every rollcage process sweeps at its start what supervisors that are gone left
(``sweep_orphans``), and a resuming controller releases its interrupted rollouts'
leftovers (``kill_leftovers``). These tests start such processes, in the host and in
private mount (and PID) namespaces, around real supervisors' SIGKILLs, and check that
every workspace ends byte for byte what the agent wrote, and that nothing of a live
rollout, or a copy of a mount seen from elsewhere, is ever taken for a leftover.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollcage.procs import ensure_subreaper
from tests.helpers.fake_worker import PREPARED, agent_tree
from tests.helpers.supervisor_env import HELPERS, fake, make_rollout, processes_with_token, requires_bwrap
from tests.helpers.waiting import wait_for

pytestmark = [requires_bwrap(), pytest.mark.bwrap]

SWEEP = "from rollcage.budgets import sweep_orphans; sweep_orphans()"
"""What every rollcage process does at its start."""
RELEASE = (
    "import sys; from rollcage.supervisor import kill_leftovers; [kill_leftovers(p) for p in sys.argv[1:]]"
)
"""What a controller resuming a run does for the rollouts its killed predecessor left."""
HELD_SWEEP = f"import sys; sys.stdin.readline(); {SWEEP}; print('swept', flush=True)"
"""A process that enters its namespace now and sweeps when told (a line on its stdin)."""
NAMESPACES = {
    "host": [],
    "mount": ["unshare", "-m", "--propagation", "private"],
    "mount+pid": ["unshare", "-m", "-p", "--fork", "--mount-proc", "--propagation", "private"],
}
"""Where a rollcage process runs: the host's namespaces, a private mount namespace, and a PID one too."""


@pytest.fixture(autouse=True)
def _root_with_unshare() -> None:
    if os.geteuid() != 0:
        pytest.skip("only root mounts bounded workspaces (and can leave them behind)")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) (util-linux)")
    ensure_subreaper()


@dataclass
class Rollout:
    """A rollout under a real supervisor whose worker writes ``agent_tree(seed, count)``."""

    root: Path
    seed: int
    count: int
    supervisor: subprocess.Popen[bytes] | None = None

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    def start(self, mode: str = "tree-hang") -> None:
        for name, data in PREPARED.items():
            (self.workspace / name).write_bytes(data)
        worker = " ".join(fake(mode, str(self.seed), str(self.count)))
        argv = [sys.executable, "-m", "rollcage", "supervise", str(self.root), "--worker-command", worker]
        with open(self.root.parent / f"{self.root.name}.log", "wb") as log:
            self.supervisor = subprocess.Popen([*argv, "--ro-path", str(HELPERS)], stdout=log, stderr=log)

    def written(self) -> bool:
        assert self.supervisor is not None
        if self.supervisor.poll() is not None and not (self.workspace / "all-written").exists():
            raise AssertionError(f"the supervisor of {self.root.name} ended early: {self.log()}")
        return (self.workspace / "all-written").exists()

    def log(self) -> str:
        return (self.root.parent / f"{self.root.name}.log").read_text(errors="replace")[-2000:]

    def tree(self) -> dict[str, bytes]:
        found = {}
        for directory, _, files in os.walk(self.workspace):
            for name in files:
                path = Path(directory, name)
                found[str(path.relative_to(self.workspace))] = path.read_bytes()
        return found

    def assert_kept(self) -> None:
        """The workspace is on the disk, unmounted, byte for byte the agent's, and no settle is left over."""
        assert not os.path.ismount(self.workspace), f"{self.workspace} is still mounted"
        found, expected = self.tree(), agent_tree(self.seed, self.count)
        missing = sorted(set(expected) - set(found))
        wrong = sorted(name for name in expected.keys() & found.keys() if found[name] != expected[name])
        extra = sorted(set(found) - set(expected))
        assert not (missing or wrong or extra), (
            f"{self.root.name}: {len(missing)} missing (e.g. {missing[:3]}), {len(wrong)} differ "
            f"(e.g. {wrong[:3]}), {len(extra)} extra (e.g. {extra[:3]})"
        )
        staging = self.root / ".sandbox"
        if staging.is_dir():
            assert not [p.name for p in staging.iterdir() if p.name.startswith("workspace-")]


def rollcage_process(
    code: str, namespace: str, *args: str, stdin: int | None = None
) -> subprocess.Popen[str]:
    """A fresh Python process that does what a rollcage process does at its start, in ``namespace``."""
    argv = [*NAMESPACES[namespace], sys.executable, "-c", code, *args]
    return subprocess.Popen(
        argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/"
    )


def finish(proc: subprocess.Popen[str], what: str) -> None:
    """Wait for ``proc`` (bounded); fail with its output if it failed."""
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{what} did not end within 180 s") from None
    assert proc.returncode in (0, -9), f"{what} failed ({proc.returncode}): {output[-2000:]}"


@contextlib.contextmanager
def stopped_at_exit(procs: list[subprocess.Popen[bytes]] | list[subprocess.Popen[str]]) -> Iterator[None]:
    """Every process started here is killed and reaped, even when the test fails."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(Exception):
                proc.communicate(timeout=60)
        wait_for(lambda: not processes_with_token(), what="the sandboxes to die with their supervisors")


def kill_supervisor(rollout: Rollout) -> None:
    assert rollout.supervisor is not None
    rollout.supervisor.kill()
    rollout.supervisor.wait()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rollcage_processes_started_around_supervisor_kills_keep_every_workspace(tmp_path: Path) -> None:
    """A seeded campaign: 1-3 killed rollouts, 1-5 rollcage processes at random moments and places."""
    rng = random.Random(36)
    for trial in range(5):
        _trial(tmp_path / f"trial{trial}", rng)


def _trial(parent: Path, rng: random.Random) -> None:
    rollouts = [
        Rollout(make_rollout(parent, f"r{i}"), seed=rng.randrange(1000), count=rng.choice([300, 1500]))
        for i in range(rng.randint(1, 3))
    ]
    plan = [
        (
            rng.choice(["sweep", "sweep", "release", "killed sweep"]),
            rng.choice(list(NAMESPACES)),
            rng.choice(["alive", "at the kill", "after"]),
        )
        for _ in range(rng.randint(1, 5))
    ]
    procs: list[subprocess.Popen[str]] = []
    supervisors: list[subprocess.Popen[bytes]] = []
    with stopped_at_exit(procs), stopped_at_exit(supervisors):
        for rollout in rollouts:
            rollout.start()
            assert rollout.supervisor is not None
            supervisors.append(rollout.supervisor)
        for rollout in rollouts:
            wait_for(rollout.written, timeout=120, what=f"the agent's files in {rollout.root.name}")
        for kind, namespace, phase in plan:
            if phase == "alive" and kind != "release":  # a controller releases only what a killed one left
                _start(procs, rollouts, rng, kind, namespace)
        for rollout in rollouts:
            for kind, namespace, phase in plan:
                if phase == "at the kill" and rng.random() < 0.5:
                    _start(procs, rollouts, rng, kind, namespace)
            time.sleep(rng.uniform(0, 0.1))  # jitter: where the kill falls among the starts, not a wait
            kill_supervisor(rollout)
        for kind, namespace, phase in plan:
            if phase == "after" or (phase == "alive" and kind == "release"):
                _start(procs, rollouts, rng, kind, namespace)
        for index, proc in enumerate(procs):
            finish(proc, f"rollcage process {index} of {parent.name} ({plan})")
        # A last process in the host: whatever every other one left to another is released now, once
        # the killed supervisors' sandboxes are gone (a sweep leaves a mount whose rollout still has a
        # process to the next sweep: under load the dying ones could outlast the campaign's sweeps).
        wait_for(lambda: not processes_with_token(), what="the sandboxes to die with their supervisors")
        finish(rollcage_process(SWEEP, "host"), "the last sweep")
    for rollout in rollouts:
        rollout.assert_kept()


def _start(
    procs: list[subprocess.Popen[str]], rollouts: list[Rollout], rng: random.Random, kind: str, namespace: str
) -> None:
    """Start one rollcage process of ``kind`` in ``namespace``; a ``killed sweep`` is SIGKILLed at random."""
    if kind == "release":
        procs.append(rollcage_process(RELEASE, namespace, *(str(r.root) for r in rollouts)))
        return
    procs.append(rollcage_process(SWEEP, namespace))
    if kind == "killed sweep":
        time.sleep(rng.uniform(0, 0.3))  # jitter: a random moment of its sweep, not a wait
        procs[-1].kill()


def test_a_sweeper_in_other_namespaces_leaves_a_live_rollouts_workspace_alone(tmp_path: Path) -> None:
    """Neither a copy of a live mount (``unshare -m``) nor a maker's PID it cannot see is a leftover."""
    rollout = Rollout(make_rollout(tmp_path), seed=1, count=300)
    procs: list[subprocess.Popen[bytes]] = []
    with stopped_at_exit(procs):
        rollout.start()
        assert rollout.supervisor is not None
        procs.append(rollout.supervisor)
        wait_for(rollout.written, timeout=120, what="the agent's files")
        mounted = os.stat(rollout.workspace).st_dev
        for namespace in ("mount", "mount+pid"):
            finish(rollcage_process(SWEEP, namespace), f"a sweep in a {namespace} namespace")
        # The live rollout's mount is where it was, and its files in it.
        assert os.path.ismount(rollout.workspace) and os.stat(rollout.workspace).st_dev == mounted
        assert rollout.tree() == agent_tree(1, 300)
        kill_supervisor(rollout)
        finish(rollcage_process(SWEEP, "host"), "the sweep after the kill")
    rollout.assert_kept()


def test_a_stale_copy_of_a_mount_is_never_copied_back_over_the_workspace(tmp_path: Path) -> None:
    """A process that entered a private mount namespace while a rollout ran holds a copy of its mount.

    The supervisor copies the workspace back and ends; the workspace moves on (here, a file
    is written into it, as a grader might). The copy's maker is gone, but the copy is not
    a leftover of this namespace: the workspace stays as it is on the disk.
    """
    rollout = Rollout(make_rollout(tmp_path), seed=2, count=300)
    procs: list[subprocess.Popen[bytes]] = []
    held: list[subprocess.Popen[str]] = []
    with stopped_at_exit(procs), stopped_at_exit(held):
        rollout.start("tree")
        assert rollout.supervisor is not None
        procs.append(rollout.supervisor)
        wait_for(rollout.written, timeout=120, what="the agent's files")
        for namespace in ("mount", "mount+pid"):
            held.append(rollcage_process(HELD_SWEEP, namespace, stdin=subprocess.PIPE))
        # Each has its copy of the mount once it runs Python (unshare is done by then).
        for proc in held:
            wait_for(lambda proc=proc: _runs_python(proc), what="the held process to enter its namespace")
        assert rollout.supervisor.wait(timeout=120) == 0, rollout.log()
        after = {**agent_tree(2, 300), "graded.txt": b"written after the rollout ended"}
        (rollout.workspace / "graded.txt").write_bytes(after["graded.txt"])
        for proc in held:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            finish(proc, "the held sweep")
    assert not os.path.ismount(rollout.workspace)
    assert rollout.tree() == after


def _runs_python(proc: subprocess.Popen[str]) -> bool:
    """``proc`` (or, under ``unshare --fork``, its child) runs this Python: its namespaces are made."""
    for pid in [proc.pid, *_children(proc.pid)]:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/exe") == os.path.realpath(sys.executable):
                return True
    if proc.poll() is not None:
        raise AssertionError(f"the held process ended: {proc.communicate()[0]}")
    return False


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(child) for child in file.read().split()]
    except OSError:
        return []
