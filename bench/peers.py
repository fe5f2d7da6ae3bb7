"""Benchmark (not a test): rollcage next to Inspect AI on identical work, and issue 16's targets.

Both systems run the same tasks against the same OpenAI-compatible model server
(rollcage's scripted policy in a process of its own, answering every request
after a configurable latency): task ``tN`` with N odd makes one python call and
then answers, with N even two; 2.5 model calls and 1.5 executions per task.

* rollcage: ``rollcage run DATASET --sandbox bwrap --concurrency C`` (this repo's ``.venv``),
  its workers started warm (the default); ``--system rollcage-cold`` adds a run with
  ``--worker-start cold`` (a fresh interpreter per rollout) for comparison;
  ``rollcage-none`` and ``rollcage-none-cold`` run ``--sandbox none``, warm and cold;
* Inspect AI (``inspect-ai`` pinned below, installed once into its own venv under the
  git-ignored ``bench/.cache/``): ``eval()`` of the ``react`` agent with its ``python``
  tool in the ``local`` sandbox, ``max_samples``/``max_connections``/``max_subprocesses``
  = C (see ``bench/_peers_inspect.py``), with an empty ``HOME`` so that the tool's login
  shell finds the system's ``python3`` rather than a user's shims (pyenv's cost ~150 ms
  of CPU per call here).

Scenarios (``--scenario``, repeatable; default all three): ``instant`` (no model
latency, N=200, C=8), ``c64`` (1 s per model call, N=256, C=64) and ``c256`` (1 s,
N=256, C=256). Each system also runs one task alone (N=1, C=1) at each latency.

How each number is taken, per system and scenario:

* **CPU** — user + system time of the run's whole process tree. Each run is started
  by a small meter process (this file, ``--meter``) that puts the system into a
  cgroup v1 ``cpuacct`` group of its own and reads ``cpuacct.usage`` at the end:
  exact, whoever reaps whom. The meter is also a child subreaper that reaps every
  process of the tree and reports ``getrusage(RUSAGE_CHILDREN)``, printed beside it
  as ``(rusage)``; that one is only a lower bound under bubblewrap: a dying PID
  namespace init ignores SIGCHLD, so a process still alive in it at that moment (the
  inner sandbox's init, with the worker's CPU in it) is auto-reaped and its time is
  never added to anyone's children total. Without a writable cpuacct hierarchy the
  rusage figure is all there is, and the bench says so. The model server is outside
  the tree (its CPU is not counted for either system).
* **peak PSS** — ``/proc/PID/smaps_rollup`` of every process of the run (the cgroup's
  ``cgroup.procs``, else the meter's descendants), summed; sampled every
  ``--sample-interval`` s, backing off so that sampling takes at most ~20% of one core.
  PSS per concurrent rollout = peak PSS / C. **peak RSS** is the same samples' largest sum of
  ``Rss`` (a page shared by N processes counted N times, as ``ps`` would add it up).
* **throughput** — tasks / wall time of the whole command (start-up and shutdown included).
* **first result** — from the command's start until the first graded result is on
  disk (rollcage: a line in ``rollouts.jsonl``; Inspect: the scorer's first line).
* **infra failures** — rollcage: attempts whose outcome is ``infra_failure`` (retries
  included); Inspect: samples that ended with an error.
* **alone** — the first result of a run of one task (N=1, C=1) at the same latency.

The machine's load average is printed before and after every run: on a shared
machine, compare the two systems only where the load was alike.

    .venv/bin/python bench/peers.py                      # everything, ~10 min on 2 quiet cores
    .venv/bin/python bench/peers.py --quick              # instant and c64 with fewer tasks, ~2 min
                                                         # (start-up weighs more than in a full run)
    .venv/bin/python bench/peers.py --scenario c256 --system rollcage
    .venv/bin/python bench/peers.py --rounds 3           # each scenario 3 times, the systems in turn

With ``--rounds K`` each scenario runs K times, the two systems back to back in each round
and the first of one round the last of the next; the ratios and targets are taken from the
rounds pooled (sums of CPU, tasks and wall; the worst peak PSS and first result), and the CPU
ratio is also printed round by round: on a machine whose neighbours come and go, one round's
ratio moves by more than the difference being measured.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import ctypes
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _measure import CpuGroup, ModelServer, cpu_s, descendants, read_smaps, write_dataset, write_policy

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / ".cache"
SYSTEMS = ["rollcage", "rollcage-cold", "rollcage-none", "rollcage-none-cold", "inspect"]
"""What ``--system`` runs: rollcage (bwrap, warm or cold; --sandbox none, warm or cold) and Inspect AI."""
INSPECT_VERSION = "0.3.285"
OPENAI_VERSION = "3.57.0"
"""The ``openai`` SDK Inspect's ``openai-api`` provider uses (pinned with it)."""
ROLLCAGE = ROOT / ".venv" / "bin" / "rollcage"
STRAGGLER_WAIT_S = 30.0
"""After the system's main process exits, how long the meter waits for its orphans before killing them."""


