"""``code-fn``: the agent writes a Python function to ``solution.py``; hidden tests grade it.

The agent works with the Python tool inside its sandbox and must leave
``solution.py`` in its workspace. ``POST /verify`` receives that file (the
controller reads it from the workspace after the sandbox is gone) and the row's
controller-only ``expected``::

    {"function": "fizzbuzz",
     "tests": [{"call": "fizzbuzz(3)", "expect": "'Fizz'"}, ...],
     "timeout_s": 5}

and runs the calls with :func:`rollcage.cage.run_contained`: a fresh cage that
holds the bare interpreter, ``solution.py`` and the harness, and nothing else of
the host (no checkout, no dataset, no ``/etc``, no home directory), as an
unprivileged uid with no capabilities, no network and bounded time, memory,
processes and output. The child only *evaluates* the calls and prints their
``repr``; the comparison with the expected values happens here, in the parent,
so code in ``solution.py`` cannot print its way to a reward without producing
the right values. The reward is the fraction of tests passed.

A cage that cannot be made is a grader error (``/verify`` answers 503 naming the
cause), never a reward. Where bubblewrap is missing, ``/verify`` refuses unless
uncontained grading was allowed explicitly (``allow_uncontained=True``, or
``ROLLCAGE_ALLOW_UNCONTAINED_GRADING=1`` in the environment's process).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import secrets
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcage.cage import PYTHON, RunLimits, run_contained
from rollcage.environments._common import BadRequest, json_error, read_json_object, verify_allowed
from rollcage.errors import SandboxError

__all__ = ["ALLOW_UNCONTAINED_ENV", "SOLUTION_FILE", "TestOutcome", "create_app", "run_hidden_tests"]

SOLUTION_FILE = "solution.py"
"""The file the agent must write in its workspace."""

ALLOW_UNCONTAINED_ENV = "ROLLCAGE_ALLOW_UNCONTAINED_GRADING"
"""Set to ``1`` to let the hidden tests run uncontained where bubblewrap is missing (trusted code only)."""

_MAX_TIMEOUT_S = 60.0
_OUTPUT_LIMIT = 1024 * 1024
_MARKER = "ROLLCAGE-RESULTS "
_HARNESS_FILE = "_rollcage_harness.py"

# Runs in the cage: the agent's module, then each call; only reprs leave the process.
# A call that raises is reported by exception type.
_HARNESS = r"""
import json, sys
spec = json.loads(sys.stdin.readline())
sys.path.insert(0, ".")
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


async def run_hidden_tests(
    source: str, tests: list[dict[str, str]], *, timeout_s: float, allow_uncontained: bool = False
) -> TestOutcome:
    """Run ``tests`` against ``source`` (the agent's ``solution.py``) in a fresh cage (``run_contained``).

    Args:
        source: The text of ``solution.py``.
        tests: ``[{"call": "f(1)", "expect": "2"}, ...]``: expressions and the ``repr`` they must equal.
        timeout_s: Wall-clock bound for the whole run; CPU time is limited to the same.
        allow_uncontained: Where bubblewrap is missing, run uncontained instead of refusing.

    Returns:
        The fraction passed as the reward, and per-test detail (first failures only).

    Raises:
        SandboxError: The cage could not be made (or bubblewrap is missing and uncontained grading
            was not allowed): no reward can be given.

    **Cancellation:** the cage is killed and reaped before the cancellation propagates.
    """
    timeout_s = max(0.5, min(timeout_s, _MAX_TIMEOUT_S))
    marker = f"{_MARKER}{secrets.token_hex(8)} "
    spec = {"calls": [t["call"] for t in tests], "marker": marker}
    run = await run_contained(
        [PYTHON, "-I", "-S", "-B", _HARNESS_FILE],
        files={SOLUTION_FILE: source, _HARNESS_FILE: _HARNESS},
        stdin=json.dumps(spec).encode() + b"\n",
        timeout_s=timeout_s,
        limits=RunLimits(cpu_seconds=int(timeout_s) + 1, output_limit=_OUTPUT_LIMIT),
        allow_uncontained=allow_uncontained,
    )
    return _score(run.stdout.decode("utf-8", "replace"), marker, tests, run.timed_out)


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


def create_app(*, verify_token: str | None = None, allow_uncontained: bool | None = None) -> Starlette:
    """The code-fn app; ``verify_token`` guards ``/verify`` (see ``rollcage.environments``).

    Args:
        verify_token: Bearer token ``/verify`` requires; ``None`` leaves it open (tests only).
        allow_uncontained: Run the hidden tests uncontained where bubblewrap is missing; ``None``:
            only when ``ROLLCAGE_ALLOW_UNCONTAINED_GRADING=1`` is set.
    """
    uncontained = (
        os.environ.get(ALLOW_UNCONTAINED_ENV) == "1" if allow_uncontained is None else allow_uncontained
    )

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
        try:
            outcome = await run_hidden_tests(
                source, tests, timeout_s=timeout_s, allow_uncontained=uncontained
            )
        except SandboxError as exc:
            # Never a reward: the controller records a grader error.
            return json_error(503, f"the hidden tests could not be run contained: {exc}")
        return JSONResponse({"reward": outcome.reward, "detail": outcome.detail})

    async def index(request: Request) -> Response:
        return JSONResponse({"environment": "code-fn", "tools": []})

    return Starlette(routes=[Route("/", index, methods=["GET"]), Route("/verify", verify, methods=["POST"])])
