"""Benchmark (not a test): where one rollout's CPU and memory go today, per process and phase.

The bench's tasks (``bench/_measure.py``: 1 or 2 python calls, then the answer; the
scripted model in a process of its own) run through rollcage as it is, and four
measurements take them apart:

1. **Launch chain** — the sandbox's command line as ``BwrapLauncher`` builds it, cut
   after each stage and ended by ``true`` (then by ``python -I -B -c pass``): outer
   bwrap (mount + PID namespace, as root), ``setpriv`` (drop to uid 65534), inner bwrap
   (user, PID, network, IPC, UTS, cgroup namespaces), ``prlimit``, the interpreter, and the
   executor's nested cage the worker makes inside (bwrap started as the ``repl`` executor starts it).
   Each cut runs ``--runs`` times, interleaved; CPU is the cgroup's ``cpuacct.usage``
   (exact; ``RUSAGE_CHILDREN`` misses processes auto-reaped by a dying PID namespace).
   A stage's cost is the difference between consecutive cuts.
2. **Imports and bytecode** — the worker's imports in a fresh ``python -I -B`` as
   today (the environment sets ``PYTHONDONTWRITEBYTECODE=1`` and the worker runs with
   ``-B``, so an editable ``src/rollcage`` is compiled from source by every rollout),
   next to the same with compiled bytecode (``-X pycache_prefix`` of a warm cache);
   and ``python -X importtime`` of both, the costliest imports listed.
3. **Real rollouts** — ``--rollouts`` tasks through ``Controller.run()`` (concurrency
   1, bwrap, cold worker starts: the probe takes a started worker's place) in a child
   process in a cgroup of its own. In the controller the
   supervisor, proxy, /proc scans, grading and records are metered (exclusive CPU per
   phase, ``bench/_profile_probe.py``); the worker is the real one started through a
   probe that meters its imports, compiling, pydantic model building and phases and
   reports its executor's CPU. While each rollout's first python cell sleeps, every
   process of the rollout is snapshotted: PSS/RSS/USS (``smaps_rollup``) and CPU so
   far (``schedstat``).
4. **Warm template (zygote) experiment** — K rollouts at once, their workers started
   (a) as today, ``python -I -B -m rollcage worker`` per rollout, and (b) forked from
   one template process that imported the worker's modules, built its pydantic
   models and froze its heap (``gc.freeze()``); no sandbox in either, so the
   difference is the interpreter alone. CPU per worker (with its executor) is its
   ``wait4`` rusage; memory is the PSS of all the workers, executors (and the
   template) while all K are in flight, divided by K.

    .venv/bin/python bench/profile.py [--rollouts 8] [--runs 10] [--zygote 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _measure import (
    CpuGroup,
    ModelServer,
    Smaps,
    cpu_s,
    descendants,
    read_smaps,
    schedstat_ns,
    tree,
    write_dataset,
    write_policy,
)
from _profile_probe import MARKER, Meters

ROOT = Path(__file__).resolve().parent.parent
PROBE_SOURCE = (Path(__file__).with_name("_profile_probe.py")).read_text()
WORKER_IMPORTS = "import rollcage.cli, rollcage.worker, rollcage.model._client, rollcage.tools"
"""What the worker imports before its first model call (rollcage.model and tools lazily)."""
SLEEPY_CODE = "import time; time.sleep(1.5); print(6 * 7)"
"""The first python call of every profiled task: long enough to snapshot the rollout's processes."""
CHAIN_LABELS = {
    1: "outer bwrap: monitor (root)",
    2: "outer bwrap: PID-ns init (root)",
    3: "inner bwrap: monitor (uid 65534, was setpriv)",
    4: "inner bwrap: PID-ns init",
    5: "worker (python, was prlimit)",
    6: "executor (python -c BOOT: _repl_child)",
}
"""Depth below the supervisor -> the process of the two-stage sandbox (as root)."""


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _run_in_group(group: CpuGroup | None, argv: list[str], **kwargs: Any) -> tuple[float, float, float]:
    """Run ``argv`` to its end; return (wall s, CPU s exact where a cgroup exists, rusage CPU s)."""
    before = group.usage_s() if group is not None else 0.0
    started = time.perf_counter()
    proc = subprocess.Popen(argv, preexec_fn=group.enter if group is not None else None, **kwargs)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:3]}... failed with exit code {proc.returncode}")
    exact = group.usage_s() - before if group is not None else cpu_s(usage)
    return wall, exact, cpu_s(usage)