@dataclass(frozen=True)
class Scenario:
    """One load: the model's latency, the tasks and the concurrency."""

    key: str
    title: str
    latency_s: float
    tasks: int
    concurrency: int


SCENARIOS = {
    "instant": Scenario("instant", "instant model", 0.0, 200, 8),
    "c64": Scenario("c64", "1 s latency, C=64", 1.0, 256, 64),
    "c256": Scenario("c256", "1 s latency, C=256", 1.0, 256, 256),
}
QUICK_TASKS = {"instant": 32, "c64": 64, "c256": 256}


@dataclass
class Run:
    """What one run of one system measured."""

    system: str
    scenario: str
    tasks: int
    concurrency: int
    latency_s: float
    round_index: int = 1
    """Which round of ``--rounds`` this was; 0 for the rounds pooled (:func:`pooled`)."""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    """The tree's CPU: cpuacct where available, else rusage."""
    rusage_cpu_s: float = 0.0
    main_cpu_s: float | None = None
    peak_pss_mb: float = 0.0
    peak_rss_mb: float = 0.0
    """The largest sum of the tree's RSS at one sample (shared pages counted once per process)."""
    peak_processes: int = 0
    pss_samples: int = 0
    first_result_s: float | None = None
    finished: int = 0
    correct: int = 0
    infra_failures: int = 0
    server_cpu_s: float = 0.0
    model_requests: int = 0
    exit_code: int | None = None
    load_before: str = ""
    load_after: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.tasks / self.wall_s if self.wall_s else 0.0

    @property
    def cpu_ms_per_rollout(self) -> float:
        return 1000 * self.cpu_s / self.tasks

    @property
    def pss_per_rollout_mb(self) -> float:
        return self.peak_pss_mb / self.concurrency


def pooled(runs: list[Run]) -> Run:
    """Rounds of one system and scenario as one run: their sums, and their worst peaks and first result.

    CPU per rollout and throughput are then the rounds' totals over their tasks and walls, so a
    round on a busier machine weighs as much as its tasks, no more.
    """
    first = runs[0]
    firsts = [r.first_result_s for r in runs]
    mains = [r.main_cpu_s for r in runs]
    return Run(
        first.system,
        first.scenario,
        sum(r.tasks for r in runs),
        first.concurrency,
        first.latency_s,
        round_index=0,
        wall_s=sum(r.wall_s for r in runs),
        cpu_s=sum(r.cpu_s for r in runs),
        rusage_cpu_s=sum(r.rusage_cpu_s for r in runs),
        main_cpu_s=None if None in mains else sum(m for m in mains if m is not None),
        peak_pss_mb=max(r.peak_pss_mb for r in runs),
        peak_rss_mb=max(r.peak_rss_mb for r in runs),
        peak_processes=max(r.peak_processes for r in runs),
        pss_samples=sum(r.pss_samples for r in runs),
        first_result_s=None if None in firsts else max(f for f in firsts if f is not None),
        finished=sum(r.finished for r in runs),
        correct=sum(r.correct for r in runs),
        infra_failures=sum(r.infra_failures for r in runs),
        server_cpu_s=sum(r.server_cpu_s for r in runs),
        model_requests=sum(r.model_requests for r in runs),
        exit_code=max((r.exit_code for r in runs if r.exit_code is not None), default=None),
        load_before=first.load_before,
        load_after=runs[-1].load_after,
        notes=[note for r in runs for note in r.notes],
    )


