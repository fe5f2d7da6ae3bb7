"""Benchmark (not a test): where a warm rollout's CPU goes, by process kind (issue 41).

``rollcage run`` (the real command line: bwrap, warm workers, forked executors) runs
``--tasks`` of the bench's tasks (``bench/_measure.py``: 2.5 model calls and 1.5
python executions per task) at ``--concurrency`` against the scripted model in a
process of its own (not counted: it stands in for the model). The run is traced by
``perf record`` with three scheduler tracepoints, inherited by every process the
run forks, whoever reaps it and in whatever PID namespace it runs:

* ``sched:sched_stat_runtime``: the CPU time (ns, exact: the scheduler's own
  ``sum_exec_runtime`` deltas) of every thread, each time the scheduler accounts it;
* ``sched:sched_process_fork``: who forked whom (the forking thread, not the parent:
  a warm worker is forked by the template with ``CLONE_PARENT``, so its parent is the
  controller, but its forker is the template);
* ``sched:sched_process_exec``: what each process became.

From these every process of the tree gets a kind (see :func:`classify`): the
controller (the ``rollcage run`` process: scheduler, supervisor threads, egress
proxy and grading are all in it), the outer bubblewrap launch of each rollout (both
bwraps, ``setpriv``, the holder), the warm template, the worker, the executor's
nested bubblewrap launch (bwrap and its holder), the executor template and the
executors. CPU per kind is divided by the tasks; for the long-lived processes the
part spent before their first child (start-up: imports, ``gc.freeze``) is shown
apart, since a longer run divides it further. The two launches are also split by
stage (each process's depth in its launch and what it exec'd), and the CPU one file
creation costs in the runs' directory is measured first (next to a tmpfs): the
controller creates a dozen files a rollout.

``--symbols N`` also samples the first round of each checkout (``cpu-clock``, one
sample per ms of CPU) and prints the top N functions (native and kernel: Python 3.11
has no perf map of its own frames) of the three costliest kinds. ``--py-spy N`` adds
an untimed run under ``py-spy record --format raw --nonblocking --subprocesses`` and
prints the controller's top N Python functions by own samples, and the workers'
(forks of the template with ``CLONE_PARENT``, so the controller's children: py-spy
catches few of them, they live too short for its look for new children).

``--baseline-python PY`` runs every round twice, ABBA: once with this checkout's
``.venv`` and once with ``PY`` (another checkout's venv, its editable install: the
template and workers run ``python -I``, so ``PYTHONPATH`` would not reach them); the
table then has both and their ratio (this / base).

    .venv/bin/python bench/cpu_breakdown.py [--tasks 64] [--concurrency 8] [--rounds 1]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from _measure import CpuGroup, ModelServer, write_dataset, write_policy

__all__ = ["Proc", "classify", "main", "parse_perf", "trace_run"]

ROOT = Path(__file__).resolve().parent.parent
THIS_PYTHON = ROOT / ".venv" / "bin" / "python"
"""This checkout's interpreter (its editable install): the run measured, "this" in the table."""
SAMPLE_PERIOD_NS = 1_000_000
"""With ``--symbols``: one ``cpu-clock`` sample per ms of CPU."""
PERF_EVENTS = ("sched:sched_stat_runtime", "sched:sched_process_fork", "sched:sched_process_exec")
LAUNCHES = (
    "outer sandbox launch (bwrap x2, setpriv, holder)",
    "executor cage launch (nested bwrap, holder)",
)
KINDS = (
    "controller (scheduler, supervisor, proxy, grading)",
    "outer sandbox launch (bwrap x2, setpriv, holder)",
    "warm template",
    "worker",
    "executor cage launch (nested bwrap, holder)",
    "executor template",
    "executor",
    "other",
)
"""Every process kind, in the table's order."""

_LINE = re.compile(r"^\s*(\d+)/(\d+)\s+([\d.]+):\s+sched:(\w+):\s+(.*)$")
_SAMPLE = re.compile(r"^\s*(\d+)/(\d+)\s+[\d.]+:\s+cpu-clock\S*:\s+[0-9a-f]+\s+(.+?)\s+\((.*)\)$")
_FIELD = re.compile(r"(\w+)=(\S+)")


