"""Benchmark (not a test): where a run on Ray spends CPU and time beyond the local backend (issue 41).

Runs ``bench/ray_local.py``'s dataset (``--tasks`` tasks, ``--sandbox bwrap``, concurrency
``--concurrency``) once on the local backend and, on a two-node Ray cluster started here, twice
by one driver (a fresh job, then the same job again). Around each run the driver reads
``/proc/PID/stat`` of every process of the bench's tree (the cluster's and its own) and sums
user + system CPU, with that of their reaped children, by kind: the driver, the GCS, the raylets,
the job's Ray worker processes (``ray::...``), the warm templates they started, Ray's other
processes (agents, monitors). A process that ends between two readings loses its CPU unless
a reader of the tree reaped it (the children of the driver and the workers are reaped by them).

For the fresh job it also prints a timeline: ``ray.init``, each Ray worker process's start
(``/proc`` start time) and the first rollout's placement.

``--titles`` lists the Ray worker processes seen (title, raylet, CPU, start); ``--python PY`` profiles
another checkout (its venv's python runs the driver, its ``ray`` the cluster).

    .venv/bin/python bench/ray_profile.py [--tasks 50] [--concurrency 4] [--titles]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from ray_local import _Cluster, _dataset, _load, child_json

TICK = os.sysconf("SC_CLK_TCK")
BOOT = time.time() - float(Path("/proc/uptime").read_text().split()[0])


def _stat(pid: int) -> tuple[int, float, float] | None:
    """(parent, CPU seconds incl. reaped children, start as Unix time)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    cpu = sum(int(fields[i]) for i in (11, 12, 13, 14)) / TICK
    return int(fields[1]), cpu, BOOT + int(fields[19]) / TICK


def _kind(pid: int, me: int) -> str:
    if pid == me:
        return "driver"
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    line = b" ".join(words)
    if b"rollcage" in words and b"template" in words:
        return "template"
    if b"gcs_server" in line:
        return "gcs"
    if b"/raylet" in line:
        return "raylet"
    if line.startswith(b"ray::"):
        return "ray worker"
    if b"default_worker.py" in line:
        return "ray worker"
    return "ray other" if b"ray" in line else "other"