# ----------------------------------------------------------------------------- the meter


def _meter(report: Path, log: Path, cgroup: str | None, cwd: str, argv: list[str]) -> None:
    """Run ``argv`` as the root of a tree we reap entirely; write its rusage to ``report``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER: orphans come to us, not to init
        raise SystemExit(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")

    def enter_cgroup() -> None:
        if cgroup is not None:
            CpuGroup(Path(cgroup)).enter()

    with log.open("wb") as out:
        spawned_at = time.time()
        try:
            # preexec_fn is safe here: the meter has no threads.
            main = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, preexec_fn=enter_cgroup
            )
        except OSError as exc:
            raise SystemExit(f"cannot start {argv[0]}: {exc}") from exc
    exited_at: float | None = None
    status = 0
    stragglers = 0
    while True:
        if exited_at is None:
            try:
                pid, st = os.wait()
            except ChildProcessError:
                break
        else:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                if time.time() - exited_at > STRAGGLER_WAIT_S:
                    for left in descendants(os.getpid()):
                        with contextlib.suppress(OSError):
                            os.kill(left, 9)
                            stragglers += 1
                time.sleep(0.05)
                continue
        if pid == main.pid:
            status, exited_at = st, time.time()
    main.returncode = os.waitstatus_to_exitcode(status)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = {
        "pid": main.pid,
        "spawned_at": spawned_at,
        "exited_at": exited_at,
        "exit_code": main.returncode,
        "cpu_s": cpu_s(usage),
        "stragglers_killed": stragglers,
    }
    report.write_text(json.dumps(result))


# ----------------------------------------------------------------------------- sampling


def _load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def _proc_cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class FirstResult(threading.Thread):
    """Watches one run's results file for its first line, every 5 ms, on its own.

    Apart from :class:`Sampler`, whose PSS readings of hundreds of processes would delay a look by
    as long as they take. A result written in the last few milliseconds of a run (a run of one task
    writes its only line just before it exits) is caught by the look after the run, at the file's
    modification time: the time of that line when it is the only one.
    """

    def __init__(self, results: Path) -> None:
        super().__init__(daemon=True)
        self.results = results
        self.stop_event = threading.Event()
        self.at: float | None = None

    def _look(self) -> os.stat_result | None:
        with contextlib.suppress(OSError):
            info = self.results.stat()
            if info.st_size > 0:
                return info
        return None

    def run(self) -> None:
        while self.at is None and not self.stop_event.wait(0.005):
            if self._look() is not None:
                self.at = time.time()

    def finish(self) -> None:
        """Stop watching (the run has ended) and take a result the last looks missed."""
        self.stop_event.set()
        self.join()
        if self.at is None:
            info = self._look()
            if info is not None:
                self.at = info.st_mtime


class Sampler(threading.Thread):
    """Watches one run: the main process's CPU, the tree's PSS."""

    def __init__(self, meter_pid: int, cgroup: CpuGroup | None, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.meter_pid = meter_pid
        self.cgroup = cgroup
        self.interval_s = interval_s
        self.stop_event = threading.Event()
        self.main_cpu_s: float | None = None
        self.peak_pss_kib = 0
        self.peak_rss_kib = 0
        self.peak_processes = 0
        self.samples = 0
        self.sampling_s = 0.0

    def _pids(self) -> list[int]:
        if self.cgroup is not None:
            return self.cgroup.pids()
        return descendants(self.meter_pid)

    def _sample_pss(self) -> None:
        started = time.perf_counter()
        pids = self._pids()
        total = rss = 0
        for pid in pids:
            smaps = read_smaps(pid)
            if smaps is not None:
                total += smaps.pss
                rss += smaps.rss
        self.peak_pss_kib = max(self.peak_pss_kib, total)
        self.peak_rss_kib = max(self.peak_rss_kib, rss)
        self.peak_processes = max(self.peak_processes, len(pids))
        self.samples += 1
        self.sampling_s += time.perf_counter() - started

    def run(self) -> None:
        main: int | None = None
        next_pss = 0.0
        while not self.stop_event.is_set():
            now = time.perf_counter()
            if main is None:
                kids = descendants(self.meter_pid)
                main = kids[0] if kids else None
            if main is not None:
                value = _proc_cpu_s(main)
                if value is not None:
                    self.main_cpu_s = value
            if now >= next_pss:
                before = time.perf_counter()
                self._sample_pss()
                took = time.perf_counter() - before
                next_pss = time.perf_counter() + max(self.interval_s, 4 * took)
            self.stop_event.wait(0.05)


@contextlib.contextmanager
def _cgroup(tag: str) -> Iterator[CpuGroup | None]:
    group = CpuGroup.make(tag)
    try:
        yield group
    finally:
        if group is not None:
            group.remove()


# ----------------------------------------------------------------------------- the systems


def ensure_inspect() -> Path:
    """The Inspect AI venv's python, installing ``inspect-ai`` into ``bench/.cache/`` the first time."""
    venv = CACHE / f"inspect-ai-{INSPECT_VERSION}"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    if not stamp.exists():
        print(f"installing inspect-ai=={INSPECT_VERSION} into {venv} (once) ...", flush=True)
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pins = [f"inspect-ai=={INSPECT_VERSION}", f"openai=={OPENAI_VERSION}"]
        pip = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *pins], capture_output=True, text=True
        )
        if pip.returncode != 0:
            raise SystemExit(
                f"pip install {' '.join(pins)} failed:\n{pip.stdout[-2000:]}{pip.stderr[-2000:]}"
            )
        stamp.write_text(f"inspect-ai=={INSPECT_VERSION} openai=={OPENAI_VERSION}\n")
    return python


