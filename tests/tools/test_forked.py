"""The warm template's side of forked executors (``rollcage.tools._forked.TemplateLink``), without a cage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollcage.cage import Limits
from rollcage.tools import _forked


def test_an_executor_template_that_keeps_dying_is_started_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One that dies at once would otherwise cost every worker's start an interpreter's start.
    dying = tmp_path / "dies.py"
    dying.write_text("raise SystemExit(1)\n")
    monkeypatch.setattr(_forked, "PROGRAM", dying)
    spawned: list[int] = []
    real_spawn = _forked.spawn

    def spawn(*args: object, **kwargs: object) -> int:
        pid = real_spawn(*args, **kwargs)  # type: ignore[arg-type]
        spawned.append(pid)
        return pid

    monkeypatch.setattr(_forked, "spawn", spawn)
    link = _forked.TemplateLink()
    try:
        for _ in range(_forked.MAX_STARTS + 4):
            fd = link.attach(uid=65534, gid=65534, limits=Limits(), umask=0o022, cgroups=[], env={})
            if fd >= 0:
                os.close(fd)
            if link._process is not None:  # let it die before the next start looks
                os.waitid(os.P_PID, link._process.pid, os.WEXITED | os.WNOWAIT)
    finally:
        link.stop()
    assert len(spawned) == _forked.MAX_STARTS
