"""The ``jupyter`` backend: an ipykernel driven by ``jupyter_client``.

For users who need Jupyter semantics (magics, ``display``, IPython
tracebacks). It costs about half a second and some 50 MB per kernel, which is
why it is not the default. This module is imported only when the backend is
chosen, so ``jupyter_client`` and ``zmq`` stay out of the worker otherwise.

The kernel talks over ``ipc`` sockets in a private temporary directory (no TCP
ports, nothing written to the user's Jupyter runtime directory), with IPython
history off and colours off. A small set-up cell, run silently once per
kernel:

* bounds the kernel's stdout/stderr per cell *inside the kernel* (the first
  ``output_limit`` characters are sent, the rest counted), so a cell printing
  100 MB never crosses the wire;
* reduces rich display to bounded ``text/plain``;
* defines the bridged tool functions. Each call is carried over the kernel's
  stdin channel: the function calls ``raw_input`` with a private prefix and the
  JSON call, the parent answers the ``input_request`` with the JSON result. A
  plain ``input()`` by agent code gets end-of-file, as in the ``repl`` backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Literal, Unpack

from jupyter_client.manager import AsyncKernelManager

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
    bound_tail,
    fail_future,
    mark_dropped,
)

if TYPE_CHECKING:
    from jupyter_client.asynchronous.client import AsyncKernelClient

    from rollcage.protocol import ExecutorSettings

__all__ = ["JupyterExecutor"]

log = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_TOOL_PREFIX = "\x00rollcage-tool\x00"
_STATS_EXPR = "__import__('_rollcage_kernel').stats()"
_IO_TIMEOUT_S = 5.0
_REAP_TIMEOUT_S = 5.0
_KERNEL_ARGS = [
    "--HistoryManager.enabled=False",
    "--InteractiveShell.colors=nocolor",
    "--IPKernelApp.quiet=True",
]

# Runs inside the kernel, once, silently. Kept free of names in the user's namespace.
_SETUP = r"""
def _rollcage_setup(limit, tools, prefix, marker):
    import contextlib, json, os, sys, threading, types

    ip = get_ipython()
    kernel = ip.kernel

    class Bound:
        def __init__(self, stream):
            self.stream = stream
            self.written = 0
            self.dropped = 0
            self.tail = ""
            self.synced = None
            self.watched = bool(getattr(stream, "_should_watch", False))
            self._write = None

        def install(self):
            # An instance attribute, as IPython's own tee does; installed from a
            # pre_run_cell hook because this set-up cell's tee restores the old
            # write method when it ends.
            if self.stream.write != self.write:
                self._write = self.stream.write
                self.stream.write = self.write

        def write(self, s):
            if not isinstance(s, str):
                raise TypeError(f"write() argument must be str, not {type(s).__name__}")
            if self.synced is not None:
                # The sync marker may come split over two reads of the fd pipe.
                seen = self.tail + s
                self.tail = seen[-len(marker):]
                if marker in seen:
                    self.synced.set()
            room = limit - self.written
            if room > 0:
                head = s[:room]
                self.written += len(head)
                self._write(head)
            self.dropped += max(len(s) - max(room, 0), 0)
            return len(s)

        def sync(self, fd):
            # Output of subprocesses reaches the kernel through a pipe and a
            # reader thread; wait (bounded) until it has all been forwarded.
            if not self.watched or self._write is None:
                return
            self.synced, self.tail = threading.Event(), ""
            try:
                os.write(fd, marker.encode())
                self.synced.wait(1.0)
            except (OSError, KeyboardInterrupt):
                pass  # the fd was closed, or an interrupt came late: the cell is over anyway
            finally:
                self.synced = None

    out, err = Bound(sys.stdout), Bound(sys.stderr)
    state = types.SimpleNamespace(value_cut=0)

    def pre_run_cell(*args):
        out.install()
        err.install()
        out.written = out.dropped = err.written = err.dropped = state.value_cut = 0

    def post_run_cell(*args):
        out.sync(1)
        err.sync(2)

    ip.events.register("pre_run_cell", pre_run_cell)
    ip.events.register("post_run_cell", post_run_cell)

    if hasattr(ip, "_tee"):
        # IPython 9 copies every write of a cell into history_manager.outputs,
        # in memory, unbounded: a cell printing 100 MB would keep 100 MB.
        ip._tee = lambda channel: contextlib.nullcontext()

    fmt = ip.display_formatter
    orig_format = fmt.format

    def bounded_format(obj, include=None, exclude=None):
        data, _ = orig_format(obj, include=include, exclude=exclude)
        text = data.get("text/plain")
        if not isinstance(text, str):
            return {}, {}
        if len(text) > limit:
            state.value_cut += len(text) - limit
            text = text[:limit] + f"…[truncated {len(text) - limit} chars]…"
        return {"text/plain": text}, {}

    fmt.format = bounded_format

    class ToolUnavailable(BaseException):
        "A bridged tool failed for reasons outside the agent's control."

    def make(name, params):
        def stub(*args, **kwargs):
            if params and len(args) > len(params):
                raise TypeError(
                    f"{name}() takes at most {len(params)} positional arguments ({len(args)} given)"
                )
            names = params or [f"arg{i}" for i in range(len(args))]
            call = dict(kwargs)
            for param, arg in zip(names, args):
                if param in call:
                    raise TypeError(f"{name}() got multiple values for argument {param!r}")
                call[param] = arg
            try:
                payload = json.dumps({"name": name, "kwargs": call}, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"arguments of {name}() must be JSON values: {exc}") from None
            reply = json.loads(kernel.raw_input(prefix + payload))
            if reply.get("interrupt"):
                raise KeyboardInterrupt
            if "error" in reply:
                raise ToolUnavailable(f"{name}: {reply['error']}")
            return str(reply.get("text", ""))

        stub.__name__ = stub.__qualname__ = name
        sig = ", ".join([*params, "**kwargs"]) if params else "*args, **kwargs"
        stub.__doc__ = f"{name}({sig}) -> str: call the {name!r} tool and return its text result."
        return stub

    for name, params in tools.items():
        ip.user_ns[name] = make(name, params)

    mod = types.ModuleType("_rollcage_kernel")
    mod.stats = lambda: f"{out.dropped},{err.dropped},{state.value_cut}"
    sys.modules["_rollcage_kernel"] = mod