# ----------------------------------------------------------------------------- 1. launch chain


def _scratch_layout(base: Path) -> Any:
    from rollcage.runfiles import RolloutLayout

    root = base / "rollout"
    layout = RolloutLayout(root)
    layout.worker_root.mkdir(parents=True)
    layout.worker_input.write_text("{}")
    layout.checkpoint.write_text("")
    layout.workspace.mkdir()
    if os.geteuid() == 0:
        for path in (layout.worker_root, layout.checkpoint, layout.workspace):
            os.chown(path, 65534, 65534)
    return layout


def chain_stages(base: Path) -> list[tuple[str, list[str]]]:
    """The launch chain cut after each stage: (label, argv), cheapest first."""
    from rollcage.cage import NestedCage
    from rollcage.supervisor.config import BwrapSandbox
    from rollcage.supervisor.sandbox import BwrapLauncher, worker_environment

    launcher = BwrapLauncher(BwrapSandbox())
    tools = launcher.check()
    interpreter = [sys.executable, "-I", "-B", "-c", "pass"]
    plan = launcher.plan(
        _scratch_layout(base),
        worker_command=interpreter,
        worker_env=worker_environment(allow=[], extra={}, sandbox="bwrap"),
        token_env={},
    )
    argv = plan.argv
    true = shutil.which("true") or "/usr/bin/true"
    at_prlimit = argv.index(tools.prlimit)
    at_worker = argv.index("--", at_prlimit) + 1
    stages = [("python -I -B -c pass (no sandbox)", interpreter)]
    if tools.setpriv is not None and tools.setpriv in argv:
        at_setpriv = argv.index(tools.setpriv)
        at_inner = argv.index(tools.bwrap, at_setpriv)
        stages += [
            ("outer bwrap -> true", [*argv[:at_setpriv], true]),
            ("  + setpriv (drop to uid 65534) -> true", [*argv[:at_inner], true]),
            ("  + inner bwrap (user/pid/net/ipc/uts/cgroup ns) -> true", [*argv[:at_prlimit], true]),
        ]
    else:
        stages.append(("bwrap (all namespaces) -> true", [*argv[:at_prlimit], true]))
    # The repl executor's own cage, made by the worker inside its cage (as the worker starts it).
    cage = NestedCage(bwrap=tools.bwrap, workspace="/rollout/workspace", hide=("/rollout",))
    stages += [
        ("  + prlimit -> true", [*argv[:at_worker], true]),
        ("  + python -I -B -c pass (the whole chain)", argv[:at_worker] + interpreter),
        (
            "  + the executor's nested cage -> python -I -B -c pass",
            argv[:at_worker] + cage.prefix(ignore_sigint=False) + interpreter,
        ),
    ]
    return stages


@dataclass
class Timing:
    """Medians of one command's runs."""

    wall_ms: float
    cpu_ms: float
    rusage_ms: float


def measure_chain(base: Path, runs: int) -> list[tuple[str, Timing]]:
    """Run every cut of the chain ``runs`` times, interleaved; medians."""
    stages = chain_stages(base)
    samples: dict[str, list[tuple[float, float, float]]] = {label: [] for label, _ in stages}
    groups = {label: CpuGroup.make(f"chain{i}") for i, (label, _) in enumerate(stages)}
    try:
        for label, argv in stages:  # warm the page cache once
            _run_in_group(groups[label], argv, cwd="/", stdout=subprocess.DEVNULL)
        for _ in range(runs):
            for label, argv in stages:
                samples[label].append(_run_in_group(groups[label], argv, cwd="/", stdout=subprocess.DEVNULL))
    finally:
        for group in groups.values():
            if group is not None:
                group.remove()
    return [
        (label, Timing(*(1000 * _median([s[i] for s in samples[label]]) for i in range(3))))
        for label, _ in stages
    ]


# ----------------------------------------------------------------------------- 2. imports and bytecode


def _importtime(argv: list[str]) -> dict[str, int]:
    """``-X importtime``: self microseconds per module."""
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stderr
    table: dict[str, int] = {}
    for line in out.splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            self_us, _, name = (part.strip() for part in line[len("import time:") :].split("|"))
            table[name.strip()] = table.get(name.strip(), 0) + int(self_us)
    return table


