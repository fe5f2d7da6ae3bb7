"""A rollout's copy-on-write root: writes land in its upper directory, the store stays byte-identical;
leases keep an image in use from ``rm`` and ``prune``."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollcage.images import ImageStore, PreparedImage, cow_root
from tests.helpers.oci import Image, Member, layer
from tests.helpers.waiting import wait_for

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting an overlay needs root")


def _busybox() -> bytes:
    path = shutil.which("busybox")
    if path is None:
        pytest.skip("busybox is not installed (scripts/system-deps test installs busybox-static)")
    return Path(path).read_bytes()


def _image(tmp_path: Path, store: ImageStore, *, runnable: bool = False) -> PreparedImage:
    members = [
        Member("etc", kind="dir"),
        Member("etc/hello", data=b"from the image\n"),
        Member("etc/remove-me", data=b"bye\n"),
        Member("bin", kind="symlink", target="usr/bin"),
    ]
    if runnable:
        members += [
            Member("usr/bin/busybox", data=_busybox(), mode=0o755),
            Member("usr/bin/sh", kind="symlink", target="busybox"),
        ]
    return store.pull(f"oci:{Image([layer(*members)]).write_oci(tmp_path / 'layout')}")


def _fingerprint(root: Path) -> dict[str, str]:
    found = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top, name)
            st = path.lstat()
            digest = (
                hashlib.sha256(path.read_bytes()).hexdigest()
                if path.is_file() and not path.is_symlink()
                else ""
            )
            found[str(path.relative_to(root))] = f"{st.st_mode:o} {st.st_size} {st.st_mtime_ns} {digest}"
    return found


@needs_root
def test_writes_land_in_the_upper_and_the_store_stays_byte_identical(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    image = _image(tmp_path, store)
    before = _fingerprint(store.path)
    rollout = tmp_path / "rollout"
    with cow_root(image, rollout / "overlay", rollout / "root") as root:
        (root.path / "etc/hello").write_text("changed by the agent\n")
        (root.path / "etc/remove-me").unlink()
        (root.path / "work").mkdir()
        (root.path / "work/new.txt").write_text("new\n")
        assert (root.path / "etc/hello").read_text() == "changed by the agent\n"
        assert os.readlink(root.path / "bin") == "usr/bin"
        assert (root.upper / "etc/hello").read_text() == "changed by the agent\n"
        assert (root.upper / "work/new.txt").read_text() == "new\n"
    assert not os.path.ismount(rollout / "root")
    assert (rollout / "overlay/upper/work/new.txt").exists()  # kept as evidence of what was written
    assert not (rollout / "overlay/work").exists()
    assert _fingerprint(store.path) == before
    assert (image.root / "etc/hello").read_text() == "from the image\n"


@needs_root
def test_the_overlay_is_mounted_nosuid_and_nodev(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    image = _image(tmp_path, store)
    with cow_root(image, tmp_path / "rollout/overlay", tmp_path / "rollout/root") as root:
        line = next(
            line for line in Path("/proc/self/mounts").read_text().splitlines() if f" {root.path} " in line
        )
        options = line.split()[3].split(",")
        assert "nosuid" in options and "nodev" in options


@needs_root
def test_bubblewrap_runs_the_image_s_own_shell_in_the_cow_root(tmp_path: Path) -> None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("bubblewrap is not installed")
    store = ImageStore(tmp_path / "store")
    image = _image(tmp_path, store, runnable=True)
    before = _fingerprint(store.path)
    with cow_root(image, tmp_path / "rollout/overlay", tmp_path / "rollout/root") as root:
        done = _run_in(bwrap, root.path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "from the image\n"
    assert (root.upper / "etc/new").read_text() == "written\n"
    assert _fingerprint(store.path) == before


def _run_in(bwrap: str, root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            bwrap,
            "--bind",
            str(root),
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--unshare-all",
            "/bin/sh",
            "-c",
            "cat /etc/hello && echo written > /etc/new && rm /etc/remove-me",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_leased_image_survives_rm_and_prune_until_the_lease_ends(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    image = _image(tmp_path, store)
    with store.lease(image):
        assert store.list()[0].in_use == 1
        assert store.remove(image.ref) is False
        assert store.prune().images == []
        assert image.root.is_dir()
    report = store.prune()
    assert report.images == [image.digest] and report.layers == 1
    assert not image.root.exists()
    assert not list((store.path / "layers").iterdir())


def test_a_lease_held_by_a_sigkilled_process_is_released(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    image = _image(tmp_path, store)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from rollcage.images import ImageStore\n"
            "s = ImageStore(__import__('pathlib').Path(sys.argv[1]))\n"
            "with s.lease(s.prepare(sys.argv[2])):\n"
            "    print('leased', flush=True)\n"
            "    sys.stdin.read()\n",
            str(store.path),
            image.ref,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "leased\n"
        assert store.prune(everything=True).images == []
        holder.send_signal(signal.SIGKILL)
        wait_for(lambda: holder.poll() is not None, what="the lease holder to die")
    finally:
        holder.kill()
        holder.communicate()
    assert store.prune(everything=True).images == [image.digest]
    assert store.list() == []


def test_prepare_of_a_dir_reference_uses_the_directory_in_place(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    image = ImageStore(tmp_path / "store").prepare(f"dir:{rootfs}")
    assert image.root == rootfs and image.digest is None
