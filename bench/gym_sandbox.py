"""Benchmark (not a test): NeMo Gym sandboxes, create -> first exec -> close, on three providers.

The same small image (busybox's applets and the host's bash, one layer) on each provider, driven
through NeMo Gym's own ``AsyncSandbox`` facade in the side environment ``nemo-gym-rollcage``
(scripts/upstream-envs), one sandbox at a time, the providers alternating, after one unmeasured
round each:

* **rollcage** (this repository's provider): the image as an OCI layout, already in the provider's
  store (prepared once, as a node does once per image);
* **docker** (NeMo Gym's own): the docker CLI against podman's Docker-compatible API
  (``podman system service`` on a socket of the bench's own, storage of its own, ``runc``,
  ``cgroupfs``), the image loaded once from the same image's ``docker save`` archive,
  ``network: none``;
* **local** (NeMo Gym's own): no isolation, a temporary directory per sandbox; the floor.

Per sandbox: **create** (``start``: to a handle that can run commands), **first exec**
(``echo started``, its output read back), **close** (``stop``), and their sum. Goals (issue 43): the
sum within 2x of local's and at most 0.1x docker's.

    .venv/bin/python bench/gym_sandbox.py --rounds 10 --write bench/results/DATE-gym-sandbox.md

Needs root, bubblewrap, podman, runc and the docker CLI (``scripts/system-deps bench``), and the
side environments (``scripts/upstream-envs``; ``$ROLLCAGE_UPSTREAM_DIR`` or ``.upstream/``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers.oci import Image  # noqa: E402
from tests.helpers.task_images import ENV, _layer  # noqa: E402

UPSTREAM = Path(os.environ.get("ROLLCAGE_UPSTREAM_DIR", ROOT / ".upstream"))
_MNT_DETACH = 2

DRIVER = r"""
import asyncio, json, sys, time
from nemo_gym.sandbox import AsyncSandbox, SandboxSpec, create_provider

setup = json.loads(sys.argv[1])

async def once(provider, image):
    t0 = time.perf_counter()
    box = AsyncSandbox(provider, SandboxSpec(image=image), owns_provider=False)
    await box.start()
    t1 = time.perf_counter()
    result = await box.exec("echo started")
    t2 = time.perf_counter()
    await box.stop()
    t3 = time.perf_counter()
    ok = result.return_code == 0 and result.stdout == "started\n"
    return {"create": t1 - t0, "exec": t2 - t1, "close": t3 - t2, "total": t3 - t0, "ok": ok}

async def main():
    providers = {name: create_provider({name: cfg}) for name, cfg in setup["providers"].items()}
    out = {name: [] for name in providers}
    for name, provider in providers.items():  # one unmeasured round each
        await once(provider, setup["images"][name])
    for _ in range(setup["rounds"]):
        for name, provider in providers.items():
            try:
                out[name].append(await once(provider, setup["images"][name]))
            except Exception as exc:
                out[name].append({"ok": False, "error": repr(exc)[:300]})
    for provider in providers.values():
        await provider.aclose()
    print(json.dumps(out))

