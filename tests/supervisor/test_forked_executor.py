"""Executors forked into their cage by the executor template (``rollcage.tools._forked``).

A warm worker's ``repl`` executor is not started but forked from a fresh interpreter
that waits beside the warm template, into the nested cage the worker made around a
holder. These tests hold a forked executor to a started one (cold start: no template),
from inside, as agent code sees itself: identity, capabilities, limits, namespaces,
modules, flags, descriptors, environment; then what is refused (an interpreter's
start-up environment that differs), what is left of another rollout in an executor's
memory (nothing), a template that dies, and a cell that must be killed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from rollcage.policy import PolicyServer
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from rollcage.supervisor.warm import stop_templates
from tests.helpers.supervisor_env import requires_bwrap
from tests.helpers.waiting import alive
from tests.helpers.worker_env import worker_input

pytestmark = [requires_bwrap(), pytest.mark.bwrap]

FACTS = r"""
import json, os, signal, subprocess, sys, time
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
mask = os.umask(0); os.umask(mask)
names = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
print("FACTS" + json.dumps({
    "ppid": os.getppid(),
    "pid_depth": len(status["NSpid"].split()),
    "status": {name: status[name].strip() for name in names},
    "umask": mask,
    "limits": open("/proc/self/limits").read(),
    "modules": sorted(sys.modules),
    "main": sorted(vars(sys.modules["__main__"])),
    "argv": sys.argv[:1],
    "path": [sys.executable, sys.prefix, *sys.path],
    "flags": str(sys.flags),
    "fds": len(os.listdir("/proc/self/fd")),
    "cwd": os.getcwd(),
    "env": sorted(os.environ),
    "stdio": [sys.__stdout__.encoding, sys.__stdout__.errors, sys.__stdout__.line_buffering,
              sys.__stdin__.encoding, sys.getfilesystemencoding(), sys.flags.utf8_mode],
    "leads": [os.getpgrp() == os.getpid(), os.getsid(0) == os.getpid()],
    "tz": list(time.tzname),
    "own_memory": os.access("/proc/self/mem", os.R_OK),
    "signals": {int(n): getattr(signal.getsignal(n), "__name__", str(signal.getsignal(n)))
                for n in signal.valid_signals() if n not in (signal.SIGKILL, signal.SIGSTOP)},
    "wakeup_fd": signal.set_wakeup_fd(-1),
    "child": subprocess.run(["true"]).returncode,
    "site": [__import__("site").USER_BASE, __import__("site").USER_SITE, __import__("site").ENABLE_USER_SITE],
    "cmdline": [w.decode() for w in open("/proc/self/cmdline", "rb").read().split(b"\0")[1:5]],
    "token": os.environ.get("ROLLCAGE_SUPERVISION_TOKEN"),
    "sees_worker": any(b"worker" in open(f"/proc/{p}/cmdline", "rb").read()
                       for p in os.listdir("/proc") if p.isdigit()),
}))
"""


def _call(code: str) -> dict[str, Any]:
    return {"name": "python", "arguments": {"code": code}}


async def _rollout(
    root: Path,
    cells: list[str],
    *,
    start: str = "warm",
    env: dict[str, str] | None = None,
    env_allow: list[str] | None = None,
) -> list[str]:
    """A real rollout that runs ``cells`` one model turn each; what each cell printed, as the model saw it."""
    turns: list[dict[str, Any]] = [{"tool_calls": [_call(code)]} for code in cells]
    with PolicyServer({"tasks": {"t": [*turns, {"text": "done"}]}}, port=0, keep_bodies=True) as server:
        _prepare(root, server.base_url)
        config = SupervisorConfig(deadline_s=120, sandbox=BwrapSandbox(worker_start=start), env=env or {})
        if env_allow is not None:
            config = config.model_copy(update={"env_allow": env_allow})
        receipt = await supervise(root, config)
        requests = [entry.body or {} for entry in server.request_log]
    assert receipt.outcome == "completed", (receipt.outcome_reason, (root / "worker.log").read_text()[-3000:])
    return [str(request["messages"][-1]["content"]) for request in requests[1:]]


def _prepare(root: Path, model_url: str) -> None:
    root.mkdir()
    (root / "workspace").mkdir()
    data = worker_input(model_url=model_url, task_id="t", tool_timeout_s=3)
    data["executor"] = {"interrupt_grace_s": 0.5}
    (root / "input.json").write_text(json.dumps(data))


def _facts(output: str) -> dict[str, Any]:
    assert "FACTS" in output and "Exception ignored" not in output, output
    facts: dict[str, Any] = json.loads(output.split("FACTS", 1)[1].strip().splitlines()[0])
    return facts


@pytest.mark.parametrize("locale", ["as the host's", "none"])
async def test_a_forked_executor_is_what_a_started_one_is(tmp_path: Path, locale: str) -> None:
    # With no locale at all a started interpreter coerces the C locale to UTF-8 and says so in its
    # environment (PEP 538's LC_CTYPE); a forked one must too.
    allow = None if locale != "none" else ["ROLLCAGE_LOG_LEVEL"]
    stop_templates()  # the executor template starts with this test's first worker's environment
    forked = _facts((await _rollout(tmp_path / "warm", [FACTS], env_allow=allow))[0])
    started = _facts((await _rollout(tmp_path / "cold", [FACTS], start="cold", env_allow=allow))[0])
    # Forked: its parent, the executor template, is outside its PID namespace; started: bwrap's init.
    assert (forked.pop("ppid"), started.pop("ppid")) == (0, 1)
    assert forked.pop("token") != started.pop("token")
    # It leads its own session and group (the worker signals that group); a started one is in its
    # cage's monitor's, outside its PID namespace.
    assert (forked.pop("leads"), started.pop("leads")) == ([True, True], [False, False])
    assert forked["sees_worker"] is False
    assert forked["status"]["CapEff"] == forked["status"]["CapBnd"] == "0000000000000000"
    assert forked["status"]["NoNewPrivs"] == "1"
    assert forked["cmdline"][:3] == ["-I", "-u", "-c"]
    assert forked == started


async def test_an_interpreter_start_up_environment_that_differs_is_started_not_forked(tmp_path: Path) -> None:
    # The executor template is started with the first worker's locale and time zone, which a fork
    # inherits from it: a rollout whose differ gets a started executor, as it would have before.
    # Refused once, that worker asks no more: its environment would differ at every start, and a
    # cage made for nothing before each started executor would cost more than the fork saves.
    stop_templates()
    first = _facts((await _rollout(tmp_path / "a", [FACTS], env={"TZ": "Etc/GMT-3"}))[0])
    stuck = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(600)"
    outputs = await _rollout(tmp_path / "b", [FACTS, stuck, FACTS], env={"TZ": "Etc/GMT+5"})
    assert (first["ppid"], first["tz"]) == (0, ["+03", "+03"])
    for output in (outputs[0], outputs[2]):
        assert (_facts(output)["ppid"], _facts(output)["tz"]) == (1, ["-05", "-05"])
    asked = (tmp_path / "b" / "worker.log").read_text().count("did not fork an executor (refused TZ")
    assert asked == 1


SEARCH = r"""
import hashlib, re
target = {digest!r}
found = 0
with open("/proc/self/maps") as maps:
    regions = [line.split() for line in maps]