def _installed_version(python: Path, package: str) -> str:
    code = f"from importlib.metadata import version; print(version({package!r}))"
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def _command(
    system: str, inspect_python: Path | None, run_dir: Path, base_url: str, tasks: int, concurrency: int
) -> tuple[list[str], Path]:
    """The command line of one run, and the file whose first line is its first result."""
    if system.startswith("rollcage"):
        dataset = run_dir / "dataset.jsonl"
        write_dataset(dataset, tasks)
        out = run_dir / "out"
        argv = [
            str(ROLLCAGE),
            "run",
            str(dataset),
            "--out",
            str(out),
            "--model",
            base_url,
            "--model-name",
            "scripted",
            "--concurrency",
            str(concurrency),
            "--sandbox",
            "none" if system.startswith("rollcage-none") else "bwrap",
            "--worker-start",
            "cold" if system.endswith("-cold") else "warm",
            "--quiet",
        ]
        return argv, out / "rollouts.jsonl"
    assert inspect_python is not None
    results = run_dir / "scores.txt"
    # Inspect's python tool runs `bash --login -c 'python3 -'`: with this machine's HOME, the login shell's
    # profile puts pyenv's shims first (a shell script, ~150 ms of CPU per call). An empty HOME gives the
    # login shell the system's PATH and python3, as on a clean machine or in a container.
    (run_dir / "home").mkdir()
    argv = [
        "env",
        f"HOME={run_dir / 'home'}",
        str(inspect_python),
        str(ROOT / "bench" / "_peers_inspect.py"),
        "--base-url",
        base_url,
        "--tasks",
        str(tasks),
        "--concurrency",
        str(concurrency),
        "--log-dir",
        str(run_dir / "logs"),
        "--results",
        str(results),
    ]
    return argv, results


def _collect(run: Run, run_dir: Path, log: Path) -> None:
    """Outcomes of the run from the system's own artifacts."""
    if run.system.startswith("rollcage"):
        records = run_dir / "out" / "rollouts.jsonl"
        finished: set[str] = set()
        if records.exists():
            for line in records.read_text().splitlines():
                record = json.loads(line)
                if record["outcome"] == "infra_failure":
                    run.infra_failures += 1
                    reason = record["receipt"]["outcome_reason"][:160]
                    if reason not in run.notes and len(run.notes) < 3:
                        run.notes.append(reason)
                else:
                    finished.add(record["task_id"])
                run.correct += record.get("reward") == 1.0
        run.finished = len(finished)
        return
    summary: dict[str, Any] = {}
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                summary = json.loads(line)
                break
    if not summary:
        run.notes.append("no summary from Inspect; see its log: " + log.read_text(errors="replace")[-400:])
        return
    run.infra_failures = summary["errors"]
    run.finished = summary["samples"] - summary["errors"]
    run.correct = summary["correct"]
    run.notes += summary.get("error_messages", [])[:3]