asyncio.run(main())
"""


class PodmanService:
    """``podman system service`` on a socket of its own, with storage of its own; ``close()`` always."""

    def __init__(self, directory: Path, archive: Path) -> None:
        binary = shutil.which("podman")
        if binary is None or shutil.which("runc") is None or shutil.which("docker") is None:
            raise SystemExit(
                "bench/gym_sandbox.py needs podman, runc and the docker CLI (scripts/system-deps bench)"
            )
        self.storage = directory / "storage"
        self.socket = directory / "podman.sock"
        base = [binary, "--root", str(self.storage), "--runroot", str(directory / "run")]
        base += ["--cgroup-manager", "cgroupfs", "--runtime", "runc", "--log-level", "error"]
        base += ["--storage-driver", "overlay"]
        loaded = subprocess.run([*base, "load", "-q", "-i", str(archive)], capture_output=True, text=True)
        if loaded.returncode != 0:
            raise SystemExit(f"podman load failed: {loaded.stderr.strip()[-300:]}")
        self.image = loaded.stdout.strip().rsplit(" ", 1)[-1]
        self.log = (directory / "service.log").open("wb")
        self.proc = subprocess.Popen(
            [*base, "system", "service", "--time", "0", f"unix://{self.socket}"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "version"], env=self.env, capture_output=True).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit("podman system service did not answer the docker CLI")
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        # podman's overlay driver bind-mounts its directory on itself (same file system: os.path.ismount
        # cannot see it), maybe once per podman process: unmount until the kernel says none is left.
        libc = ctypes.CDLL(None, use_errno=True)
        for _ in range(16):
            if libc.umount2(os.fsencode(self.storage / "overlay"), _MNT_DETACH) != 0:
                break


def _ulimits() -> list[str]:
    """podman's default rlimits (nofile 1048576, nproc 32768) may be above what this process may raise
    them to (as bench/images.py found): ask for no more than the hard limits we have."""
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1048576)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def _ms(values: list[float], q: float | None = None) -> str:
    if not values:
        return "-"
    if q is None:
        return f"{statistics.median(values) * 1000:.1f}"
    return f"{sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000:.1f}"


def report(out: dict[str, list[dict[str, object]]], meta: str) -> str:
    names = ["rollcage", "local", "docker"]
    lines = ["| median ms (p90) | " + " | ".join(names) + " | rollcage / local | rollcage / docker |"]
    lines.append("|---" * (len(names) + 3) + "|")

    def ratio(values: dict[str, list[float]], a: str, b: str) -> str:
        if not values[a] or not values[b]:
            return "-"
        return f"{statistics.median(values[a]) / statistics.median(values[b]):.3f}x"

    for phase in ("create", "exec", "close", "total"):
        values = {n: [float(r[phase]) for r in out[n] if r.get("ok")] for n in names}  # type: ignore[arg-type]
        cells = [f"{_ms(values[n])} ({_ms(values[n], 0.9)})" for n in names]

        lines.append(
            f"| {phase} | "
            + " | ".join(cells)
            + f" | {ratio(values, 'rollcage', 'local')} | {ratio(values, 'rollcage', 'docker')} |"
        )
    failed = {n: sum(1 for r in out[n] if not r.get("ok")) for n in names}
    lines.append("")
    lines.append(f"failed: {failed}; {meta}")
    errors = {n: [r.get("error") for r in out[n] if not r.get("ok")][:2] for n in names}
    if any(errors.values()):
        lines.append(f"first errors: {errors}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--write", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/gym_sandbox.py needs root (the rollcage provider and podman's storage)")
    python = UPSTREAM / "nemo-gym-rollcage" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no side environment at {python.parent.parent}: run scripts/upstream-envs")
    work = Path(tempfile.mkdtemp(prefix="rollcage-bench-gym-", dir="/tmp"))
    os.chmod(work, 0o711)
    podman: PodmanService | None = None
    try:
        image = Image(
            [_layer(False, ["/bin/bash"])], env=list(ENV), working_dir="/work", user="", compress=False
        )
        image.write_oci(work / "oci", tag="1")
        image.write_docker_archive(work / "image.tar")
        podman = PodmanService(work / "podman", work / "image.tar")
        setup = {
            "rounds": args.rounds,
            "providers": {
                "rollcage": {"state_dir": str(work / "state"), "image_store": str(work / "store")},
                "local": {"workspace_root": str(work / "local")},
                "docker": {"create": {"network": "none", "use_init": False, "extra_run_args": _ulimits()}},
            },
            "images": {"rollcage": f"oci:{work / 'oci'}:1", "local": None, "docker": podman.image},
        }
        load = os.getloadavg()
        done = subprocess.run(
            [str(python), "-c", DRIVER, json.dumps(setup)], env=podman.env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise SystemExit(f"the driver failed:\n{done.stderr[-3000:]}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
        after = os.getloadavg()
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        meta = (
            f"rounds: {args.rounds} each, alternating, one sandbox at a time; "
            f"rollcage {commit.stdout.strip()}; "
            f"docker = NeMo Gym's docker provider on podman {podman.image}; "
            f"{os.cpu_count()} cores, load average {load[0]:.2f} before, {after[0]:.2f} after"
        )
        table = report(out, meta)
        print(table)
        if args.write is not None:
            args.write.write_text(table)
    finally:
        if podman is not None:
            podman.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