with open("/proc/self/mem", "rb", buffering=0) as mem:
    for fields in regions:
        if not fields[1].startswith("rw"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        try:
            mem.seek(start)
            data = mem.read(end - start)
        except (OSError, ValueError, OverflowError):
            continue
        for match in re.finditer(rb"[0-9a-f]{{32}}", data):
            if hashlib.sha256(match.group()).hexdigest() == target:
                found += 1
print("FOUND", found)
"""


async def test_an_executor_holds_nothing_of_another_rollout_in_its_memory(tmp_path: Path) -> None:
    # The template's heap is every executor's: it must never have read a worker's request (their
    # environments hold the rollouts' tokens). The first rollout's token, as its executor saw it,
    # is looked for in the second's memory by its hash (the token itself would put it there).
    stop_templates()
    first = _facts((await _rollout(tmp_path / "a", [FACTS]))[0])
    token = first["token"]
    assert isinstance(token, str) and len(token) == 32 and first["ppid"] == 0
    digest = hashlib.sha256(token.encode()).hexdigest()
    [own, search] = await _rollout(tmp_path / "b", [FACTS, SEARCH.format(digest=digest)])
    assert _facts(own)["ppid"] == 0
    assert "FOUND 0" in search, search
    # The search finds what is there: the rollout's own token, in its own environment.
    name = "ROLLCAGE_SUPERVISION_TOKEN"
    own = f"import hashlib, os\nd = hashlib.sha256(os.environ[{name!r}].encode()).hexdigest()\n"
    [mine] = await _rollout(
        tmp_path / "c", [own + SEARCH.replace("target = {digest!r}", "target = d").format()]
    )
    assert "FOUND 0" not in mine and "FOUND" in mine, mine


def _template_children() -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as file:
                words = file.read().split(b"\0")
        except OSError:
            continue
        if any(word.endswith(b"_executor_template.py") for word in words):
            found.append(int(name))
    return found


async def test_a_dead_executor_template_is_started_again_and_a_stuck_cell_is_killed(tmp_path: Path) -> None:
    stop_templates()
    assert _facts((await _rollout(tmp_path / "a", [FACTS]))[0])["ppid"] == 0
    mine = _ours()
    assert len(mine) == 1, [_lineage(pid) for pid in mine]
    os.kill(mine[0], signal.SIGKILL)
    # The next worker's start finds it dead and starts another; a cell that ignores its interrupt is
    # killed at its timeout (with its cage) and the next cell runs in a new forked executor.
    stuck = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(600)"
    outputs = await _rollout(tmp_path / "b", [FACTS, stuck, FACTS])
    assert _facts(outputs[0])["ppid"] == 0
    assert _facts(outputs[2])["ppid"] == 0
    assert "restarted" in outputs[1] or "killed" in outputs[1], outputs[1]


def _lineage(pid: int) -> list[str]:
    """``PID STATE COMMAND`` of ``pid`` and of each ancestor up to this process (evidence)."""
    found = []
    while pid > 1 and pid != os.getpid():
        try:
            with open(f"/proc/{pid}/stat", "rb") as file:
                fields = file.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ")[:120].decode(errors="replace")
        except OSError:
            break
        found.append(f"{pid} {fields[0].decode()} {command}")
        pid = int(fields[1])
    return found


def _ours() -> list[int]:
    """The executor templates of this process's own warm templates (its children's children): not those of
    any other tree this process started (a Ray node's worker processes keep theirs, by design)."""
    return [pid for pid in _template_children() if _parent(_parent(pid)) == os.getpid()]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return int(file.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError):
        return 0


ORPHANS = """
import os, time
for _ in range(40):
    os.system("sleep 0.01 &")  # the shell exits at once: its sleep is the cage's PID 1's to reap

def states():
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            found.append(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0])
        except OSError:
            pass
    return found

# Until the orphans are gone (reaped), or 2 s (the cell has 3): what is left PID 1 did not reap.
deadline = time.monotonic() + 2
while (states().count("Z") or len(states()) > 3) and time.monotonic() < deadline:
    time.sleep(0.05)
print("ZOMBIES", states().count("Z"))
"""


async def test_an_interrupted_cell_keeps_its_executor_and_orphans_are_reaped(tmp_path: Path) -> None:
    # SIGINT reaches the forked executor's group (its own): the cell stops, the session stays.
    outputs = await _rollout(
        tmp_path / "r",
        [
            "x = 41\nimport os\nprint('PID', os.getpid())",
            "import time\ntime.sleep(600)",
            "print('PID', os.getpid(), x + 1)",
            ORPHANS,
        ],
    )
    assert "KeyboardInterrupt" in outputs[1], outputs[1]
    pid = outputs[0].split("PID", 1)[1].split()[0]
    assert outputs[2].split("PID", 1)[1].split()[:2] == [pid, "42"], outputs[2]
    assert "ZOMBIES 0" in outputs[3], outputs[3]


async def test_a_hung_executor_template_costs_no_cell_and_is_replaced(tmp_path: Path) -> None:
    """An executor template that stops answering (SIGSTOP: alive, its sockets open, silent) fails no cell:
    the worker waits a bounded time for its answer and starts the executor itself. The warm template
    then finds its hand-overs unread, kills it (SIGKILL ends a stopped process too) and starts another,
    whose executors are forked again."""
    stop_templates()
    assert _facts((await _rollout(tmp_path / "a", [FACTS]))[0])["ppid"] == 0
    mine = _ours()
    assert len(mine) == 1, [_lineage(pid) for pid in mine]
    hung = mine[0]
    os.kill(hung, signal.SIGSTOP)
    try:
        # Started, not forked (its parent is the cage's init), and not an error the agent sees.
        assert _facts((await _rollout(tmp_path / "b", [FACTS]))[0])["ppid"] != 0
        # Until the hung template's hand-overs are old enough to call it hung: a bounded number of
        # rollouts, each of which completes all the same.
        for attempt in range(6):
            facts = _facts((await _rollout(tmp_path / f"c{attempt}", [FACTS]))[0])
            if facts["ppid"] == 0:
                break
        else:
            raise AssertionError("the hung executor template was never replaced")
        assert not alive(hung), "the hung executor template was left behind"
        assert _ours() != [hung]
    finally:
        if alive(hung):
            os.kill(hung, signal.SIGKILL)
        stop_templates()
