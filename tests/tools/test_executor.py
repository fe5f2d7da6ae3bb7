"""The executor suite: every backend passes the same behaviours (jupyter skipped only if not installed)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import marshal
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rollcage.errors import ConfigError, ExecutorError, ResourceUnavailableError
from rollcage.protocol import ExecutorSettings
from rollcage.tools import CellResult, Executor, ExecutorState, ToolBridge, make_executor
from tests.helpers.waiting import alive, wait_for_async

# Generous where a slow, loaded machine must not turn a pass into a flake; short
# where the expected outcome (a kill) does not depend on it.
GRACE_S = 5.0
SHORT_GRACE_S = 0.5
LOOP_TIMEOUT_S = 0.5
CELL_TIMEOUT_S = 30.0
DEADLINE_S = 30.0

HAVE_JUPYTER = all(importlib.util.find_spec(m) is not None for m in ("jupyter_client", "ipykernel"))
BACKENDS = [
    "repl",
    pytest.param("jupyter", marks=pytest.mark.skipif(not HAVE_JUPYTER, reason="jupyter extra not installed")),
]

MakeExecutor = Callable[..., Awaitable[Executor]]

# The executor's environment as in production: ipykernel stops capturing the
# output of subprocesses when it sees pytest's variable.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make(backend: str, tmp_path: Path) -> AsyncIterator[MakeExecutor]:
    """Build and start executors of the backend under test; every one is closed at the end."""
    made: list[Executor] = []

    async def factory(
        *,
        bridge: ToolBridge | None = None,
        bridged_tools: Any = (),
        output_limit: int = 16_384,
        grace_s: float = GRACE_S,
    ) -> Executor:
        executor = make_executor(
            ExecutorSettings(backend=backend, interrupt_grace_s=grace_s),  # type: ignore[arg-type]
            cwd=tmp_path,
            bridge=bridge,
            bridged_tools=bridged_tools,
            output_limit=output_limit,
            env=CHILD_ENV,
        )
        made.append(executor)
        await executor.start()
        return executor

    try:
        yield factory
    finally:
        for executor in made:
            await executor.aclose()


@pytest.fixture
async def executor(make: MakeExecutor) -> Executor:
    return await make()


@pytest.fixture
async def impatient(make: MakeExecutor) -> Executor:
    """An executor with a short interrupt grace, for cells that are meant to be killed."""
    return await make(grace_s=SHORT_GRACE_S)


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    await wait_for_async(predicate, what=what)


IGNORE_SIGINT = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)"

FORK_TWO_CHILDREN = """
import os, subprocess, time
popen = subprocess.Popen(["sleep", "1000"])
forked = os.fork()
if forked == 0:
    while True:
        time.sleep(1)
