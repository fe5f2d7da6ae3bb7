"""Benchmark (not a test): what one Python executor costs, started from scratch or forked.

The executor (``rollcage.tools._repl``) is a fresh interpreter per rollout: ``python -I -u
-c BOOT`` under its nested bubblewrap. Forking it from a warm process instead (a zygote,
as the worker is forked from the template) looks like the way to skip the interpreter's
start. This measures, per session (start, ``init``, one cell, exit), without any cage:

1. **exec**: ``python -I -u -c BOOT`` exactly as :class:`ReplExecutor` starts it; the
   child's CPU from ``wait4`` (its exit included), the parent's own CPU around it.
2. **fork**: a fork of this process after it took the warm template's state
   (:func:`rollcage.worker.warm_up`, ``gc.freeze()``), running the same module in-process:
   the best case of any zygote, before the joins, the privilege drop and the stream set-up
   a caged executor also needs (a warm worker pays ~5 ms for those, ``bench/profile.py``).
3. **fork + exit** of an image of N MB of Python objects: the kernel's share alone
   (copying page tables, tearing the address space down).

What it showed (2 cores, this VM; see the README): exec ~14 ms of child CPU, fork ~4 ms,
and fork + exit of a 33 MB image ~1.8 ms. But a zygote must be forked before the rollout
is read (its memory becomes the agent's), and entering a PID namespace takes one more
fork after the ``setns``: the in-worker prototype (zygote, joiner, executor; measured
with ``perf`` over 100 rollouts) cost 6.0 + 4.8 + 7.5 ms, more than the exec it replaced,
and the worker's own CPU rose ~2 ms (its pages were shared again with the zygote, so each
later write copied them once more). Each page written after a fork costs ~2.8 µs here.

    .venv/bin/python bench/executor_start.py [--runs 40]
"""

from __future__ import annotations

import argparse
import gc
import json
import marshal
import os
import resource
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any


def _frame(obj: Any) -> bytes:
    body = marshal.dumps(obj)
    return len(body).to_bytes(4, "big") + body


def _reply(sock: socket.socket) -> dict[str, Any]:
    size = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "big")
    reply: dict[str, Any] = json.loads(sock.recv(size, socket.MSG_WAITALL))
    return reply


def _session(sock: socket.socket) -> None:
    """What a rollout's executor does at least: become ready, run one cell, exit."""
    sock.sendall(_frame({"op": "init", "limit": 1000, "marker": b"\x1e\x00bench:", "tools": {}}))
    ready = _reply(sock)
    if ready.get("op") != "ready":
        raise RuntimeError(f"the executor did not become ready: {ready}")
    sock.sendall(_frame({"op": "run", "id": 1, "code": "print(6 * 7)"}))
    _reply(sock)
    sock.sendall(_frame({"op": "exit"}))


def _cpu_self() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _exec_once(code: bytes, boot: str, null: int) -> tuple[float, int]:
    ours, theirs = socket.socketpair()
    child = subprocess.Popen(
        [sys.executable, "-I", "-u", "-c", boot, str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        stdin=null,
        stdout=null,
        stderr=null,
        start_new_session=True,
    )
    theirs.close()
    ours.sendall(len(code).to_bytes(4, "big") + code)
    _session(ours)
    ours.close()
    _, _, usage = os.wait4(child.pid, 0)
    child.returncode = 0  # reaped above
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def _fork_once(module: Any, null: int) -> tuple[float, int]:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.setsid()
            sys.argv = ["-c", str(theirs.fileno())]
            namespace = {"__name__": "__main__", "__file__": module.co_filename, "__builtins__": __builtins__}
            exec(module, namespace)
        finally:
            os._exit(0)
    theirs.close()
    _session(ours)
    ours.close()
    _, _, usage = os.wait4(pid, 0)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def _measure(label: str, once: Callable[[], tuple[float, int]], runs: int) -> dict[str, Any]:
    once()  # warm the caches
    child_ms: list[float] = []
    faults: list[int] = []
    before = _cpu_self()
    for _ in range(runs):
        cpu, minflt = once()
        child_ms.append(cpu * 1000)
        faults.append(minflt)
    parent_ms = (_cpu_self() - before) * 1000 / runs
    return {
        "label": label,
        "child_ms": statistics.median(child_ms),
        "parent_ms": parent_ms,
        "faults": statistics.median(faults),
    }


def _anon_mb() -> float:
    with open("/proc/self/smaps_rollup") as handle:
        for line in handle:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fork_exit(runs: int) -> tuple[float, float]:
    parent = child = 0.0
    for _ in range(runs):
        before = _cpu_self()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        _, _, usage = os.wait4(pid, 0)
        parent += _cpu_self() - before
        child += usage.ru_utime + usage.ru_stime
    return parent * 1000 / runs, child * 1000 / runs


def _image_sizes(sizes: list[int], runs: int) -> list[tuple[float, float, float]]:
    """Fork + exit of this process grown to each size (run it in a fresh process: the image only grows)."""
    ballast: list[list[object]] = []
    rows = []
    for size in sizes:
        while _anon_mb() < size:
            ballast.append([object() for _ in range(1000)])
        gc.collect()
        gc.freeze()
        parent, child = _fork_exit(runs)
        rows.append((_anon_mb(), parent, child))
    return rows


def main() -> None:
    """Measure and print the three tables."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=40, help="sessions (and forks) per case (default 40)")
    parser.add_argument("--images-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.images_child:
        print(json.dumps(_image_sizes([3, 10, 20, 30], args.runs)))
        return

    # Image sizes first, in a fresh interpreter of their own (this one is about to grow).
    images = json.loads(
        subprocess.run(
            [sys.executable, "-I", __file__, "--images-child", "--runs", str(args.runs)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )

    from rollcage.tools._repl import _BOOT, child_code
    from rollcage.worker import warm_up

    warm_up()
    gc.collect()
    gc.freeze()
    code = child_code()
    module = marshal.loads(code)
    null = os.open(os.devnull, os.O_RDWR)
    template_mb = _anon_mb()
    forked = f"fork of the template's heap ({template_mb:.0f} MB)"
    rows = [
        _measure("exec: python -I -u -c BOOT", lambda: _exec_once(code, _BOOT, null), args.runs),
        _measure(forked, lambda: _fork_once(module, null), args.runs),
    ]
    print(f"cores: {os.cpu_count()}  load average: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"\n1-2. one executor session (start, one cell, exit), medians of {args.runs}, no cage")
    print(f"   {'how':48s} {'child CPU ms':>12s} {'parent CPU ms':>13s} {'child faults':>12s}")
    for row in rows:
        print(f"   {row['label']:48s} {row['child_ms']:12.2f} {row['parent_ms']:13.2f} {row['faults']:12.0f}")
    exec_total = rows[0]["child_ms"] + rows[0]["parent_ms"]
    fork_total = rows[1]["child_ms"] + rows[1]["parent_ms"]
    print(f"   fork / exec, child + parent: {fork_total / exec_total:.2f}x")
    print("\n3. fork + exit of an image of N MB of Python objects (the kernel's share)")
    print(f"   {'anonymous MB':>12s} {'parent fork ms':>14s} {'child exit ms':>13s}")
    for anon, parent, child in images:
        print(f"   {anon:12.1f} {parent:14.2f} {child:13.2f}")


if __name__ == "__main__":
    main()
