"""A fake worker for the supervisor's tests: ``fake_worker.py MODE [ARG...] INPUT RESULT --checkpoint PATH``.

It speaks the worker's file protocol (reads INPUT, appends journal lines to the
checkpoint, publishes RESULT atomically under the name ``publish_json`` uses)
and then misbehaves as MODE says. Standard library only, so it starts fast,
also inside the sandbox.

Modes:
    ok                    publish a valid completed result, exit 0
    model                 one model call through the proxy (input's model.uds/base_url), then completed
    model-then-fatal      one model call, then a fatal error (an agent error)
    resource NAME PATH    one resource call (POST), then completed; the reply in workspace/resource.json
    fatal-early           fatal error before any model call, exit 1
    transient             transient error, exit 1
    hang                  sleep; on SIGTERM publish a cancelled result and exit 143
    hang-model            call the model (which hangs); on SIGTERM publish a cancelled result, exit 143
    no-result CODE        exit CODE without a result
    truncated CODE        write a truncated result.json, exit CODE
    not-json CODE         write a result.json that is not JSON, exit CODE
    wrong-schema CODE     write JSON that is not a WorkerResult, exit CODE
    self-kill             append two checkpoint records, then SIGKILL itself
    temp-then-die         write and fsync the temporary result file, then SIGKILL itself before the rename
    daemon [ignore-term]  leave a setsid double-forked daemon (pid in workspace/daemon.pid), then completed
    fork-bomb MAX         one model response journaled, then fork until refused or MAX children (count in
                          workspace/forks.txt); then completed
    fill PATH MIB         one model response journaled, then write MIB MiB to PATH (in the sandbox's view),
                          then completed
    fill-hang PATH MIB    as fill, then sleep; on SIGTERM publish a cancelled result and exit 143
    tree SEED COUNT       write the tree agent_tree(SEED, COUNT) says into the workspace, then completed
    tree-hang SEED COUNT  as tree, then sleep; on SIGTERM publish a cancelled result and exit 143
    memory-bomb MAX_MIB   allocate until refused or MAX_MIB (MiB in workspace/memory.txt); then completed
    probe                 try to escape (see _probe); findings in workspace/probe.json, then completed
    first-action FILE     write time.time() to FILE (host view) at once, then completed (benchmark)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import time
import zlib
from collections.abc import Callable
from http.client import HTTPConnection
from typing import Any
from urllib.parse import urlsplit

STARTED = time.time()


def journal_append(path: str, seq: int, record: dict[str, Any]) -> None:
    body = json.dumps({"seq": seq, **record}, separators=(",", ":")).encode()
    line = body[:-1] + b',"crc32":"%08x"}\n' % zlib.crc32(body)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def publish(path: str, value: Any) -> None:
    directory, name = os.path.split(os.path.abspath(path))
    temp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, json.dumps(value).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, path)


def result(
    spec: dict[str, Any], *, calls: list[dict[str, Any]], error: dict[str, Any] | None
) -> dict[str, Any]:
    now = time.time()
    response = None
    if calls:
        response = {"id": spec["rollout_id"], "model": "fake", "status": "completed", "output": []}
    reason = "completed" if error is None else ("cancelled" if error["kind"] == "cancelled" else "error")
    return {
        "rollout_id": spec.get("rollout_id", ""),
        "task_id": spec.get("task_id", ""),
        "response": response,
        "trajectory": {"model_calls": calls, "tool_calls": []},
        "termination_reason": reason,
        "error": error,
        "started_at": STARTED,
        "ended_at": now,
    }


class UnixHTTPConnection(HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def http_post(
    base_url: str, uds: str | None, path: str, payload: Any, timeout: float = 60
) -> tuple[int, Any]:
    url = urlsplit(base_url)
    if uds is not None:
        conn: HTTPConnection = UnixHTTPConnection(uds, timeout)
    else:
        conn = HTTPConnection(url.hostname or "localhost", url.port or 80, timeout=timeout)
    body = json.dumps(payload).encode()
    conn.request(
        "POST",
        url.path.rstrip("/") + path,
        body=body,
        headers={"Content-Type": "application/json", "Authorization": "Bearer sandbox-has-no-key"},
    )
    response = conn.getresponse()
    data = response.read()
    conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode("utf-8", "replace")


def model_call(spec: dict[str, Any], index: int = 0) -> dict[str, Any]:
    model = spec["model"]
    request = {"model": model["model"], "messages": [{"role": "user", "content": "hi"}]}
    started = time.time()
    status, response = http_post(model["base_url"], model.get("uds"), "/chat/completions", request)
    if status != 200 or not isinstance(response, dict):
        raise SystemExit(f"model call failed: {status} {response}")
    ended = time.time()
    attempt = {
        "index": 0,
        "status": "completed",
        "http_status": status,
        "started_at": started,
        "ended_at": ended,
    }
    return {
        "id": f"{spec.get('rollout_id', 'r')}:m{index}",
        "index": index,
        "turn": index,
        "api": "chat",
        "request": request,
        "response": response,
        "status": "completed",
        "http_status": status,
        "attempts": [attempt],
        "started_at": started,
        "ended_at": ended,
    }


def on_sigterm_publish_cancelled(spec: dict[str, Any], result_path: str) -> None:
    def handler(signum: int, frame: Any) -> None:
        error = {
            "kind": "cancelled",
            "type": "CancelledError",
            "message": f"cancelled by {signal.Signals(signum).name}",
        }
        publish(result_path, result(spec, calls=[], error=error))
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def daemonize(ignore_term: bool, pid_file: str) -> None:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            if ignore_term:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(pid_file + ".tmp", "w") as file:
                file.write(str(os.getpid()))
            os.replace(pid_file + ".tmp", pid_file)
            time.sleep(600)
            os._exit(0)
        os._exit(0)
    while not os.path.exists(pid_file):
        time.sleep(0.01)
    os.wait()


def fork_bomb(out: str, most: int) -> None:
    # Bounded, so that a sandbox that fails to contain it does not take the test machine down.
    children = 0
    try:
        for _ in range(most):
            pid = os.fork()
            if pid == 0:
                time.sleep(600)
                os._exit(0)
            children += 1
    except OSError as exc:
        with open(out, "w") as file:
            file.write(f"{children} {exc.errno}")
        return
    with open(out, "w") as file:
        file.write(f"{children} none")


def memory_bomb(out: str, most_mib: int) -> None:
    blocks = []
    try:
        for _ in range(most_mib // 16):
            blocks.append(bytearray(16 << 20))
    except MemoryError:
        pass
    with open(out, "w") as file:
        file.write(str(len(blocks) * 16))
    blocks.clear()


def _attempt(what: str, fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"refused: {type(exc).__name__}: {exc}"
    return f"succeeded: {what}"


def _write(path: str) -> None:
    with open(path, "a") as file:
        file.write("pwned\n")


def probe(args: list[str], workspace: str) -> dict[str, Any]:
    """args: HOST_TCP_PORT SECRET_VAR HOST_PATH... (paths to try writing)."""
    port, secret_var, *paths = args
    findings: dict[str, Any] = {}
    findings["tcp_loopback"] = _attempt(
        "connected", lambda: socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
    )
    findings["dns"] = _attempt("resolved", lambda: socket.getaddrinfo("example.com", 80))
    findings["tcp_external"] = _attempt(
        "connected", lambda: socket.create_connection(("1.1.1.1", 53), timeout=2).close()
    )
    findings["secret"] = os.environ.get(secret_var)
    leaks = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as file:
                    if secret_var.encode() + b"=" in file.read():
                        leaks.append(pid)
            except OSError:
                pass
    findings["secret_in_proc"] = leaks
    findings["visible_pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    findings["writes"] = {path: _attempt("wrote", lambda p=path: _write(p)) for path in paths}
    findings["env"] = dict(os.environ)
    findings["uid"] = os.getuid()
    return findings


def mark(path: str, text: str) -> None:
    """Write a marker file a test waits for, whole or not at all: a test that sees it reads all of it."""
    temp = f"{path}.{secrets.token_hex(8)}.tmp"
    with open(temp, "w") as file:
        file.write(text)
    os.replace(temp, path)


def publish_inventory(workspace: str) -> None:
    """Write ``inventory.json`` into the workspace: each entry found there (links as links), in order."""
    found: dict[str, str] = {}
    for directory, dirs, files in os.walk(workspace):
        for name in sorted([*dirs, *files]):
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, workspace)
            if os.path.islink(path):
                found[rel] = "link:" + os.readlink(path)
            elif os.path.isdir(path):
                found[rel] = "dir"
            else:
                with open(path, encoding="utf-8", errors="replace") as file:
                    found[rel] = "file:" + file.read()
    with open(os.path.join(workspace, "inventory.json"), "w") as file:
        json.dump(found, file, sort_keys=True)


def acted(checkpoint: str) -> None:
    """Journal one model response: what follows is the policy's doing."""
    journal_append(checkpoint, 2, {"kind": "model_call", "at": 2, "model_call": {"status": "completed"}})