def run_once(
    system: str,
    scenario: str,
    *,
    tasks: int,
    concurrency: int,
    latency_s: float,
    policy: Path,
    work: Path,
    inspect_python: Path | None,
    interval_s: float,
) -> Run:
    """One run of one system, measured."""
    run = Run(system, scenario, tasks, concurrency, latency_s)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{system}-{scenario}-", dir=work))
    report, log = run_dir / "meter.json", run_dir / "system.log"
    run.load_before = _load()
    with ModelServer(policy, latency_s) as server, _cgroup(run_dir.name) as cgroup:
        argv, results = _command(system, inspect_python, run_dir, server.base_url, tasks, concurrency)
        meter_argv = [
            sys.executable,
            __file__,
            "--meter",
            str(report),
            str(log),
            "" if cgroup is None else str(cgroup.path),
            str(run_dir),
        ]
        meter = subprocess.Popen([*meter_argv, "--", *argv])
        first = FirstResult(results)
        sampler = Sampler(meter.pid, cgroup, interval_s)
        first.start()
        sampler.start()
        meter.wait()
        first.finish()
        sampler.stop_event.set()
        sampler.join()
        cgroup_cpu_s = None
        if cgroup is not None:
            with contextlib.suppress(OSError, ValueError):
                cgroup_cpu_s = cgroup.usage_s()
    run.load_after = _load()
    if not report.exists():
        raise SystemExit(f"the meter of {system}/{scenario} failed (exit code {meter.returncode}); see above")
    measured = json.loads(report.read_text())
    run.exit_code = measured["exit_code"]
    run.wall_s = measured["exited_at"] - measured["spawned_at"]
    run.rusage_cpu_s = measured["cpu_s"]
    run.cpu_s = run.rusage_cpu_s if cgroup_cpu_s is None else cgroup_cpu_s
    if cgroup_cpu_s is None:
        run.notes.append("no writable cgroup v1 cpuacct: CPU is RUSAGE_CHILDREN, a lower bound under bwrap")
    run.main_cpu_s = sampler.main_cpu_s
    run.peak_pss_mb = sampler.peak_pss_kib / 1024
    run.peak_rss_mb = sampler.peak_rss_kib / 1024
    run.peak_processes = sampler.peak_processes
    run.pss_samples = sampler.samples
    if first.at is not None:
        run.first_result_s = first.at - measured["spawned_at"]
    run.server_cpu_s = server.cpu_s
    run.model_requests = int(server.stats.get("model_requests", 0))
    if measured["stragglers_killed"]:
        run.notes.append(f"{measured['stragglers_killed']} processes outlived the run and were killed")
    _collect(run, run_dir, log)
    if run.exit_code != 0:
        run.notes.append(f"exit code {run.exit_code}; log tail: {log.read_text(errors='replace')[-300:]!r}")
    return run


