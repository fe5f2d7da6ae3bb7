"""Benchmark (not a test): where a warm rollout's memory goes, by process kind (issue 41).

``rollcage run`` (bwrap, warm workers, forked executors) runs ``--tasks`` of the bench's
tasks (``bench/_measure.py``: 2.5 model calls and 1.5 python executions per task) at
``--concurrency`` against the scripted model answering ``--latency`` s late. Every
``--interval`` s the run's processes (``rollcage run`` and its descendants) are read from
``/proc/PID/smaps_rollup`` and given a kind from their command line; the sample with the
largest PSS summed over the tree is shown by kind: processes, PSS, RSS and USS (private,
what the process alone holds), and PSS per concurrent rollout. RSS counts a page shared by N
processes N times (as ``ps`` adds it up); PSS divides it among them.

    .venv/bin/python bench/memory_breakdown.py [--tasks 256] [--concurrency 64] [--latency 1]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import ModelServer, Smaps, descendants, read_smaps, write_dataset, write_policy

ROOT = Path(__file__).resolve().parent.parent
KINDS = (
    (b"rollcage\0run\0", "controller (rollcage run)"),
    (b"rollcage\0template\0", "warm template"),
    (b"rollcage\0worker\0", "worker"),
    (b"-I\0-u\0-c\0# rollcage executor", "executor"),
    (b"_executor_template", "executor template"),
    (b"trap '' HUP INT QUIT TERM", "sh: outer holder"),
    (b"printf r; exec >/dev/null", "sh: executor holder"),
)


def kind_of(pid: int) -> str | None:
    """What the process is, from its command line (``None`` if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = handle.read()
        with open(f"/proc/{pid}/comm") as handle:
            comm = handle.read().strip()
    except OSError:
        return None
    if comm in ("bwrap", "setpriv"):
        return comm  # its arguments hold the command it runs: the holder's script, the worker's
    for needle, kind in KINDS:
        if needle in argv:
            return kind
    return comm


def sample(root: int) -> dict[str, list[Smaps]]:
    """Every live process of ``root``'s tree (``root`` included), by kind."""
    found: dict[str, list[Smaps]] = collections.defaultdict(list)
    for pid in [root, *descendants(root)]:
        kind = kind_of(pid)
        smaps = read_smaps(pid)
        if kind is not None and smaps is not None:
            found[kind].append(smaps)
    return found


def main() -> None:
    """Run the load, sample it, print the peak sample by kind."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--latency", type=float, default=1.0, help="seconds per model call (default 1)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="memory-breakdown-"))
    write_policy(work / "policy.yaml", args.tasks)
    write_dataset(work / "data.jsonl", args.tasks)
    rollcage = ROOT / ".venv" / "bin" / "rollcage"
    print(f"cores: {os.cpu_count()}  load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    peak: dict[str, list[Smaps]] = {}
    peak_pss = samples = 0
    with ModelServer(work / "policy.yaml", args.latency) as server:
        argv = [str(rollcage), "run", str(work / "data.jsonl"), "--out", str(work / "out")]
        argv += ["--model", server.base_url, "--model-name", "scripted", "--quiet"]
        argv += ["--concurrency", str(args.concurrency), "--sandbox", "bwrap", "--worker-start", "warm"]
        run = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        try:
            while run.poll() is None:
                now = sample(run.pid)
                samples += 1
                total = sum(s.pss for group in now.values() for s in group)
                if total > peak_pss:
                    peak, peak_pss = now, total
                time.sleep(args.interval)  # a sampling period, not a wait for anything
        finally:
            if run.poll() is None:
                run.kill()
            run.wait()
    if run.returncode != 0:
        raise SystemExit(f"rollcage run failed (exit code {run.returncode}); its output is above")
    mib = 1024
    load = f"N={args.tasks}, C={args.concurrency}, {args.latency:g} s a call"
    print(f"\nthe peak of {samples} samples ({load}):")
    heads = ("procs", "PSS MB", "RSS MB", "USS MB", "PSS/proc", "USS/proc")
    print(f"{'kind':<28} " + " ".join(f"{h:>{max(len(h), 8)}}" for h in heads))
    rows = sorted(peak.items(), key=lambda item: -sum(s.pss for s in item[1]))
    for kind, group in rows:
        pss, rss, uss = (sum(getattr(s, f) for s in group) / mib for f in ("pss", "rss", "private"))
        n = len(group)
        print(f"{kind:<28} {n:>5} {pss:>8.1f} {rss:>8.1f} {uss:>8.1f} {pss / n:>9.2f} {uss / n:>9.2f}")
    total_pss = peak_pss / mib
    total_rss = sum(s.rss for group in peak.values() for s in group) / mib
    workers = len(peak.get("worker", []))
    print(f"{'all':<28} {sum(len(g) for g in peak.values()):>5} {total_pss:>8.1f} {total_rss:>8.1f}")
    print(f"\nPSS per concurrent rollout: {total_pss / args.concurrency:.1f} MB (peak / C)")
    if workers:
        print(f"PSS per live worker's rollout: {total_pss / workers:.1f} MB (peak / {workers} live workers)")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
