"""Benchmark (not a test): what one rollout costs the disk and the controller's loop, counted, per tree.

Runs ``bench/peers.py``'s C=256 load (N tasks of the scripted python-tool policy, 1 s per model
call, ``--sandbox bwrap --worker-start warm``) with each checkout's own ``rollcage run``, twice:

* under ``strace -f --seccomp-bpf -y -e trace=fsync,fdatasync`` (every process of the run): each
  sync is named by the file it synced (a temporary file by the artifact it becomes) and whether
  that is a directory;
* plain, with the controller's ``asyncio`` patched to count: thread hops
  (``loop.run_in_executor``, which ``asyncio.to_thread`` uses, by the function sent), budget
  readings (checks, and the hops that took them) and stop-file looks.

Counts of syncs and hops do not depend on the machine's load; budget readings and stop-file
looks are taken on a clock, so they are shown per rollout and per second a rollout was
supervised (``receipt.duration_s``, summed).

    .venv/bin/python bench/rollout_counts.py --tree /work/wt/perf2 --tree /work/bench/old
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import ModelServer, write_dataset, write_policy

# Run in the tree's own python before its CLI: counts what the controller process does.
_PATCH = r"""
import asyncio, collections, functools, importlib, json, os, sys
hops = collections.Counter()
counts = collections.Counter()
_run_in_executor = asyncio.BaseEventLoop.run_in_executor
def run_in_executor(self, executor, func, *args):
    inner = func  # to_thread sends functools.partial(context.run, the function, ...)
    if isinstance(inner, functools.partial) and getattr(inner.func, "__name__", "") == "run" and inner.args:
        inner = inner.args[0]
    while isinstance(inner, functools.partial):
        inner = inner.func
    hops[getattr(inner, "__qualname__", type(inner).__name__)] += 1
    return _run_in_executor(self, executor, func, *args)
asyncio.BaseEventLoop.run_in_executor = run_in_executor
for name in ("rollcage.budgets._polls", "rollcage.supervisor.budgetpolls"):
    try:
        polls = importlib.import_module(name)
    except ImportError:
        continue
    _read_all = polls._read_all
    def read_all(checks, _read_all=_read_all):
        counts["budget_checks"] += len(checks)
        counts["budget_hops"] += 1
        return _read_all(checks)
    polls._read_all = read_all
    break
import rollcage.supervisor.stopfiles as stopfiles
_existing = stopfiles._existing
def existing(paths):
    counts["stop_file_looks"] += len(paths)
    counts["stop_file_hops"] += 1
    return _existing(paths)
stopfiles._existing = existing
sys.argv = ["rollcage", *sys.argv[1:]]
from rollcage.cli import main
try:
    main()
finally:
    with open(os.environ["ROLLCAGE_COUNTS"], "w") as out:
        json.dump({"hops": hops, "counts": counts}, out)
