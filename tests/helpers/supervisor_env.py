"""Shared set-up for the supervisor, sandbox and proxy tests: rollout directories, fake workers, bwrap."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from rollcage.supervisor import BwrapSandbox, NoSandbox, SupervisorConfig

__all__ = [
    "HELPERS",
    "bwrap_usable",
    "config",
    "fake",
    "make_rollout",
    "processes_with_token",
    "requires_bwrap",
]

HELPERS = Path(__file__).resolve().parent
FAKE_WORKER = HELPERS / "fake_worker.py"


def fake(mode: str, *args: str) -> list[str]:
    """The command line of the fake worker in ``mode``."""
    return [sys.executable, str(FAKE_WORKER), mode, *args]


@functools.cache
def bwrap_usable() -> str | None:
    """``None`` if the supervisor can sandbox here (the launcher's own check); otherwise why not."""
    from rollcage.errors import SandboxError

    try:
        BwrapSandbox().launcher().check()
    except SandboxError as exc:
        return str(exc)
    return None


def requires_bwrap() -> pytest.MarkDecorator:
    """Skip (saying why) where bubblewrap cannot run; ROLLCAGE_REQUIRE_BWRAP=1 makes that a failure."""
    reason = bwrap_usable()
    if reason is not None and os.environ.get("ROLLCAGE_REQUIRE_BWRAP") == "1":
        pytest.fail(f"ROLLCAGE_REQUIRE_BWRAP=1 but {reason}")
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def make_rollout(
    parent: Path,
    name: str = "r1",
    *,
    model_url: str = "http://127.0.0.1:9/v1",
    resources: dict[str, str] | None = None,
    **extra: Any,
) -> Path:
    """A prepared rollout directory: ``input.json`` and an empty ``workspace/``."""
    root = parent / name
    root.mkdir(parents=True)
    (root / "workspace").mkdir()
    data: dict[str, Any] = {
        "rollout_id": name,
        "task_id": "t",
        "input": "hi",
        "model": {"base_url": model_url, "model": "m", "max_retries": 0},
        "resources": {key: {"base_url": url} for key, url in (resources or {}).items()},
        **extra,
    }
    (root / "input.json").write_text(json.dumps(data))
    return root


def config(sandbox: str, *command: str, **fields: Any) -> SupervisorConfig:
    """A SupervisorConfig running ``command`` under ``sandbox`` (bwrap sees the test helpers, read-only)."""
    limits = dict(fields.pop("limits", {}))
    limits["extra_ro_paths"] = [str(HELPERS), *limits.get("extra_ro_paths", [])]
    box = BwrapSandbox(**limits) if sandbox == "bwrap" else NoSandbox()
    fields.setdefault("deadline_s", 20)
    fields.setdefault("grace_s", 2)
    return SupervisorConfig(sandbox=box, worker_command=list(command), **fields)


def processes_with_token(token_prefix: str = "ROLLCAGE_SUPERVISION_TOKEN=") -> list[int]:
    """PIDs of live processes under this one that carry a supervision token in their environment.

    Only this process's descendants count: strays from a supervise() call here are reparented to
    it (a child subreaper), while other people's rollouts on the same machine are not.
    """
    from rollcage.procs import descendants, scan_processes

    table = scan_processes()
    me = os.getpid()
    found = []
    for info in descendants(table, [child.pid for child in table.values() if child.ppid == me], marked=None):
        try:
            with open(f"/proc/{info.pid}/environ", "rb") as file:
                env = file.read()
        except OSError:
            continue
        if token_prefix.encode() in env and info.alive:
            found.append(info.pid)
    return found


def gone_mount_source() -> str:
    """A tmpfs source naming a supervisor that is gone (PID 1 never started that late), in this namespace."""
    pidns = os.stat("/proc/thread-self/ns/pid").st_ino
    mntns = os.stat("/proc/thread-self/ns/mnt").st_ino
    return f"rollcage-1.999999999.{pidns}-m{mntns}"
