"""The ``bash`` tool: one persistent shell session per rollout, in the executor's cage.

The shell is ``bash --noprofile --norc`` started under the same cage prefix as the
Python executor (:meth:`rollcage.cage.NestedCage.prefix`), so commands see exactly
the file system cells see and never the worker's. Three pipes connect it to the
worker, none of them its standard input:

* commands: bash reads its *script* from a pipe (``/dev/fd/N``) the worker writes;
  each command travels as one line, ``eval $'…'`` with the text ANSI-C quoted (in a
  one-pass loop that the SIGINT trap breaks out of), so
  an unbalanced quote in a command is a syntax error of that command and never
  swallows the next one; ``cd`` and ``export`` persist because ``eval`` runs in the
  shell itself;
* output: the command's stdout and stderr share one pipe, drained by a
  :class:`~rollcage.tools._repl.StreamSink` that keeps the first ``output_limit``
  bytes of each command and counts the rest; a marker written after each command
  tells where its output ends;
* status: after each command the shell writes ``<id> <exit status>`` on a pipe of
  its own (closed for the command itself), so a command that closes or redirects
  its stdout cannot hide its end.

Standard input is ``/dev/null`` and the environment says there is no terminal
(``TERM=dumb``, ``PAGER=cat``, ``GIT_EDITOR=true`` …): a command that waits for a
terminal (``read``, ``python`` without arguments, ``git commit`` without ``-m``)
sees end of input at once and the model gets its answer, never a hang.

A command past its timeout gets SIGINT, sent to the shell's process group (the
shell traps SIGINT, abandons the rest of the command and lives on; its foreground
program does not). If the shell
has not reported within the interrupt grace, the whole session (the cage with
everything in it) is killed, the model is told its shell state was lost, and the
next command starts a fresh shell. Background processes are the session's: they
die with it at the end of the rollout (the cage's PID namespace ends with its
monitor; without a cage, the session's process group is swept).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from rollcage.errors import ExecutorError
from rollcage.procs import (
    AsyncClosing,
    GroupTree,
    StopStrategy,
    describe_exit,
    ns_pids,
    read_proc,
    shielded,
    signal_group,
    stop_tree,
    subtree,
    wait_shared,
    within,
)
from rollcage.tools._executor import bound_middle, mark_dropped, uncaged_leash
from rollcage.tools._repl import StreamSink

__all__ = ["SHELL_ENV", "ShellResult", "ShellSession", "ShellStatus", "bash_quote"]

log = logging.getLogger(__name__)

ShellStatus = Literal["ok", "error", "timeout", "restarted"]
"""How a command ended: ``ok`` (exit status 0); ``error`` (another exit status); ``timeout``
(interrupted at its timeout, the shell kept); ``restarted`` (the shell was killed or exited:
its state, working directory and variables, is lost)."""

SHELL_ENV: Mapping[str, str] = {
    "TERM": "dumb",
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "MANPAGER": "cat",
    "SYSTEMD_PAGER": "cat",
    "EDITOR": "true",
    "VISUAL": "true",
    "GIT_EDITOR": "true",
    "GIT_TERMINAL_PROMPT": "0",
    "DEBIAN_FRONTEND": "noninteractive",
    "PIP_NO_INPUT": "1",
    "PYTHONUNBUFFERED": "1",
}
"""Set in the shell's environment: no terminal, no pager, no editor to wait for."""

_SHELL = "/bin/bash"
_START_TIMEOUT_S = 20.0
_MARKER_WAIT_S = 1.0
"""How long a finished command's output may lag behind its status on the pipes."""
_REAP_TIMEOUT_S = 5.0
_IO_TIMEOUT_S = 5.0


_EDITORS = ("vi", "vim", "nvim", "view", "nano", "pico", "emacs", "joe", "mcedit")
_NO_TERMINAL = "".join(
    f"{name}() {{ echo '{name}: there is no terminal in this session: edit files with the file editor "
    f"tool, sed, or a heredoc (cat > FILE <<EOF)' >&2; return 1; }}\n"
    for name in _EDITORS
)
"""Shell functions answering at once for the full-screen editors, which (vim) may otherwise wait for a
terminal that never comes, ignoring SIGINT, until the command's timeout."""


def bash_quote(text: str) -> str:
    """``text`` as one bash ANSI-C quoted word (``$'…'``): every byte survives, nothing expands.

    NUL cannot be in a bash string; it is dropped (a command line cannot hold one either).
    """
    out = ["$'"]
    for char in text.replace("\0", ""):
        code = ord(char)
        if char == "\\":
            out.append("\\\\")
        elif char == "'":
            out.append("\\'")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        else:
            out.append(char)
    out.append("'")
    return "".join(out)