_rollcage_setup(__LIMIT__, __TOOLS__, __PREFIX__, __MARKER__)
del _rollcage_setup
"""


class _TextBuffer:
    """Keeps the first ``limit`` characters of a stream, counts the rest."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._parts: list[str] = []
        self._size = 0
        self.dropped = 0

    def add(self, text: str) -> None:
        room = self._limit - self._size
        if room > 0:
            head = text[:room]
            self._parts.append(head)
            self._size += len(head)
        self.dropped += max(len(text) - max(room, 0), 0)

    def text(self, extra_dropped: int = 0) -> str:
        return mark_dropped("".join(self._parts), self.dropped + extra_dropped)


class _JupyterCell(PendingCell):
    _executor: JupyterExecutor

    def __init__(self, executor: JupyterExecutor, msg_id: str) -> None:
        super().__init__(executor)
        self.msg_id = msg_id
        limit = executor._output_limit
        self.stdout = _TextBuffer(limit)
        self.stderr = _TextBuffer(limit)
        self.value: str | None = None
        self.error: str | None = None
        self.interrupted = False
        self.truncated = False
        self.reply: dict[str, Any] | None = None
        self.idle = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # Messages routed here by the executor's channel pumps.

    def on_iopub(self, msg: dict[str, Any]) -> None:
        kind = msg.get("msg_type")
        content = msg.get("content", {})
        if kind == "stream":
            target = self.stderr if content.get("name") == "stderr" else self.stdout
            target.add(str(content.get("text", "")))
        elif kind == "display_data":
            text = content.get("data", {}).get("text/plain")
            if isinstance(text, str):
                self.stdout.add(text + "\n")
        elif kind == "execute_result":
            text = content.get("data", {}).get("text/plain")
            if isinstance(text, str):
                self.value = text
        elif kind == "error":
            self.interrupted = content.get("ename") == "KeyboardInterrupt"
            text = _ANSI.sub("", "\n".join(str(line) for line in content.get("traceback", [])))
            self.error, cut = bound_tail(text, self._executor._output_limit)
            self.truncated = self.truncated or cut
        elif kind == "status" and content.get("execution_state") == "idle":
            self.idle = True
            self._maybe_done()

    def on_reply(self, msg: dict[str, Any]) -> None:
        self.reply = msg.get("content", {})
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.idle and self.reply is not None and not self.done.done():
            self.done.set_result(None)

    async def wait(self) -> CellOutput:
        await wait_shared(self.done)
        return self._output()

    def partial(self) -> CellOutput:
        return self._output()

    def _output(self) -> CellOutput:
        out_dropped, err_dropped, value_cut = _parse_stats((self.reply or {}).get("user_expressions", {}))
        marker = self._executor._marker
        status: Literal["ok", "error"] = "ok"
        if self.error is not None or (self.reply or {}).get("status") == "error":
            status = "error"
        return CellOutput(
            status=status,
            stdout=self.stdout.text(out_dropped).replace(marker, ""),
            stderr=self.stderr.text(err_dropped).replace(marker, ""),
            value=self.value,
            error=self.error,
            truncated=self.truncated
            or bool(self.stdout.dropped or self.stderr.dropped or out_dropped or err_dropped or value_cut),
            interrupted=self.interrupted,
        )


