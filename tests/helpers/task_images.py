"""Small task images for rollouts, made offline from the host's own programs (no registry, no network).

* ``busybox``: Debian's ``busybox-static`` (scripts/system-deps installs it) and its applets, an
  ``/etc/os-release`` and a ``/work`` with a marker file; no bash, no Python;
* ``python``: the same, plus the host's ``/bin/bash`` and the host's Python interpreter (its binary,
  ``libpython`` and standard library, at the host's paths, without site-packages) with the shared
  libraries they load, and ``/usr/bin/python3`` pointing at it.

Each is one uncompressed layer written as an OCI layout (``oci:PATH``), so a rollout's image goes
through the image store (config ``Env``, ``WorkingDir``, ``User``) as a pulled one does.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.oci import Image

__all__ = ["MARKER", "OS_RELEASE", "TaskImage", "make_task_image", "task_image"]

# Quoted as a real os-release is: it is a shell fragment (NeMo Gym's terminal-bench set-up sources it).
OS_RELEASE = 'ID=rollcage-task-image\nNAME="Rollcage Task Image"\n'
MARKER = "in-the-image\n"
ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", "TASK_IMAGE_MARK=from-the-image-env"]
WORKING_DIR = "/work"
_SKIP_STDLIB = {"site-packages", "test", "idlelib", "tkinter", "ensurepip", "lib2to3", "turtledemo"}


@dataclass(frozen=True)
class TaskImage:
    """A task image on disk: its reference and what a rollout in it must see."""

    ref: str
    env: tuple[str, ...]
    working_dir: str
    has_python: bool


def _libraries(program: str) -> list[str]:
    """The shared libraries ``program`` loads (``ldd``), as real files' paths."""
    out = subprocess.run(["ldd", program], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/") and os.path.exists(path):
            found.append(path)
    return found


def _filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if any(part in _SKIP_STDLIB for part in Path(info.name).parts) or ".opt-" in info.name:
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode &= 0o777  # nothing setuid in a test image
    return info


def _layer(python: bool, programs: Sequence[str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def directory(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def text(name: str, data: str, mode: int = 0o644) -> None:
            info = tarfile.TarInfo(name)
            body = data.encode()
            info.size, info.mode = len(body), mode
            tar.addfile(info, io.BytesIO(body))

        def link(name: str, target: str) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)

        made: set[str] = set()
        libraries: set[str] = set()

        def parents(path: str) -> None:
            parts = path.strip("/").split("/")[:-1]
            for i in range(len(parts)):
                name = "/".join(parts[: i + 1])
                if name not in made:
                    made.add(name)
                    directory(name)

        def host_file(path: str, inside: str | None = None) -> None:
            name = (inside or path).lstrip("/")
            parents(name)
            tar.add(os.path.realpath(path), arcname=name, filter=_filter)

        for name in ("bin", "etc", "proc", "dev", "root", "work", "usr", "usr/bin"):
            made.add(name)
            directory(name)
        directory("tmp", 0o1777)
        made.add("tmp")
        busybox = shutil.which("busybox") or "/bin/busybox"
        host_file(busybox, "/bin/busybox")
        applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout
        for applet in applets.split():
            if applet not in ("busybox", "bash") and "/" not in applet:
                link(f"bin/{applet}", "busybox")
        text("etc/os-release", OS_RELEASE)
        text("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nagent:x:1234:1234::/work:/bin/sh\n")
        text("etc/group", "root:x:0:\nagent:x:1234:\n")
        text("work/marker.txt", MARKER)
        if python:
            executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
            libraries |= {*_libraries("/bin/bash"), *_libraries(executable)}
            dynload = Path(sysconfig.get_paths()["stdlib"]) / "lib-dynload"
            for module in sorted(dynload.glob("*.so")):  # ctypes needs libffi, ssl libssl...
                libraries |= set(_libraries(str(module)))
            host_file("/bin/bash", "/bin/bash")
            host_file(executable)
            for library in sorted(libraries):
                host_file(library)
            stdlib = sysconfig.get_paths()["stdlib"]
            parents(stdlib.lstrip("/") + "/x")
            tar.add(stdlib, arcname=stdlib.lstrip("/"), filter=_filter)
            link("usr/bin/python3", executable)
        for program in programs:
            for library in sorted(set(_libraries(program)) - libraries):
                host_file(library)
                libraries.add(library)
            host_file(program)
    return buffer.getvalue()


def make_task_image(
    directory: Path,
    *,
    python: bool,
    user: str = "",
    working_dir: str = WORKING_DIR,
    programs: Sequence[str] = (),
) -> TaskImage:
    """Write a task image (see the module docstring) as an OCI layout in ``directory``.

    ``programs``: more host programs, with their libraries, at their host paths (made inert: no
    setuid bit survives a test image, nor the store).
    """
    image = task_image(python=python, user=user, working_dir=working_dir, programs=programs)
    image.write_oci(directory, tag="1")
    return TaskImage(f"oci:{directory}:1", tuple(ENV), working_dir, python)


def task_image(
    *,
    python: bool,
    user: str = "",
    working_dir: str = WORKING_DIR,
    programs: Sequence[str] = (),
    env: Sequence[str] = (),
) -> Image:
    """The image :func:`make_task_image` writes, to push to a registry; ``env``: more ``Env`` entries."""
    layer = _layer(python, programs)
    return Image([layer], env=[*ENV, *env], working_dir=working_dir, user=user, compress=False)
