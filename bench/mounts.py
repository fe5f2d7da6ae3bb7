"""Benchmark (not a test): what a sandbox's launch costs as the host's mount table grows.

As root, every rollout in flight has bounded tmpfs mounted on the host: its
workspace, and, for a cold start, its ``/tmp`` and ``/dev/shm`` too; a warm
start (the default) mounts those two inside
the cage, where no other launch sees them (see ``rollcage.budgets``).
Each outer bubblewrap stage starts from a copy of its caller's mount table and
reads ``/proc/self/mountinfo`` once per bind, so started from the host's namespace
its cost grows with the number of rollouts in flight elsewhere on the machine;
started by ``rollcage.cage``'s launcher (what the supervisor does), from a namespace
without rollcage's tmpfs plus the launch's own, it does not. This bench mounts
``M x R`` small tmpfs for R rollouts in flight, M = 3 (three host mounts per
rollout) and M = 1 (one), and runs the real launch chain (``bench/profile.py``'s
cuts: the outer stage, and the whole chain up to the worker) ended by ``true``,
``--runs`` times each, both ways, interleaved; CPU is the cgroup's
``cpuacct.usage`` (exact; the launcher's own system calls, in this process, are not
in it). The ratio is against R = 0 started from the host's namespace, in the same run.

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
from rollcage.budgets import mount_tmpfs, mount_tmpfs_with_copy, unmount
from rollcage.cage import Launcher, launcher

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
    """Print the launch's CPU per number of rollouts in flight, from the host's namespace and the launcher."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--in-flight", type=int, nargs="+", default=[0, 50, 128, 256])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/mounts.py needs root: only root mounts the rollouts' bounded tmpfs")
    levels = sorted(set(args.in_flight))
    launch = launcher()
    with tempfile.TemporaryDirectory(prefix="rollcage-mounts-") as scratch:
        base = Path(scratch)
        stages = chain_stages(base / "chain")
        cuts = [(label.strip(), argv) for label, argv in stages if "bwrap" in label or "prlimit" in label]
        cuts = [cuts[0], cuts[-1]]  # the outer stage alone, and the whole chain up to the worker
        # The launch's own workspace, mounted as a supervisor mounts it: on the host, with a copy to bind.
        workspace = base / "chain" / "rollout" / "workspace"
        copy = mount_tmpfs_with_copy(workspace, size=1 << 20, inodes=64, uid=65534, gid=65534, mode=0o755)
        binds = [(copy, str(workspace))]
        ways: Ways = [("host", None), ("launcher", binds)]
        (base / "mounts").mkdir()
        results: dict[int, dict[tuple[str, str], float]] = {}
        tables: dict[int, int] = {}
        counts = sorted({per * level for level in levels for per in MOUNTS_PER_ROLLOUT})
        try:
            with _host_mounts(base / "mounts") as mounted:
                for count in counts:
                    _grow(mounted, base / "mounts", count)
                    tables[count] = _host_table()
                    results[count] = _measure(cuts, ways, launch, runs=args.runs, tag=f"mounts{count}")
                    print(f"  {count} mounts of rollouts in flight measured", flush=True)
        finally:
            os.close(copy)
            unmount(workspace)
    if launch.plain_reason is not None:
        print(f"note: the launcher started everything the plain way ({launch.plain_reason})")
    exact = CpuGroup.make("probe")
    if exact is not None:
        exact.remove()
    print()
    print(f"CPU per launch, median of {args.runs} ({'cgroup cpuacct' if exact else 'rusage: a lower bound'})")
    print("host: started from the host's mount namespace; launcher: by rollcage.cage's launcher (default)")
    header = f"{'in flight':>9}  {'per rollout':>11}  {'host mounts':>11}"
    for label, _ in cuts:
        for way, _ in ways:
            header += f"  {(label[:30] + ', ' + way):>42}  {'ratio':>5}"
    print(header)
    for per in MOUNTS_PER_ROLLOUT:
        for level in levels:
            count = per * level
            row = f"{level:>9}  {per:>11}  {tables[count]:>11}"
            for label, _ in cuts:
                for way, _ in ways:
                    ms = results[count][label, way]
                    row += f"  {ms:>39.1f} ms  {ms / results[counts[0]][label, 'host']:>4.2f}x"
            print(row)


Ways = list[tuple[str, list[tuple[int, str]] | None]]


def _measure(
    cuts: list[tuple[str, list[str]]], ways: Ways, launch: Launcher, *, runs: int, tag: str
) -> dict[tuple[str, str], float]:
    """Median CPU ms of each cut started each way, ``runs`` times, interleaved."""
    keys = [(label, way) for label, _ in cuts for way, _ in ways]
    groups = {key: CpuGroup.make(f"{tag}-{i}") for i, key in enumerate(keys)}
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    try:
        for _ in range(runs):
            for label, argv in cuts:
                for way, needs in ways:
                    group = groups[label, way]

                    def run(group: CpuGroup | None = group, argv: list[str] = argv) -> float:
                        return float(_run_in_group(group, argv, cwd="/", stdout=subprocess.DEVNULL)[1])

                    samples[label, way].append(launch.run(run, needs, timeout_s=60, late=_ignore))
    finally:
        for group in groups.values():
            if group is not None:
                group.remove()
    return {key: 1000 * statistics.median(values) for key, values in samples.items()}


def _ignore(_: float) -> None:
    """A measurement that came after the launcher's wait gave up: nothing to undo."""


if __name__ == "__main__":
    main()
