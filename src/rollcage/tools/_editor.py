"""The file editor tool (``str_replace_based_edit_tool``, alias ``str_replace_editor``), run in the cage.

Every operation is one short process started under the executor's cage prefix:
the editor's own program (:mod:`rollcage.tools._editor_child`, standard library
only) run by the cage's Python, reading a JSON request on stdin. So the editor
sees exactly the file system that bash commands and Python cells see, and the
worker never opens a path the agent names. The undo history (the content each
change replaced) is the worker's, per rollout; an undo sends the old content back
into the cage to be written there.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollcage.errors import ExecutorError
from rollcage.procs import GroupTree, StopStrategy, shielded, signal_group, stop_tree
from rollcage.tools._executor import bound_middle, uncaged_leash

__all__ = ["EDITOR_COMMANDS", "FileEditor"]

EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
"""The editor's commands, as the editors models are trained on name them."""

_CHILD = Path(__file__).with_name("_editor_child.py")
_MAX_REPLY_BYTES = 64 << 20
_KILL_WAIT_S = 5.0


@functools.cache
def _child_source() -> str:
    return _CHILD.read_text(encoding="utf-8")


class FileEditor:
    """The editor of one rollout: its operations run in the cage, its undo history here.

    Args:
        cwd: Working directory of each operation (the workspace; paths must be absolute anyway).
        prefix: The cage's command-line prefix (empty: beside the worker).
        name: The tool's name, as the model sees it (quoted in an unknown command's answer).
        output_limit: Bound, in characters, of each answer.
        env: Environment of each operation; None: the worker's own.
        python: The interpreter that runs the editor's program, as the cage sees it.
    """

    def __init__(
        self,
        *,
        cwd: Path,
        prefix: Sequence[str] = (),
        name: str = "str_replace_based_edit_tool",
        output_limit: int = 16_384,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self._cwd = Path(cwd)
        self._prefix = list(prefix)
        self._name = name
        self._limit = output_limit
        self._env = dict(os.environ if env is None else env)
        self._python = python
        self._history: dict[str, list[str | None]] = {}
        self._lock = asyncio.Lock()

    async def call(self, arguments: Mapping[str, Any], timeout_s: float) -> tuple[bool, str]:
        """Carry out one editor call; return whether it succeeded and the answer for the model.

        Raises:
            ExecutorError: the editor's process could not start, or did not answer (the infrastructure's
                failure, never the agent's).

        **Cancellation:** the editor's process is killed (shielded) and ``CancelledError`` propagates.
        """
        command = arguments.get("command")
        path = arguments.get("path")
        async with self._lock:  # one file system, edits in call order
            if command == "undo_edit":
                if not isinstance(path, str) or not path.startswith("/"):
                    return False, self._bound(
                        f"The path {path} is not an absolute path, it should start with `/`."
                    )
                history = self._history.get(path)
                if not history:
                    return False, f"No edit history found for {path}."
                reply = await self._run(
                    {"command": "restore", "path": path, "content": history[-1]}, timeout_s
                )
                if reply.get("ok"):
                    history.pop()
            else:
                if command not in EDITOR_COMMANDS:
                    allowed = ", ".join(EDITOR_COMMANDS)
                    return False, (
                        f"Unrecognized command {command}. "
                        f"The allowed commands for the {self._name} tool are: {allowed}"
                    )
                reply = await self._run({**arguments, "tool": self._name}, timeout_s)
                if reply.get("ok") and command in ("create", "str_replace", "insert"):
                    previous = reply.get("previous")
                    before = previous if isinstance(previous, str) and reply.get("existed") else None
                    self._history.setdefault(str(path), []).append(before)
        return bool(reply.get("ok")), self._bound(str(reply.get("text", "")))

    def _bound(self, text: str) -> str:
        return bound_middle(text, self._limit)

    async def _run(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        argv = [*(self._prefix or uncaged_leash()), self._python, "-I", "-c", _child_source()]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self._cwd,
                env=self._env,
                start_new_session=True,
            )
        except OSError as exc:
            raise ExecutorError(
                f"cannot start the file editor ({self._python} in {self._cwd}): {exc}"
            ) from exc
        exit_task = asyncio.ensure_future(proc.wait())
        try:
            async with asyncio.timeout(timeout_s):
                out, err = await proc.communicate(json.dumps(request).encode("utf-8", "surrogatepass"))
        except TimeoutError:
            raise ExecutorError(f"the file editor did not answer within {timeout_s:g} s") from None
        finally:
            if proc.returncode is None:
                await shielded(stop_tree(GroupTree(proc.pid, exit_task), StopStrategy(0.0, _KILL_WAIT_S)))
            signal_group(proc.pid, signal.SIGKILL)  # anything it left behind in its group
            if not exit_task.done():
                exit_task.cancel()
        if len(out) > _MAX_REPLY_BYTES:
            raise ExecutorError("the file editor's answer is too large")
        try:
            reply = json.loads(out)
        except ValueError:
            said = err.decode("utf-8", "replace").strip()[-2000:]
            raise ExecutorError(
                f"the file editor failed (exit status {proc.returncode})" + (f": {said}" if said else "")
            ) from None
        if not isinstance(reply, dict):
            raise ExecutorError("the file editor's answer is not a JSON object")
        return reply
