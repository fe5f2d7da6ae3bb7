"""What importing the model client costs a worker process (a benchmark, not a test).

Every rollout starts a fresh worker process that imports ``rollcage.model`` and
``rollcage.protocol``, so their import cost is paid once per rollout. This
starts fresh interpreters that import only that, next to a bare ``python -c
pass`` and to ``import openai`` (what the client deliberately does not use),
and reports medians of wall time, CPU time (user + system) and peak RSS (the
child's own ``VmHWM``; Linux only). A second line adds what the first call
costs on top (pydantic builds the validators it needs on first use).

Usage: ``.venv/bin/python bench/imports.py [--runs N]``. Target for the worker's
imports: under 150 ms wall and 35 MB peak RSS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = ["CASES", "Sample", "main", "measure"]

# What the first model call adds on top of the imports: the validators built on first use.
_FIRST_PARSE = (
    "import rollcage.model, rollcage.protocol, rollcage.wire, time\n"
    "rollcage.model.ModelClient\n"
    "body = {'choices': [{'message': {'role': 'assistant', 'content': 'hi'}, 'finish_reason': 'stop'}],"
    " 'usage': {'prompt_tokens': 1, 'completion_tokens': 1, 'total_tokens': 2}}\n"
    "out = rollcage.wire.parse_payload('chat', body)\n"
    "now = time.time()\n"
    "attempt = rollcage.protocol.CallAttempt(index=0, status='completed', http_status=200, started_at=now,"
    " ended_at=now)\n"
    "rollcage.protocol.ModelCall(id='r:m0', index=0, turn=0, api='chat', request={}, response=body,"
    " status=out.status, output=out.output, usage=out.usage, tokens=out.tokens, attempts=[attempt],"
    " started_at=now, ended_at=now)"
)
CASES: dict[str, str] = {
    "python -c pass": "pass",
    "rollcage.model + rollcage.protocol": "from rollcage.model import ModelClient; import rollcage.protocol",
    "  + parse one response into a ModelCall": _FIRST_PARSE,
    "  of which rollcage.protocol alone": "import rollcage.protocol",
    "openai (for comparison)": "import openai",
}
# The child reports its own high-water mark: ru_maxrss of a child started by fork/vfork and exec
# keeps the parent's RSS at exec time as a floor, which would inflate every number by the bench's size.
_REPORT_HWM = (
    "\nimport os as _os\n"
    "_os.write(1, next(l for l in open('/proc/self/status', 'rb') if l.startswith(b'VmHWM')))"
)
TARGET_CASE = "rollcage.model + rollcage.protocol"
TARGET_WALL_S = 0.150
TARGET_RSS_MB = 35.0


@dataclass(frozen=True)
class Sample:
    """One fresh interpreter's cost."""

    wall_s: float
    """Wall-clock time from spawn to exit."""
    cpu_s: float
    """User + system CPU time of the child."""
    rss_mb: float
    """Peak resident set size of the child (MiB)."""


def measure(code: str) -> Sample:
    """Run ``python -c code`` in a fresh interpreter and measure it."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", code + _REPORT_HWM], stdout=subprocess.PIPE)
    assert process.stdout is not None
    report = process.stdout.read()  # a few bytes at exit; read before reaping
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.stdout.close()
    process.returncode = os.waitstatus_to_exitcode(status)  # already reaped: keep Popen consistent
    if process.returncode != 0:
        raise SystemExit(f"python -c {code!r} failed with exit code {process.returncode}")
    rss_kib = int(report.split()[1])  # b"VmHWM:  12345 kB"
    return Sample(wall, usage.ru_utime + usage.ru_stime, rss_kib / 1024)


def main(argv: list[str] | None = None) -> int:
    """Measure every case, print medians, and say whether the worker's imports meet the target."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=9, help="fresh processes per case (median reported)")
    args = parser.parse_args(argv)

    for code in CASES.values():  # warm the filesystem cache and .pyc files once
        measure(code)
    results: dict[str, list[Sample]] = {name: [] for name in CASES}
    for _ in range(args.runs):  # interleaved, so drifting machine load hits every case alike
        for name, code in CASES.items():
            results[name].append(measure(code))

    print(f"{sys.executable} ({sys.version.split()[0]}), medians of {args.runs} fresh processes")
    print(f"{'case':42} {'wall ms':>9} {'cpu ms':>9} {'peak RSS MB':>12}")
    medians: dict[str, Sample] = {}
    for name, samples in results.items():
        median = Sample(
            statistics.median(s.wall_s for s in samples),
            statistics.median(s.cpu_s for s in samples),
            statistics.median(s.rss_mb for s in samples),
        )
        medians[name] = median
        print(f"{name:42} {median.wall_s * 1000:9.1f} {median.cpu_s * 1000:9.1f} {median.rss_mb:12.1f}")

    worker = medians[TARGET_CASE]
    bare = medians["python -c pass"]
    print(
        f"\nworker imports over bare python: {(worker.wall_s - bare.wall_s) * 1000:.1f} ms wall, "
        f"{(worker.cpu_s - bare.cpu_s) * 1000:.1f} ms CPU, {worker.rss_mb - bare.rss_mb:.1f} MB"
    )
    ok = worker.wall_s < TARGET_WALL_S and worker.rss_mb < TARGET_RSS_MB
    print(
        f"target (< {TARGET_WALL_S * 1000:.0f} ms, < {TARGET_RSS_MB:.0f} MB): "
        f"{'met' if ok else 'NOT met'} ({worker.wall_s * 1000:.0f} ms, {worker.rss_mb:.1f} MB)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
