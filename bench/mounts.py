"""Benchmark (not a test): what a sandbox's launch costs as the host's mount table grows.

As root, every rollout in flight has bounded tmpfs mounted on the host: its
workspace, and, for a cold start, its ``/tmp`` and ``/dev/shm`` too; a warm
start (the default) mounts those two inside
the cage, where no other launch sees them (see ``rollcage.supervisor.budgets``).
Each rollout's outer bubblewrap stage starts from a copy of the host's mount table
and reads ``/proc/self/mountinfo`` once per bind, so its cost grows with the number
of rollouts in flight elsewhere on the machine. This bench mounts ``M x R`` small
tmpfs for R rollouts in flight, M = 3 (three host mounts per rollout) and M = 1
(one), and runs the real launch chain (``bench/profile.py``'s cuts: the outer stage,
and the whole chain up to the worker) ended by ``true``, ``--runs`` times each,
interleaved; CPU is the cgroup's ``cpuacct.usage`` (exact). The ratio is against
R = 0 in the same run.

    sudo .venv/bin/python bench/mounts.py [--in-flight 0 50 128 256] [--runs 15]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _measure import CpuGroup
from rollcage.cage._budget import mount_tmpfs, unmount

# bench/profile.py by path: imported as "profile" it would shadow the standard library's (cProfile uses it).
_spec = importlib.util.spec_from_file_location("bench_profile", Path(__file__).with_name("profile.py"))
assert _spec is not None and _spec.loader is not None
_profile = sys.modules["bench_profile"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_profile)
_run_in_group = _profile._run_in_group
chain_stages = _profile.chain_stages

MOUNTS_PER_ROLLOUT = (3, 1)
"""Host mounts per rollout in flight: cold starts (workspace, /tmp, /dev/shm), warm starts (workspace)."""


@contextlib.contextmanager
def _host_mounts(base: Path) -> Iterator[list[Path]]:
    """A list to grow with mounted tmpfs under ``base``; every one is unmounted at the end."""
    mounted: list[Path] = []
    try:
        yield mounted
    finally:
        for path in reversed(mounted):
            with contextlib.suppress(OSError):
                unmount(path)


def _grow(mounted: list[Path], base: Path, count: int) -> None:
    while len(mounted) < count:
        path = base / f"m{len(mounted)}"
        path.mkdir(exist_ok=True)
        mount_tmpfs(path, size=1 << 20, inodes=64, uid=0, gid=0, source="rollcage-bench")
        mounted.append(path)


def _host_table() -> int:
    with open("/proc/self/mountinfo", encoding="utf-8") as file:
        return sum(1 for _ in file)


def main() -> None:
    """Print the launch's CPU per number of rollouts in flight."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--in-flight", type=int, nargs="+", default=[0, 50, 128, 256])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/mounts.py needs root: only root mounts the rollouts' bounded tmpfs")
    levels = sorted(set(args.in_flight))
    with tempfile.TemporaryDirectory(prefix="rollcage-mounts-") as scratch:
        base = Path(scratch)
        stages = chain_stages(base / "chain")
        cuts = [(label.strip(), argv) for label, argv in stages if "bwrap" in label or "prlimit" in label]
        cuts = [cuts[0], cuts[-1]]  # the outer stage alone, and the whole chain up to the worker
        (base / "mounts").mkdir()
        results: dict[int, dict[str, float]] = {}
        tables: dict[int, int] = {}
        counts = sorted({per * level for level in levels for per in MOUNTS_PER_ROLLOUT})
        with _host_mounts(base / "mounts") as mounted:
            for count in counts:
                _grow(mounted, base / "mounts", count)
                tables[count] = _host_table()
                groups = {label: CpuGroup.make(f"mounts{count}-{i}") for i, (label, _) in enumerate(cuts)}
                try:
                    samples: dict[str, list[float]] = {label: [] for label, _ in cuts}
                    for _ in range(args.runs):
                        for label, argv in cuts:
                            _, cpu, _ = _run_in_group(groups[label], argv, cwd="/", stdout=subprocess.DEVNULL)
                            samples[label].append(cpu)
                finally:
                    for group in groups.values():
                        if group is not None:
                            group.remove()
                results[count] = {
                    label: 1000 * statistics.median(values) for label, values in samples.items()
                }
                print(f"  {count} mounts of rollouts in flight measured", flush=True)
    exact = CpuGroup.make("probe")
    if exact is not None:
        exact.remove()
    print()
    print(f"CPU per launch, median of {args.runs} ({'cgroup cpuacct' if exact else 'rusage: a lower bound'})")
    header = f"{'in flight':>9}  {'per rollout':>11}  {'host mounts':>11}"
    for label, _ in cuts:
        header += f"  {label[:44]:>44}  {'ratio':>5}"
    print(header)
    for per in MOUNTS_PER_ROLLOUT:
        for level in levels:
            count = per * level
            row = f"{level:>9}  {per:>11}  {tables[count]:>11}"
            for label, _ in cuts:
                ms = results[count][label]
                row += f"  {ms:>41.1f} ms  {ms / results[counts[0]][label]:>4.2f}x"
            print(row)


if __name__ == "__main__":
    main()