def snapshot(root: int) -> dict[int, tuple[str, float, float]]:
    """Every process descending from ``root``: pid -> (kind, CPU s, start)."""
    table: dict[int, tuple[int, float, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _stat(int(entry))) is not None:
            table[int(entry)] = info
    me = os.getpid()
    out: dict[int, tuple[str, float, float]] = {}
    for pid, (_parent, cpu, start) in table.items():
        up, seen = pid, 0
        while up > 1 and up != root and seen < 64:
            up, seen = table.get(up, (0, 0.0, 0.0))[0], seen + 1
        if up == root or pid == root:
            out[pid] = (_kind(pid, me), cpu, start)
    for pid, (kind, cpu, start) in out.items():
        if kind in ("template", "driver", "ray worker", "gcs", "raylet"):
            continue
        up, seen = table.get(pid, (0, 0.0, 0.0))[0], 0
        while up > 1 and up != root and seen < 64:
            if up == me or out.get(up, ("",))[0] in ("ray worker", "template"):
                out[pid] = ("rollout procs", cpu, start)  # the sandboxes, the executors
                break
            up, seen = table.get(up, (0, 0.0, 0.0))[0], seen + 1
    return out


class Sampler:
    """Keeps the last reading of every process of the tree seen, also of those that end between
    the snapshots (the run's stop-flag actor, sweep workers): ``snapshot`` alone would miss them."""

    def __init__(self, root: int, period_s: float = 0.2) -> None:
        self.root, self.period_s = root, period_s
        self.seen: dict[int, tuple[str, float, float]] = {}
        self.titles: dict[int, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="bench-cpu-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def read(self) -> dict[int, tuple[str, float, float]]:
        now = snapshot(self.root)
        with self._lock:
            for pid, value in now.items():
                old = self.seen.get(pid)
                # An exiting process's cmdline reads empty: keep what it was.
                self.seen[pid] = (
                    value if old is None or value[0] not in ("?", "other") else (old[0], *value[1:])
                )
                if pid not in self.titles or value[0] == "ray worker":
                    with contextlib.suppress(OSError):
                        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                        title = b" ".join(words)[:60].decode(errors="replace")
                        if title:  # an exiting process's reads empty: keep the last
                            parent = _stat(pid)
                            self.titles[pid] = f"{title} (parent {parent[0] if parent else '?'})"
            return dict(self.seen)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.read()


def _delta(
    before: dict[int, tuple[str, float, float]], after: dict[int, tuple[str, float, float]]
) -> dict[str, Any]:
    kinds: dict[str, float] = {}
    counts: dict[str, int] = {}
    for pid, (kind, cpu, _start) in after.items():
        base = before.get(pid, (kind, 0.0, 0.0))[1]
        kinds[kind] = kinds.get(kind, 0.0) + cpu - base
        counts[kind] = counts.get(kind, 0) + (pid not in before and kind != "?")
    return {"cpu": kinds, "new": counts}


def _child(
    backend: str, address: str, root: int, tasks: int, concurrency: int, workdir: Path
) -> dict[str, Any]:
    from rollcage.controller import LocalBackendConfig, RayBackendConfig, RunConfig

    def config(out: str) -> RunConfig:
        return RunConfig(
            dataset=_dataset(workdir, tasks),
            out=workdir / out,
            sandbox="bwrap",
            concurrency=concurrency,
            deadline_s=120,
            backend=RayBackendConfig() if backend == "ray" else LocalBackendConfig(),
        )

    with Sampler(root) as sampler:
        return _runs(backend, address, sampler, config, workdir)


def _runs(backend: str, address: str, sampler: Sampler, config: Any, workdir: Path) -> dict[str, Any]:
    from rollcage.controller import Controller

    rows: dict[str, Any] = {}
    before = sampler.read()
    if backend == "local":
        started = time.monotonic()
        asyncio.run(Controller(config("out")).run())
        rows["local"] = {"wall_s": time.monotonic() - started, **_delta(before, sampler.read())}
        return rows
    import ray

    t0 = time.time()
    ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    t_init = time.time()
    try:
        started = time.monotonic()
        asyncio.run(Controller(config("out")).run())
        wall = time.monotonic() - started + (t_init - t0)
        middle = sampler.read()
        workers = sorted(
            start - t0 for kind, _cpu, start in middle.values() if kind == "ray worker" and start >= t0 - 1
        )
        records = [
            json.loads(line) for line in (workdir / "out" / "rollouts.jsonl").read_bytes().splitlines()
        ]
        first = min(r["receipt"]["started_at"] for r in records) if records else None
        rows["ray"] = {
            "wall_s": wall,
            **_delta(before, middle),
            "timeline": {
                "ray.init": t_init - t0,
                "worker starts": workers,
                "first supervision": None if first is None else _unix(first) - t0,
            },
        }
        started = time.monotonic()
        asyncio.run(Controller(config("again")).run())
        rows["ray, same job"] = {"wall_s": time.monotonic() - started, **_delta(middle, sampler.read())}
    finally:
        ray.shutdown()
    rows["titles"] = sorted(
        f"{pid} {title} cpu={sampler.seen[pid][1]:.2f} start={sampler.seen[pid][2] - t0:.2f}"
        for pid, title in sampler.titles.items()
        if sampler.seen.get(pid, ("",))[0] == "ray worker"
    )
    return rows


def _unix(value: Any) -> float:
    from datetime import datetime

    return (
        datetime.fromisoformat(str(value)).timestamp() if not isinstance(value, int | float) else float(value)
    )


def main() -> None:
    """Run and print the CPU by kind and the timeline."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--python", default=sys.executable, help="the checkout's venv python to profile")
    parser.add_argument("--titles", action="store_true", help="list the processes seen")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        backend, address, root, workdir = args.child
        rows = _child(backend, address, int(root), args.tasks, args.concurrency, Path(workdir))
        print(json.dumps(rows))
        return
    root = Path(tempfile.mkdtemp(prefix="rc-prof-ray-", dir="/tmp"))
    cluster = _Cluster(root, max(args.concurrency // 2, 1), ray=str(Path(args.python).with_name("ray")))
    results: dict[str, Any] = {}
    try:
        cluster.start()
        for backend in ("local", "ray"):
            workdir = Path(tempfile.mkdtemp(prefix="rollcage-prof-", dir="/tmp"))
            command = [
                args.python,
                __file__,
                "--tasks",
                str(args.tasks),
                "--concurrency",
                str(args.concurrency),
            ]
            command += ["--child", backend, cluster.address or "-", str(os.getpid()), str(workdir)]
            print(f"{backend}: load {_load()}", file=sys.stderr)
            results.update(child_json(command, workdir))
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    titles = results.pop("titles", [])
    kinds = sorted({k for r in results.values() for k in r["cpu"]})
    print(f"tasks {args.tasks}, C={args.concurrency}, load now {_load()}")
    print(f"{'run':>14} {'wall s':>7} {'CPU s':>7} " + " ".join(f"{k:>11}" for k in kinds))
    for name, r in results.items():
        cells = " ".join(f"{r['cpu'].get(k, 0.0):>11.2f}" for k in kinds)
        print(f"{name:>14} {r['wall_s']:>7.1f} {sum(r['cpu'].values()):>7.2f} {cells}")
    print(
        "new processes per kind (ray):", results["ray"]["new"], "same job:", results["ray, same job"]["new"]
    )
    if args.titles:
        print("\n".join(titles))
    print("fresh job timeline (s after ray.init began):", json.dumps(results["ray"]["timeline"]))


if __name__ == "__main__":
    main()
