"""The ``repl`` backend: a lean child process speaking a framed protocol over a socket.

The child (:mod:`rollcage.tools._repl_child`) runs in its own session and
process group, so an interrupt reaches everything the cell started and a kill
leaves nothing behind. Three channels connect it to the parent:

* a Unix socket pair for control frames (cells, results, bridged tool calls);
* its fds 1 and 2, pipes drained by :class:`_StreamSink` protocols that keep the
  first ``output_limit`` bytes of each cell's output and count the rest.

The parent hands the child its pipes' write ends directly (rather than
``stdout=PIPE``) so that ``Process.wait()`` returns when the child exits even if
a grandchild still holds a pipe open.

The child is not run as a script: Python never caches a script's bytecode, and
compiling ``_repl_child.py`` was a third of every executor's start. The parent
compiles it once (or reads it from the bytecode cache the
worker imports from, :mod:`rollcage.supervisor.bytecode`) and sends the code
object as the first frame; the child's command line (:data:`_BOOT`) only reads
that frame and runs it as its ``__main__``, as the script ran before.

In its own cage (a warm worker's), the child is not started but forked into that cage by
the executor template (:mod:`rollcage.tools._forked`), which runs the same boot program:
a fresh interpreter's start is most of what a started child costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.machinery
import json
import logging
import marshal
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Unpack

from rollcage.errors import ExecutorError
from rollcage.procs import (
    GroupTree,
    PidHandle,
    StopStrategy,
    describe_exit,
    is_running,
    signal_group,
    stop_tree,
    wait_shared,
)
from rollcage.tools._executor import (
    CellOutput,
    Executor,
    ExecutorOptions,
    PendingCell,
    ProcessDied,
    fail_future,
    mark_dropped,
    uncaged_leash,
)
from rollcage.tools._forked import ANSWER_S as FORKED_ANSWER_S
from rollcage.tools._forked import ForkedExecutor
from rollcage.tools._forked import start as start_forked

if TYPE_CHECKING:
    from rollcage.protocol import ExecutorSettings

__all__ = ["ReplExecutor", "StreamSink"]

log = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("_repl_child.py")
_BOOT = (
    # Names the process in ps and /proc/PID/cmdline (bench/profile.py looks for it).
    "# rollcage executor: _repl_child\n"
    "import marshal,os,sys\n"
    "f=int(sys.argv[1])\n"
    "def r(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  c=os.read(f,n-len(b))\n"
    "  if not c:os._exit(0)\n"
    "  b+=c\n"
    " return b\n"
    "c=marshal.loads(r(int.from_bytes(r(4),'big')))\n"
    "del f,r\n"
    "exec(c,{'__name__':'__main__','__file__':c.co_filename,'__builtins__':__builtins__})\n"
)
"""The child's ``-c`` program: read the first frame (the child's code, marshalled) and run it as ``__main__``.

