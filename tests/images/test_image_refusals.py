"""Image rollouts refused up front where they cannot run: one line, naming the row, nothing run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollcage.controller import Controller, RunConfig
from rollcage.errors import ConfigError, SandboxError
from rollcage.protocol import ImageSandbox
from rollcage.supervisor.imageroot import mount_image_root


def _config(tmp_path: Path, **run: object) -> RunConfig:
    image = tmp_path / "root"
    image.mkdir(parents=True)
    rows = [{"id": "plain", "input": "x", "tools": []}, {"id": "imaged", "input": "x", "tools": []}]
    rows[1]["sandbox"] = {"image": f"dir:{image}"}
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return RunConfig(dataset=dataset, out=tmp_path / "out", **run)  # type: ignore[arg-type]


def test_a_task_image_without_root_is_refused_naming_the_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, sandbox="none")
    with pytest.raises(ConfigError, match=r"line 2 \(task imaged\).*bwrap sandbox"):
        asyncio.run(Controller(config).run())
    if os.geteuid() == 0:  # as any other user, as a user would meet it
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError) as refused:
        asyncio.run(Controller(_config(tmp_path / "b")).run())
    message = str(refused.value)
    assert "line 2 (task imaged)" in message and "root" in message and "\n" not in message
    assert not (tmp_path / "b" / "out" / "rollouts").exists()


def test_the_jupyter_executor_in_a_task_image_is_refused_naming_the_row(tmp_path: Path) -> None:
    config = _config(tmp_path)
    rows = [json.loads(line) for line in config.dataset.read_text().splitlines()]  # type: ignore[union-attr]
    rows[1].update(tools=["python"], executor={"backend": "jupyter"})
    config.dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))  # type: ignore[union-attr]
    if os.geteuid() != 0:
        pytest.skip("refused for want of root first")
    with pytest.raises(ConfigError, match=r"line 2 \(task imaged\): the jupyter executor cannot run"):
        asyncio.run(Controller(config).run())


def test_the_supervisor_refuses_to_mount_an_image_root_without_root(tmp_path: Path) -> None:
    image = ImageSandbox(ref=f"dir:{tmp_path}", root=str(tmp_path))
    with pytest.raises(SandboxError, match="needs a supervisor running as root") as refused:
        mount_image_root(image, tmp_path / "rollout", None)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "rollout" / ".image").exists()


def test_a_bad_run_image_is_refused_by_the_command_line(tmp_path: Path) -> None:
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text('{"id": "a", "input": "x"}\n')
    args = [sys.executable, "-m", "rollcage", "run", str(dataset), "--image", "podman://x", "--quiet"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "unknown transport 'podman'" in done.stderr
    assert not (tmp_path / "dataset-out").exists() and not list(tmp_path.glob("*/rollouts"))
