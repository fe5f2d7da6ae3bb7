"""Shared by ``bench/peers.py`` and ``bench/profile.py``: the bench's tasks, its model server, /proc readings.

The tasks (the same for every system measured): task ``tN`` with N odd makes one
python call and then answers, with N even two python calls; so 2.5 model calls
and 1.5 executions per task on average. The scripted model plays them by task id
(rollcage sends ``X-Task-Id``; the prompt also carries a ``[task:tN]`` marker for
clients that send no such header).

The model server runs in a process of its own (``python bench/_measure.py serve
SCRIPT LATENCY``), so that neither system pays for it: it prints its base URL,
serves until its stdin closes, then prints its counters as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ANSWER",
    "CODE",
    "PROMPT",
    "CpuGroup",
    "ModelServer",
    "Smaps",
    "cpu_s",
    "descendants",
    "python_calls",
    "read_smaps",
    "schedstat_ns",
    "tree",
    "write_dataset",
    "write_policy",
]

PROMPT = "[task:{id}] Compute 6 * 7 with the python tool, then answer with the number only."
"""The words of every task (the same in ``bench/_peers_inspect.py``)."""
CODE = "print(6 * 7)"
"""What each python call runs."""
ANSWER = "42"


def python_calls(index: int) -> int:
    """How many python calls task ``t<index>`` makes before it answers (odd: 1, even: 2)."""
    return 1 if index % 2 else 2


def write_policy(path: Path, count: int, *, first_code: str = CODE) -> None:
    """The scripted model's turns for tasks t1..t<count> (``first_code``: what the first call runs)."""
    tasks: dict[str, list[dict[str, Any]]] = {}
    for i in range(1, count + 1):
        codes = [first_code] + [CODE] * (python_calls(i) - 1)
        turns: list[dict[str, Any]] = [
            {"tool_calls": [{"name": "python", "arguments": {"code": code}}]} for code in codes
        ]
        tasks[f"t{i}"] = [*turns, {"text": ANSWER}]
    path.write_text(json.dumps({"model": "scripted", "tasks": tasks}))


def write_dataset(path: Path, count: int) -> None:
    """rollcage's dataset for tasks t1..t<count>: the python tool, graded by exact match outside."""
    with path.open("w") as handle:
        for i in range(1, count + 1):
            row = {
                "id": f"t{i}",
                "input": PROMPT.format(id=f"t{i}"),
                "tools": ["python"],
                "expected": ANSWER,
                "grader": {"type": "exact"},
            }
            handle.write(json.dumps(row) + "\n")


class ModelServer:
    """The scripted model in a child process, answering every request ``latency_s`` late.

    Use as a context manager; ``stats`` holds the server's counters (model requests
    served) and ``cpu_s`` its CPU time once it has exited.
    """

    def __init__(self, script: Path, latency_s: float) -> None:
        self.script = script
        self.latency_s = latency_s
        self.base_url = ""
        self.stats: dict[str, Any] = {}
        self.cpu_s = 0.0
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> ModelServer:
        argv = [sys.executable, __file__, "serve", str(self.script), str(self.latency_s)]
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line.startswith("http"):
            self._proc.kill()
            raise SystemExit(f"the model server did not start: {line!r}")
        self.base_url = line
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        proc.stdout.close()
        self.cpu_s = usage.ru_utime + usage.ru_stime
        with contextlib.suppress(ValueError, IndexError):
            self.stats = json.loads(out.strip().splitlines()[-1])


def _serve(script: str, latency_s: float) -> None:
    import logging

    from rollcage.policy import PolicyServer

    logging.getLogger("uvicorn").setLevel(logging.WARNING)
    faults = [f"kind=latency:delay={latency_s:g}"] if latency_s > 0 else []
    with PolicyServer(script, faults=faults, request_log_limit=100) as server:
        print(server.base_url, flush=True)
        sys.stdin.read()  # until the bench closes our stdin
        calls = server.state.calls
    print(json.dumps({"model_requests": calls}), flush=True)


# ----------------------------------------------------------------------------- /proc


def tree(pid: int) -> dict[int, int]:
    """``pid``'s descendants (not itself) -> depth below it (1: a child).

    Read through ``/proc/PID/task/TID/children``, so no scan of all of ``/proc``.
    """
    depths: dict[int, int] = {}
    todo = [(pid, 0)]
    while todo:
        current, depth = todo.pop()
        try:
            tids = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{current}/task/{tid}/children") as handle:
                    kids = [int(k) for k in handle.read().split()]
            except OSError:
                continue
            for kid in kids:
                depths[kid] = depth + 1
                todo.append((kid, depth + 1))
    return depths


def descendants(pid: int) -> list[int]:
    """``pid``'s descendants (not itself), parents before their children."""
    return list(tree(pid))


@dataclass(frozen=True)
class Smaps:
    """``/proc/PID/smaps_rollup`` of one process, in KiB."""

    rss: int
    pss: int
    private: int
    """Private_Clean + Private_Dirty (USS): what the process alone holds."""
    anonymous: int


def read_smaps(pid: int) -> Smaps | None:
    """The process's memory, or ``None`` if it is gone (or not readable)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    fields: dict[bytes, int] = {}
    for line in data.splitlines()[1:]:
        key, _, rest = line.partition(b":")
        parts = rest.split()
        if parts:
            fields[key] = int(parts[0])
    if b"Pss" not in fields:
        return None  # a zombie, or a kernel thread
    return Smaps(
        rss=fields.get(b"Rss", 0),
        pss=fields[b"Pss"],
        private=fields.get(b"Private_Clean", 0) + fields.get(b"Private_Dirty", 0),
        anonymous=fields.get(b"Anonymous", 0),
    )


def schedstat_ns(pid: int) -> int | None:
    """CPU time of the process's live threads in ns (``/proc/PID/task/*/schedstat``), None if gone."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                total += int(handle.read().split()[0])
    return total


class CpuGroup:
    """A cgroup v1 ``cpuacct`` group of its own: exact CPU time of every process put in it, and its members.

    Children inherit the group, whoever reaps them, so ``usage_s`` is exact where
    ``RUSAGE_CHILDREN`` is not (see ``bench/peers.py``). ``CpuGroup.make`` returns
    None where no cpuacct hierarchy is writable (not root, cgroup v2 only).
    """

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def make(cls, tag: str) -> CpuGroup | None:
        """A new, empty group, or None where cgroup v1 cpuacct is not writable."""
        path = cls.ROOT / f"rollcage-bench-{os.getpid()}-{tag}"
        try:
            path.mkdir()
        except OSError:
            return None
        return cls(path)

    def enter(self) -> None:
        """Move the calling process into the group (a ``preexec_fn``: between fork and exec)."""
        with open(self.path / "cgroup.procs", "w") as handle:
            handle.write(str(os.getpid()))

    def usage_s(self) -> float:
        """CPU seconds used in the group so far, user + system."""
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def pids(self) -> list[int]:
        """The processes in the group now."""
        with contextlib.suppress(OSError):
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        return []

    def remove(self) -> None:
        """Remove the group once its processes are gone (waits up to 10 s for them)."""
        for _ in range(100):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def cpu_s(usage: Any) -> float:
    """User + system seconds of a ``resource.struct_rusage``."""
    return float(usage.ru_utime + usage.ru_stime)


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"] or len(sys.argv) != 4:
        raise SystemExit("usage: python bench/_measure.py serve SCRIPT LATENCY_S")
    _serve(sys.argv[2], float(sys.argv[3]))