def _parse_stats(expressions: object) -> tuple[int, int, int]:
    """Characters the kernel cut from stdout, stderr and the value (zeros if it did not say)."""
    try:
        assert isinstance(expressions, dict)
        text = expressions["rollcage"]["data"]["text/plain"]
        out, err, value = str(text).strip("'\"").split(",")
        return max(int(out), 0), max(int(err), 0), max(int(value), 0)
    except (AssertionError, KeyError, TypeError, ValueError):
        return 0, 0, 0


class _KernelManager(AsyncKernelManager):
    """A kernel manager that starts the kernel under a command-line prefix (the executor's cage)."""

    def __init__(self, prefix: Sequence[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rollcage_prefix = list(prefix)

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        command: list[str] = super().format_kernel_cmd(extra_arguments)
        return [*self._rollcage_prefix, *command]


class JupyterExecutor(Executor):
    """The optional backend: an ipykernel in its own session, driven by ``jupyter_client``."""

    backend: Literal["repl", "jupyter"] = "jupyter"

    def __init__(self, settings: ExecutorSettings, **options: Unpack[ExecutorOptions]) -> None:
        super().__init__(settings, **options)
        self._km: AsyncKernelManager | None = None
        self._kc: AsyncKernelClient | None = None
        self._tmpdir: str | None = None
        self._pid: int | None = None
        self._exited: asyncio.Future[None] | None = None
        self._pid_handle: PidHandle | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._orphans: set[asyncio.Task[None]] = set()
        self._current: _JupyterCell | None = None
        self._setup_id: str | None = None
        # Written to fds 1 and 2 after each cell to flush subprocess output through; stripped here.
        self._marker = f"\x1e\x00rollcage-sync-{os.urandom(6).hex()}\x1e"
        self._setup_reply: asyncio.Future[dict[str, Any]] | None = None

    @property
    def pid(self) -> int | None:
        """Pid (and process group id) of the kernel; None when there is none."""
        return self._pid if self._alive() else None

    # ------------------------------------------------------------------ launch

    async def _launch(self) -> None:
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        self._tmpdir = tmpdir = await asyncio.to_thread(tempfile.mkdtemp, prefix="rollcage-kernel-")
        env = dict(self._env)
        env.setdefault("IPYTHONDIR", os.path.join(tmpdir, "ipython"))
        env["JUPYTER_RUNTIME_DIR"] = tmpdir
        km = self._km = _KernelManager(
            self._prefix,
            kernel_name="python3",
            transport="ipc",
            ip=os.path.join(tmpdir, "kernel"),
            connection_file=os.path.join(tmpdir, "kernel.json"),
        )
        stderr_path = os.path.join(tmpdir, "kernel.stderr")
        try:
            async with asyncio.timeout(self._start_timeout_s):
                stderr = await asyncio.to_thread(open, stderr_path, "wb")
                with stderr:  # the kernel keeps its own copy of the fd
                    await km.start_kernel(
                        cwd=str(self._cwd),
                        env=env,
                        extra_arguments=_KERNEL_ARGS,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=stderr,
                    )
                process = self._process()
                if process is None:
                    raise ExecutorError("the Jupyter kernel did not start (no process)")
                self._pid = int(process.pid)
                self._watch_exit(self._pid)
                kc = self._kc = km.client()
                kc.start_channels()
                ready = asyncio.ensure_future(kc.wait_for_ready(timeout=self._start_timeout_s))
                assert self._exited is not None
                await asyncio.wait({ready, self._exited}, return_when=asyncio.FIRST_COMPLETED)
                if not ready.done():
                    ready.cancel()
                    raise ExecutorError("the Jupyter kernel exited during start-up")
                ready.result()
                self._start_pumps(kc)
                await self._setup(kc)
        except ExecutorError as exc:
            tail = await self._stderr_tail(stderr_path)
            failure = self.cage_failure(tail)
            if failure is not None:
                raise failure from exc
            raise ExecutorError(f"{exc}{tail}") from exc
        except TimeoutError as exc:
            raise ExecutorError(
                f"the Jupyter kernel did not become ready within {self._start_timeout_s:g} s"
                f"{await self._stderr_tail(stderr_path)}"
            ) from exc
        except Exception as exc:
            raise ExecutorError(
                f"cannot start the Jupyter kernel ({type(exc).__name__}: {exc})"
                f"{await self._stderr_tail(stderr_path)}"
            ) from exc

    async def _stderr_tail(self, path: str) -> str:
        def read() -> str:
            try:
                with open(path, "rb") as f:
                    return f.read()[-2000:].decode("utf-8", "replace").strip()
            except OSError:
                return ""

        text = await asyncio.to_thread(read)
        return f": {text}" if text else ""

    def _watch_exit(self, pid: int) -> None:
        """Resolve ``self._exited`` when the kernel exits (pidfd; polling where there is none)."""
        loop = asyncio.get_running_loop()

        def exited() -> None:
            if self._pid_handle is not None:
                loop.remove_reader(self._pid_handle.fd)
            process = self._process()
            if process is not None:
                process.poll()  # reap it now: a zombie leader keeps its group "alive"
            if self._exited is not None and not self._exited.done():
                self._exited.set_result(None)
            if self._current is not None:
                fail_future(self._current.done, ProcessDied(self._describe_exit()))

        self._pid_handle = PidHandle.of_child(pid)
        if self._pid_handle is None:
            # No pidfd (not Linux): a thread waits for the exit instead.
            self._tasks.append(asyncio.create_task(self._wait_exit_in_thread(exited)))
            return
        loop.add_reader(self._pid_handle.fd, exited)

    async def _wait_exit_in_thread(self, exited: Callable[[], None]) -> None:
        process = self._process()
        if process is not None:
            await asyncio.to_thread(process.wait)
        exited()

    def _process(self) -> subprocess.Popen[bytes] | None:
        """The kernel's Popen, as the local provisioner holds it."""
        km = self._km
        process: subprocess.Popen[bytes] | None = getattr(km.provisioner, "process", None) if km else None
        return process

    def _describe_exit(self) -> str:
        process = self._process()
        code = process.poll() if process is not None else None
        return "the kernel exited" if code is None else describe_exit(code)

    def _start_pumps(self, kc: AsyncKernelClient) -> None:
        self._tasks.append(asyncio.create_task(self._pump(kc.get_iopub_msg, self._on_iopub)))
        self._tasks.append(asyncio.create_task(self._pump(kc.get_shell_msg, self._on_shell)))
        self._tasks.append(asyncio.create_task(self._pump(kc.get_stdin_msg, self._on_stdin)))

    async def _pump(
        self,
        get: Callable[[], Coroutine[Any, Any, dict[str, Any]]],
        handle: Callable[[dict[str, Any]], None],
    ) -> None:
        with contextlib.suppress(Exception):  # the channels were closed under us
            while True:
                handle(await get())

    def _cell_for(self, msg: dict[str, Any]) -> _JupyterCell | None:
        cell = self._current
        parent = msg.get("parent_header") or {}
        if cell is not None and parent.get("msg_id") == cell.msg_id:
            return cell
        return None

    def _on_iopub(self, msg: dict[str, Any]) -> None:
        cell = self._cell_for(msg)
        if cell is not None:
            cell.on_iopub(msg)

    def _on_shell(self, msg: dict[str, Any]) -> None:
        cell = self._cell_for(msg)
        if cell is not None and msg.get("msg_type") == "execute_reply":
            cell.on_reply(msg)
        elif self._setup_reply is not None and not self._setup_reply.done():
            if (msg.get("parent_header") or {}).get("msg_id") == self._setup_id:
                self._setup_reply.set_result(msg.get("content", {}))

    async def _setup(self, kc: AsyncKernelClient) -> None:
        code = (
            _SETUP.replace("__LIMIT__", str(self._output_limit))
            .replace("__TOOLS__", repr({name: list(params) for name, params in self._tools.items()}))
            .replace("__PREFIX__", repr(_TOOL_PREFIX))
            .replace("__MARKER__", repr(self._marker))
        )
        self._setup_reply = asyncio.get_running_loop().create_future()
        self._setup_id = kc.execute(code, silent=True, store_history=False)
        assert self._exited is not None
        waits: set[asyncio.Future[Any]] = {self._setup_reply, self._exited}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not self._setup_reply.done():
            raise ExecutorError("the Jupyter kernel exited during set-up")
        reply = self._setup_reply.result()
        if reply.get("status") != "ok":
            raise ExecutorError(
                f"the Jupyter kernel set-up failed: {reply.get('ename')}: {reply.get('evalue')}"
            )

    def _on_stdin(self, msg: dict[str, Any]) -> None:
        if msg.get("msg_type") != "input_request":
            return
        prompt = str(msg.get("content", {}).get("prompt", ""))
        cell = self._cell_for(msg)
        if not prompt.startswith(_TOOL_PREFIX):
            # Agent code called input(): there is nobody to type, answer end-of-file.
            self._reply_input("\x04")
            return
        task = asyncio.create_task(self._serve_tool(cell, prompt[len(_TOOL_PREFIX) :]))
        # Keep a reference: a task nobody holds may be garbage-collected mid-call.
        tasks = cell.bridge_tasks if cell is not None else self._orphans
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _reply_input(self, value: str) -> None:
        if self._kc is not None:
            with contextlib.suppress(Exception):
                self._kc.input(value)

    async def _serve_tool(self, cell: _JupyterCell | None, payload: str) -> None:
        reply: dict[str, Any] = {}
        try:
            call = json.loads(payload)
            name, kwargs = call["name"], call["kwargs"]
        except (ValueError, KeyError, TypeError):
            name, kwargs = None, None
        if cell is None:
            reply["error"] = "tool calls are only possible while a cell runs"
        elif not isinstance(name, str) or name not in self._tools or not isinstance(kwargs, dict):
            reply["error"] = f"unknown tool {name!r}"
        else:
            assert self._bridge is not None  # checked in __init__ when tools are given
            try:
                reply["text"] = str(await self._bridge(name, kwargs))
            except asyncio.CancelledError:
                reply["interrupt"] = True
                self._reply_input(json.dumps(reply))
                raise
            except Exception as exc:
                if cell.bridge_failure is None:
                    cell.bridge_failure = exc
                reply["error"] = f"{type(exc).__name__}: {exc}"
        self._reply_input(json.dumps(reply))

    # ------------------------------------------------------------------ cells

    def _submit(self, code: str) -> PendingCell:
        kc = self._kc
        assert kc is not None
        msg_id = kc.execute(
            code,
            silent=False,
            store_history=True,
            allow_stdin=True,
            stop_on_error=False,
            user_expressions={"rollcage": _STATS_EXPR},
        )
        cell = self._current = _JupyterCell(self, msg_id)
        if not self._alive():
            fail_future(cell.done, ProcessDied(self._describe_exit()))
        return cell

    async def _interrupt(self) -> None:
        if self._pid is not None and self._alive():
            # The kernel spec's interrupt mode is "signal": SIGINT to the group,
            # as KernelManager.interrupt_kernel would send.
            signal_group(self._pid, signal.SIGINT)
        if self._current is not None:
            self._current.cancel_bridges()

    def _alive(self) -> bool:
        if self._exited is not None and self._exited.done():
            return False
        process = self._process()
        return process is not None and process.poll() is None and is_running(process.pid)

    async def _teardown(self, *, graceful: bool) -> None:
        pid = self._pid
        exited = self._exited
        if pid is not None and exited is not None:
            strategy = StopStrategy(
                grace_s=self._settings.interrupt_grace_s if graceful and self._alive() else 0.0,
                kill_wait_s=_REAP_TIMEOUT_S,
            )
            # The leader may be gone while members of its group live on: the stop always sweeps the group.
            if not await stop_tree(GroupTree(pid, exited), strategy):
                log.error("processes of the Jupyter kernel's group %d survived SIGKILL", pid)
        if self._current is not None:
            fail_future(self._current.done, ProcessDied("killed"))
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=_IO_TIMEOUT_S)
        self._tasks.clear()
        if self._pid_handle is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pid_handle.fd)
            self._pid_handle.close()
            self._pid_handle = None
        if self._kc is not None:
            with contextlib.suppress(Exception):
                self._kc.stop_channels()
            self._kc = None
        if self._km is not None:
            # Reaps the (dead) kernel and removes its connection and ipc files.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_REAP_TIMEOUT_S):
                    await self._km.shutdown_kernel(now=True)
            self._km = None
        if self._tmpdir is not None:
            await asyncio.to_thread(shutil.rmtree, self._tmpdir, True)
            self._tmpdir = None
        self._pid = None
        self._setup_reply = None