@dataclass
class Proc:
    """One process (thread group) of the traced tree."""

    tgid: int
    forker: int | None = None
    """The thread group of the thread that forked it (None: the root, or born before the trace)."""
    execs: list[str] = field(default_factory=list)
    """What it exec'd, in order (file names)."""
    runtime_ns: int = 0
    """CPU time of all its threads."""
    startup_ns: int = 0
    """CPU time before it forked its first child process (its start-up, for the long-lived ones)."""
    children: list[int] = field(default_factory=list)
    """Processes it forked (not threads), in order."""
    kind: str = "other"
    """One of :data:`KINDS` (set by :func:`classify`)."""
    symbols: collections.Counter[str] = field(default_factory=collections.Counter)
    """With ``--symbols``: ``cpu-clock`` samples by function (library)."""


def trace_run(
    argv: list[str], data: Path, env: dict[str, str], cwd: Path, *, sample: bool
) -> tuple[int, float | None]:
    """Run ``argv`` under ``perf record`` (the tree inherits the events); (exit code, cgroup CPU s).

    With ``sample``, also where the CPU is: ``cpu-clock`` every 1 ms of CPU, its function and library.
    """
    group = CpuGroup.make(f"breakdown-{data.stem}")
    # The command enters the cgroup itself (perf is outside it): the cgroup's exact total checks the trace's.
    enter = [] if group is None else ["sh", "-c", f'echo $$ > {group.path}/cgroup.procs && exec "$@"', "sh"]
    perf = [
        "perf",
        "record",
        "-q",
        "--mmap-pages",
        "4096",
        *(arg for event in PERF_EVENTS for arg in ("-e", event)),
        *(("-e", f"cpu-clock/period={SAMPLE_PERIOD_NS}/") if sample else ()),
        "-o",
        str(data),
        "--",
        *enter,
        *argv,
    ]
    try:
        code = subprocess.run(perf, env=env, cwd=cwd, stdout=subprocess.DEVNULL, check=False).returncode
        return code, None if group is None else group.usage_s()
    finally:
        if group is not None:
            group.remove()


def parse_perf(data: Path) -> tuple[dict[int, Proc], int]:
    """The processes of a trace, and the count of events perf lost (0: the trace is whole)."""
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "pid,tid,time,event,trace,ip,sym,dso"],
        capture_output=True,
        text=True,
        check=True,
    )
    lost = sum(int(n) for n in re.findall(r"(\d+) lost", script.stderr))
    procs: dict[int, Proc] = {}
    tgid_of: dict[int, int] = {}
    forks: list[tuple[int, int]] = []
    for line in script.stdout.splitlines():
        match = _LINE.match(line)
        if match is None:
            sampled = _SAMPLE.match(line)
            if sampled is not None:
                symbol = f"{sampled[3]} ({Path(sampled[4]).name})"
                procs.setdefault(int(sampled[1]), Proc(int(sampled[1]))).symbols[symbol] += 1
            continue
        pid, tid, event, rest = int(match[1]), int(match[2]), match[4], match[5]
        tgid_of.setdefault(tid, pid)
        fields = dict(_FIELD.findall(rest))
        if event == "sched_process_fork":
            forks.append((pid, int(fields["child_pid"])))
        elif event == "sched_process_exec":
            procs.setdefault(pid, Proc(pid)).execs.append(fields["filename"])
    for forker, child in forks:
        child_tgid = tgid_of.get(child, child)
        if child_tgid == forker:
            continue  # a thread
        proc = procs.setdefault(child_tgid, Proc(child_tgid))
        proc.forker = forker
        procs.setdefault(forker, Proc(forker)).children.append(child_tgid)
    _accumulate(script.stdout, procs, tgid_of)
    return procs, lost


