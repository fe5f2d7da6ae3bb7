"""Benchmark (not a test): starting a command in a task image, rollcage beside ``podman run --rm``.

The image is examples/swe-mini's ``inflection`` task (a Debian root with python3, pytest and git,
plus a repository at /testbed: ~200 MB, ~7,000 files), built by ``examples/swe-mini/build.py``
(cached). Both systems run the same command in it, ``touch /testbed/.started && echo started``:

* **rollcage**: the image already prepared in a store (``ImageStore.prepare``, not timed, as a
  run's controller does once per image), then per start ``cow_root`` (an overlay whose upper is
  the start's own directory) and ``bwrap`` into it with the sandbox's namespaces, uid 1000, the
  image's ``Env`` and ``WorkingDir``; then the overlay is unmounted;
* **podman** (Debian's, as root, its own storage under the bench's directory with the ``overlay``
  driver, else ``vfs``; ``--runtime runc --cgroup-manager cgroupfs``, ``--network none``, the
  image loaded once from the same image's ``docker save`` archive): ``podman run --rm``.

Per start, the two alternating (after one unmeasured start each):

* **start** — from the request (rollcage: before mounting the overlay; podman: before spawning
  ``podman run``) to the command's first line of output read back: the command ran in the image;
* **CPU** — ``getrusage(RUSAGE_CHILDREN)`` of this process, which is made a child subreaper, so
  that podman's conmon and runc, which detach, are reaped here and counted too; plus this
  process's own CPU over the start (rollcage mounts the overlay in-process);
* **disk** — bytes of the start's overlay upper directory (rollcage; what a rollout's
  ``changes/`` holds).

Then, when ``rollcage run`` has ``--image`` (issue 39's rollouts in image roots), image-backed
rollouts: N tasks at C=64 (rollouts/s over the whole command), 256 at C=256 (infrastructure
failures), each one bash call that touches a file and an answer, graded by exact match; disk per
rollout = bytes in each rollout's ``changes/``. Without ``--image``, those rows say
``not available``.

    .venv/bin/python bench/images.py                  # ~1-3 minutes once the images are cached
    .venv/bin/python bench/images.py --starts 40 --write bench/results/DATE-images.md

Needs root (overlay mounts, podman's storage), bubblewrap, podman and runc
(``scripts/system-deps bench``), and what examples/swe-mini's build needs.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from rollcage.images import ImageStore, PreparedImage, cow_root

ROOT = Path(__file__).resolve().parent.parent
ROLLCAGE = ROOT / ".venv" / "bin" / "rollcage"
COMMAND = "touch /testbed/.started && echo started"
TASK = "inflection"
_PR_SET_CHILD_SUBREAPER = 36
_MNT_DETACH = 2


def _load_build() -> ModuleType:
    path = ROOT / "examples" / "swe-mini" / "build.py"
    spec = importlib.util.spec_from_file_location("swe_mini_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _cpu_now() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    return kids.ru_utime + kids.ru_stime + me.ru_utime + me.ru_stime


def _reap_orphans(deadline_s: float = 10.0) -> None:
    """Wait for every process reparented to this subreaper (podman's conmon) so its CPU is counted."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)  # a detached helper still exiting; nothing to wait on but its pid


def _bytes_under(path: Path) -> int:
    total = 0
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


@dataclass
class Starts:
    """What one system's starts measured."""

    system: str
    start_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    disk: list[int] = field(default_factory=list)
    failures: int = 0


def _bwrap_prefix(image: PreparedImage, root: Path) -> list[str]:
    env: list[str] = []
    for item in image.config.env:
        name, _, value = item.partition("=")
        env += ["--setenv", name, value]
    return [
        shutil.which("bwrap") or "bwrap",
        "--bind",
        str(root),
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--tmpfs",
        "/tmp",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--uid",
        "1000",
        "--gid",
        "1000",
        "--chdir",
        image.config.working_dir or "/",
        "--clearenv",
        *env,
    ]


def _timed(argv: list[str], t0: float) -> tuple[float, bool]:
    """Seconds from ``t0`` (the request) to the command's first line, and whether it said ``started``."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - t0
    _out, err = proc.communicate()
    ok = line.strip() == b"started" and proc.returncode == 0
    if not ok:
        print(f"  failed start: {argv[0]} exit {proc.returncode}: {err.decode(errors='replace')[-300:]}")
    return elapsed, ok


def rollcage_start(image: PreparedImage, work: Path, index: int, into: Starts) -> None:
    directory = work / f"rollcage-{index}"
    cpu0 = _cpu_now()
    t0 = time.perf_counter()
    root = cow_root(image, directory / "overlay", directory / "root")
    try:
        elapsed, ok = _timed([*_bwrap_prefix(image, root.path), "/bin/sh", "-c", COMMAND], t0)
    finally:
        root.remove()
    into.start_s.append(elapsed)
    into.cpu_s.append(_cpu_now() - cpu0)
    into.disk.append(_bytes_under(directory / "overlay" / "upper"))
    into.failures += not ok
    shutil.rmtree(directory)


class Podman:
    """Debian's podman with storage of its own under ``directory``."""

    def __init__(self, directory: Path, archive: Path) -> None:
        binary = shutil.which("podman")
        if binary is None or shutil.which("runc") is None:
            raise SystemExit("bench/images.py needs podman and runc: scripts/system-deps bench installs them")
        self.storage = directory / "storage"
        self.base = [binary, "--root", str(self.storage), "--runroot", str(directory / "run")]
        self.base += ["--cgroup-manager", "cgroupfs", "--runtime", "runc", "--log-level", "error"]
        self.driver = "overlay"
        loaded = self._load(archive)
        if loaded is None:
            self.driver = "vfs"
            loaded = self._load(archive)
        if loaded is None:
            raise SystemExit("podman could not load the image with the overlay or the vfs storage driver")
        self.image = loaded
        # podman's default rlimits (nofile 1048576, nproc 32768) may be above what this process may
        # raise them to without CAP_SYS_RESOURCE (a container's root has not got it): ask for no more
        # than the hard limits we have.
        nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1048576)
        nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
        self.ulimits = ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]

    def close(self) -> None:
        """Unmount what podman's storage left mounted (it bind-mounts its driver's directory), so the
        bench's directory can be removed."""
        libc = ctypes.CDLL(None, use_errno=True)
        for mounted in (self.storage / "overlay", self.storage / "vfs"):
            libc.umount2(os.fsencode(mounted), _MNT_DETACH)

    def _load(self, archive: Path) -> str | None:
        done = subprocess.run(
            [*self.base, "--storage-driver", self.driver, "load", "-q", "-i", str(archive)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            print(f"podman load ({self.driver}) failed: {done.stderr.strip()[-300:]}")
            return None
        return done.stdout.strip().rsplit(" ", 1)[-1]

    def argv(self) -> list[str]:
        return [
            *self.base,
            "--storage-driver",
            self.driver,
            "run",
            "--rm",
            "--network",
            "none",
            "--pull",
            "never",
            *self.ulimits,
            self.image,
            "/bin/sh",
            "-c",
            COMMAND,
        ]


def podman_start(podman: Podman, into: Starts) -> None:
    cpu0 = _cpu_now()
    elapsed, ok = _timed(podman.argv(), time.perf_counter())
    _reap_orphans()
    into.start_s.append(elapsed)
    into.cpu_s.append(_cpu_now() - cpu0)
    into.failures += not ok


# ----------------------------------------------------------------------------- rollouts


def image_option() -> bool:
    """Whether ``rollcage run`` takes ``--image`` (rollouts in image roots)."""
    done = subprocess.run([str(ROLLCAGE), "run", "--help"], capture_output=True, text=True, check=False)
    return "--image" in done.stdout


@dataclass
class Rollouts:
    tasks: int
    concurrency: int
    wall_s: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    changes_bytes: list[int] = field(default_factory=list)
    exit_code: int | None = None


def run_rollouts(ref: str, work: Path, tasks: int, concurrency: int) -> Rollouts:
    """``rollcage run --image REF`` of ``tasks`` one-bash-call tasks at ``concurrency``."""
    directory = work / f"run-c{concurrency}"
    directory.mkdir()
    dataset, policy = directory / "dataset.jsonl", directory / "policy.json"
    with dataset.open("w") as handle:
        for i in range(tasks):
            row = {"id": f"t{i}", "input": "Touch a file, then answer ok.", "tools": ["bash"]}
            handle.write(json.dumps({**row, "expected": "ok", "grader": {"type": "exact"}}) + "\n")
    call = {"name": "bash", "arguments": {"command": "touch /testbed/.rollout && echo ok"}}
    policy.write_text(
        json.dumps({"model": "scripted", "tasks": {"*": [{"tool_calls": [call]}, {"text": "ok"}]}})
    )
    result = Rollouts(tasks, concurrency)
    argv = [str(ROLLCAGE), "run", str(dataset), "--image", ref, "--policy", str(policy)]
    argv += ["--concurrency", str(concurrency), "--out", str(directory / "out")]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    result.wall_s = time.perf_counter() - t0
    result.exit_code = done.returncode
    records = directory / "out" / "rollouts.jsonl"
    for line in records.read_text().splitlines() if records.exists() else []:
        record = json.loads(line)
        result.outcomes[record["outcome"]] = result.outcomes.get(record["outcome"], 0) + 1
        changes = Path(record["rollout_dir"]) / "changes"
        if not changes.is_absolute():
            changes = directory / "out" / changes
        if changes.is_dir():
            result.changes_bytes.append(_bytes_under(changes))
    if done.returncode not in (0, 1):
        print(f"  rollcage run exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return result


# ----------------------------------------------------------------------------- report


def _ms(values: list[float], q: float | None = None) -> str:
    if not values:
        return "-"
    if q is None:
        return f"{statistics.median(values) * 1000:.1f}"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.1f}"


def report(rc: Starts, pm: Starts, runs: list[Rollouts | None], podman: Podman, meta: str) -> str:
    lines = [meta, ""]
    lines.append("| | rollcage | podman run --rm | rollcage / podman |")
    lines.append("|---|---|---|---|")

    def ratio(a: list[float], b: list[float]) -> str:
        if not a or not b:
            return "-"
        return f"{statistics.median(a) / statistics.median(b):.3f}x"

    lines.append(
        f"| start to first command, median ms (p90) | {_ms(rc.start_s)} ({_ms(rc.start_s, 0.9)}) "
        f"| {_ms(pm.start_s)} ({_ms(pm.start_s, 0.9)}) | {ratio(rc.start_s, pm.start_s)} |"
    )
    lines.append(
        f"| CPU per start, median ms | {_ms(rc.cpu_s)} | {_ms(pm.cpu_s)} | {ratio(rc.cpu_s, pm.cpu_s)} |"
    )
    disk = f"{statistics.median(rc.disk) / 1024:.0f} KiB" if rc.disk else "-"
    lines.append(f"| disk per start (overlay upper), median | {disk} | - | |")
    lines.append(
        f"| failed starts | {rc.failures} of {len(rc.start_s)} | {pm.failures} of {len(pm.start_s)} | |"
    )
    c64, c256 = runs
    if c64 is None:
        lines.append("| image-backed rollouts/s at C=64 (`rollcage run --image`) | not available | - | |")
    else:
        rate = c64.tasks / c64.wall_s if c64.wall_s else 0.0
        lines.append(f"| image-backed rollouts/s at C=64 ({c64.tasks} tasks) | {rate:.1f} | - | |")
    if c256 is None:
        lines.append("| infrastructure failures at C=256 | not available | - | |")
        lines.append("| disk per rollout (bytes in changes/) | not available | - | |")
    else:
        infra = c256.outcomes.get("infra_failure", 0)
        lines.append(f"| infrastructure failures at C=256 ({c256.tasks} tasks) | {infra} | - | |")
        sizes = [*(c64.changes_bytes if c64 else []), *c256.changes_bytes]
        shown = f"{statistics.median(sizes) / 1024:.0f} KiB (max {max(sizes) / 1024:.0f})" if sizes else "-"
        lines.append(f"| disk per rollout (bytes in changes/), median | {shown} | - | |")
    lines.append("")
    lines.append(f"starts: {len(rc.start_s)} each, alternating; podman storage driver: {podman.driver}")
    for run in runs:
        if run is not None:
            lines.append(
                f"rollcage run C={run.concurrency}: {run.tasks} tasks in {run.wall_s:.1f} s, "
                f"outcomes {run.outcomes}, exit {run.exit_code}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--starts", type=int, default=20, help="measured starts per system")
    parser.add_argument("--tasks", type=int, default=128, help="tasks of the C=64 run")
    parser.add_argument("--write", type=Path, default=None, help="also write the table to this file")
    parser.add_argument("--keep", action="store_true", help="keep the bench's directory")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/images.py needs root (overlay mounts, podman's storage)")
    build = _load_build()
    task = next(t for t in build.TASKS if t.name == TASK)
    built = build.ensure_images(build.default_cache())
    work = Path(tempfile.mkdtemp(prefix="rollcage-bench-images-"))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    cleanups: list[Callable[[], None]] = []
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        store = ImageStore(work / "store")
        image = store.prepare(built.oci_ref(task))
        podman = Podman(work / "podman", built.archives[task.name])
        cleanups.append(podman.close)
        rc, pm = Starts("rollcage"), Starts("podman")
        rollcage_start(image, work, -1, Starts("warm-up"))
        podman_start(podman, Starts("warm-up"))
        for i in range(args.starts):
            rollcage_start(image, work, i, rc)
            podman_start(podman, pm)
        runs: list[Rollouts | None] = [None, None]
        if image_option():
            ref = built.oci_ref(task)
            runs = [run_rollouts(ref, work, args.tasks, 64), run_rollouts(ref, work, 256, 256)]
        load_after = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        meta = (
            f"rollcage {commit.stdout.strip()}, image swe-mini/{task.name} ({image.digest}), "
            f"{os.cpu_count()} cores, load average {load} before, {load_after} after"
        )
        text = report(rc, pm, runs, podman, meta)
        print(text)
        if args.write is not None:
            args.write.parent.mkdir(parents=True, exist_ok=True)
            args.write.write_text(text + "\n")
    finally:
        for cleanup in cleanups:
            cleanup()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