@dataclasses.dataclass(frozen=True, slots=True)
class ShellResult:
    """What one command produced; :attr:`text` is what the model sees."""

    status: ShellStatus
    output: str = ""
    """Its stdout and stderr, interleaved as written, bounded."""
    exit_code: int | None = None
    """The command's exit status; None when it did not finish (timeout, restart)."""
    note: str | None = None
    """A sentence for the model about what the tool did (timeout, restart); None otherwise."""
    truncated: bool = False
    duration_s: float = 0.0
    output_limit: int = 16_384

    @property
    def text(self) -> str:
        """Output, then the exit status when it is not 0, then the note; at most ``output_limit`` chars."""
        parts = [self.output.rstrip("\n")] if self.output else []
        if self.exit_code not in (None, 0):
            parts.append(f"[exit status: {self.exit_code}]")
        if self.note:
            parts.append(self.note)
        return bound_middle("\n".join(parts), self.output_limit)


class _Died(Exception):
    """The shell exited (or was killed) before the command ended."""


class ShellSession(AsyncClosing):
    """A persistent bash session in the executor's cage: one command at a time.

    Args:
        cwd: Where the shell starts (the rollout's workspace).
        prefix: The cage's command-line prefix (empty: the shell runs beside the worker). It must
            start the shell in a session of its own (``bwrap --new-session``) so that an interrupt
            reaches the shell's commands and not the cage's monitor.
        env: The shell's environment (:data:`SHELL_ENV` is laid over it); None: the worker's own.
        output_limit: Bound, in characters, of each command's output and of :attr:`ShellResult.text`.
        interrupt_grace_s: After SIGINT, how long a command may take to stop before the session is killed.
        shell: The shell program as the cage sees it.
    """

    def __init__(
        self,
        *,
        cwd: Path,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        output_limit: int = 16_384,
        interrupt_grace_s: float = 2.0,
        start_timeout_s: float = _START_TIMEOUT_S,
        shell: str = _SHELL,
    ) -> None:
        if output_limit < 64:
            raise ValueError(f"output_limit must be at least 64 characters, got {output_limit}")
        self._cwd = Path(cwd)
        self._prefix = list(prefix)
        self._env = {**(os.environ if env is None else env), **SHELL_ENV}
        self._limit = output_limit
        self._grace = interrupt_grace_s
        self._start_timeout_s = start_timeout_s
        self._shell = shell
        self._proc: asyncio.subprocess.Process | None = None
        self._pgid: int | None = None
        self._commands: int | None = None
        self._status_reader: asyncio.StreamReader | None = None
        self._status_transport: asyncio.BaseTransport | None = None
        self._out_transport: asyncio.BaseTransport | None = None
        self._sink: StreamSink | None = None
        self._marker = b""
        self._next_id = 0
        self._lost = False
        self._closed = False
        self._restarts = 0
        self._lock = asyncio.Lock()

    @property
    def restarts(self) -> int:
        """How many times the session was killed or exited and had to start again."""
        return self._restarts

    @property
    def pid(self) -> int | None:
        """Pid (and process group) of the session's outermost process (the cage's monitor, or bash)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    @property
    def shell_pgid(self) -> int | None:
        """The process group of the shell and its foreground commands, as the worker sees it."""
        return self._pgid

    async def __aenter__(self) -> ShellSession:
        """Nothing starts until the first command; leaving the block closes the session.

        **Cancellation:** nothing to cancel (it does not wait).
        """
        return self

    async def run(self, command: str, timeout_s: float) -> ShellResult:
        """Run one command and return what it produced.

        Raises:
            ExecutorError: the shell could not start, or the session is closed.
            ValueError: ``timeout_s`` is not positive.

        **Cancellation:** the command is interrupted (the session killed if it does not stop),
        then ``CancelledError`` propagates.
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        async with self._lock:
            note: str | None = None
            if self._proc is not None and self._proc.returncode is not None:
                await self._kill(restart=True)
                self._lost = True
            if self._lost:
                self._lost = False
                note = (
                    "Before this command ran, the shell had exited and was restarted: its state "
                    "(working directory, variables, functions) was lost."
                )
            await self._start()
            result = await self._supervised(command, timeout_s)
            if note is not None:
                result = dataclasses.replace(result, note=f"{note} {result.note}" if result.note else note)
            return result

    async def restart(self) -> None:
        """Kill the session; the next command starts a fresh shell (what ``restart: true`` asks for).

        **Cancellation:** the kill is shielded: the session is always gone before ``CancelledError``
        propagates.
        """
        async with self._lock:
            await self._kill(restart=False)

    async def aclose(self) -> None:
        """Kill the session and everything it started, and reap it; idempotent.

        **Cancellation:** shielded.
        """
        self._closed = True
        await shielded(self._kill(restart=False))

    # ------------------------------------------------------------------ internals

    async def _start(self) -> None:
        if self._closed:
            raise ExecutorError("the bash session is closed")
        if self._proc is not None:
            return
        try:
            await self._launch()
        except BaseException:
            await shielded(self._teardown())
            raise

    async def _launch(self) -> None:
        loop = asyncio.get_running_loop()
        self._marker = b"\x1erollcage-bash-end:" + os.urandom(8).hex().encode() + b":"
        sink = self._sink = StreamSink(self._limit, self._marker)
        cmd_r, cmd_w = os.pipe()
        st_r, st_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            transport, _ = await loop.connect_read_pipe(lambda: sink, os.fdopen(out_r, "rb", buffering=0))
            self._out_transport = transport
            reader = asyncio.StreamReader(limit=1 << 16)
            self._status_transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(st_r, "rb", buffering=0)
            )
            self._status_reader = reader
            prefix = self._prefix or uncaged_leash()
            argv = [*prefix, self._shell, "--noprofile", "--norc", f"/dev/fd/{cmd_r}"]
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=out_w,
                    pass_fds=(cmd_r, st_w),
                    cwd=self._cwd,
                    env=self._env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ExecutorError(
                    f"cannot start the bash session ({self._shell} in {self._cwd}): {exc}"
                ) from exc
        finally:
            for fd in (cmd_r, st_w, out_w):
                os.close(fd)
        self._commands = cmd_w
        os.set_blocking(cmd_w, False)
        # The session's own descriptors are closed for everything the shell starts; SIGINT runs a
        # no-op trap, so an interrupt ends the foreground command and not the shell.
        boot = (
            f"exec {cmd_r}<&-\ntrap 'break 1000 2>/dev/null' INT\n{_NO_TERMINAL}"
            f"__rollcage_status={st_w}\nprintf 'ready %s\\n' \"$$\" >&{st_w}\n"
        )
        await self._write(boot)
        try:
            async with asyncio.timeout(self._start_timeout_s):
                line = await self._status_line()
        except TimeoutError:
            raise ExecutorError(
                f"the bash session did not become ready within {self._start_timeout_s:g} s"
            ) from None
        except _Died:
            await asyncio.wait({sink.closed}, timeout=1.0)
            said = sink.take(None)[0].decode("utf-8", "replace").strip()
            code = self._proc.returncode if self._proc is not None else None
            raise ExecutorError(
                f"the bash session exited during start-up ({describe_exit(code)})"
                + (f": {said[-2000:]}" if said else "")
            ) from None
        parts = line.split()
        if len(parts) != 2 or parts[0] != "ready" or not parts[1].isdigit():
            raise ExecutorError(f"the bash session started with an unexpected line: {line[:200]!r}")
        self._pgid = self._shell_group(int(parts[1]))

    def _shell_group(self, inner_pid: int) -> int:
        """The process group of the shell that calls itself ``inner_pid`` in its own PID namespace."""
        assert self._proc is not None
        for info in subtree([self._proc.pid]):
            pids = ns_pids(info.pid)
            if pids and pids[-1] == inner_pid and (info.pid == self._proc.pid or len(pids) > 1):
                if info.pgid == self._proc.pid and info.pid != self._proc.pid:
                    # In the cage's group: SIGINT would reach the cage's monitor too.
                    raise ExecutorError(
                        "the bash session's cage did not give the shell a session of its own "
                        "(bwrap --new-session)"
                    )
                return info.pgid
        raise ExecutorError(f"cannot find the bash session's shell (pid {inner_pid} in its cage)")

    async def _write(self, text: str) -> None:
        fd = self._commands
        if fd is None:
            raise _Died("no shell")
        data = text.encode("utf-8", "surrogateescape")
        async with asyncio.timeout(_IO_TIMEOUT_S):
            while data:
                try:
                    written = os.write(fd, data)
                except BlockingIOError:
                    await asyncio.sleep(0.01)
                    continue
                except (BrokenPipeError, OSError) as exc:
                    raise _Died(str(exc)) from None
                data = data[written:]

    async def _status_line(self) -> str:
        reader, proc = self._status_reader, self._proc
        assert reader is not None and proc is not None
        line = await reader.readline()
        if not line.endswith(b"\n"):
            raise _Died("the shell closed its status pipe")
        return line.decode("ascii", "replace").strip()

    async def _supervised(self, command: str, timeout_s: float) -> ShellResult:
        started = time.monotonic()
        self._next_id += 1
        cid = self._next_id
        # The command's own line, then the report line: a command cut off mid-way (a syntax error)
        # ends at its line, and the report runs whatever the command did. The one-pass loop is what
        # the SIGINT trap breaks out of: an interrupted command stops there, as at a terminal, rather
        # than going on with the rest of its list.
        line = (
            f"for __rollcage_once in 1; do eval {bash_quote(command)}; done {{__rollcage_status}}>&-\n"
            f"__rollcage_rc=$?; printf '%s%08x\\036' {bash_quote(self._marker.decode())} {cid}; "
            f"printf '%s %s\\n' {cid} \"$__rollcage_rc\" >&$__rollcage_status\n"
        )
        try:
            await self._write(line)
            wait = asyncio.ensure_future(self._await_status(cid))
            try:
                try:
                    async with asyncio.timeout(timeout_s):
                        code = await wait_shared(wait)
                except TimeoutError:
                    pass
                else:
                    return await self._finished(cid, code, started)
                self._interrupt()
                try:
                    async with asyncio.timeout(self._grace):
                        code = await wait_shared(wait)
                except TimeoutError:
                    output, truncated = self._partial()
                    await self._kill(restart=True)
                    return self._result(
                        "restarted",
                        output,
                        None,
                        truncated,
                        started,
                        f"The command ran past its {timeout_s:g} s timeout and did not stop when "
                        "interrupted, so the shell was killed and restarted: its state (working "
                        "directory, variables, functions) and its background processes were lost.",
                    )
                result = await self._finished(cid, code, started)
                return dataclasses.replace(
                    result,
                    status="timeout",
                    note=f"The command was interrupted (SIGINT) after exceeding its {timeout_s:g} s timeout; "
                    "the shell's state is kept.",
                )
            except asyncio.CancelledError:
                await shielded(self._stop_cancelled(wait))
                raise
            finally:
                wait.cancel()
        except _Died as died:
            output, truncated = self._partial()
            code = None
            if self._proc is not None:
                # Its status pipe closed as it exited: its exit status follows at once.
                code = await within(self._proc.wait(), _IO_TIMEOUT_S)
            await self._kill(restart=True)
            return self._result(
                "restarted",
                output,
                None,
                truncated,
                started,
                f"The shell exited ({describe_exit(code) if code is not None else died}) and will be "
                "restarted with the next command: its state (working directory, variables, functions) "
                "was lost.",
            )

    async def _await_status(self, cid: int) -> int:
        while True:
            line = await self._status_line()
            parts = line.split()
            if len(parts) == 2 and parts[0] == str(cid):
                try:
                    return int(parts[1])
                except ValueError:
                    return -1
            # Anything else (a stale report of an abandoned command) is skipped.

    async def _stop_cancelled(self, wait: asyncio.Future[int]) -> None:
        self._interrupt()
        try:
            async with asyncio.timeout(self._grace):
                await wait_shared(wait)
        except (TimeoutError, _Died):
            await self._kill(restart=True)

    def _interrupt(self) -> None:
        if self._pgid is not None:
            signal_group(self._pgid, signal.SIGINT)

    async def _finished(self, cid: int, code: int, started: float) -> ShellResult:
        sink = self._sink
        assert sink is not None
        await sink.wait_marker(cid, _MARKER_WAIT_S)
        data, dropped = sink.take(cid)
        output = mark_dropped(data.decode("utf-8", "replace"), dropped)
        return self._result("ok" if code == 0 else "error", output, code, bool(dropped), started, None)

    def _partial(self) -> tuple[str, bool]:
        sink = self._sink
        if sink is None:
            return "", False
        data, dropped = sink.take(None)
        return mark_dropped(data.decode("utf-8", "replace"), dropped), bool(dropped)

    def _result(
        self,
        status: ShellStatus,
        output: str,
        code: int | None,
        truncated: bool,
        started: float,
        note: str | None,
    ) -> ShellResult:
        return ShellResult(
            status=status,
            output=output,
            exit_code=code,
            note=note,
            truncated=truncated,
            duration_s=time.monotonic() - started,
            output_limit=self._limit,
        )

    async def _kill(self, *, restart: bool) -> None:
        if self._proc is not None and restart:
            self._restarts += 1
        await shielded(self._teardown())

    async def _teardown(self) -> None:
        proc = self._proc
        if proc is not None:
            strategy = StopStrategy(grace_s=0.0, kill_wait_s=_REAP_TIMEOUT_S)
            exit_task = asyncio.ensure_future(proc.wait())
            # The shell's own group first (without a cage its background jobs are there), then the
            # session's outermost group: in a cage its monitor, whose end ends the PID namespace.
            if self._pgid is not None and self._pgid != proc.pid and read_proc(self._pgid) is not None:
                signal_group(self._pgid, signal.SIGKILL)
            if not await stop_tree(GroupTree(proc.pid, exit_task), strategy):
                log.error("processes of the bash session's group %d survived SIGKILL", proc.pid)
            if not exit_task.done():
                exit_task.cancel()
        if self._commands is not None:
            with contextlib.suppress(OSError):
                os.close(self._commands)
        for transport in (self._status_transport, self._out_transport):
            if transport is not None:
                transport.close()
        self._proc = None
        self._pgid = None
        self._commands = None
        self._status_reader = None
        self._status_transport = None
        self._out_transport = None
