"""The ``repl`` executor's child process: a persistent namespace behind a framed protocol.

Run by :mod:`rollcage.tools._repl` as ``python -I -u -c BOOT CTL_FD``: the
parent sends this module's code, compiled, as the first frame, and ``BOOT`` runs
it as ``__main__`` (a script's bytecode is never cached; this way it is compiled
once, not at every start, and importing the ``rollcage`` package and pydantic is
not part of any start). It imports nothing beyond what the interpreter has
already loaded at start-up, so it is ready in about a bare interpreter's time.

Wire format on the control socket ``CTL_FD`` (never on stdout, which belongs to
the cell):

* parent → child: 4-byte big-endian length, then a ``marshal``-encoded dict
  (``init``, ``run``, ``tool_result``). The child trusts its parent.
* child → parent: 4-byte big-endian length, then UTF-8 JSON (``ready``,
  ``done``, ``tool_call``). The parent does not trust the child, hence JSON.

The cell's ``sys.stdout``/``sys.stderr`` write straight to fds 1 and 2 (pipes
the parent drains), so a cell's prints and its subprocesses' output arrive in
order; each stream stops forwarding after ``limit`` bytes per cell and counts the
rest, so a cell printing 100 MB costs neither process memory. After each cell a
marker is written to both fds so the parent knows where the cell's output ends.

SIGINT raises KeyboardInterrupt only while cell code runs; while the child is
reading or writing the control socket it is only remembered, so an interrupt
can never tear a frame.
"""

from __future__ import annotations

import _ast
import _thread
import builtins
import io
import marshal
import os
import sys

# ``typing`` would pull in re, enum, functools and collections (~10 ms): the
# annotations here are never evaluated, so it is imported for the type checker only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__: list[str] = []

# Already loaded by the interpreter at start-up; ``import signal`` would add enum.
_signal: Any = sys.modules.get("_signal") or __import__("signal")

_MAIN_THREAD = _thread.get_ident()
_THIS_FILE = __file__


class _State:
    """Flags shared by the SIGINT handler and the loop."""

    in_cell = False
    """SIGINT raises KeyboardInterrupt only while this is true (main thread only)."""
    pending_interrupt = False
    """A SIGINT arrived while in_cell was false."""
    next_call_id = 0


_io_lock = _thread.allocate_lock()


def _on_sigint(signum: int, frame: object) -> None:
    if _State.in_cell:
        raise KeyboardInterrupt
    _State.pending_interrupt = True


# ---------------------------------------------------------------- JSON encoding
# ``json`` costs ~5 ms to import (it pulls in ``re``); the child only ever
# encodes small frames of str/int/float/bool/None/list/dict, so it does it here.

_ESCAPES = {i: f"\\u{i:04x}" for i in range(32)}
_ESCAPES[ord('"')] = '\\"'
_ESCAPES[ord("\\")] = "\\\\"


def _json(obj: object, depth: int = 0) -> str:
    if depth > 64:
        raise ValueError("value nested too deeply")
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, str):
        return '"' + obj.translate(_ESCAPES) + '"'
    if isinstance(obj, int):
        return int.__repr__(obj)
    if isinstance(obj, float):
        if obj != obj or obj in (float("inf"), float("-inf")):
            raise ValueError(f"{obj!r} is not a JSON number")
        return float.__repr__(obj)
    if isinstance(obj, list | tuple):
        return "[" + ",".join(_json(v, depth + 1) for v in obj) + "]"
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"object keys must be strings, not {type(k).__name__}")
            items.append(_json(k) + ":" + _json(v, depth + 1))
        return "{" + ",".join(items) + "}"
    raise TypeError(f"{type(obj).__name__} is not a JSON value")


# --------------------------------------------------------------------- framing