"""

_TEMP = re.compile(r"^\.(.+)\.[0-9a-f]{16}\.tmp$")
# The call's line; with -f another thread's call may cut it (``<unfinished ...>``): counted all the same.
_SYNC = re.compile(r"^\d+\s+(fsync|fdatasync)\((\d+)(?:<(.*?)>)?[), ]")


def _argv(tree: Path, run_dir: Path, base_url: str, tasks: int, concurrency: int) -> list[str]:
    dataset = run_dir / "dataset.jsonl"
    write_dataset(dataset, tasks)
    return [
        str(tree / ".venv" / "bin" / "python"),
        "-c",
        _PATCH,
        "run",
        str(dataset),
        "--out",
        str(run_dir / "out"),
        "--model",
        base_url,
        "--model-name",
        "scripted",
        "--concurrency",
        str(concurrency),
        "--sandbox",
        "bwrap",
        "--worker-start",
        "warm",
        "--quiet",
    ]


def _role(path: str, run_dir: Path) -> str:
    """A synced path as the artifact it is: ``result.json``, ``dir rollouts/<r>``, ..."""
    is_dir = os.path.isdir(path)
    name = os.path.basename(path)
    match = _TEMP.match(name)
    if match is not None:
        name = match.group(1)
    out = str(run_dir / "out")
    if path.startswith(out + "/rollouts/"):
        where = "R/" if not is_dir else ""
    elif path.startswith(out):
        where = "OUT/"
    else:
        where = f"{os.path.dirname(path)}/"
    if is_dir:
        rel = os.path.relpath(path, out) if path.startswith(out) else path
        rel = re.sub(r"^rollouts/[^/]+", "rollouts/<r>", rel)
        return f"dir {rel}"
    return where + name


def _syncs(trace: Path, run_dir: Path) -> collections.Counter[str]:
    found: collections.Counter[str] = collections.Counter()
    for line in trace.read_text(errors="replace").splitlines():
        match = _SYNC.match(line)
        if match is not None:
            path = match.group(3)
            found[f"{match.group(1)} {_role(path, run_dir) if path else '(fd not named)'}"] += 1
    return found


def _supervised_s(run_dir: Path) -> tuple[int, float]:
    rows = [json.loads(line) for line in (run_dir / "out" / "rollouts.jsonl").read_text().splitlines()]
    return len(rows), sum(r["receipt"]["duration_s"] for r in rows)


def _one(tree: Path, work: Path, base_url: str, args: argparse.Namespace, *, strace: bool) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="counts-", dir=work))
    argv = _argv(tree, run_dir, base_url, args.tasks, args.concurrency)
    trace = run_dir / "strace.txt"
    if strace:
        syncs = ["-e", "trace=fsync,fdatasync", "-o", str(trace)]
        argv = ["strace", "-f", "--seccomp-bpf", "-qq", "-y", *syncs, *argv]
    counts_file = run_dir / "counts.json"
    env = {**os.environ, "ROLLCAGE_COUNTS": str(counts_file)}
    subprocess.run(argv, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    rollouts, supervised = _supervised_s(run_dir)
    found: dict[str, Any] = {"rollouts": rollouts, "supervised_s": supervised}
    if strace:
        found["syncs"] = _syncs(trace, run_dir)
    else:
        found.update(json.loads(counts_file.read_text()))
    return found


def _table(rows: list[tuple[str, list[float]]], names: list[str]) -> None:
    print("| per rollout | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for what, values in rows:
        print(f"| {what} | " + " | ".join(f"{v:.2f}" for v in values) + " |")


def _commit(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or tree.name


def _sync_rows(traced: list[dict[str, Any]]) -> list[tuple[str, list[float]]]:
    kinds = sorted({k for t in traced for k in t["syncs"]})
    rows = [(k, [t["syncs"].get(k, 0) / t["rollouts"] for t in traced]) for k in kinds]
    rows.append(("all syncs", [sum(t["syncs"].values()) / t["rollouts"] for t in traced]))
    dirs = [sum(v for k, v in t["syncs"].items() if " dir " in k) / t["rollouts"] for t in traced]
    rows.append(("of them directory syncs", dirs))
    return rows


def _loop_rows(plain: list[dict[str, Any]], top: int) -> list[tuple[str, list[float]]]:
    rows = [("supervised s (mean)", [p["supervised_s"] / p["rollouts"] for p in plain])]
    for key in ("budget_checks", "budget_hops", "stop_file_looks", "stop_file_hops"):
        rows.append((key, [p["counts"].get(key, 0) / p["rollouts"] for p in plain]))
        rows.append((f"{key} per supervised s", [p["counts"].get(key, 0) / p["supervised_s"] for p in plain]))
    rows.append(("thread hops (all)", [sum(p["hops"].values()) / p["rollouts"] for p in plain]))
    names: collections.Counter[str] = collections.Counter()
    for p in plain:
        names.update(p["hops"])
    for name, _ in names.most_common(top):
        rows.append((f"hop {name}", [p["hops"].get(name, 0) / p["rollouts"] for p in plain]))
    return rows


def main() -> None:
    """Count each tree's syncs and hops per rollout, and print them side by side."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", type=Path, action="append", required=True, help="a checkout (repeatable)")
    parser.add_argument("--tasks", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--latency", type=float, default=1.0, help="seconds per model call")
    parser.add_argument("--top-hops", type=int, default=40, help="hop functions shown (the most frequent)")
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree]
    names = [_commit(t) for t in trees]
    traced: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="rollcage-counts-") as tmp:
        work = Path(tmp)
        policy = work / "policy.json"
        write_policy(policy, args.tasks)
        for tree in trees:
            with ModelServer(policy, args.latency) as server:
                traced.append(_one(tree, work, server.base_url, args, strace=True))
            with ModelServer(policy, args.latency) as server:
                plain.append(_one(tree, work, server.base_url, args, strace=False))
    print(f"N={args.tasks} C={args.concurrency}, {args.latency:g} s per model call")
    print(f"load average before: {load}; after:", " ".join(f"{x:.1f}" for x in os.getloadavg()))
    print()
    _table(_sync_rows(traced), names)
    print()
    _table(_loop_rows(plain, args.top_hops), names)


if __name__ == "__main__":
    main()
