"""``code-fn``: the agent writes a Python function to ``solution.py``; hidden tests grade it.

The agent works with the Python tool inside its sandbox and must leave
``solution.py`` in its workspace. ``POST /verify`` receives that file (the
controller reads it from the workspace after the sandbox is gone) and the row's
controller-only ``expected``::

    {"function": "fizzbuzz",
     "tests": [{"call": "fizzbuzz(3)", "expect": "'Fizz'"}, ...],
     "timeout_s": 5}

and runs the calls in a separate Python process, under bubblewrap when it is
installed (no network, read-only system, private /tmp), always in its own session,
with resource limits and a timeout, the whole process group killed at the end.
The child only *evaluates* the calls and prints their ``repr``; the comparison
with the expected values happens here, in the parent, so code in ``solution.py``
cannot print its way to a reward without producing the right values. The reward
is the fraction of tests passed.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcage.environments._common import BadRequest, json_error, read_json_object, verify_allowed

__all__ = ["SOLUTION_FILE", "TestOutcome", "create_app", "run_hidden_tests"]

SOLUTION_FILE = "solution.py"
"""The file the agent must write in its workspace."""

_MAX_TIMEOUT_S = 60.0
_OUTPUT_LIMIT = 1024 * 1024
_MARKER = "ROLLCAGE-RESULTS "

# Runs in the child. Limits first, then the agent's module, then each call; only
# reprs leave the process. A call that raises is reported by exception type.
_HARNESS = r"""
import json, resource, sys
spec = json.loads(sys.stdin.readline())
cpu = int(spec["cpu_s"])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.path.insert(0, spec["dir"])
sys.stdin.close()
results = []
try:
    import solution
except BaseException as exc:
    print(spec["marker"] + json.dumps({"import_error": f"{type(exc).__name__}: {exc}"[:500]}), flush=True)
    raise SystemExit(0)
namespace = dict(vars(solution))
for call in spec["calls"]:
    try:
        results.append({"repr": repr(eval(call, namespace))[:10000]})
    except BaseException as exc:
        results.append({"raised": type(exc).__name__})