class _Channel:
    """Blocking framed I/O on the control socket."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def send(self, frame: dict[str, Any]) -> None:
        # Lone surrogates (from odd bytes in a traceback) become '?' rather than
        # breaking the frame.
        body = _json(frame).encode("utf-8", "replace")
        data = memoryview(len(body).to_bytes(4, "big") + body)
        while data:
            n = os.write(self.fd, data)
            data = data[n:]

    def recv(self) -> dict[str, Any] | None:
        """The next frame, or None at EOF (the parent is gone)."""
        while len(self.buf) < 4:
            if not self._fill():
                return None
        size = int.from_bytes(self.buf[:4], "big")
        while len(self.buf) < 4 + size:
            if not self._fill():
                return None
        body, self.buf = self.buf[4 : 4 + size], self.buf[4 + size :]
        msg = marshal.loads(body)
        assert isinstance(msg, dict)
        return msg

    def _fill(self) -> bool:
        data = os.read(self.fd, 1 << 16)
        self.buf += data
        return bool(data)


# --------------------------------------------------------------------- capture


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class _CaptureBytes(io.RawIOBase):
    """``sys.stdout.buffer``: the same bounded fd, for bytes."""

    def __init__(self, owner: _Capture) -> None:
        self._owner = owner

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._owner.fd

    def write(self, b: Any) -> int:
        data = bytes(b)
        self._owner.forward(data)
        return len(data)


class _Capture(io.TextIOBase):
    """A cell's ``sys.stdout``/``sys.stderr``: forwards the first ``limit`` bytes, counts the rest."""

    def __init__(self, fd: int, name: str, limit: int) -> None:
        self.fd = fd
        self._name = name
        self.limit = limit
        self.written = 0
        self.dropped = 0
        self._buffer = _CaptureBytes(self)

    @property
    def buffer(self) -> _CaptureBytes:
        return self._buffer

    @property
    def name(self) -> str:
        return self._name

    # Class attributes shadow io.TextIOBase's read-only descriptors.
    encoding = "utf-8"
    errors = "surrogateescape"

    def reset(self) -> None:
        self.written = 0
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.fd

    def flush(self) -> None:
        pass

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        room = self.limit - self.written
        if room <= 0:
            self.dropped += len(s)
            return len(s)
        # Encode no more than could be forwarded: a 100 MB string costs no copy.
        head = s[:room]
        self.forward(head.encode("utf-8", "surrogateescape"), len(s) - len(head))
        return len(s)

    def forward(self, data: bytes, more: int = 0) -> None:
        """Forward what fits in this cell's budget; count the rest (``more``: already cut)."""
        chunk = data[: max(self.limit - self.written, 0)]
        # Counts mix characters and bytes at the cut; the marker only needs to be about right.
        self.dropped += more + len(data) - len(chunk)
        if chunk:
            self.written += len(chunk)
            _write_all(self.fd, chunk)


# ------------------------------------------------------------------ the session


class _ToolUnavailable(BaseException):
    """A bridged tool failed for reasons outside the agent's control.

    A BaseException, so that ``except Exception`` in agent code does not hide an
    infrastructure failure; the parent reports it in any case.
    """


def _make_stub(channel: _Channel, name: str, params: tuple[str, ...]) -> Any:
    def stub(*args: Any, **kwargs: Any) -> str:
        if params and len(args) > len(params):
            raise TypeError(f"{name}() takes at most {len(params)} positional arguments ({len(args)} given)")
        # Without declared parameter names, positional arguments travel as arg0, arg1, ...
        names = params or tuple(f"arg{i}" for i in range(len(args)))
        call = dict(kwargs)
        for param, arg in zip(names, args, strict=False):
            if param in call:
                raise TypeError(f"{name}() got multiple values for argument {param!r}")
            call[param] = arg
        return _call_tool(channel, name, call)

    stub.__name__ = stub.__qualname__ = name
    signature = ", ".join([*params, "**kwargs"]) if params else "*args, **kwargs"
    stub.__doc__ = f"{name}({signature}) -> str: call the {name!r} tool and return its text result."
    return stub


def _call_tool(channel: _Channel, name: str, kwargs: dict[str, Any]) -> str:
    try:
        _State.next_call_id += 1
        call_id = _State.next_call_id
        frame = {"op": "tool_call", "id": call_id, "name": name, "kwargs": kwargs}
        _json(frame)  # fail in the caller's frame, with a clear message, if not JSON
    except (TypeError, ValueError) as exc:
        raise TypeError(f"arguments of {name}() must be JSON values: {exc}") from None
    main = _thread.get_ident() == _MAIN_THREAD
    # One tool call at a time; a call from another thread waits its turn.
    with _io_lock:
        was_in_cell = _State.in_cell
        if main:
            _State.in_cell = False
        try:
            channel.send(frame)
            while True:
                msg = channel.recv()
                if msg is None:
                    os._exit(0)  # the parent is gone
                if msg.get("op") == "tool_result" and msg.get("id") == call_id:
                    break
                # Anything else is a stale reply to an abandoned call.
        finally:
            if main:
                _State.in_cell = was_in_cell
    if main and _State.pending_interrupt:
        _State.pending_interrupt = False
        raise KeyboardInterrupt
    if msg.get("interrupt"):
        raise KeyboardInterrupt  # the parent abandoned the call: the cell is being interrupted
    if "error" in msg:
        raise _ToolUnavailable(f"{name}: {msg['error']}")
    return str(msg.get("text", ""))