[popen.pid, forked]
"""


def pids_of(result: CellResult) -> list[int]:
    assert result.status == "ok", result.text
    assert result.value is not None
    return [int(p) for p in result.value.strip("[]").split(",")]


# ---------------------------------------------------------------------- basics


async def test_state_persists_across_cells(executor: Executor) -> None:
    assert (await executor.run("x = 20\ndef twice(v):\n    return 2 * v", CELL_TIMEOUT_S)).status == "ok"
    result = await executor.run("twice(x) + 2", CELL_TIMEOUT_S)
    assert (result.status, result.value) == ("ok", "42")


async def test_last_expression_value_is_displayed_like_ipython(executor: Executor) -> None:
    assert (await executor.run("y = 3", CELL_TIMEOUT_S)).value is None
    assert (await executor.run("None", CELL_TIMEOUT_S)).value is None
    assert (await executor.run("'a' + 'b'", CELL_TIMEOUT_S)).value == "'ab'"
    printed = await executor.run("print(7)", CELL_TIMEOUT_S)
    assert (printed.stdout, printed.value) == ("7\n", None)
    assert (await executor.run("y * 2\n[y] * 2", CELL_TIMEOUT_S)).value == "[3, 3]"


async def test_exception_is_an_error_result_with_traceback(executor: Executor) -> None:
    result = await executor.run("def f():\n    return 1 / 0\nf()", CELL_TIMEOUT_S)
    assert result.status == "error"
    assert result.error is not None and "ZeroDivisionError" in result.error
    assert "return 1 / 0" in result.error  # the cell's source line is shown
    assert "ZeroDivisionError" in result.text
    assert (await executor.run("1 + 1", CELL_TIMEOUT_S)).value == "2"


async def test_syntax_error_is_an_error_result(executor: Executor) -> None:
    result = await executor.run("def (:", CELL_TIMEOUT_S)
    assert result.status == "error"
    assert result.error is not None and "SyntaxError" in result.error


async def test_stdout_stderr_and_subprocess_output_are_captured(executor: Executor) -> None:
    code = "import os, sys\nprint('out')\nprint('err', file=sys.stderr)\nos.system('echo from-a-subprocess')"
    result = await executor.run(code, CELL_TIMEOUT_S)
    assert result.status == "ok"
    assert "out\n" in result.stdout and "from-a-subprocess" in result.stdout
    assert "err" in result.stderr
    assert result.value == "0"


async def test_input_gets_end_of_file(executor: Executor) -> None:
    result = await executor.run("input('name? ')", CELL_TIMEOUT_S)
    assert result.status == "error"
    assert result.error is not None and "EOFError" in result.error


def rss_mib(pid: int | None) -> float:
    assert pid is not None
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def test_large_output_is_bounded_as_it_is_produced(make: MakeExecutor) -> None:
    executor = await make(output_limit=4096)
    rss_before = rss_mib(executor.pid)
    started = time.monotonic()
    result = await executor.run("chunk = 'x' * 1_000_000\nfor _ in range(100):\n    print(chunk)", 30)
    elapsed = time.monotonic() - started
    assert result.status == "ok"
    assert result.truncated
    assert len(result.stdout) < 4096 + 100
    assert len(result.text) <= 4096
    assert "truncated" in result.text
    assert elapsed < 15, f"printing 100 MB took {elapsed:.1f}s"
    # Nothing kept the 100 MB (IPython 9, for one, copies every write into its history).
    assert rss_mib(executor.pid) - rss_before < 40
    assert (await executor.run("len(chunk)", CELL_TIMEOUT_S)).value == "1000000"


async def test_huge_value_repr_is_bounded(make: MakeExecutor) -> None:
    executor = await make(output_limit=1024)
    result = await executor.run("'y' * 10_000_000", CELL_TIMEOUT_S)
    assert result.value is not None and len(result.value) < 1024 + 100
    assert result.truncated and len(result.text) <= 1024


# ---------------------------------------------------------- timeouts and kills


async def test_timeout_interrupts_cell_and_keeps_state(executor: Executor) -> None:
    await executor.run("kept = 'yes'", CELL_TIMEOUT_S)
    result = await executor.run("while True:\n    pass", LOOP_TIMEOUT_S)
    assert result.status == "timeout"
    assert result.error is not None and "KeyboardInterrupt" in result.error
    assert "timeout" in result.text and "state is kept" in result.text
    after = await executor.run("kept", CELL_TIMEOUT_S)
    assert (after.status, after.value) == ("ok", "'yes'")
    assert executor.restarts == 0


async def test_cell_ignoring_sigint_gets_executor_killed_and_restarted(impatient: Executor) -> None:
    executor = impatient
    await executor.run("kept = 1", CELL_TIMEOUT_S)
    old_pid = executor.pid
    assert old_pid is not None
    code = f"{IGNORE_SIGINT}\nprint('stubborn')\nwhile True:\n    pass"
    result = await executor.run(code, LOOP_TIMEOUT_S)
    assert result.status == "restarted"
    assert "state" in result.text and "lost" in result.text
    assert executor.restarts == 1
    assert not alive(old_pid)
    fresh = await executor.run("'kept' in dir()", CELL_TIMEOUT_S)
    assert (fresh.status, fresh.value) == ("ok", "False")
    assert executor.pid not in (None, old_pid)


async def test_process_dying_mid_cell_is_reported_as_restarted(executor: Executor) -> None:
    await executor.run("kept = 1", CELL_TIMEOUT_S)
    result = await executor.run("import os\nos._exit(3)", CELL_TIMEOUT_S)
    assert result.status == "restarted"
    assert "exited unexpectedly" in result.text
    assert executor.restarts == 1
    assert (await executor.run("'kept' in dir()", CELL_TIMEOUT_S)).value == "False"


async def test_process_dying_between_cells_is_restarted_with_a_note(
    executor: Executor, tmp_path: Path
) -> None:
    pid = executor.pid
    assert pid is not None
    trigger = tmp_path / "die-now"
    # The process exits only once the test says so, after the cell's reply is in: on a busy
    # machine a timer could fire before the reply and make it a death *during* the cell.
    code = (
        "import os, threading, time\n"
        "def _die():\n"
        f"    while not os.path.exists({str(trigger)!r}): time.sleep(0.005)\n"
        "    os._exit(0)\n"
        "threading.Thread(target=_die, daemon=True).start()"
    )
    first = await executor.run(code, CELL_TIMEOUT_S)
    assert first.status == "ok", first
    trigger.touch()
    await wait_until(lambda: not alive(pid), "the child to exit")
    result = await executor.run("1 + 1", CELL_TIMEOUT_S)
    assert (result.status, result.value) == ("ok", "2")
    assert result.note is not None and "state" in result.note and "lost" in result.note


async def test_forked_children_are_killed_on_restart(impatient: Executor) -> None:
    executor = impatient
    children = pids_of(await executor.run(FORK_TWO_CHILDREN, CELL_TIMEOUT_S))
    assert all(alive(pid) for pid in children)
    code = f"{IGNORE_SIGINT}\nwhile True:\n    pass"
    assert (await executor.run(code, LOOP_TIMEOUT_S)).status == "restarted"
    await wait_until(lambda: not any(alive(pid) for pid in children), "forked children to be gone")


async def test_forked_children_are_killed_on_close(make: MakeExecutor) -> None:
    executor = await make()
    children = pids_of(await executor.run(FORK_TWO_CHILDREN, CELL_TIMEOUT_S))
    child_pid = executor.pid
    assert child_pid is not None
    await executor.aclose()
    assert executor.state is ExecutorState.CLOSED
    assert not alive(child_pid)
    await wait_until(lambda: not any(alive(pid) for pid in children), "forked children to be gone")


async def test_cancelling_run_interrupts_the_cell_and_keeps_state(executor: Executor, tmp_path: Path) -> None:
    await executor.run("kept = 'yes'", CELL_TIMEOUT_S)
    task = asyncio.create_task(executor.run("open('started', 'w').close()\nwhile True:\n    pass", 60))
    await wait_until(lambda: (tmp_path / "started").exists(), "the cell to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert executor.restarts == 0
    after = await executor.run("kept", CELL_TIMEOUT_S)
    assert (after.status, after.value) == ("ok", "'yes'")  # the cancelled cell is not still running


async def test_cancelling_run_kills_a_cell_that_ignores_sigint(impatient: Executor, tmp_path: Path) -> None:
    executor = impatient
    old_pid = executor.pid
    assert old_pid is not None
    code = f"{IGNORE_SIGINT}\nopen('started', 'w').close()\nwhile True:\n    pass"
    task = asyncio.create_task(executor.run(code, 60))
    await wait_until(lambda: (tmp_path / "started").exists(), "the cell to start")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert executor.restarts == 1
    assert not alive(old_pid)
    assert (await executor.run("2 * 21", CELL_TIMEOUT_S)).value == "42"


# ------------------------------------------------------------------- lifecycle


async def test_start_is_idempotent_and_safe_to_race(backend: str, tmp_path: Path) -> None:
    executor = make_executor(ExecutorSettings(backend=backend), cwd=tmp_path)  # type: ignore[arg-type]
    try:
        await asyncio.gather(executor.start(), executor.start())
        pid = executor.pid
        await executor.start()
        assert executor.pid == pid is not None
        assert executor.state is ExecutorState.RUNNING
    finally:
        await executor.aclose()


async def test_run_starts_the_executor_lazily(backend: str, tmp_path: Path) -> None:
    executor = make_executor(ExecutorSettings(backend=backend), cwd=tmp_path)  # type: ignore[arg-type]
    try:
        assert executor.state is ExecutorState.UNOPENED and executor.pid is None
        assert (await executor.run("import os\nos.getcwd()", CELL_TIMEOUT_S)).value == repr(str(tmp_path))
    finally:
        await executor.aclose()


async def test_failure_to_start_raises_executor_error(backend: str, tmp_path: Path) -> None:
    executor = make_executor(
        ExecutorSettings(backend=backend),  # type: ignore[arg-type]
        cwd=tmp_path / "does-not-exist",
    )
    try:
        with pytest.raises(ExecutorError, match=r"does-not-exist|No such file"):
            await executor.start()
        assert executor.pid is None
    finally:
        await executor.aclose()


async def test_closed_executor_refuses_to_run(executor: Executor) -> None:
    await executor.aclose()
    await executor.aclose()  # idempotent
    with pytest.raises(ExecutorError, match="closed"):
        await executor.run("1", CELL_TIMEOUT_S)


# ---------------------------------------------------------------- bridged tools


class RecordingBridge:
    """A worker-side bridge that records calls; ``hang`` makes it wait until cancelled."""

    def __init__(self, *, hang: bool = False, fail: BaseException | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.cancelled = False
        self._hang = hang
        self._fail = fail

    async def __call__(self, name: str, kwargs: dict[str, Any]) -> str:
        self.calls.append((name, kwargs))
        if self._fail is not None:
            raise self._fail
        if self._hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        return json.dumps({"city": kwargs.get("city"), "weather": "cold"})


async def test_bridged_tool_round_trip(make: MakeExecutor) -> None:
    bridge = RecordingBridge()
    tools = {"get_weather": ["city"], "submit": ["answer"]}
    executor = await make(bridge=bridge, bridged_tools=tools)
    code = "import json\nw = json.loads(get_weather('Oslo'))\nsubmit(answer=w['weather'])\nw['weather']"
    result = await executor.run(code, CELL_TIMEOUT_S)
    assert (result.status, result.value) == ("ok", "'cold'"), result.text
    assert bridge.calls == [("get_weather", {"city": "Oslo"}), ("submit", {"answer": "cold"})]


async def test_bridged_tool_with_bare_name_sends_positional_args_by_position(make: MakeExecutor) -> None:
    bridge = RecordingBridge()
    executor = await make(bridge=bridge, bridged_tools=["submit"])
    assert (await executor.run("submit('x', extra=1)", CELL_TIMEOUT_S)).status == "ok"
    assert bridge.calls == [("submit", {"arg0": "x", "extra": 1})]


async def test_bridged_tool_rejects_arguments_that_are_not_json(make: MakeExecutor) -> None:
    bridge = RecordingBridge()
    executor = await make(bridge=bridge, bridged_tools={"get_weather": ["city"]})
    result = await executor.run("get_weather(object())", CELL_TIMEOUT_S)
    assert result.status == "error" and result.error is not None and "JSON" in result.error
    assert bridge.calls == []


async def test_bridge_failure_is_raised_by_run_as_infrastructure(make: MakeExecutor) -> None:
    bridge = RecordingBridge(fail=ResourceUnavailableError("weather resource is down"))
    executor = await make(bridge=bridge, bridged_tools={"get_weather": ["city"]})
    # Agent code that swallows every Exception still cannot hide the failure.
    code = "try:\n    get_weather('Oslo')\nexcept Exception:\n    pass"
    with pytest.raises(ResourceUnavailableError, match="down"):
        await executor.run(code, CELL_TIMEOUT_S)
    assert (await executor.run("1 + 1", CELL_TIMEOUT_S)).value == "2"


async def test_timeout_during_a_bridged_call_cancels_it_and_keeps_state(make: MakeExecutor) -> None:
    bridge = RecordingBridge(hang=True)
    executor = await make(bridge=bridge, bridged_tools={"get_weather": ["city"]})
    await executor.run("kept = 1", CELL_TIMEOUT_S)
    result = await executor.run("get_weather('Oslo')", LOOP_TIMEOUT_S)
    assert result.status == "timeout", result.text
    assert bridge.cancelled
    assert (await executor.run("kept + 1", CELL_TIMEOUT_S)).value == "2"


async def test_bridged_tools_need_valid_names_and_a_bridge(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        make_executor(ExecutorSettings(), cwd=tmp_path, bridge=RecordingBridge(), bridged_tools=["not-valid"])
    with pytest.raises(ValueError, match="bridge"):
        make_executor(ExecutorSettings(), cwd=tmp_path, bridged_tools=["submit"])
    with pytest.raises(TypeError):
        make_executor(ExecutorSettings(), cwd=tmp_path, bridge=RecordingBridge(), bridged_tools="submit")


# -------------------------------------------------------------- result and import


def test_cell_result_text_is_bounded_with_a_visible_marker() -> None:
    result = CellResult(status="ok", stdout="a" * 5000, error="Traceback\nValueError: end", output_limit=1000)
    assert len(result.text) <= 1000
    assert "…[truncated" in result.text
    assert result.text.startswith("aaa") and result.text.endswith("ValueError: end")


def test_restarted_result_tells_the_model_its_state_was_lost() -> None:
    result = CellResult(status="ok").with_note("restarted", "the session's state was lost.")
    assert result.status == "restarted" and "state was lost" in result.text


def test_importing_tools_does_not_import_jupyter() -> None:
    code = (
        "import sys, pathlib\n"
        "from rollcage.protocol import ExecutorSettings\n"
        "from rollcage.tools import make_executor\n"
        "make_executor(ExecutorSettings(), cwd=pathlib.Path('.'))\n"
        "heavy = ('jupyter_client', 'zmq', 'ipykernel', 'starlette', 'typer', 'yaml')\n"
        "assert not [m for m in heavy if m in sys.modules], sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ------------------------------------------------------- the repl child's start


async def test_the_repl_child_runs_the_code_its_parent_sends_not_its_source_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child compiles nothing at start: it runs the module its parent compiled once and sent."""
    from rollcage.tools import _repl

    source = Path(_repl.__file__).with_name("_repl_child.py").read_text()
    assert 'sys.argv = [""]' in source
    marked = compile(source.replace('sys.argv = [""]', 'sys.argv = ["sent-by-the-parent"]'), "x", "exec")
    monkeypatch.setattr(_repl, "child_code", lambda: marshal.dumps(marked))
    executor = make_executor(ExecutorSettings(), cwd=tmp_path, env=CHILD_ENV)
    try:
        assert (await executor.run("import sys\nsys.argv", CELL_TIMEOUT_S)).value == "['sent-by-the-parent']"
    finally:
        await executor.aclose()


def test_the_repl_childs_code_is_its_module_compiled_once() -> None:
    from rollcage.tools._repl import child_code

    code = marshal.loads(child_code())
    assert Path(code.co_filename).name == "_repl_child.py"
    assert child_code() is child_code()


def test_a_repl_child_whose_parent_left_before_sending_its_code_exits_quietly() -> None:
    from rollcage.tools._repl import _BOOT

    ours, theirs = socket.socketpair()
    with ours, theirs:
        child = subprocess.Popen(
            [sys.executable, "-I", "-u", "-c", _BOOT, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        theirs.close()
        ours.sendall((1000).to_bytes(4, "big") + b"part of a frame")
        ours.close()
        stdout, stderr = child.communicate(timeout=60)
    assert (child.returncode, stdout, stderr) == (0, b"", b"")