# ----------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def print_table(runs: list[Run], alone: dict[tuple[str, float], float | None]) -> None:
    """Every run, one row each."""
    columns = [
        ("scenario", 9),
        ("round", 5),
        ("system", 13),
        ("N", 4),
        ("C", 4),
        ("wall s", 7),
        ("rollouts/s", 10),
        ("CPU ms/rollout", 14),
        ("(rusage)", 9),
        ("main proc %", 11),
        ("peak PSS MB", 11),
        ("PSS/C MB", 9),
        ("peak RSS MB", 11),
        ("peak procs", 10),
        ("infra fail", 10),
        ("correct", 7),
        ("first s", 8),
        ("alone s", 8),
        ("calls/task", 10),
        ("load before -> after", 24),
    ]
    print("  ".join(f"{name:>{width}}" for name, width in columns))
    for r in runs:
        share = None if r.main_cpu_s is None or not r.cpu_s else 100 * r.main_cpu_s / r.cpu_s
        rusage_ms = 1000 * r.rusage_cpu_s / r.tasks
        cells = [
            r.scenario,
            r.round_index or "all",
            r.system,
            r.tasks,
            r.concurrency,
            f"{r.wall_s:.1f}",
            f"{r.throughput:.2f}",
            f"{r.cpu_ms_per_rollout:.0f}",
            f"{rusage_ms:.0f}",
            _fmt(share, ".0f"),
            f"{r.peak_pss_mb:.0f}",
            f"{r.pss_per_rollout_mb:.1f}",
            f"{r.peak_rss_mb:.0f}",
            r.peak_processes,
            r.infra_failures,
            f"{r.correct}/{r.tasks}",
            _fmt(r.first_result_s, ".1f"),
            _fmt(alone.get((r.system, r.latency_s)), ".1f"),
            f"{r.model_requests / r.tasks:.2f}",
            f"{r.load_before} -> {r.load_after}",
        ]
        print("  ".join(f"{c!s:>{w}}" for c, (_, w) in zip(cells, columns, strict=True)))
    for r in runs:
        for note in r.notes:
            print(f"  note {r.system}/{r.scenario}: {note}")


def print_ratios_and_targets(runs: list[Run], alone: dict[tuple[str, float], float | None]) -> None:
    """rollcage / Inspect per scenario (rounds pooled), then issue 16's targets and whether each is met."""
    rounds: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        rounds.setdefault((r.system, r.scenario), []).append(r)
    by = {key: group[0] if len(group) == 1 else pooled(group) for key, group in rounds.items()}
    scenarios = [s for s in SCENARIOS if ("rollcage", s) in by]
    several = any(len(group) > 1 for group in rounds.values())
    if several:
        print("\npooled over the rounds (sums; the worst peak and first result):")
        print_table(list(by.values()), alone)
    print(f"\nrollcage / Inspect AI (same run{', rounds pooled' if several else ''}):")
    print(
        f"{'scenario':>9}  {'throughput':>10}  {'CPU/rollout':>11}  {'peak PSS':>8}  {'peak RSS':>8}  "
        f"{'first result':>12}"
    )
    for s in scenarios:
        rc, ins = by[("rollcage", s)], by.get(("inspect", s))
        if ins is None:
            continue
        cells = [
            _ratio(rc.throughput, ins.throughput),
            _ratio(rc.cpu_ms_per_rollout, ins.cpu_ms_per_rollout),
            _ratio(rc.peak_pss_mb, ins.peak_pss_mb),
            _ratio(rc.peak_rss_mb, ins.peak_rss_mb),
            _ratio(rc.first_result_s, ins.first_result_s),
        ]
        widths = (10, 11, 8, 8, 12)
        shown = [f"{_fmt(c, '.2f') + 'x':>{w}}" for c, w in zip(cells, widths, strict=True)]
        print(f"{s:>9}  " + "  ".join(shown))
    if several:
        # Each round ran both systems back to back (alternating which went first), so a round's
        # ratio compares the two under the same neighbours; their spread is the run's noise.
        print("\nCPU per rollout, rollcage / Inspect AI, round by round:")
        for s in scenarios:
            pairs = zip(rounds[("rollcage", s)], rounds.get(("inspect", s), []), strict=False)
            ratios = [_ratio(a.cpu_ms_per_rollout, b.cpu_ms_per_rollout) for a, b in pairs]
            known = [x for x in ratios if x is not None]
            if known:
                under = sum(x <= 1.0 for x in known)
                spread = f"   (min {min(known):.2f}x, max {max(known):.2f}x, {under}/{len(known)} <= 1)"
                print(f"{s:>9}  " + "  ".join(f"{_fmt(x, '.2f')}x" for x in ratios) + spread)

    print("\nissue 16 targets (rollcage):")
    rows: list[tuple[str, str, bool | None]] = []
    for s in scenarios:
        rc, ins = by[("rollcage", s)], by.get(("inspect", s))
        if ins is not None:
            ratio = _ratio(rc.cpu_ms_per_rollout, ins.cpu_ms_per_rollout)
            rows.append(
                (
                    f"CPU per rollout <= Inspect's ({s})",
                    f"{_fmt(ratio, '.2f')}x",
                    ratio is not None and ratio <= 1.0,
                )
            )
            ratio = _ratio(rc.throughput, ins.throughput)
            rows.append(
                (
                    f"throughput >= 1.0x Inspect's ({s})",
                    f"{_fmt(ratio, '.2f')}x",
                    ratio is not None and ratio >= 1.0,
                )
            )
        own = alone.get(("rollcage", rc.latency_s))
        ratio = _ratio(rc.first_result_s, own)
        rows.append(
            (
                f"first result within 2x of one rollout alone ({s})",
                f"{_fmt(rc.first_result_s, '.1f')} s vs {_fmt(own, '.1f')} s = {_fmt(ratio, '.1f')}x",
                ratio is not None and ratio <= 2.0,
            )
        )
    if ("rollcage", "c256") in by:
        rc = by[("rollcage", "c256")]
        rows.append(
            (
                "PSS per concurrent rollout <= 8 MB (c256)",
                f"{rc.pss_per_rollout_mb:.1f} MB",
                rc.pss_per_rollout_mb <= 8,
            )
        )
        rows.append(("zero infra failures (c256)", str(rc.infra_failures), rc.infra_failures == 0))
    rows.append(
        ("controller peak RSS at 10k tasks <= 1.2x of 1k", "bench/controller.py --sizes 1000 10000", None)
    )
    for name, value, met in rows:
        verdict = "not measured here" if met is None else ("met" if met else "NOT met")
        print(f"  {name:<52} {value:<40} {verdict}")