def fill(path: str, mib: int) -> None:
    """Write up to ``mib`` MiB to ``path``, stopping at the first refusal (ENOSPC, EFBIG)."""
    try:
        with open(path, "wb") as file:
            for _ in range(mib):
                file.write(b"x" * (1 << 20))
                file.flush()
    except OSError:
        pass


PREPARED = {"prepared-kept.txt": b"prepared, left alone", "prepared-changed.txt": b"prepared, then changed"}
"""What the tests lay in a workspace before a ``tree`` worker (which changes one and deletes none)."""


def agent_tree(seed: int, count: int) -> dict[str, bytes]:
    """The workspace a ``tree`` worker leaves: the prepared files, one changed, ``count`` new ones.

    Spread over directories, sized from a few bytes to tens of KiB, each naming its seed
    and index (so a file from another rollout or a torn copy never matches).
    """
    tree = dict(PREPARED)
    tree["prepared-changed.txt"] = f"changed by the agent {seed}".encode()
    for index in range(count):
        size = 1 + (index * 7919 + seed * 104729) % 40_000
        line = f"{seed}:{index}:".encode()
        tree[f"d{index % 7}/e{index % 3}/f{index}.bin"] = (line * (size // len(line) + 1))[:size]
    tree["all-written"] = str(count).encode()  # last: the test waits for it
    return tree


def write_tree(workspace: str, tree: dict[str, bytes]) -> None:
    """Write ``tree`` (relative path to bytes) into ``workspace``, in order."""
    for name, data in tree.items():
        path = os.path.join(workspace, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as file:
            file.write(data)


def first_action(extra: list[str], spec: dict[str, Any], result_path: str, workspace: str) -> int:
    """``first-action``."""
    with open(extra[0], "w") as file:
        file.write(repr(STARTED))
    publish(result_path, result(spec, calls=[], error=None))
    return 0


def tree_mode(hang: bool, extra: list[str], spec: dict[str, Any], result_path: str, workspace: str) -> int:
    """``tree`` and ``tree-hang``."""
    if hang:
        on_sigterm_publish_cancelled(spec, result_path)
    write_tree(workspace, agent_tree(int(extra[0]), int(extra[1])))
    if hang:
        time.sleep(600)
    publish(result_path, result(spec, calls=[], error=None))
    return 0


_OWN_MODES: dict[str, Callable[[list[str], dict[str, Any], str, str], int]] = {
    "first-action": first_action,
    "tree": lambda *args: tree_mode(False, *args),
    "tree-hang": lambda *args: tree_mode(True, *args),
}
"""Modes that do all of their work themselves: (extra arguments, input, result path, workspace)."""

_THEN_OK: dict[str, Callable[[str], None]] = {"ok": lambda _: None, "inventory": publish_inventory}
"""Modes that do one thing in the workspace, then publish an ordinary result."""


def main(argv: list[str]) -> int:
    mode, extra = argv[0], argv[1:-4]
    input_path, result_path = argv[-4], argv[-3]
    checkpoint = argv[-1]
    with open(input_path, "rb") as file:
        spec = json.load(file)
    workspace = os.path.join(os.path.dirname(os.path.abspath(result_path)), "workspace")
    journal_append(checkpoint, 1, {"kind": "start", "at": 1, "rollout_id": spec["rollout_id"]})
    ok = result(spec, calls=[], error=None)

    if mode in _THEN_OK:
        _THEN_OK[mode](workspace)
        publish(result_path, ok)
        return 0
    if mode in _OWN_MODES:
        return _OWN_MODES[mode](extra, spec, result_path, workspace)
    if mode in ("model", "model-then-fatal"):
        call = model_call(spec)
        journal_append(checkpoint, 2, {"kind": "model_call", "at": 2})
        error = None
        if mode == "model-then-fatal":
            error = {"kind": "fatal", "type": "ToolError", "message": "the agent broke its tool"}
        publish(result_path, result(spec, calls=[call], error=error))
        return 0 if error is None else 1
    if mode == "resource":
        name, path = extra
        endpoint = spec["resources"][name]
        status, reply = http_post(endpoint["base_url"], endpoint.get("uds"), path, {"city": "Oslo"})
        with open(os.path.join(workspace, "resource.json"), "w") as file:
            json.dump({"status": status, "reply": reply}, file)
        publish(result_path, ok)
        return 0
    if mode == "fatal-early":
        error = {"kind": "fatal", "type": "ExecutorError", "message": "the kernel never started"}
        publish(result_path, result(spec, calls=[], error=error))
        return 1
    if mode == "transient":
        error = {"kind": "transient", "type": "TransientModelError", "message": "503 from the endpoint"}
        publish(result_path, result(spec, calls=[], error=error))
        return 1
    if mode == "hang":
        on_sigterm_publish_cancelled(spec, result_path)
        mark(os.path.join(workspace, "started"), str(os.getpid()))
        time.sleep(600)
        return 0
    if mode == "hang-model":
        on_sigterm_publish_cancelled(spec, result_path)
        model_call(spec)
        return 0
    if mode == "no-result":
        return int(extra[0])
    if mode in ("truncated", "not-json", "wrong-schema"):
        content = {
            "truncated": json.dumps(ok)[:40],
            "not-json": "this is not JSON",
            "wrong-schema": json.dumps({"rollout_id": spec["rollout_id"], "reward": 1.0}),
        }[mode]
        with open(result_path, "w") as file:
            file.write(content)
        return int(extra[0])
    if mode == "self-kill":
        journal_append(checkpoint, 2, {"kind": "model_call", "at": 2})
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "temp-then-die":
        directory, name = os.path.split(os.path.abspath(result_path))
        temp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, json.dumps(ok).encode())
        os.fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "daemon":
        daemonize("ignore-term" in extra, os.path.join(workspace, "daemon.pid"))
        publish(result_path, ok)
        return 0
    if mode == "fork-bomb":
        acted(checkpoint)
        fork_bomb(os.path.join(workspace, "forks.txt"), int(extra[0]))
        publish(result_path, ok)
        return 0
    if mode == "memory-bomb":
        memory_bomb(os.path.join(workspace, "memory.txt"), int(extra[0]))
        publish(result_path, ok)
        return 0
    if mode == "fill-hang":
        on_sigterm_publish_cancelled(spec, result_path)
        acted(checkpoint)
        fill(extra[0], int(extra[1]))
        time.sleep(600)
        return 0
    if mode == "fill":
        acted(checkpoint)
        fill(extra[0], int(extra[1]))
        publish(result_path, ok)
        return 0
    if mode == "probe":
        findings = probe(extra, workspace)
        with open(os.path.join(workspace, "probe.json"), "w") as file:
            json.dump(findings, file)
        publish(result_path, ok)
        return 0
    print(f"fake_worker: unknown mode {mode!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