def _accumulate(text: str, procs: dict[int, Proc], tgid_of: dict[int, int]) -> None:
    """Sum runtimes per process, and the part before each process's first fork of a child process."""
    forked: set[int] = set()
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        pid, event, rest = int(match[1]), match[4], match[5]
        fields = dict(_FIELD.findall(rest))
        if event == "sched_stat_runtime":
            tgid = tgid_of.get(int(fields["pid"]), pid)
            proc = procs.setdefault(tgid, Proc(tgid))
            ns = int(fields["runtime"])
            proc.runtime_ns += ns
            if tgid not in forked:
                proc.startup_ns += ns
        elif event == "sched_process_fork":
            child = int(fields["child_pid"])
            if tgid_of.get(child, child) != pid:
                forked.add(pid)


def _is_python(path: str) -> bool:
    return Path(path).name.startswith("python")


def classify(procs: dict[int, Proc], root: int) -> None:
    """Give every process under ``root`` its kind (see the module docstring); the rest stay "other".

    By lineage (forker) and what each exec'd: the root is the controller; a bwrap the controller
    starts (and everything under it) is the outer sandbox launch; a python the controller exec's
    and which forks is the warm template; the template's forks that exec nothing are workers and
    its python child the executor template, whose forks are the executors; a bwrap started under
    a worker (and its holder) is the executor's cage launch.
    """

    def mark(pid: int, kind: str) -> None:
        todo = [pid]
        while todo:
            current = todo.pop()
            procs[current].kind = kind
            todo.extend(procs[current].children)

    procs[root].kind = KINDS[0]
    for pid in procs[root].children:
        proc = procs[pid]
        exe = Path(proc.execs[-1]).name if proc.execs else ""
        if exe == "bwrap":
            mark(pid, KINDS[1])
        elif _is_python(exe) and proc.children:
            proc.kind = KINDS[2]
            for child in proc.children:
                forked = procs[child]
                if forked.execs and _is_python(forked.execs[-1]):
                    forked.kind = KINDS[5]
                    for executor in forked.children:
                        mark(executor, KINDS[6])
                elif not forked.execs:
                    forked.kind = KINDS[3]
                    for below in forked.children:
                        below_exec = procs[below].execs
                        mark(below, KINDS[4] if below_exec and below_exec[0].endswith("bwrap") else KINDS[7])
                else:
                    mark(child, KINDS[7])
        else:
            mark(pid, KINDS[7])


def _root(procs: dict[int, Proc], argv0: str) -> int:
    """The traced command: the first process that exec'd ``argv0`` (after the cgroup's ``sh``)."""
    for proc in procs.values():
        if proc.execs and any(Path(e).name == Path(argv0).name for e in proc.execs):
            return proc.tgid
    raise SystemExit(f"no process exec'd {argv0} in the trace")


@dataclass
class Round:
    """One traced run."""

    label: str
    tasks: int
    cgroup_s: float | None
    per_kind_ms: dict[str, float]
    startup_ms: dict[str, float]
    counts: dict[str, int]
    lost: int
    traced_s: float
    load: tuple[float, float, float]
    symbols: dict[str, collections.Counter[str]] = field(default_factory=dict)
    """With ``--symbols`` (the first round of each label): samples by function, per kind."""
    stages: dict[str, float] = field(default_factory=dict)
    """The two launches by stage (see :func:`_stage`): ms per rollout."""