def print_peer_ratios(runs: list[Run]) -> None:
    """Each rollcage system against Inspect AI and against its own cold start (rounds pooled)."""
    rounds: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        rounds.setdefault((r.system, r.scenario), []).append(r)
    by = {key: group[0] if len(group) == 1 else pooled(group) for key, group in rounds.items()}
    rows = []
    for (system, scenario), run in by.items():
        if system == "inspect":
            continue
        for peer in ("inspect", f"{system}-cold"):
            other = by.get((peer, scenario))
            if other is not None and peer != system:
                rows.append((scenario, system, peer, run, other))
    if not rows:
        return
    print("\neach rollcage system / a peer (same run, rounds pooled):")
    print(f"{'scenario':>9}  {'system':>18}  {'peer':>18}  {'throughput':>10}  {'CPU/rollout':>11}")
    for scenario, system, peer, run, other in rows:
        throughput = _ratio(run.throughput, other.throughput)
        cpu = _ratio(run.cpu_ms_per_rollout, other.cpu_ms_per_rollout)
        print(
            f"{scenario:>9}  {system:>18}  {peer:>18}  "
            f"{_fmt(throughput, '.2f') + 'x':>10}  {_fmt(cpu, '.2f') + 'x':>11}"
        )


# ----------------------------------------------------------------------------- main


def _alone(system: str, latency_s: float, runs: int, common: dict[str, Any]) -> float | None:
    """The median first result of ``runs`` runs of one task alone (N=1, C=1)."""
    firsts = []
    for i in range(runs):
        one = run_once(system, f"alone{i}", tasks=1, concurrency=1, latency_s=latency_s, **common)
        if one.first_result_s is not None:
            firsts.append(one.first_result_s)
        print(
            f"  {system} alone ({latency_s:g} s latency): first result "
            f"{_fmt(one.first_result_s, '.2f')} s, wall {one.wall_s:.2f} s",
            flush=True,
        )
    return statistics.median(firsts) if firsts else None