It reads exactly that frame, so the ``init`` frame after it is the child's own to read; a parent
gone before sending it ends the child quietly, as the child does at EOF.
"""
_BOOT_SOURCE = _BOOT.replace(
    "c=marshal.loads(r(int.from_bytes(r(4),'big')))\n",
    "c=compile(r(int.from_bytes(r(4),'big')),'_repl_child.py','exec')\n",
)
"""The boot program for another interpreter (a task image's): the first frame is the child's source,
compiled there, since a code object is only readable by the Python version that made it."""
_MAX_FRAME = 32 << 20
"""A longer frame from the child is a protocol violation: the session is killed."""
_IO_TIMEOUT_S = 5.0
"""Bound on a control-socket write and on the wait for a cell's output markers."""
_MARKER_WAIT_S = 1.0
"""How long a finished cell's output may lag behind its result on the pipes."""
_REAP_TIMEOUT_S = 5.0
"""Bound on waiting for a SIGKILLed child to be reaped."""


class _StreamSink(asyncio.Protocol):
    """Drains one output pipe of the child: bounded per cell, cut at per-cell markers."""

    def __init__(self, limit: int, marker: bytes) -> None:
        self._limit = limit
        self._marker = marker
        self._mark_len = len(marker) + 9  # marker, 8 hex digits of the cell id, b"\x1e"
        self._kept = bytearray()
        self._dropped = 0
        self._carry = b""
        self._segments: dict[int, tuple[bytes, int]] = {}
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._taken_upto = 0
        self.closed = asyncio.get_running_loop().create_future()
        """Resolved when the pipe reaches EOF (every writer closed it)."""

    def eof_received(self) -> bool | None:
        if not self.closed.done():
            self.closed.set_result(None)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def data_received(self, data: bytes) -> None:
        data = self._carry + data
        self._carry = b""
        while True:
            i = data.find(self._marker)
            if i < 0:
                break
            if len(data) < i + self._mark_len:
                self._take(data[:i])
                self._carry = data[i:]
                return
            self._take(data[:i])
            digits = data[i + len(self._marker) : i + len(self._marker) + 8]
            data = data[i + self._mark_len :]
            try:
                self._close_segment(int(digits, 16))
            except ValueError:
                continue
        # A marker may straddle two reads: hold back what could be its start.
        keep = min(len(self._marker) - 1, len(data))
        self._take(data[: len(data) - keep])
        self._carry = data[len(data) - keep :]

    def _take(self, chunk: bytes) -> None:
        room = max(self._limit - len(self._kept), 0)
        self._kept += chunk[:room]
        self._dropped += max(len(chunk) - room, 0)

    def _close_segment(self, cell_id: int) -> None:
        if cell_id <= self._taken_upto:
            return  # a late marker of a cell whose output was already taken
        self._segments[cell_id] = (bytes(self._kept), self._dropped)
        self._kept = bytearray()
        self._dropped = 0
        waiter = self._waiters.pop(cell_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_marker(self, cell_id: int, timeout_s: float) -> None:
        """Wait until the cell's marker went by (bounded; a cell may have closed the fd).

        **Cancellation:** safe; the marker is still recorded when it arrives.
        """
        if cell_id in self._segments:
            return
        waiter = self._waiters.get(cell_id)
        if waiter is None:
            waiter = self._waiters[cell_id] = asyncio.get_running_loop().create_future()
        await asyncio.wait({waiter}, timeout=timeout_s)

    def take(self, cell_id: int | None) -> tuple[bytes, int]:
        """The output of ``cell_id`` (up to its marker), or everything so far if None or unmarked."""
        if cell_id is not None:
            self._taken_upto = max(self._taken_upto, cell_id)
            segment = self._segments.pop(cell_id, None)
            if segment is not None:
                return segment
        self._take(self._carry)
        self._carry = b""
        kept, dropped = bytes(self._kept), self._dropped
        self._kept = bytearray()
        self._dropped = 0
        return kept, dropped


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the block (what a process started meanwhile inherits)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


StreamSink = _StreamSink
"""The bounded, marker-cut drain of an output pipe; the ``bash`` tool's too (:mod:`rollcage.tools._shell`)."""


def _factory(sink: _StreamSink) -> Callable[[], _StreamSink]:
    return lambda: sink


def _decode(data: bytes, dropped: int) -> str:
    return mark_dropped(data.decode("utf-8", "replace"), dropped)


class _ReplCell(PendingCell):
    _executor: ReplExecutor

    def __init__(self, executor: ReplExecutor, cell_id: int) -> None:
        super().__init__(executor)
        self.id = cell_id
        self.done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._output: CellOutput | None = None

    async def wait(self) -> CellOutput:
        if self._output is not None:
            return self._output
        msg = await wait_shared(self.done)
        out_sink, err_sink = self._executor._sinks()
        await asyncio.gather(
            out_sink.wait_marker(self.id, _MARKER_WAIT_S), err_sink.wait_marker(self.id, _MARKER_WAIT_S)
        )
        stdout, stdout_dropped = out_sink.take(self.id)
        stderr, stderr_dropped = err_sink.take(self.id)
        stdout_dropped += _int(msg.get("stdout_dropped"))
        stderr_dropped += _int(msg.get("stderr_dropped"))
        value = msg.get("value")
        error = msg.get("error")
        self._output = CellOutput(
            status="error" if msg.get("status") == "error" else "ok",
            stdout=_decode(stdout, stdout_dropped),
            stderr=_decode(stderr, stderr_dropped),
            value=value if isinstance(value, str) else None,
            error=error if isinstance(error, str) else None,
            truncated=bool(msg.get("truncated")) or bool(stdout_dropped) or bool(stderr_dropped),
            interrupted=bool(msg.get("interrupted")),
        )
        return self._output

    def partial(self) -> CellOutput:
        if self._output is not None:
            return self._output
        out_sink, err_sink = self._executor._sinks()
        stdout, stdout_dropped = out_sink.take(None)
        stderr, stderr_dropped = err_sink.take(None)
        return CellOutput(
            stdout=_decode(stdout, stdout_dropped),
            stderr=_decode(stderr, stderr_dropped),
            truncated=bool(stdout_dropped or stderr_dropped),
        )


def _int(value: object) -> int:
    return value if isinstance(value, int) and value > 0 else 0


@functools.cache
def child_code() -> bytes:
    """The child's module, compiled and marshalled: the first frame every child reads (once per process).

    Read from the bytecode cache when it holds a current copy (the loader checks the source's
    modification time and size, and honours ``-X pycache_prefix``), compiled from source otherwise.
    """
    code = importlib.machinery.SourceFileLoader("_repl_child", str(_CHILD)).get_code("_repl_child")
    return marshal.dumps(code)


class ReplExecutor(Executor):
    """The default backend: ``python -I -u -c BOOT`` (:data:`_BOOT`, running ``_repl_child``), own session.

    Start to first result takes tens of milliseconds and the child's RSS is
    that of a bare interpreter plus what the agent's code imports.
    """

    backend: Literal["repl", "jupyter"] = "repl"

    def __init__(self, settings: ExecutorSettings, **options: Unpack[ExecutorOptions]) -> None:
        super().__init__(settings, **options)
        self._python = options.get("python") or sys.executable
        self._foreign = bool(options.get("python"))
        """The child runs in another interpreter: started cold, sent its source (:data:`_BOOT_SOURCE`)."""
        self._proc: asyncio.subprocess.Process | ForkedExecutor | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._exit_task: asyncio.Task[int] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._out_sink: _StreamSink | None = None
        self._err_sink: _StreamSink | None = None
        self._transports: list[asyncio.BaseTransport] = []
        self._current: _ReplCell | None = None
        self._orphans: set[asyncio.Task[None]] = set()
        self._pid_handle: PidHandle | None = None
        self._next_id = 0

    @property
    def pid(self) -> int | None:
        """Pid (and process group id) of the child; None when there is none."""
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    def _sinks(self) -> tuple[_StreamSink, _StreamSink]:
        assert self._out_sink is not None and self._err_sink is not None, "used before launch"
        return self._out_sink, self._err_sink

    # ------------------------------------------------------------------ launch

    async def _launch(self) -> None:
        loop = asyncio.get_running_loop()
        marker = b"\x1e\x00rollcage-cell-end:" + os.urandom(8).hex().encode() + b":"
        self._ready = loop.create_future()
        out_sink, err_sink = self._out_sink, self._err_sink = (
            _StreamSink(self._output_limit, marker),
            _StreamSink(self._output_limit, marker),
        )
        parent_sock, child_sock = socket.socketpair()
        try:
            self._proc = await self._spawn(child_sock, out_sink, err_sink)
            reader, self._writer = await asyncio.open_unix_connection(sock=parent_sock)
        except BaseException:
            parent_sock.close()
            raise
        finally:
            child_sock.close()
        self._pid_handle = PidHandle.of_child(self._proc.pid)
        self._exit_task = asyncio.create_task(self._watch_exit(self._proc))
        self._reader_task = asyncio.create_task(self._read_frames(reader))
        code = _CHILD.read_bytes() if self._foreign else child_code()
        self._writer.write(len(code).to_bytes(4, "big") + code)
        tools = {name: list(params) for name, params in self._tools.items()}
        await self._send({"op": "init", "limit": self._output_limit, "marker": marker, "tools": tools})
        started: set[asyncio.Future[Any]] = {self._ready, self._exit_task}
        done, _ = await asyncio.wait(
            started, timeout=self._start_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if self._ready in done and self._ready.exception() is None:
            return
        if self._exit_task in done:
            # Let the child's last words reach the sink before quoting them.
            await asyncio.wait({err_sink.closed}, timeout=1.0)
            stderr = err_sink.take(None)[0].decode("utf-8", "replace").strip()
            failure = self.cage_failure(stderr)
            if failure is not None:
                raise failure
            raise ExecutorError(
                f"the Python executor exited during start-up ({describe_exit(self._exit_task.result())})"
                + (f": {stderr[-2000:]}" if stderr else "")
            )
        raise ExecutorError(f"the Python executor did not become ready within {self._start_timeout_s:g} s")

    async def _spawn(
        self, child_sock: socket.socket, out_sink: _StreamSink, err_sink: _StreamSink
    ) -> asyncio.subprocess.Process | ForkedExecutor:
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            for fd, sink in ((out_r, out_sink), (err_r, err_sink)):
                pipe = os.fdopen(fd, "rb", buffering=0)
                transport, _ = await loop.connect_read_pipe(_factory(sink), pipe)
                self._transports.append(transport)
            boot = _BOOT_SOURCE if self._foreign else _BOOT
            # Another interpreter writes no bytecode: an image rollout's changes are the agent's alone.
            flags = ["-I", "-u", "-B"] if self._foreign else ["-I", "-u"]
            argv = [self._python, *flags, "-c", boot, str(child_sock.fileno())]
            # Started with SIGINT blocked (held pending, never lost; the child unblocks it once its
            # handler is set): an interrupt is SIGINT to the whole group, which holds a cage's bwrap
            # monitor too, and a blocked signal is what stays so across exec without a shell
            # to ignore it first (rollcage.cage._nested). Meanwhile this process's other threads
            # take a SIGINT sent to it, and the loop handles it as ever.
            with _sigint_blocked():
                if self._prefix and not self._foreign:
                    # Forked into its cage by the executor template where there is one: a fresh
                    # interpreter's start is most of what a started executor costs.
                    async with asyncio.timeout(self._start_timeout_s):
                        forked = await start_forked(
                            self._prefix,
                            cwd=str(self._cwd),
                            env=self._env,
                            boot=_BOOT,
                            argv=argv,
                            control=child_sock.fileno(),
                            stdout=out_w,
                            stderr=err_w,
                            # A hung template leaves time to start the executor instead.
                            answer_s=min(FORKED_ANSWER_S, self._start_timeout_s / 4),
                        )
                    if forked is not None:
                        return forked
                return await asyncio.create_subprocess_exec(
                    *(self._prefix or uncaged_leash()),
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out_w,
                    stderr=err_w,
                    pass_fds=(child_sock.fileno(),),
                    cwd=self._cwd,
                    env=self._env,
                    start_new_session=True,
                )
        except OSError as exc:
            raise ExecutorError(
                f"cannot start the Python executor ({self._python} in {self._cwd}): {exc}"
            ) from exc
        finally:
            # The child holds its own copies; ours would keep the pipes open after it exits.
            os.close(out_w)
            os.close(err_w)

    async def _watch_exit(self, proc: asyncio.subprocess.Process | ForkedExecutor) -> int:
        returncode = await proc.wait()
        reason = describe_exit(returncode)
        if self._current is not None:
            fail_future(self._current.done, ProcessDied(reason))
        return returncode

    # ------------------------------------------------------------------- frames

    def _write(self, frame: dict[str, Any]) -> asyncio.StreamWriter | None:
        writer = self._writer
        if writer is None or writer.is_closing():
            return None  # the child is gone; its exit is reported by the exit watcher
        body = marshal.dumps(frame)
        writer.write(len(body).to_bytes(4, "big") + body)
        return writer

    async def _send(self, frame: dict[str, Any]) -> None:
        writer = self._write(frame)
        if writer is None:
            return
        # A child that stops reading (a hung cell holding the channel) must not hang us.
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(_IO_TIMEOUT_S):
                await writer.drain()

    async def _read_frames(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "big")
                if size > _MAX_FRAME:
                    raise ValueError(f"control frame of {size} bytes")
                msg = json.loads(await reader.readexactly(size))
                if not isinstance(msg, dict):
                    raise ValueError("control frame is not an object")
                self._dispatch(msg)
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # EOF: the exit watcher reports the death
        except ValueError:
            # The agent's code wrote garbage on the control socket: end the session.
            proc = self._proc
            if proc is not None:
                signal_group(proc.pid, signal.SIGKILL)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        cell = self._current
        if op == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif op == "done":
            if cell is not None and msg.get("id") == cell.id and not cell.done.done():
                cell.done.set_result(msg)
        elif op == "tool_call":
            task = asyncio.create_task(self._serve_tool(cell, msg))
            # Keep a reference: a task nobody holds may be garbage-collected mid-call.
            tasks = cell.bridge_tasks if cell is not None else self._orphans
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _serve_tool(self, cell: _ReplCell | None, msg: dict[str, Any]) -> None:
        call_id = msg.get("id")
        name = msg.get("name")
        kwargs = msg.get("kwargs")
        reply: dict[str, Any] = {"op": "tool_result", "id": call_id}
        if cell is None:
            reply["error"] = "tool calls are only possible while a cell runs"
        elif not isinstance(name, str) or name not in self._tools or not isinstance(kwargs, dict):
            reply["error"] = f"unknown tool {name!r}"
        else:
            assert self._bridge is not None  # checked in __init__ when tools are given
            try:
                reply["text"] = str(await self._bridge(name, kwargs))
            except asyncio.CancelledError:
                # The cell is being interrupted: wake the stub, which raises KeyboardInterrupt.
                reply["interrupt"] = True
                self._write(reply)
                raise
            except Exception as exc:
                if cell.bridge_failure is None:
                    cell.bridge_failure = exc
                reply["error"] = f"{type(exc).__name__}: {exc}"
        await self._send(reply)

    # ------------------------------------------------------------------ cells

    def _submit(self, code: str) -> PendingCell:
        self._next_id += 1
        cell = _ReplCell(self, self._next_id)
        self._current = cell
        proc = self._proc
        if proc is None or proc.returncode is not None:
            fail_future(cell.done, ProcessDied(describe_exit(proc.returncode if proc else None)))
            return cell
        self._write({"op": "run", "id": cell.id, "code": code})
        return cell

    async def _interrupt(self) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            signal_group(proc.pid, signal.SIGINT)
        if self._current is not None:
            # A cell blocked in a bridged call is waiting for its reply, not for
            # a signal: cancelling the call sends it one.
            self._current.cancel_bridges()

    def _alive(self) -> bool:
        proc = self._proc
        if proc is None or proc.returncode is not None or not is_running(proc.pid):
            return False
        if self._pid_handle is not None:
            # The child watcher learns of an exit a little late; the pidfd knows at once.
            return not self._pid_handle.exited()
        return True

    async def _teardown(self, *, graceful: bool) -> None:
        proc = self._proc
        if proc is not None:
            # A launch that failed half-way has a process but no exit watcher yet.
            exit_task = self._exit_task or asyncio.ensure_future(proc.wait())
            strategy = StopStrategy(
                grace_s=self._settings.interrupt_grace_s if graceful else 0.0, kill_wait_s=_REAP_TIMEOUT_S
            )
            # The leader may be gone while members of its group live on: the stop always sweeps the group.
            if not await stop_tree(GroupTree(proc.pid, exit_task), strategy):
                log.error("processes of the Python executor's group %d survived SIGKILL", proc.pid)
            if exit_task is not self._exit_task and not exit_task.done():
                exit_task.cancel()
        for task in (self._reader_task, self._exit_task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=_IO_TIMEOUT_S)
        if self._current is not None:
            fail_future(self._current.done, ProcessDied("killed"))
        if self._writer is not None:
            self._writer.close()
        for transport in self._transports:
            transport.close()
        self._transports.clear()
        if self._pid_handle is not None:
            self._pid_handle.close()
            self._pid_handle = None
        self._proc = None
        self._writer = None
        self._reader_task = None
        self._exit_task = None
