"""Pulling through the distribution API from a real local registry, and loading the same image from an OCI
layout and a ``docker save`` archive: layers composed, verified, shared, deduplicated, resumed."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcage.errors import ImagePullError, ImageRefusedError
from rollcage.images import ImageStore
from tests.helpers.oci import AuthFront, Image, Member, Registry, layer, push, sha256
from tests.helpers.waiting import wait_for

BASE = layer(
    Member("etc", kind="dir"),
    Member("etc/hostname", data=b"image\n"),
    Member("etc/gone", data=b"deleted by the top layer\n"),
    Member("opt/cache", kind="dir"),
    Member("opt/cache/old", data=b"hidden by an opaque dir\n"),
    Member("usr/bin", kind="dir"),
    Member("usr/bin/tool", data=b"#!/bin/sh\necho tool\n", mode=0o4755),
    Member("usr/bin/tool-again", kind="hardlink", target="usr/bin/tool"),
    Member("bin", kind="symlink", target="usr/bin"),
    Member("lib/host-link", kind="symlink", target="/etc/shadow"),
)
TOP = layer(
    Member("etc/.wh.gone"),
    Member("opt/cache", kind="dir"),
    Member("opt/cache/.wh..wh..opq"),
    Member("opt/cache/new", data=b"top\n"),
    Member("work", kind="dir", mode=0o1777),
)
IMAGE = Image([BASE, TOP])


def _check_root(root: Path) -> None:
    assert (root / "etc/hostname").read_bytes() == b"image\n"
    assert not (root / "etc/gone").exists()
    assert sorted(os.listdir(root / "opt/cache")) == ["new"]
    tool = root / "usr/bin/tool"
    assert stat.S_IMODE(tool.stat().st_mode) == 0o755  # setuid made inert
    assert tool.stat().st_ino == (root / "usr/bin/tool-again").stat().st_ino  # hard link kept
    assert os.readlink(root / "bin") == "usr/bin"
    assert os.readlink(root / "lib/host-link") == "/etc/shadow"  # kept as written, never followed here
    assert stat.S_IMODE((root / "work").stat().st_mode) == 0o1777
    assert not any(name.startswith(".wh.") for _, dirs, files in os.walk(root) for name in dirs + files)


def test_pull_composes_layers_and_applies_whiteouts(registry: Registry, store: ImageStore) -> None:
    push(registry.base, "tests/compose", "v1", IMAGE, as_list=True)
    image = store.pull(f"docker://{registry.host}/tests/compose:v1")
    assert image.digest == IMAGE.id
    _check_root(image.root)
    assert image.config.env == ("PATH=/usr/bin:/bin", "IMAGE=test")
    assert image.config.working_dir == "/work"
    assert image.config.cmd == ("/bin/sh",)
    assert [e.ref for e in store.list()] == [f"docker://{registry.host}/tests/compose:v1"]


def test_pull_by_digest_and_docker_media_types(registry: Registry, store: ImageStore) -> None:
    image = Image([BASE, TOP], docker_media=True)
    digest = push(registry.base, "tests/dockerv2", "v1", image)
    pulled = store.pull(f"docker://{registry.host}/tests/dockerv2@{digest}")
    assert pulled.manifest_digest == digest
    _check_root(pulled.root)


def test_oci_layout_and_docker_archive_give_the_same_image(tmp_path: Path, store: ImageStore) -> None:
    from_layout = store.pull(f"oci:{IMAGE.write_oci(tmp_path / 'layout', tag='v3')}:v3")
    from_archive = store.pull(f"docker-archive:{IMAGE.write_docker_archive(tmp_path / 'image.tar')}")
    assert from_layout.digest == from_archive.digest == IMAGE.id
    assert from_layout.root == from_archive.root
    _check_root(from_archive.root)
    assert len(list((store.path / "layers").iterdir())) == 2


def test_layers_are_unpacked_once_and_shared_between_images(tmp_path: Path, store: ImageStore) -> None:
    other = Image([BASE, layer(Member("etc/other", data=b"x"))])
    first = store.pull(f"oci:{IMAGE.write_oci(tmp_path / 'a')}")
    second = store.pull(f"oci:{other.write_oci(tmp_path / 'b')}")
    assert len(list((store.path / "layers").iterdir())) == 3
    assert (first.root / "etc/hostname").stat().st_ino == (second.root / "etc/hostname").stat().st_ino


def test_prepare_uses_the_store_without_asking_the_registry(registry: Registry, store: ImageStore) -> None:
    push(registry.base, "tests/offline", "v1", IMAGE)
    ref = f"docker://{registry.host}/tests/offline:v1"
    pulled = store.pull(ref)
    asked = registry.log.read_text().count("/v2/tests/offline/manifests/")
    assert store.prepare(ref) == pulled
    assert registry.log.read_text().count("/v2/tests/offline/manifests/") == asked


@pytest.fixture
def auth_front(registry: Registry) -> Iterator[AuthFront]:
    front = AuthFront(registry.base)
    try:
        yield front
    finally:
        front.stop()


def test_token_auth_with_credentials_from_the_environment(
    registry: Registry, auth_front: AuthFront, store: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    push(registry.base, "tests/private", "v1", IMAGE)
    monkeypatch.setenv("ROLLCAGE_REGISTRY_AUTH", json.dumps({auth_front.host: "alice:s3cret-pw"}))
    monkeypatch.setenv("DOCKER_CONFIG", "/nonexistent")
    image = store.pull(f"docker://{auth_front.host}/tests/private:v1")
    _check_root(image.root)
    token_requests = [r for r in auth_front.requests if r[1].startswith("/token")]
    assert token_requests and "scope=repository%3Atests%2Fprivate%3Apull" in token_requests[0][1]
    assert _store_never_mentions(store.path, "s3cret-pw")


def test_token_auth_with_credentials_from_the_docker_config(
    registry: Registry,
    auth_front: AuthFront,
    store: ImageStore,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    push(registry.base, "tests/private", "v1", IMAGE)
    config = tmp_path / "docker"
    config.mkdir()
    auth = base64.b64encode(b"alice:s3cret-pw").decode()
    (config / "config.json").write_text(json.dumps({"auths": {auth_front.host: {"auth": auth}}}))
    monkeypatch.delenv("ROLLCAGE_REGISTRY_AUTH", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(config))
    _check_root(store.pull(f"docker://{auth_front.host}/tests/private:v1").root)


def test_missing_credentials_fail_in_one_line_without_secrets(
    registry: Registry, auth_front: AuthFront, store: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    push(registry.base, "tests/private", "v1", IMAGE)
    monkeypatch.setenv("DOCKER_CONFIG", "/nonexistent")
    monkeypatch.delenv("ROLLCAGE_REGISTRY_AUTH", raising=False)
    with pytest.raises(ImagePullError, match="refused anonymous access") as caught:
        store.pull(f"docker://{auth_front.host}/tests/private:v1")
    assert "\n" not in str(caught.value)
    monkeypatch.setenv("ROLLCAGE_REGISTRY_AUTH", json.dumps({auth_front.host: "alice:wrong-pw"}))
    with pytest.raises(ImagePullError, match="refused the credentials given") as caught:
        store.pull(f"docker://{auth_front.host}/tests/private:v1")
    assert "wrong-pw" not in str(caught.value)


def _store_never_mentions(path: Path, secret: str) -> bool:
    for top, _dirs, files in os.walk(path):
        for name in files:
            file = Path(top, name)
            if file.is_file() and not file.is_symlink() and secret.encode() in file.read_bytes():
                return False
    return True


def test_a_partial_download_is_continued_with_a_range_request(registry: Registry, store: ImageStore) -> None:
    payload = os.urandom(2 << 20)
    big = Image([layer(Member("data/blob", data=payload))])
    push(registry.base, "tests/resume", "v1", big)
    blob = big.blobs()[0]
    (store.path / "tmp").mkdir(parents=True)
    (store.path / "tmp" / f"{sha256(blob)[7:]}.partial").write_bytes(blob[: len(blob) // 2])
    image = store.pull(f"docker://{registry.host}/tests/resume:v1")
    assert (image.root / "data/blob").read_bytes() == payload
    gets = registry.blob_gets(sha256(blob))
    assert len(gets) == 1 and '" 206 ' in gets[0], gets


def test_a_pull_sigkilled_mid_download_is_continued_by_the_next(registry: Registry, tmp_path: Path) -> None:
    payload = os.urandom(4 << 20)
    image = Image([layer(Member("data/blob", data=payload))], compress=False)
    push(registry.base, "tests/killed-download", "v1", image)
    blob = image.blobs()[0]
    half = 2 << 20  # a whole number of the client's 1 MiB write chunks
    front = AuthFront(registry.base, require_token=False, stall=(sha256(blob), half))
    root = tmp_path / "store"
    partial = root / "tmp" / f"{sha256(blob)[7:]}.partial"
    ref = f"docker://{front.host}/tests/killed-download:v1"
    try:
        proc = _pull_process(root, ref)
        try:
            wait_for(
                lambda: (partial.exists() and partial.stat().st_size >= half) or proc.poll() is not None,
                what="half the blob to arrive",
            )
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.communicate()
            front.release.set()
        assert partial.stat().st_size == half
        assert not list((root / "layers").iterdir()) and not list((root / "roots").iterdir())
        image_again = ImageStore(root).pull(ref)
        assert (image_again.root / "data/blob").read_bytes() == payload
        asked = [wanted for path, wanted in front.ranges if path.endswith(sha256(blob))]
        assert asked == ["", f"bytes={half}-"]
    finally:
        front.stop()


def test_a_whole_partial_download_is_used_without_asking_again(registry: Registry, store: ImageStore) -> None:
    """A pull killed after the last byte but before the rename left the whole blob under its temp name."""
    image = Image([layer(Member("data/file", data=os.urandom(64 << 10)))])
    push(registry.base, "tests/whole-partial", "v1", image)
    blob = image.blobs()[0]
    (store.path / "tmp").mkdir(parents=True)
    (store.path / "tmp" / f"{sha256(blob)[7:]}.partial").write_bytes(blob)
    assert store.pull(f"docker://{registry.host}/tests/whole-partial:v1").digest == image.id
    assert registry.blob_gets(sha256(blob)) == []


def test_a_corrupt_partial_download_is_refused_then_started_over(
    registry: Registry, store: ImageStore
) -> None:
    image = Image([layer(Member("data/file", data=os.urandom(64 << 10)))])
    push(registry.base, "tests/corrupt-partial", "v1", image)
    partial = store.path / "tmp" / f"{sha256(image.blobs()[0])[7:]}.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\0" * 1000)
    ref = f"docker://{registry.host}/tests/corrupt-partial:v1"
    with pytest.raises(ImageRefusedError, match="its digest is"):
        store.pull(ref)
    assert not partial.exists()
    assert store.pull(ref).digest == image.id


def _pull_process(store: Path, ref: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollcage", "images", "pull", "--store", str(store), ref],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_processes_pulling_one_image_download_it_once(registry: Registry, tmp_path: Path) -> None:
    image = Image([layer(*(Member(f"data/{n}", data=os.urandom(256 << 10)) for n in range(40)))])
    push(registry.base, "tests/concurrent", "v1", image)
    ref = f"docker://{registry.host}/tests/concurrent:v1"
    procs = [_pull_process(tmp_path / "store", ref) for _ in range(2)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert len(registry.blob_gets(sha256(image.blobs()[0]))) == 1
    assert len(list((tmp_path / "store" / "roots").iterdir())) == 1


def test_concurrent_prepares_in_one_store_ask_the_registry_once(registry: Registry, tmp_path: Path) -> None:
    # A Ray node's rollouts prepare their image at once, each in its own process: one pulls, the
    # others wait for it and use the store's copy, never asking the registry again.
    image = Image([layer(*(Member(f"data/{n}", data=os.urandom(256 << 10)) for n in range(40)))])
    push(registry.base, "tests/prepare-once", "v1", image)
    ref = f"docker://{registry.host}/tests/prepare-once:v1"
    start = threading.Barrier(4)

    def prepare() -> Path:
        store = ImageStore(tmp_path / "store")
        start.wait(timeout=60)
        return store.prepare(ref).root

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        roots = list(pool.map(lambda _: prepare(), range(4), timeout=300))
    assert len(set(roots)) == 1
    asked = [
        line for line in registry.log.read_text().splitlines() if "/v2/tests/prepare-once/manifests/" in line
    ]
    assert len([line for line in asked if "GET /v2/" in line]) == 1, asked
    assert len(registry.blob_gets(sha256(image.blobs()[0]))) == 1


def _unpack_started(store: Path) -> bool:
    """Files are being written under the store's layers (wherever the store stages them)."""
    return any(
        any(path.rglob("*"))
        for sub in ("tmp", "layers")
        if (store / sub).is_dir()
        for path in (store / sub).iterdir()
        if path.is_dir()
    )