def main() -> None:
    """Run the selected scenarios for the selected systems and print the tables."""
    if sys.argv[1:2] == ["--meter"]:
        report, log, cgroup, cwd, sep, *argv = sys.argv[2:]
        if sep != "--":
            raise SystemExit("usage: peers.py --meter REPORT LOG CGROUP CWD -- COMMAND...")
        _meter(Path(report), Path(log), cgroup or None, cwd, argv)
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenario", action="append", choices=list(SCENARIOS), help="repeatable; default: all"
    )
    parser.add_argument(
        "--system",
        action="append",
        choices=SYSTEMS,
        help="default: rollcage and inspect; rollcage-cold: rollcage with --worker-start cold (to compare); "
        "rollcage-none, rollcage-none-cold: with --sandbox none, warm and cold",
    )
    parser.add_argument(
        "--quick", action="store_true", help="instant (N=32) and c64 (N=64) only, one alone run"
    )
    parser.add_argument("--tasks", type=int, help="override N of every scenario")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each scenario this many times, the systems in turn (the first of one round is the last of"
        " the next), and pool the rounds; default 1",
    )
    parser.add_argument(
        "--alone-runs", type=int, default=3, help="runs of one task alone (median; default 3)"
    )
    parser.add_argument("--sample-interval", type=float, default=0.5, help="PSS sampling period, s")
    parser.add_argument("--json", type=Path, help="also write every run's numbers here")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    if not ROLLCAGE.exists():
        raise SystemExit(f"{ROLLCAGE} is missing: run `make test` (or create .venv) first")
    # As `make run` leaves it, and as pip leaves Inspect AI's packages: the controller's bytecode compiled.
    compileall.compile_dir(str(ROOT / "src" / "rollcage"), quiet=1)
    keys = args.scenario or (["instant", "c64"] if args.quick else list(SCENARIOS))
    systems = args.system or ["rollcage", "inspect"]
    alone_runs = 1 if args.quick and args.alone_runs == 3 else args.alone_runs
    inspect_python = ensure_inspect() if "inspect" in systems else None

    print(f"cores: {os.cpu_count()}  load average (1/5/15 min): {_load()}  python: {sys.version.split()[0]}")
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    print(f"rollcage: {commit.stdout.strip()} (sandbox as --system says, euid {os.geteuid()})", end="")
    if inspect_python is not None:
        versions = (
            _installed_version(inspect_python, "inspect-ai"),
            _installed_version(inspect_python, "openai"),
        )
        print(f"   inspect-ai: {versions[0]} (openai {versions[1]})", end="")
    print(f"   PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}", flush=True)

    work = Path(tempfile.mkdtemp(prefix="rollcage-peers-"))
    runs: list[Run] = []
    alone: dict[tuple[str, float], float | None] = {}
    try:
        policy = work / "policy.json"
        # Every task of the largest run has its script (a task without one fails at once, cheaply).
        write_policy(policy, max([args.tasks or 0, *(SCENARIOS[k].tasks for k in SCENARIOS)]))
        common: dict[str, Any] = {
            "policy": policy,
            "work": work,
            "inspect_python": inspect_python,
            "interval_s": args.sample_interval,
        }
        for key in keys:
            scenario = SCENARIOS[key]
            tasks = args.tasks or (QUICK_TASKS[key] if args.quick else scenario.tasks)
            for system in systems:
                if (system, scenario.latency_s) not in alone:
                    alone[(system, scenario.latency_s)] = _alone(
                        system, scenario.latency_s, alone_runs, common
                    )
            for index in range(1, args.rounds + 1):
                # Alternating who goes first (ABBA), so a drift in the machine's load over a scenario
                # falls on both systems alike.
                for system in systems if index % 2 else systems[::-1]:
                    run = run_once(
                        system,
                        key,
                        tasks=tasks,
                        concurrency=scenario.concurrency,
                        latency_s=scenario.latency_s,
                        **common,
                    )
                    run.round_index = index
                    runs.append(run)
                    label = f" round {index}" if args.rounds > 1 else ""
                    print(
                        f"  {system} {key}{label}: {run.tasks} tasks in {run.wall_s:.1f} s "
                        f"({run.throughput:.2f}/s), "
                        f"{run.cpu_ms_per_rollout:.0f} ms CPU/rollout, peak PSS {run.peak_pss_mb:.0f} MB, "
                        f"infra failures {run.infra_failures}, load {run.load_before} -> {run.load_after}",
                        flush=True,
                    )
    finally:
        if args.keep:
            print(f"runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print_table(runs, alone)
    print_ratios_and_targets(runs, alone)
    print_peer_ratios(runs)
    if args.json is not None:
        payload = {
            "runs": [asdict(r) | {"throughput": r.throughput} for r in runs],
            "alone": {f"{k[0]}@{k[1]:g}": v for k, v in alone.items()},
        }
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