class _Session:
    def __init__(self, channel: _Channel, init: dict[str, Any]) -> None:
        self.channel = channel
        self.limit = int(init["limit"])
        self.marker = bytes(init["marker"])
        self.sources: dict[str, str] = {}
        self.pid = os.getpid()
        module = type(sys)("__main__")
        module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = module
        self.ns = module.__dict__
        for name, params in dict(init["tools"]).items():
            self.ns[name] = _make_stub(channel, name, tuple(params))
        self.out = _Capture(1, "<stdout>", self.limit)
        self.err = _Capture(2, "<stderr>", self.limit)
        sys.argv = [""]
        # Like Jupyter: modules the agent writes into its workspace are importable.
        sys.path.insert(0, "")

    def run(self, cell_id: int, code: str) -> dict[str, Any]:
        _State.pending_interrupt = False
        _signal.signal(_signal.SIGINT, _on_sigint)
        sys.stdout, sys.stderr = self.out, self.err
        self.out.reset()
        self.err.reset()
        filename = f"<cell-{cell_id}>"
        self.sources[filename] = code
        status = "ok"
        value: str | None = None
        error: str | None = None
        truncated = False
        interrupted = False
        try:
            try:
                _State.in_cell = True
                tree: Any = compile(code, filename, "exec", _ast.PyCF_ONLY_AST, dont_inherit=True)
                last = tree.body.pop() if tree.body and isinstance(tree.body[-1], _ast.Expr) else None
                exec(compile(tree, filename, "exec", dont_inherit=True), self.ns)
                if last is not None:
                    expr = _ast.Expression(last.value)
                    result = eval(compile(expr, filename, "eval", dont_inherit=True), self.ns)
                    if result is not None:
                        self.ns["_"] = result
                        value, truncated = _bounded_repr(result, self.limit)
            finally:
                _State.in_cell = False
                if os.getpid() != self.pid:
                    # A process the cell forked fell out of it: it must not speak for the session.
                    os._exit(0)
        except BaseException as exc:  # the cell's exceptions (SystemExit included) are results
            status = "error"
            interrupted = isinstance(exc, KeyboardInterrupt)
            error, cut = self._format(exc)
            truncated = truncated or cut
        finally:
            sys.stdout, sys.stderr = self.out, self.err
        mark = self.marker + b"%08x\x1e" % cell_id
        for fd in (1, 2):
            try:
                _write_all(fd, mark)
            except OSError:
                pass  # the cell closed it; the parent stops waiting for the marker
        return {
            "op": "done",
            "id": cell_id,
            "status": status,
            "value": value,
            "error": error,
            "interrupted": interrupted,
            "truncated": truncated,
            "stdout_dropped": self.out.dropped,
            "stderr_dropped": self.err.dropped,
        }

    def _format(self, exc: BaseException) -> tuple[str, bool]:
        try:
            # Imported only when a cell fails: traceback costs ~9 ms.
            import linecache
            import traceback

            for filename, source in self.sources.items():
                linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
            _drop_own_frames(te, set())
            text = "".join(te.format())
        except BaseException as fmt_exc:  # a broken __str__ must not kill the session
            text = f"{type(exc).__name__} (traceback unavailable: {type(fmt_exc).__name__})\n"
        if len(text) <= self.limit:
            return text, False
        cut = len(text) - self.limit
        return f"…[truncated {cut} chars]…\n" + text[cut:], True


def _drop_own_frames(te: Any, seen: set[int]) -> None:
    """Remove this file's frames (the loop, the SIGINT handler) from a traceback and its chain."""
    if te is None or id(te) in seen:
        return
    seen.add(id(te))
    import traceback

    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != _THIS_FILE])
    _drop_own_frames(te.__cause__, seen)
    _drop_own_frames(te.__context__, seen)


def _bounded_repr(value: object, limit: int) -> tuple[str, bool]:
    text = repr(value)
    if len(text) <= limit:
        return text, False
    return text[:limit] + f"…[truncated {len(text) - limit} chars]…", True


def main(argv: list[str]) -> int:
    """Serve cells until the parent closes the control socket."""
    fd = int(argv[1])
    # Processes the cell starts must not inherit the control socket.
    os.set_inheritable(fd, False)
    channel = _Channel(fd)
    _signal.signal(_signal.SIGINT, _on_sigint)
    # The parent may start this process with SIGINT blocked (rollcage.tools._repl): taken from here on.
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [_signal.SIGINT])
    init = channel.recv()
    if init is None or init.get("op") != "init":
        return 2
    session = _Session(channel, init)
    channel.send({"op": "ready", "pid": os.getpid()})
    while True:
        with _io_lock:
            msg = channel.recv()
        if msg is None:
            return 0
        op = msg.get("op")
        if op == "run":
            reply = session.run(int(msg["id"]), str(msg["code"]))
            with _io_lock:
                channel.send(reply)
        elif op == "exit":
            return 0
        # A stale tool_result (its call was abandoned by an interrupt) is dropped.


if __name__ == "__main__":
    try:
        code = main(sys.argv)
    except (BrokenPipeError, ConnectionResetError):
        code = 0  # the parent went away: nothing to report to
    os._exit(code)
