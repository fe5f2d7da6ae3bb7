"""Benchmark (not a test): the same tasks on the local backend and on Ray, both nodes on this machine.

Issue 41 measured 50 tasks at 18.8 s on Ray against 3.9 s locally: every rollout on a Ray
node started a warm worker template of its own (the template died with the rollout's
thread). This runs the same dataset (``--tasks`` tasks: one python call, then the answer,
on the embedded scripted policy) with ``--sandbox`` (``bwrap``, the default, or ``none``: a
``--sandbox none`` worker's template is its starting thread's), concurrency ``--concurrency``,
on the local backend and on a two-node Ray cluster started here (``ray start``, each node
``--concurrency / 2`` CPUs, one rollout per CPU), in ``--rounds`` rounds, the two backends
in turn (ABBA). While a run goes, a sampler counts the template processes that appear
(``python ... -m rollcage template``, distinct PIDs: a template lives at least as long as
one warm start, far longer than the sampling period).

On Ray the driver runs the dataset twice: ``ray`` is the run a user starts (connecting to the
cluster included: the job's Ray worker processes start, import rollcage and start their templates),
``ray, same job`` the same dataset again by the same driver, whose worker processes are up.

Prints a table per run, then the median wall times and the ratios to local (target: <= 1.3x).

``--baseline-python PY`` also runs Ray with another checkout (``PY``: its venv's python, an editable
install): a second two-node cluster started with that venv's ``ray`` (its nodes' worker processes
run that checkout's code), up for the whole bench like the first, and its driver run by ``PY``.
Each round then runs the local backend (this checkout), Ray with this checkout and Ray with the
baseline, in turn (ABBA); the table has a ``source`` column and the ratios are per source, to the
same local runs.

    .venv/bin/python bench/ray_local.py                      # 50 tasks, C=4, 2 rounds
    .venv/bin/python bench/ray_local.py --tasks 20 --rounds 1
    .venv/bin/python bench/ray_local.py --sandbox none
    .venv/bin/python bench/ray_local.py --baseline-python /work/main/.venv/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

POLICY = {
    "tasks": {
        "*": [
            {"tool_calls": [{"name": "python", "arguments": {"code": "print(6 * 7)"}}]},
            {"text": "42"},
        ]
    }
}
RAY = str(Path(sys.executable).with_name("ray"))


def _load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def _free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


class _Cluster:
    """A head and a worker node (``ray start --block``), each in its own session and temp dir."""

    def __init__(self, root: Path, cpus: int, ray: str = RAY) -> None:
        self.root, self.cpus, self.ray = root, cpus, ray
        self.procs: list[subprocess.Popen[bytes]] = []
        self.address = ""

    def _start(self, name: str, *args: str) -> None:
        temp, scratch = self.root / name / "ray", self.root / name / "tmp"
        temp.mkdir(parents=True)
        scratch.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "TMPDIR": str(scratch)})
        log = self.root / name / "ray-start.log"
        command = [
            self.ray,
            "start",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            "--num-cpus",
            str(self.cpus),
        ]
        command += ["--temp-dir", str(temp), "--disable-usage-stats", *args]
        with log.open("ab") as out:
            proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.procs.append(proc)
        deadline = time.monotonic() + 180
        while b"Ray runtime started" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start of {name} failed:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)

    def start(self) -> None:
        port, dashboard, agent = _free_ports(3)
        self.address = f"127.0.0.1:{port}"
        self._start(
            "head",
            "--head",
            "--port",
            str(port),
            "--include-dashboard",
            "false",
            "--dashboard-port",
            str(dashboard),
            "--dashboard-agent-listen-port",
            str(agent),
        )
        self._start(
            "worker", "--address", self.address, "--dashboard-agent-listen-port", str(_free_ports(1)[0])
        )

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=60)


class _TemplateSampler:
    """Counts the distinct template processes seen while it runs that descend from ``root`` (the
    bench: the local run's controller and the Ray nodes are its children), not other users'."""

    def __init__(self, root: int, period_s: float = 0.02) -> None:
        self.root, self.period_s = root, period_s
        self.seen: set[tuple[int, str]] = set()
        self.parents: set[int] = set()
        """The processes that started them (on Ray: the node worker processes that ran rollouts)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-template-sampler", daemon=True)

    def __enter__(self) -> _TemplateSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as handle:
                        words = handle.read().split(b"\0")
                    with open(f"/proc/{entry}/stat") as handle:
                        start = handle.read().rsplit(")", 1)[1].split()[19]
                except (OSError, IndexError):
                    continue
                # A worker the template forked carries its command line until it takes its own: it is
                # in its cage's PID namespace (NSpid has two levels), the template is not.
                if (
                    b"rollcage" in words
                    and b"template" in words
                    and b"-m" in words
                    and self._ours(int(entry))
                    and self._host_pid(int(entry))
                ):
                    self.seen.add((int(entry), start))
                    self.parents.add(self._parent(int(entry)))

    def _ours(self, pid: int) -> bool:
        while pid > 1:
            if pid == self.root:
                return True
            pid = self._parent(pid)
        return False

    @staticmethod
    def _host_pid(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/status") as handle:
                return any(line.startswith("NSpid:") and len(line.split()) == 2 for line in handle)
        except OSError:
            return False

    @staticmethod
    def _parent(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                return int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0


def _dataset(workdir: Path, tasks: int) -> Path:
    dataset = workdir / "dataset.jsonl"
    with dataset.open("w") as handle:
        for i in range(tasks):
            row = {"id": f"t{i}", "input": "6*7?", "expected": "42", "tools": ["python"]}
            handle.write(json.dumps(row) + "\n")
    (workdir / "policy.yaml").write_text(json.dumps(POLICY))  # JSON is YAML
    return dataset


def _once(name: str, config: Any, extra_s: float = 0.0) -> dict[str, Any]:
    """One run of ``config`` in this process, its templates counted."""
    from rollcage.controller import Controller
    from rollcage.protocol import RolloutRecord

    with _TemplateSampler(os.getppid()) as sampler:
        started = time.monotonic()
        summary = asyncio.run(Controller(config).run())
        wall = time.monotonic() - started + extra_s
    lines = (config.out / "rollouts.jsonl").read_bytes().splitlines()
    durations = [RolloutRecord.model_validate_json(line).receipt.duration_s for line in lines]
    return {
        "backend": name,
        "wall_s": wall,
        "supervised_s": statistics.mean(durations),
        "rollouts": summary.metrics.rollouts,
        "completed": summary.metrics.outcomes["completed"],
        "templates": len(sampler.seen),
        "processes": len(sampler.parents - {0}),
    }


def _child(
    backend: str, address: str, tasks: int, concurrency: int, workdir: Path, sandbox: str
) -> list[dict[str, Any]]:
    """The local run; or on Ray, the run as a user starts it (connecting included) and a second one
    by the same driver, whose Ray worker processes are started already (a job's workers are its own)."""
    from rollcage.controller import LocalBackendConfig, RayBackendConfig, RunConfig

    def config(out: str) -> RunConfig:
        return RunConfig(
            dataset=_dataset(workdir, tasks),
            out=workdir / out,
            sandbox=sandbox,
            concurrency=concurrency,
            deadline_s=120,
            backend=RayBackendConfig() if backend == "ray" else LocalBackendConfig(),
        )

    if backend == "local":
        return [_once("local", config("out"))]
    import ray

    started = time.monotonic()
    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    connect_s = time.monotonic() - started
    try:
        return [_once("ray", config("out"), connect_s), _once("ray, same job", config("again"))]
    finally:
        ray.shutdown()


def child_json(command: list[str], workdir: Path) -> Any:
    """Run a bench's ``--child`` command line; the JSON of its last line. ``workdir`` is removed after."""
    try:
        out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=1200)
    except subprocess.CalledProcessError as exc:
        sys.stderr.write(exc.stderr[-4000:])
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run(
    backend: str, address: str, args: argparse.Namespace, python: str = sys.executable, source: str = "this"
) -> list[dict[str, Any]]:
    workdir = Path(tempfile.mkdtemp(prefix="rollcage-bench-ray-", dir="/tmp"))
    load = _load()
    command = [
        python,
        __file__,
        "--tasks",
        str(args.tasks),
        "--concurrency",
        str(args.concurrency),
        "--sandbox",
        args.sandbox,
    ]
    command += ["--child", backend, address or "-", str(workdir)]
    rows: list[dict[str, Any]] = child_json(command, workdir)
    for row in rows:
        row["load"] = load
        row["source"] = source if backend == "ray" else "this"
        print(json.dumps(row), file=sys.stderr)
    return rows


def main() -> None:
    """Run the rounds and print the table and ratio."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sandbox", choices=("bwrap", "none"), default="bwrap")
    parser.add_argument(
        "--baseline-python", help="another checkout's venv python: Ray with it too, on its own cluster"
    )
    parser.add_argument("--child", nargs=3, metavar=("BACKEND", "ADDRESS", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        backend, address, workdir = args.child
        rows = _child(backend, address, args.tasks, args.concurrency, Path(workdir), args.sandbox)
        print(json.dumps(rows))
        return
    root = Path(tempfile.mkdtemp(prefix="rc-bench-ray-", dir="/tmp"))  # Ray's socket paths must be short
    cpus = max(args.concurrency // 2, 1)
    clusters = {"this": (sys.executable, _Cluster(root / "t", cpus))}
    if args.baseline_python:
        base = str(Path(args.baseline_python).absolute())
        clusters["base"] = (base, _Cluster(root / "b", cpus, ray=str(Path(base).with_name("ray"))))
    runs = [("local", "this"), *(("ray", source) for source in clusters)]
    rows = []
    try:
        for _python, cluster in clusters.values():
            cluster.start()
        for index in range(args.rounds):
            for backend, source in runs if index % 2 == 0 else reversed(runs):
                python, cluster = clusters[source]
                address = cluster.address if backend == "ray" else ""
                rows.extend(_run(backend, address, args, python, source))
    finally:
        for _python, cluster in clusters.values():
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"cores: {os.cpu_count()}  tasks: {args.tasks}  concurrency: {args.concurrency}  "
        f"sandbox: {args.sandbox}  "
        f"Ray: 2 nodes x {cpus} CPUs per cluster ({len(clusters)})  load now (1/5/15 min): {_load()}"
    )
    columns = (
        "source",
        "backend",
        "completed",
        "wall s",
        "rollouts/s",
        "supervised s",
        "templates",
        "in processes",
        "load",
    )
    print("  ".join(f"{c:>12}" for c in columns))
    for r in rows:
        cells = (
            r["source"],
            r["backend"],
            r["completed"],
            f"{r['wall_s']:.1f}",
            f"{r['rollouts'] / r['wall_s']:.2f}",
            f"{r['supervised_s']:.2f}",
            r["templates"],
            r["processes"],
            r["load"].split()[0],
        )
        print("  ".join(f"{c:>12}" for c in cells))
    local = statistics.median(r["wall_s"] for r in rows if r["backend"] == "local")
    for source in clusters:
        for name in ("ray", "ray, same job"):
            ray = statistics.median(
                r["wall_s"] for r in rows if r["backend"] == name and r["source"] == source
            )
            print(
                f"median wall: local {local:.1f} s, {name} ({source}) {ray:.1f} s; "
                f"ratio {ray / local:.2f}x (target <= 1.3x)"
            )


if __name__ == "__main__":
    main()