def measure_bytecode(base: Path, runs: int) -> dict[str, Any]:
    """The worker's imports as today vs with compiled bytecode; the costliest imports."""
    warm = base / "pycache"
    python = sys.executable
    today = [python, "-I", "-B", "-c", WORKER_IMPORTS]
    cached = [python, "-I", "-B", "-X", f"pycache_prefix={warm}", "-c", WORKER_IMPORTS]
    bare = [python, "-I", "-B", "-c", "pass"]
    subprocess.run([python, "-I", "-X", f"pycache_prefix={warm}", "-c", WORKER_IMPORTS], check=True)
    cases = {"python -I -B -c pass": bare, "worker imports, today": today, "worker imports, bytecode": cached}
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in cases}
    for argv in cases.values():
        _run_in_group(None, argv)
    for _ in range(runs):
        for name, argv in cases.items():
            samples[name].append(_run_in_group(None, argv))
    timings = {
        name: Timing(*(1000 * _median([s[i] for s in samples[name]]) for i in range(3))) for name in cases
    }
    today_times = _importtime([python, "-X", "importtime", *today[1:]])
    cached_times = _importtime([python, "-X", "importtime", *cached[1:]])
    pyc = list((ROOT / "src" / "rollcage").rglob("__pycache__/*.pyc"))
    return {
        "timings": timings,
        "today": today_times,
        "cached": cached_times,
        "repo_pyc": len(pyc),
        "exit_ms": 1000 * _median([_exit_cost(today) for _ in range(runs)]),
    }


