"""What the controller's lazy face saves the processes that import it (a benchmark, not a test).

``rollcage.controller``'s face imports each of its names from its module on first use
(PEP 562). Before, it imported every module of the controller at once, whoever asked
for one name. Each case here is a fresh interpreter doing what a room of rollcage
does at its start, measured twice, interleaved:

* *lazy*: as the code is now;
* *eager*: the same, and then every module the eager face imported (the modules the
  face's names live in, ``rollcage.controller._HOMES``): what the process paid before.

The cases: ``rollcage run``'s start-up up to its first rollout (the command line built
and parsed, the collector's classes loaded: what the real process imports before it
runs anything), ``rollcage run --help`` through the real entry point, the rooms of
``rollcage show`` (the viewer) and ``rollcage export``, and ``rollcage.collect`` for a
trainer. Reported: medians of CPU time (user + system, the child's own, ``wait4``), USS
(the child's private memory at its end, ``/proc/self/smaps_rollup``) and the number of
modules loaded, and eager / lazy.

Usage: ``.venv/bin/python bench/lean.py [--runs N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CASES", "Sample", "main", "measure"]

_RUN_STARTUP = (
    "from rollcage.cli import _build_app\n"
    "import typer.main\n"
    "command = typer.main.get_command(_build_app('run'))\n"
    "command.make_context('rollcage', ['run', 'dataset.jsonl', '--policy', 'script.json'])\n"
    "from rollcage.controller import Collection, RunConfig, RunSummary\n"
)
_RUN_HELP = (
    "import contextlib, io, sys\n"
    "sys.argv = ['rollcage', 'run', '--help']\n"
    "from rollcage.cli import main\n"
    "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
    "    main()\n"
)
CASES: dict[str, str] = {
    "rollcage run start-up": _RUN_STARTUP,
    "rollcage run --help": _RUN_HELP,
    "rollcage show (the viewer)": "import rollcage.viewer\n",
    "rollcage export": "import rollcage.export\n",
    "rollcage.collect (a trainer)": "import rollcage\nrollcage.collect\n",
}
_EAGER = (
    "import importlib, rollcage.controller as _face\n"
    "for _home in sorted(set(_face._HOMES.values())):\n"
    "    importlib.import_module(_home)\n"
)
# The child reports its own USS and module count into a file: its stdout belongs to the case.
_REPORT = (
    "import os as _os, sys as _sys\n"
    "_private = 0\n"
    "for _line in open('/proc/self/smaps_rollup'):\n"
    "    if _line.startswith(('Private_Clean:', 'Private_Dirty:')):\n"
    "        _private += int(_line.split()[1])\n"
    "with open(_sys.argv[1], 'w') as _out:\n"
    "    _out.write(f'{_private} {len(_sys.modules)}')\n"
)


@dataclass(frozen=True)
class Sample:
    """One fresh interpreter's cost."""

    cpu_s: float
    """User + system CPU time of the child."""
    uss_mb: float
    """The child's private memory (clean + dirty) at its end, MiB."""
    modules: int
    """Modules loaded (``len(sys.modules)``) at its end."""


def measure(code: str, workdir: Path) -> Sample:
    """Run ``code`` in a fresh interpreter (in ``workdir``) and measure it."""
    report = workdir / "report"
    process = subprocess.Popen(
        [sys.executable, "-c", code + _REPORT, str(report)], cwd=workdir, stdout=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # already reaped: keep Popen consistent
    if process.returncode != 0:
        raise SystemExit(f"python -c {code!r} failed with exit code {process.returncode}")
    private_kib, modules = map(int, report.read_text().split())
    return Sample(usage.ru_utime + usage.ru_stime, private_kib / 1024, modules)


def _median(samples: list[Sample]) -> Sample:
    return Sample(
        statistics.median(s.cpu_s for s in samples),
        statistics.median(s.uss_mb for s in samples),
        int(statistics.median(s.modules for s in samples)),
    )


def main(argv: list[str] | None = None) -> int:
    """Measure every case lazy and eager, interleaved; print medians and eager / lazy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=9, help="fresh processes per case and face (median)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rollcage-bench-lean-") as tmp:
        workdir = Path(tmp)
        (workdir / "dataset.jsonl").write_text('{"id": "t1", "input": "hi", "expected": "42"}\n')
        (workdir / "script.json").write_text('{"tasks": {"t1": [{"text": "42"}]}}')
        runs: dict[tuple[str, str], list[Sample]] = {(n, f): [] for n in CASES for f in ("lazy", "eager")}
        for code in CASES.values():  # warm the file system cache and the .pyc files once
            measure(code, workdir)
        for _ in range(args.runs):  # interleaved, so drifting machine load hits every case alike
            for name, code in CASES.items():
                runs[name, "lazy"].append(measure(code, workdir))
                runs[name, "eager"].append(measure(_EAGER + code, workdir))
    print(f"{sys.executable} ({sys.version.split()[0]}), medians of {args.runs} fresh processes each")
    print(f"{'case':30} {'face':6} {'cpu ms':>8} {'USS MB':>8} {'modules':>8}")
    for name in CASES:
        lazy, eager = _median(runs[name, "lazy"]), _median(runs[name, "eager"])
        for face, m in (("lazy", lazy), ("eager", eager)):
            print(f"{name:30} {face:6} {m.cpu_s * 1000:8.1f} {m.uss_mb:8.1f} {m.modules:8d}")
        print(
            f"{'':30} {'e/l':6} {eager.cpu_s / lazy.cpu_s:8.2f} {eager.uss_mb / lazy.uss_mb:8.2f} "
            f"{eager.modules - lazy.modules:+8d}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