def test_a_sigkilled_unpack_leaves_nothing_in_use_and_the_next_pull_completes(
    registry: Registry, tmp_path: Path
) -> None:
    image = Image([layer(*(Member(f"many/{n:05d}", data=b"x" * 1024) for n in range(6000)))])
    push(registry.base, "tests/killed", "v1", image)
    ref = f"docker://{registry.host}/tests/killed:v1"
    root = tmp_path / "store"
    unpacking = root / "tmp" / f"layer-{sha256(image.layers[0])[7:]}"
    proc = _pull_process(root, ref)
    try:
        wait_for(
            lambda: _unpack_started(root) or proc.poll() is not None,
            what="the unpack to start",
            interval=0.002,
        )
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    assert not list((root / "roots").iterdir()) or proc.returncode == 0
    for done in (root / "layers").iterdir():  # whatever is under layers/ is whole
        assert (done / "meta.json").is_file()
        assert len(os.listdir(done / "root" / "many")) == 6000
    again = ImageStore(root).pull(ref)
    assert len(os.listdir(again.root / "many")) == 6000
    assert not unpacking.exists()


def test_plain_http_is_for_loopback_registries_or_those_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollcage.images import parse_ref
    from rollcage.images._registry import RegistryClient

    monkeypatch.delenv("ROLLCAGE_INSECURE_REGISTRIES", raising=False)
    for host, scheme in [("127.0.0.1:5000", "http"), ("localhost:5000", "http"), ("[::1]:5000", "http")]:
        with RegistryClient(parse_ref(f"docker://{host}/x")) as client:
            assert client.base.startswith(f"{scheme}://"), host
    with RegistryClient(parse_ref("docker://registry.example:5000/x")) as client:
        assert client.base == "https://registry.example:5000/v2/x"
    monkeypatch.setenv("ROLLCAGE_INSECURE_REGISTRIES", "registry.example:5000")
    with RegistryClient(parse_ref("docker://registry.example:5000/x")) as client:
        assert client.base.startswith("http://")