print(spec["marker"] + json.dumps({"results": results}), flush=True)
"""


class TestOutcome:
    """What running the hidden tests gave: reward and detail for ``/verify``."""

    __test__ = False  # not a pytest class

    def __init__(self, reward: float, detail: dict[str, Any]) -> None:
        """Store the reward in [0, 1] and its explanation."""
        self.reward = reward
        self.detail = detail


def _same(got: str, expect: str) -> bool:
    try:
        return bool(ast.literal_eval(got) == ast.literal_eval(expect))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return got.strip() == expect.strip()


def _ro_binds_under_tmp(*paths: str) -> list[str]:
    args: list[str] = []
    for path in dict.fromkeys(os.path.realpath(p) for p in paths):
        if path == "/tmp" or path.startswith("/tmp/"):
            args += ["--ro-bind", path, path]
    return args


def _command(workdir: str) -> list[str]:
    python = [sys.executable, "-I", "-c", _HARNESS]
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return python
    # Same containment idea as the rollout sandbox, minus the egress proxy: nothing to reach.
    return [
        bwrap,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        # The private /tmp would hide an interpreter that lives under /tmp (a CI checkout's venv).
        *_ro_binds_under_tmp(sys.prefix, sys.base_prefix),
        "--bind",
        workdir,
        workdir,
        "--chdir",
        workdir,
        "--",
        *python,
    ]


async def _read_bounded(stream: asyncio.StreamReader) -> bytes:
    kept = bytearray()
    while chunk := await stream.read(65536):
        # Keep reading past the limit so the child never blocks on a full pipe.
        if len(kept) < _OUTPUT_LIMIT:
            kept += chunk[: _OUTPUT_LIMIT - len(kept)]
    return bytes(kept)


async def run_hidden_tests(source: str, tests: list[dict[str, str]], *, timeout_s: float) -> TestOutcome:
    """Run ``tests`` against ``source`` (the agent's ``solution.py``) in a contained child process.

    Args:
        source: The text of ``solution.py``.
        tests: ``[{"call": "f(1)", "expect": "2"}, ...]``: expressions and the ``repr`` they must equal.
        timeout_s: Wall-clock bound for the whole child; CPU time is limited to the same.

    Returns:
        The fraction passed as the reward, and per-test detail (first failures only).

    **Cancellation:** the child's process group is killed and reaped before the
    cancellation propagates.
    """
    timeout_s = max(0.5, min(timeout_s, _MAX_TIMEOUT_S))
    calls = [t["call"] for t in tests]
    workdir = await asyncio.to_thread(tempfile.mkdtemp, prefix="rollcage-code-fn-")
    try:
        await asyncio.to_thread(Path(workdir, SOLUTION_FILE).write_text, source, "utf-8")
        marker = f"{_MARKER}{secrets.token_hex(8)} "
        spec = {"dir": workdir, "calls": calls, "cpu_s": int(timeout_s) + 1, "marker": marker}
        proc = await asyncio.create_subprocess_exec(
            *_command(workdir),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            cwd=workdir,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        timed_out = False
        output = b""
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(spec).encode() + b"\n")
            with contextlib.suppress(ConnectionError):
                await proc.stdin.drain()
                proc.stdin.close()
            try:
                async with asyncio.timeout(timeout_s):
                    output = await _read_bounded(proc.stdout)
                    await proc.wait()
            except TimeoutError:
                timed_out = True
        finally:
            # Shielded: whatever happened, the group dies and is reaped.
            await asyncio.shield(_kill_group(proc))
    finally:
        await asyncio.to_thread(shutil.rmtree, workdir, True)
    return _score(output.decode("utf-8", "replace"), marker, tests, timed_out)


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5.0):
            await proc.wait()


def _score(output: str, marker: str, tests: list[dict[str, str]], timed_out: bool) -> TestOutcome:
    report: dict[str, Any] | None = None
    for line in output.splitlines():
        if line.startswith(marker):
            with contextlib.suppress(ValueError):
                report = json.loads(line[len(marker) :])
    total = len(tests)
    if report is None:
        reason = "timed out" if timed_out else "the test process died before reporting"
        return TestOutcome(0.0, {"passed": 0, "total": total, "error": reason})
    if "import_error" in report:
        return TestOutcome(0.0, {"passed": 0, "total": total, "error": f"import: {report['import_error']}"})
    results = report.get("results", [])
    passed = 0
    failures: list[dict[str, str]] = []
    for test, result in zip(tests, results, strict=False):
        got = result.get("repr") if isinstance(result, dict) else None
        if isinstance(got, str) and _same(got, test["expect"]):
            passed += 1
        elif len(failures) < 5:
            shown = got[:200] if isinstance(got, str) else f"raised {result.get('raised', '?')}"
            failures.append({"call": test["call"], "got": shown})
    return TestOutcome(
        passed / total if total else 0.0, {"passed": passed, "total": total, "failures": failures}
    )


def _tests_of(expected: Any) -> tuple[list[dict[str, str]], float]:
    if not isinstance(expected, dict) or not isinstance(expected.get("tests"), list):
        raise BadRequest("code-fn rows need expected = {'tests': [{'call': ..., 'expect': ...}, ...]}")
    tests: list[dict[str, str]] = []
    for test in expected["tests"]:
        if not (isinstance(test, dict) and isinstance(test.get("call"), str)):
            raise BadRequest(f"bad test {test!r}: needs a string 'call' and 'expect'")
        if not isinstance(test.get("expect"), str):
            raise BadRequest(f"bad test {test!r}: needs a string 'call' and 'expect'")
        tests.append({"call": test["call"], "expect": test["expect"]})
    timeout = expected.get("timeout_s", 5.0)
    return tests, float(timeout) if isinstance(timeout, int | float) else 5.0


def create_app(*, verify_token: str | None = None) -> Starlette:
    """The code-fn app; ``verify_token`` guards ``/verify`` (see ``rollcage.environments``)."""

    async def verify(request: Request) -> Response:
        if not verify_allowed(request, verify_token):
            return json_error(403, "verify is for the controller only")
        try:
            body = await read_json_object(request)
            tests, timeout_s = _tests_of(body.get("expected"))
        except BadRequest as exc:
            return json_error(400, str(exc))
        files = body.get("workspace_files")
        source = files.get(SOLUTION_FILE) if isinstance(files, dict) else None
        if not isinstance(source, str):
            detail = {"passed": 0, "total": len(tests), "error": f"no {SOLUTION_FILE} in the workspace"}
            return JSONResponse({"reward": 0.0, "detail": detail})
        outcome = await run_hidden_tests(source, tests, timeout_s=timeout_s)
        return JSONResponse({"reward": outcome.reward, "detail": outcome.detail})

    async def index(request: Request) -> Response:
        return JSONResponse({"environment": "code-fn", "tools": []})

    return Starlette(routes=[Route("/", index, methods=["GET"]), Route("/verify", verify, methods=["POST"])])