def create_cost_us(directory: Path, files: int = 500) -> float:
    """CPU microseconds this process spends creating one empty file in ``directory`` (then all removed).

    A rollout's controller creates a dozen files and directories in its rollout directory; on an
    ext4 without a journal each new inode is checked against recently deleted ones (``recently_deleted``
    in perf), which can cost a hundred times a tmpfs's.
    """
    scratch = Path(tempfile.mkdtemp(prefix="create-", dir=directory))
    try:
        started = time.process_time()
        for index in range(files):
            os.close(os.open(scratch / f"f{index}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        return 1e6 * (time.process_time() - started) / files
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _rollcage_argv(args: argparse.Namespace, run_dir: Path, base_url: str, python: Path) -> list[str]:
    """``python -m rollcage run`` of the run directory's dataset: bwrap, warm workers, ``--concurrency``."""
    return [
        str(python),
        "-m",
        "rollcage",
        "run",
        str(run_dir / "dataset.jsonl"),
        "--out",
        str(run_dir / "out"),
        "--model",
        base_url,
        "--model-name",
        "scripted",
        "--concurrency",
        str(args.concurrency),
        "--sandbox",
        "bwrap",
        "--worker-start",
        "warm",
        "--quiet",
    ]


def warm_up(args: argparse.Namespace, work: Path, base_url: str, python: Path, label: str) -> None:
    """Two tasks, untraced: the bytecode cache of ``python``'s worker is compiled once before the rounds."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"warm-{label}-", dir=work))
    write_dataset(run_dir / "dataset.jsonl", 2)
    argv = _rollcage_argv(args, run_dir, base_url, python)
    subprocess.run(argv, env=dict(os.environ), cwd=run_dir, stdout=subprocess.DEVNULL, check=True)
    shutil.rmtree(run_dir, ignore_errors=True)


def one_round(
    label: str, args: argparse.Namespace, work: Path, base_url: str, python: Path, *, sample: bool = False
) -> Round:
    """Trace one ``rollcage run`` and sum its CPU per kind."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=work))
    dataset = run_dir / "dataset.jsonl"
    write_dataset(dataset, args.tasks)
    argv = _rollcage_argv(args, run_dir, base_url, python)
    env = dict(os.environ)
    load = os.getloadavg()
    code, cgroup_s = trace_run(argv, run_dir / "perf.data", env, run_dir, sample=sample)
    if code != 0:
        raise SystemExit(f"rollcage run failed ({label}): exit code {code}")
    procs, lost = parse_perf(run_dir / "perf.data")
    root = _root(procs, str(python))
    classify(procs, root)
    per_kind: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    startup: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    counts: dict[str, int] = dict.fromkeys(KINDS, 0)
    traced = 0
    symbols: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    stages: dict[str, float] = {}
    for proc in _under(procs, root):
        symbols[proc.kind].update(proc.symbols)
        per_kind[proc.kind] += proc.runtime_ns / 1e6 / args.tasks
        if proc.kind in LAUNCHES:
            stage = _stage(procs, proc)
            stages[stage] = stages.get(stage, 0.0) + proc.runtime_ns / 1e6 / args.tasks
        counts[proc.kind] += 1
        traced += proc.runtime_ns
        if proc.kind in (KINDS[0], KINDS[2], KINDS[5]):
            startup[proc.kind] += proc.startup_ns / 1e6
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return Round(
        label, args.tasks, cgroup_s, per_kind, startup, counts, lost, traced / 1e9, load, symbols, stages
    )


def _stage(procs: dict[int, Proc], proc: Proc) -> str:
    """A launch's process: its kind, its depth below the launch's first process, and what it ran.

    A process that exec'd nothing is a fork of its forker's program (bubblewrap's PID-namespace init,
    or its child before it runs the command); one that did is named by what it ran, in order
    (``sh > bwrap``: the cgroup-entering ``sh`` that becomes bubblewrap). The CPU a child spends
    before its exec (bubblewrap's namespace and mount set-up) counts to that stage.
    """
    depth, up = 0, proc
    while up.forker is not None and procs[up.forker].kind == proc.kind:
        up, depth = procs[up.forker], depth + 1
    ran = " > ".join(Path(e).name for e in proc.execs) or "(a fork, no exec)"
    return f"{proc.kind.split(' (')[0]} {depth}: {ran}"


def _under(procs: dict[int, Proc], root: int) -> Iterator[Proc]:
    todo = [root]
    while todo:
        proc = procs[todo.pop()]
        yield proc
        todo.extend(proc.children)


def print_rounds(rounds: list[Round]) -> None:
    """The table: ms of CPU per rollout by kind, per label (means over its rounds), and this / base."""
    labels = list(dict.fromkeys(r.label for r in rounds))
    pooled = {label: [r for r in rounds if r.label == label] for label in labels}

    def mean(label: str, pick: Callable[[Round], float]) -> float:
        return statistics.fmean(pick(r) for r in pooled[label])

    def steady(r: Round, kind: str) -> float:
        # Without the long-lived processes' start-up, which a longer run divides further.
        return r.per_kind_ms[kind] - r.startup_ms[kind] / r.tasks

    rounds_of = ", ".join(f"{label}: {len(group)} rounds" for label, group in pooled.items())
    print(f"\nCPU per rollout by process kind, ms ({rounds_of}; steady: without start-ups)")
    header = f"{'kind':50}" + "".join(f" {label + ' all':>9} {'steady':>7} {'procs':>6}" for label in labels)
    print(header + (f" {'ratio (steady)':>15}" if len(labels) == 2 else ""))
    for kind in (*KINDS, "total"):
        row = f"{kind:50}"
        cells = []
        for label in labels:
            if kind == "total":
                all_ms = mean(label, lambda r: sum(r.per_kind_ms.values()))
                steady_ms = mean(label, lambda r: sum(steady(r, k) for k in KINDS))
                row += f" {all_ms:9.1f} {steady_ms:7.1f} {'':6}"
            else:
                all_ms = mean(label, lambda r, k=kind: r.per_kind_ms[k])  # type: ignore[misc]
                steady_ms = mean(label, lambda r, k=kind: steady(r, k))  # type: ignore[misc]
                procs = mean(label, lambda r, k=kind: r.counts[k] / r.tasks)  # type: ignore[misc]
                row += f" {all_ms:9.1f} {steady_ms:7.1f} {procs:6.2f}"
            cells.append(steady_ms)
        if len(labels) == 2 and cells[0] > 0:
            row += f" {cells[1] / cells[0]:15.2f}"
        print(row)
    print("\nthe launches by stage (depth below the launch's first process: what it ran), ms per rollout")
    stage_names = sorted({stage for r in rounds for stage in r.stages})
    for stage in stage_names:
        cells = [mean(label, lambda r, s=stage: r.stages.get(s, 0.0)) for label in labels]  # type: ignore[misc]
        if max(cells) >= 0.05:
            print(f"  {stage:62}" + "".join(f" {c:7.2f}" for c in cells))
    for label in labels:
        cgroup = mean(label, lambda r: 1000 * (r.cgroup_s or 0.0) / r.tasks)
        print(f"{label}: cgroup cpuacct (exact, the whole tree with start-ups): {cgroup:.1f} ms per rollout")
        for kind in (KINDS[0], KINDS[2], KINDS[5]):
            once = mean(label, lambda r, k=kind: r.startup_ms[k])  # type: ignore[misc]
            print(f"{label}: start-up of the {kind.split(' (')[0]}: {once:.0f} ms once per run")
    for r in rounds:
        print(
            f"round {r.label}: load {' '.join(f'{v:.1f}' for v in r.load)}, lost events {r.lost}, "
            f"traced {r.traced_s:.2f} s, cgroup {r.cgroup_s or 0.0:.2f} s"
        )


def print_symbols(rounds: list[Round], top: int) -> None:
    """The top functions (perf ``cpu-clock`` samples, own time) of the three costliest kinds."""
    for r in rounds:
        costliest = sorted(KINDS, key=lambda k: r.per_kind_ms[k], reverse=True)[:3]
        for kind in costliest:
            counter = r.symbols.get(kind, collections.Counter())
            total = sum(counter.values())
            print(f"\nperf, {r.label}, {kind}: top {top} functions ({total} samples, 1 per ms of CPU)")
            for name, count in counter.most_common(top):
                print(f"  {100 * count / max(total, 1):5.1f}%  {name}")


def spy_run(args: argparse.Namespace, work: Path, base_url: str, top: int) -> None:
    """One more run, sampled by py-spy; print each kind's top functions by own samples."""
    run_dir = Path(tempfile.mkdtemp(prefix="spy-", dir=work))
    dataset = run_dir / "dataset.jsonl"
    write_dataset(dataset, args.tasks)
    spy = shutil.which("py-spy", path=str(ROOT / ".venv" / "bin")) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--py-spy needs py-spy (.venv/bin/pip install py-spy)")
    out = run_dir / "spy.txt"
    argv = [
        spy,
        "record",
        "--format",
        "raw",
        "--nonblocking",
        "--rate",
        "200",
        "--subprocesses",
        "-o",
        str(out),
        "--",
        *_rollcage_argv(args, run_dir, base_url, THIS_PYTHON),
    ]
    subprocess.run(argv, cwd=run_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    own: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    template_pid: str | None = None
    for line in out.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or not stack.startswith("process "):
            continue  # the tail of an executor's multi-line command line
        frames = stack.split(";")
        # A child's stack follows its ancestors' "process PID:CMDLINE" frames; the last one is its own.
        last = max(i for i, frame in enumerate(frames) if frame.startswith("process "))
        pid, _, cmdline = frames[last][len("process ") :].partition(":")
        if "rollcage template" in cmdline:
            # Workers are forks of the template and keep its command line: the template is the first seen.
            template_pid = template_pid or pid
            kind = "warm template" if pid == template_pid else "worker"
        elif "_executor_template.py" in cmdline:
            kind = "executor template"
        elif "rollcage run" in cmdline:
            kind = "controller"
        else:
            kind = "executor"
        mine = frames[last + 1 :]
        function = re.sub(r":\d+\)", ")", mine[-1]) if mine else "(no Python frame: native code)"
        own[kind][function] += int(count)
    for kind in ("controller", "worker"):
        total = sum(own[kind].values())
        print(f"\npy-spy, {kind}: top {top} functions by own samples ({total} samples at 200 Hz, not idle)")
        for name, samples in own[kind].most_common(top):
            print(f"  {100 * samples / max(total, 1):5.1f}%  {name}")
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    """Parse the options, run the rounds, print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=64, help="tasks per run (default 64)")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent rollouts (default 8)")
    parser.add_argument("--rounds", type=int, default=1, help="runs (ABBA pairs with --baseline-python)")
    parser.add_argument(
        "--baseline-python",
        type=Path,
        help="another checkout's venv python (its editable install) to compare with",
    )
    parser.add_argument(
        "--py-spy", type=int, default=0, metavar="N", help="also a py-spy run: top N functions"
    )
    parser.add_argument(
        "--symbols", type=int, default=0, metavar="N", help="perf cpu-clock samples: top N functions per kind"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directories (perf.data)")
    args = parser.parse_args()
    if shutil.which("perf") is None or os.geteuid() != 0:
        raise SystemExit("needs perf and root (tracepoints of every process of the run)")
    print(f"cores: {os.cpu_count()}  load average: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    sources: list[tuple[str, Path]] = [("this", THIS_PYTHON)]
    if args.baseline_python is not None:
        sources.insert(0, ("base", args.baseline_python.absolute()))
    work = Path(tempfile.mkdtemp(prefix="rollcage-breakdown-"))
    shm = Path("/dev/shm")
    print(
        f"creating a file: {create_cost_us(work):.0f} us CPU in the runs' directory ({work.parent}), "
        + (f"{create_cost_us(shm):.0f} us in {shm} (tmpfs)" if shm.is_dir() else "")
    )
    rounds: list[Round] = []
    try:
        policy = work / "policy.json"
        write_policy(policy, args.tasks)
        with ModelServer(policy, 0.0) as server:
            for label, python in sources:
                # Untraced: the worker's bytecode cache of this tree is compiled once (not a rollout's cost).
                warm_up(args, work, server.base_url, python, label)
            for index in range(args.rounds):
                order = sources if index % 2 == 0 else sources[::-1]  # ABBA: drifting load hits both alike
                for label, python in order:
                    sample = bool(args.symbols) and index == 0
                    rounds.append(one_round(label, args, work, server.base_url, python, sample=sample))
            print_rounds(rounds)
            if args.symbols:
                sampled = [r for r in rounds if any(r.symbols.values())]
                print_symbols(sampled, args.symbols)
            if args.py_spy:
                spy_run(args, work, server.base_url, args.py_spy)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nload average at the end: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