def _exit_cost(argv: list[str]) -> float:
    """CPU seconds ``argv`` (``python ... -c CODE``) spends after its code has run: finalization and exit."""
    code = argv[-1] + "\nimport os as _o, time as _t\n_o.write(1, str(_t.process_time()).encode())"
    proc = subprocess.Popen([*argv[:-1], code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    inside = float(proc.stdout.read())
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return cpu_s(usage) - inside


# ----------------------------------------------------------------------------- 3. real rollouts


def _controller_patches(meters: Meters) -> list[str]:
    """Meter the controller's and supervisor's phases; return the patch points that were not found."""
    from rollcage import procs
    from rollcage.controller import _graders, _ledger, _records, _unit
    from rollcage.supervisor import core, launch, proxy, tree

    supervision = core._Supervision
    points: list[tuple[Any, str, str]] = [
        (core, "supervise", "supervisor: supervise() coroutine"),
        (launch.Launch, "_read_bwrap_status", "supervisor: bwrap status, adopt the sandbox init"),
        (procs.ChildProcess, "spawn", "supervisor: spawn bwrap (fork + exec)"),
        (proxy.EgressProxy, "__aenter__", "egress proxy"),
        (proxy.EgressProxy, "aclose", "egress proxy"),
        (proxy.EgressProxy, "respond", "egress proxy"),
        (_unit, "lay_out", "controller: prepare the rollout directory"),
        (_unit, "_grade", "grading (read result.json, grade)"),
        (_graders, "grade_builtin", "grading (read result.json, grade)"),
        (_records.RecordLog, "append", "controller: records, ledger, health"),
        (
            _ledger.RunLedger,
            "add",
            "controller: records, ledger, health",
        ),
        (_unit, "assess", "controller: records, ledger, health"),
    ]
    for name in ("check", "_read_input", "_prepare_files", "_stage", "_conclude"):
        points.append((supervision, name, "supervisor: staging, receipt (threads)"))
    for name in ("subtree", "tree_of", "read_proc", "environ_has", "ns_pids"):
        points.append((tree, name, "supervisor: /proc scans"))
    return [f"{getattr(o, '__name__', o)}.{n}" for o, n, label in points if not meters.patch(o, n, label)]


def controller_child(workdir: Path, base_url: str, rollouts: int, cprofile: bool) -> None:
    """Run the profiled rollouts in this process; print one JSON line (the last) with the meters.

    With ``cprofile``, the run is also traced by ``cProfile`` and its costliest functions
    (own time) are printed first: where the controller's unmetered time goes (slower run).
    """
    from rollcage.controller import Controller, ModelEndpointConfig, RunConfig
    from rollcage.supervisor import BwrapSandbox, core

    startup = cpu_s(resource.getrusage(resource.RUSAGE_SELF))
    meters = Meters()
    missing = _controller_patches(meters)

    def probe_command(bytecode: str | None = None) -> list[str]:
        # The real worker's flags (its compiled bytecode cache included), through the probe.
        prefix = ["-X", f"pycache_prefix={bytecode}"] if bytecode is not None else []
        return [sys.executable, "-I", "-B", *prefix, "-c", PROBE_SOURCE]

    core.default_worker_command = probe_command  # type: ignore[attr-defined]
    dataset = workdir / "dataset.jsonl"
    write_dataset(dataset, rollouts)
    config = RunConfig(
        dataset=dataset,
        out=workdir / "out",
        model=ModelEndpointConfig(base_url=base_url, model_name="scripted"),
        concurrency=1,
        sandbox="bwrap",
        # Cold: the probe stands in the worker's place, and a warm worker is forked, never run from a command.
        bwrap=BwrapSandbox(worker_start="cold"),
        max_infra_retries=0,
    )
    before = cpu_s(resource.getrusage(resource.RUSAGE_SELF))
    if cprofile:
        # This file is named like the standard library's ``profile``, which cProfile imports.
        here = str(Path(__file__).resolve().parent)
        saved = sys.path[:]
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        try:
            import cProfile
            import pstats
        finally:
            sys.path[:] = saved

        profiler = cProfile.Profile(time.thread_time)
        profiler.enable()
        asyncio.run(Controller(config).run())
        profiler.disable()
        stats = pstats.Stats(profiler, stream=sys.stdout)
        print("controller functions by own CPU time (cProfile, thread CPU; all rollouts):")
        stats.sort_stats("tottime").print_stats(25)
    else:
        asyncio.run(Controller(config).run())
    run_cpu = cpu_s(resource.getrusage(resource.RUSAGE_SELF)) - before
    probes, outcomes = [], []
    records = workdir / "out" / "rollouts.jsonl"
    for line in records.read_text().splitlines():
        record = json.loads(line)
        outcomes.append(record["outcome"])
        log = Path(record["rollout_dir"]) / "worker.log"
        for text in log.read_text(errors="replace").splitlines():
            if text.startswith(MARKER):
                probes.append(json.loads(text[len(MARKER) :]))
    print(
        MARKER
        + json.dumps(
            {
                "startup_cpu_s": startup,
                "run_cpu_s": run_cpu,
                "meters": meters.report(),
                "missing": missing,
                "probes": probes,
                "outcomes": outcomes,
            }
        ),
        flush=True,
    )


@dataclass
class Snapshot:
    """The processes of one rollout in flight."""

    procs: dict[str, tuple[Smaps, float]] = field(default_factory=dict)
    """label -> (memory, CPU ms so far)."""
    controller: Smaps | None = None


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class RolloutWatcher(threading.Thread):
    """Snapshots each rollout of a controller once its executor runs (its first cell sleeps)."""

    def __init__(self, controller: int) -> None:
        super().__init__(daemon=True)
        self.controller = controller
        self.snapshots: list[Snapshot] = []
        self.stop_event = threading.Event()
        self._seen: set[int] = set()

    def run(self) -> None:
        while not self.stop_event.wait(0.03):
            with contextlib.suppress(OSError, ValueError):
                depths = tree(self.controller)
                executors = [p for p, d in depths.items() if "_repl_child" in _cmdline(p)]
                fresh = [p for p in executors if p not in self._seen]
                if fresh:
                    self._seen.update(fresh)
                    time.sleep(0.2)  # the executor is up; let it finish starting
                    self.snapshots.append(self._snapshot(tree(self.controller)))

    def _snapshot(self, depths: dict[int, int]) -> Snapshot:
        snap = Snapshot(controller=read_smaps(self.controller))
        for pid, depth in depths.items():
            label = CHAIN_LABELS.get(depth, f"depth {depth}")
            if "_repl_child" in _cmdline(pid):
                label = CHAIN_LABELS[6]
            smaps, ns = read_smaps(pid), schedstat_ns(pid)
            if smaps is not None and ns is not None:
                snap.procs[label] = (smaps, ns / 1e6)
        return snap


def measure_rollouts(base: Path, rollouts: int, cprofile: bool) -> dict[str, Any]:
    """Run the profiled controller in a child (in a cgroup of its own) and watch its rollouts."""
    policy = base / "policy.json"
    write_policy(policy, rollouts, first_code=SLEEPY_CODE)
    workdir = base / "controller"
    workdir.mkdir()
    group = CpuGroup.make("rollouts")
    try:
        with ModelServer(policy, 0.0) as server:
            argv = [
                sys.executable,
                __file__,
                "--controller-child",
                str(workdir),
                server.base_url,
                str(rollouts),
                "cprofile" if cprofile else "",
            ]
            before = group.usage_s() if group is not None else 0.0
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=group.enter if group is not None else None,
            )
            watcher = RolloutWatcher(proc.pid)
            watcher.start()
            out, _ = proc.communicate()
            watcher.stop_event.set()
            watcher.join()
            total = group.usage_s() - before if group is not None else None
    finally:
        if group is not None:
            group.remove()
    if cprofile:
        print("\n".join(line for line in out.splitlines() if not line.startswith(MARKER)))
    lines = [line for line in out.splitlines() if line.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the profiled controller failed (exit code {proc.returncode}):\n{out[-2000:]}")
    report: dict[str, Any] = json.loads(lines[-1][len(MARKER) :])
    report["tree_cpu_s"] = total
    report["snapshots"] = watcher.snapshots
    return report


# ----------------------------------------------------------------------------- 4. zygote experiment


def _worker_input(directory: Path, task: str, base_url: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "workspace").mkdir()
    path = directory / "input.json"
    data = {
        "rollout_id": f"{directory.name}",
        "task_id": task,
        "input": task,
        "model": {"base_url": base_url, "model": "scripted", "max_retries": 0},
        "tools": [{"type": "python"}],
    }
    path.write_text(json.dumps(data))
    return path


def template_child(directory: Path, base_url: str, count: int) -> None:
    """The warm template: import and build once, then fork ``count`` workers when told; report as JSON."""
    import gc

    import pydantic

    import rollcage.cli
    import rollcage.model
    import rollcage.protocol
    import rollcage.tools
    import rollcage.wire._payloads
    import rollcage.worker

    for module in (rollcage.protocol, rollcage.wire._payloads):  # build every deferred model now, once
        for value in list(vars(module).values()):
            if (
                isinstance(value, type)
                and issubclass(value, pydantic.BaseModel)
                and value is not pydantic.BaseModel
            ):
                with contextlib.suppress(pydantic.PydanticUserError, TypeError, NameError):
                    value.model_rebuild()
    _ = rollcage.cli
    gc.collect()
    gc.freeze()  # keep the collector from writing to (and so copying) the template's pages
    template_cpu = cpu_s(resource.getrusage(resource.RUSAGE_SELF))
    print(json.dumps({"ready": True, "template_cpu_s": template_cpu}), flush=True)
    sys.stdin.readline()
    pids = {}
    for i in range(1, count + 1):
        inp = _worker_input(directory / f"fork-{i}", f"t{i}", base_url)
        pid = os.fork()
        if pid == 0:  # the rollout's worker: no exec, no imports, no model building
            code = 1
            try:
                os.setsid()
                os.chdir(inp.parent / "workspace")
                log = os.open(inp.parent / "worker.log", os.O_WRONLY | os.O_CREAT, 0o600)
                os.dup2(log, 1)
                os.dup2(log, 2)
                code = rollcage.worker.worker_main([str(inp), str(inp.parent / "result.json")])
            finally:
                os._exit(code)
        pids[pid] = i
    usages = []
    while pids:
        pid, status, usage = os.wait4(-1, 0)
        if pids.pop(pid, None) is not None:
            usages.append({"cpu_s": cpu_s(usage), "exit": os.waitstatus_to_exitcode(status)})
    print(json.dumps({"workers": usages}), flush=True)


def _memory(pids: list[int]) -> dict[str, float]:
    """PSS and USS (MB) of ``pids`` together, and how many there were."""
    found = [m for m in (read_smaps(pid) for pid in pids) if m is not None]
    return {
        "pss_mb": sum(m.pss for m in found) / 1024,
        "uss_mb": sum(m.private for m in found) / 1024,
        "processes": len(found),
    }


def _await_executors(roots: list[int], count: int) -> dict[str, float]:
    """Once ``count`` executors run below ``roots``, the memory of the roots and all their descendants."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        tree = [p for root in roots for p in descendants(root)]
        if sum("_repl_child" in _cmdline(p) for p in tree) >= count:
            time.sleep(0.2)
            return _memory(roots + [p for root in roots for p in descendants(root)])
        time.sleep(0.03)
    return {"pss_mb": float("nan"), "uss_mb": float("nan"), "processes": 0}


def measure_zygote(base: Path, count: int) -> dict[str, Any]:
    """K workers at once, exec'd as today vs forked from a warm template: CPU and PSS per worker."""
    policy = base / "zygote-policy.json"
    write_policy(policy, count, first_code=SLEEPY_CODE)
    results: dict[str, Any] = {}
    with ModelServer(policy, 0.0) as server:
        # (a) as today: one fresh interpreter per worker.
        procs, tempdirs = [], base / "exec"
        for i in range(1, count + 1):
            inp = _worker_input(tempdirs / f"exec-{i}", f"t{i}", server.base_url)
            argv = [
                sys.executable,
                "-I",
                "-B",
                "-m",
                "rollcage",
                "worker",
                str(inp),
                str(inp.parent / "result.json"),
            ]
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            procs.append(subprocess.Popen(argv, cwd=inp.parent / "workspace", **quiet))
        memory = _await_executors([p.pid for p in procs], count)
        usages = []
        for proc in procs:
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            usages.append(cpu_s(usage))
        results["exec"] = {**memory, "cpu_s": usages}
        # (b) forked from a warm template.
        argv = [
            sys.executable,
            "-B",
            __file__,
            "--template-child",
            str(base / "fork"),
            server.base_url,
            str(count),
        ]
        template = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert template.stdin is not None and template.stdout is not None
        ready = json.loads(template.stdout.readline())
        template_mb = _memory([template.pid])["pss_mb"]
        template.stdin.write("go\n")
        template.stdin.flush()
        memory = _await_executors([template.pid], count)
        done = json.loads(template.stdout.readline())
        template.stdin.close()
        template.wait()
        results["fork"] = {
            **memory,
            "cpu_s": [w["cpu_s"] for w in done["workers"]],
            "exits": [w["exit"] for w in done["workers"]],
            "template_cpu_s": ready["template_cpu_s"],
            "template_pss_mb": template_mb,
        }
    results["exec"]["exits"] = [p.returncode for p in procs]
    return results


# ----------------------------------------------------------------------------- report


def _avg(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def print_chain(chain: list[tuple[str, Timing]]) -> None:
    print("\n1. launch chain (medians; CPU = cgroup cpuacct, the whole chain's processes)")
    print(f"   {'cut':58} {'wall ms':>8} {'CPU ms':>8} {'stage CPU ms':>13} {'(rusage)':>9}")
    previous = 0.0
    for i, (label, t) in enumerate(chain):
        stage = "" if i == 0 else f"{t.cpu_ms - previous:13.1f}"
        print(f"   {label:58} {t.wall_ms:8.1f} {t.cpu_ms:8.1f} {stage:>13} {t.rusage_ms:9.1f}")
        previous = t.cpu_ms if i > 0 else 0.0


def print_bytecode(data: dict[str, Any]) -> None:
    t = data["timings"]
    print("\n2. the worker's imports in a fresh interpreter (medians)")
    for name, timing in t.items():
        print(f"   {name:32} wall {timing.wall_ms:7.1f} ms   CPU {timing.cpu_ms:7.1f} ms")
    paid = t["worker imports, today"].cpu_ms - t["worker imports, bytecode"].cpu_ms
    exit_ms = data["exit_ms"]
    print(f"   interpreter exit after the worker's imports (finalization, unmapping): {exit_ms:.0f} ms CPU")
    print(
        f"   => compiling rollcage from source costs every rollout {paid:.0f} ms CPU "
        f"(PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}, worker -B; "
        f"{data['repo_pyc']} .pyc files under src/rollcage now)"
    )
    today, cached = data["today"], data["cached"]
    print("   costliest imports by self time (python -X importtime, one run each, µs):")
    print(f"     {'module':44} {'today':>8} {'bytecode':>9}")
    for name, us in sorted(today.items(), key=lambda kv: -kv[1])[:18]:
        print(f"     {name:44} {us:8d} {cached.get(name, 0):9d}")
    print(f"     {'(all modules)':44} {sum(today.values()):8d} {sum(cached.values()):9d}")


def print_breakdown(report: dict[str, Any], chain: list[tuple[str, Timing]], exit_ms: float | None) -> None:
    """The per-rollout table: ms CPU and MB PSS per process and phase."""
    n = len(report["outcomes"])
    snaps: list[Snapshot] = report["snapshots"]
    print(
        f"\n3. one rollout, per process and phase (mean of {n} rollouts, concurrency 1, bwrap; outcomes: ",
        end="",
    )
    print(", ".join(f"{o}={report['outcomes'].count(o)}" for o in sorted(set(report["outcomes"]))) + ")")
    if report["missing"]:
        print(f"   (patch points not found, their time is in 'other': {', '.join(report['missing'])})")
    rows: list[tuple[str, float | None, float | None, str]] = []

    def mem(label: str) -> tuple[float | None, str]:
        values = [s.procs[label][0] for s in snaps if label in s.procs]
        if not values:
            return None, ""
        rss, uss = _avg([v.rss for v in values]) / 1024, _avg([v.private for v in values]) / 1024
        return _avg([v.pss for v in values]) / 1024, f"RSS {rss:.1f}, USS {uss:.1f}"

    def cpu_so_far(label: str) -> float | None:
        values = [s.procs[label][1] for s in snaps if label in s.procs]
        return _avg(values) if values else None

    meters = report["meters"]
    run_cpu_ms = 1000 * report["run_cpu_s"] / n
    metered = 0.0
    rows.append(("controller process (supervisor, proxy, grading, records)", run_cpu_ms, None, "RUSAGE_SELF"))
    for label, value in sorted(meters.items(), key=lambda kv: -kv[1]["cpu_s"]):
        ms = 1000 * value["cpu_s"] / n
        metered += ms
        rows.append((f"  {label}", ms, None, f"{value['calls'] / n:.1f} calls"))
    rows.append(("  other (event loop, to_thread, dataset, metrics.json)", run_cpu_ms - metered, None, ""))
    controller_pss = _avg([s.controller.pss for s in snaps if s.controller]) / 1024 if snaps else None
    rows.append(("  (controller's own PSS, whole process)", None, controller_pss, "not per rollout"))

    stage_cpu = {label: t.cpu_ms for label, t in chain}
    keys = list(stage_cpu)
    rows.append(("sandbox launch chain (section 1: marginal CPU of each stage)", None, None, ""))
    for i in range(1, len(keys) - 1):
        previous = stage_cpu[keys[i - 1]] if i > 1 else 0.0
        rows.append((f"  {keys[i].strip()}", stage_cpu[keys[i]] - previous, None, ""))
    rows.append(("sandbox processes while the rollout runs (snapshot)", None, None, ""))
    for depth in (1, 2, 3, 4):
        label = CHAIN_LABELS[depth]
        pss, detail = mem(label)
        so_far = cpu_so_far(label)
        if pss is not None:
            rows.append((f"  {label}", None, pss, f"{detail}; CPU so far (schedstat) {so_far or 0:.1f} ms"))

    probes = report["probes"]
    worker_total = 1000 * _avg([p["total_cpu_s"] for p in probes])
    rows.append(
        (
            "worker process (probe inside the sandbox)",
            worker_total,
            mem(CHAIN_LABELS[5])[0],
            mem(CHAIN_LABELS[5])[1],
        )
    )
    rows.append(
        (
            "  interpreter start (before the probe's first line)",
            1000 * _avg([p["started_cpu_s"] for p in probes]),
            None,
            "",
        )
    )
    labels = sorted({label for p in probes for label in p["meters"]})
    worker_metered = 1000 * _avg([p["started_cpu_s"] for p in probes])
    for label in sorted(
        labels, key=lambda lb: -_avg([p["meters"].get(lb, {}).get("cpu_s", 0) for p in probes])
    ):
        ms = 1000 * _avg([p["meters"].get(label, {}).get("cpu_s", 0.0) for p in probes])
        calls = _avg([p["meters"].get(label, {}).get("calls", 0) for p in probes])
        worker_metered += ms
        rows.append((f"  {label}", ms, None, f"{calls:.1f} calls"))
    rows.append(
        (
            "  other (agent loop, asyncio, result building; exit not included)",
            worker_total - worker_metered,
            None,
            "",
        )
    )
    executor_ms = 1000 * _avg([p["children_cpu_s"] for p in probes])
    pss, detail = mem(CHAIN_LABELS[6])
    rows.append(("executor (python -c BOOT, _repl_child: start, 1.5 cells)", executor_ms, pss, detail))

    tree = report["tree_cpu_s"]
    sandbox_chain = stage_cpu[keys[-2]] if len(keys) > 2 else 0.0
    parts = run_cpu_ms + sandbox_chain + worker_total + executor_ms
    rollout_pss = sum(filter(None, (mem(CHAIN_LABELS[d])[0] for d in CHAIN_LABELS)))
    if tree is not None:
        whole = 1000 * (tree - report["startup_cpu_s"]) / n
        exit_note = (
            "" if exit_ms is None else f"; a worker's interpreter exit alone: {exit_ms:.0f} ms (section 2)"
        )
        rows.append(
            (
                "unattributed: exits, sandbox teardown, kernel work (whole - parts)",
                whole - parts,
                None,
                exit_note,
            )
        )
        rows.append(("the whole rollout (cgroup cpuacct of the tree, less start-up)", whole, rollout_pss, ""))
    else:
        rows.append(("the whole rollout (sum of the parts; no cgroup here)", parts, rollout_pss, ""))
    print(f"   {'process / phase':68} {'ms CPU':>8} {'MB PSS':>7}  detail")
    for label, ms, pss, detail in rows:
        cpu = "" if ms is None else f"{ms:8.1f}"
        memory = "" if pss is None else f"{pss:7.1f}"
        print(f"   {label:68} {cpu:>8} {memory:>7}  {detail}")
    print(f"   controller start-up (imports, once per run): {1000 * report['startup_cpu_s']:.0f} ms CPU")


def print_zygote(data: dict[str, Any], count: int) -> None:
    """Section 4's table."""
    exec_, fork = data["exec"], data["fork"]
    print(
        f"\n4. {count} workers at once, no sandbox: exec'd per rollout (today) vs forked from a warm template"
    )
    print(
        f"   {'way':46} {'CPU ms/worker':>14} {'PSS MB/rollout':>15} {'USS MB/rollout':>15} {'processes':>10}"
    )
    for name, way in (
        ("python -I -B -m rollcage worker (today)", exec_),
        ("fork of the template, worker_main()", fork),
    ):
        cpu, pss, uss = 1000 * _avg(way["cpu_s"]), way["pss_mb"] / count, way["uss_mb"] / count
        print(f"   {name:46} {cpu:14.1f} {pss:15.1f} {uss:15.1f} {way['processes']:10d}")
    print(
        f"   the template: {1000 * fork['template_cpu_s']:.0f} ms CPU once, "
        f"{fork['template_pss_mb']:.1f} MB PSS "
        "alone (its pages are shared with the children: included above, divided among them). A worker's CPU\n"
        "   includes its executor (an exec'd `python -c BOOT` (_repl_child), both ways) and, for the fork, "
        "no interpreter exit (os._exit). "
        f"Exit codes: exec {sorted(set(exec_['exits']))}, fork {sorted(set(fork['exits']))}."
    )


def main() -> None:
    """Run the four measurements and print the breakdown."""
    if sys.argv[1:2] == ["--controller-child"]:
        controller_child(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5:6] == ["cprofile"])
        return
    if sys.argv[1:2] == ["--template-child"]:
        template_child(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, default=8, help="profiled rollouts (default 8)")
    parser.add_argument("--runs", type=int, default=10, help="runs of each launch-chain cut and import case")
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="also trace the controller with cProfile (slower; its top functions)",
    )
    parser.add_argument("--zygote", type=int, default=8, help="workers at once in the template experiment")
    parser.add_argument(
        "--skip", action="append", default=[], choices=["chain", "imports", "rollouts", "zygote"]
    )
    args = parser.parse_args()
    print(
        f"cores: {os.cpu_count()}  load average: {' '.join(f'{v:.1f}' for v in os.getloadavg())}  "
        f"euid {os.geteuid()}"
    )
    base = Path(tempfile.mkdtemp(prefix="rollcage-profile-"))
    try:
        chain = measure_chain(base / "chain", args.runs) if "chain" not in args.skip else []
        if chain:
            print_chain(chain)
        exit_ms = None
        if "imports" not in args.skip:
            imports = measure_bytecode(base, args.runs)
            print_bytecode(imports)
            exit_ms = imports["exit_ms"]
        if "rollouts" not in args.skip:
            print_breakdown(measure_rollouts(base, args.rollouts, args.cprofile), chain, exit_ms)
        if "zygote" not in args.skip:
            print_zygote(measure_zygote(base, args.zygote), args.zygote)
        print(f"\nload average at the end: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
