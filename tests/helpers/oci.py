"""Images for the image-store tests, built offline: layer tarballs, configs, manifests; a local registry.

* :func:`layer` makes a layer tarball from member specs (files, dirs, links, whiteouts, devices);
* :class:`Image` holds layers and a config and writes itself as an OCI layout or a ``docker save``
  archive, or pushes itself over the distribution API (:func:`push`);
* :class:`Registry` runs Debian's ``docker-registry`` on a loopback port with a temporary storage
  directory, and reads its access log.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = ["Image", "Member", "Registry", "layer", "push", "sha256"]

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Member:
    """One tar member: ``kind`` is file, dir, symlink, hardlink, fifo, chardev, blockdev."""

    name: str
    kind: str = "file"
    data: bytes = b""
    target: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    size: int | None = None  # a header size different from the data (a lie, or a sparse file)


def layer(*members: Member) -> bytes:
    """An uncompressed layer tarball (PAX format, deterministic)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.mode, info.uid, info.gid, info.mtime = m.mode, m.uid, m.gid, 1_700_000_000
            data = None
            if m.kind == "file":
                info.size = len(m.data)
                data = io.BytesIO(m.data)
            elif m.kind == "dir":
                info.type = tarfile.DIRTYPE
                info.mode = m.mode if m.mode != 0o644 else 0o755
            elif m.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, m.target
            elif m.kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, m.target
            elif m.kind == "fifo":
                info.type = tarfile.FIFOTYPE
            elif m.kind in ("chardev", "blockdev"):
                info.type = tarfile.CHRTYPE if m.kind == "chardev" else tarfile.BLKTYPE
                info.devmajor, info.devminor = 1, 3
            tar.addfile(info, data)
    return buffer.getvalue()


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


@dataclass
class Image:
    """An image: layer tarballs (uncompressed; gzipped on the wire) and a config."""

    layers: list[bytes]
    env: list[str] = field(default_factory=lambda: ["PATH=/usr/bin:/bin", "IMAGE=test"])
    working_dir: str = "/work"
    user: str = ""
    compress: bool = True
    docker_media: bool = False

    def blobs(self) -> list[bytes]:
        return [gz(t) if self.compress else t for t in self.layers]

    def config(self) -> bytes:
        body: dict[str, Any] = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": self.env, "WorkingDir": self.working_dir, "Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": [sha256(t) for t in self.layers]},
        }
        if self.user:
            body["config"]["User"] = self.user
        return json.dumps(body, sort_keys=True).encode()

    @property
    def id(self) -> str:
        return sha256(self.config())

    def manifest(self) -> tuple[bytes, str]:
        media = DOCKER_MANIFEST if self.docker_media else OCI_MANIFEST
        layer_media = (
            "application/vnd.docker.image.rootfs.diff.tar.gzip" if self.docker_media else OCI_LAYER_GZIP
        )
        config_media = "application/vnd.docker.container.image.v1+json" if self.docker_media else OCI_CONFIG
        config = self.config()
        body = {
            "schemaVersion": 2,
            "mediaType": media,
            "config": {"mediaType": config_media, "digest": sha256(config), "size": len(config)},
            "layers": [{"mediaType": layer_media, "digest": sha256(b), "size": len(b)} for b in self.blobs()],
        }
        return json.dumps(body, sort_keys=True).encode(), media

    def write_oci(self, path: Path, tag: str = "latest") -> Path:
        blobs = path / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        manifest, media = self.manifest()
        for blob in [*self.blobs(), self.config(), manifest]:
            (blobs / sha256(blob)[7:]).write_bytes(blob)
        (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": media,
                    "digest": sha256(manifest),
                    "size": len(manifest),
                    "annotations": {"org.opencontainers.image.ref.name": tag},
                }
            ],
        }
        (path / "index.json").write_text(json.dumps(index))
        return path

    def write_docker_archive(self, path: Path) -> Path:
        """The classic ``docker save`` layout: HEX.json, DIR/layer.tar (uncompressed), manifest.json."""
        config = self.config()
        with tarfile.open(path, "w") as tar:

            def add(name: str, data: bytes) -> None:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

            names = []
            for n, t in enumerate(self.layers):
                names.append(f"{n:02d}{sha256(t)[7:20]}/layer.tar")
                add(names[-1], t)
            add(f"{sha256(config)[7:]}.json", config)
            add(
                "manifest.json",
                json.dumps(
                    [{"Config": f"{sha256(config)[7:]}.json", "RepoTags": ["t:1"], "Layers": names}]
                ).encode(),
            )
        return path


def push(base: str, name: str, tag: str, image: Image, *, as_list: bool = False) -> str:
    """Push ``image`` to the registry at ``base`` (``http://127.0.0.1:PORT``) as NAME:TAG; return the
    manifest digest (the list's, with ``as_list``)."""
    with httpx.Client(timeout=60) as client:
        for blob in [*image.blobs(), image.config()]:
            upload_blob(client, base, name, blob)
        manifest, media = image.manifest()
        if as_list:
            put_manifest(client, base, name, sha256(manifest), manifest, media)
            body = {
                "schemaVersion": 2,
                "mediaType": DOCKER_LIST,
                "manifests": [
                    {
                        "mediaType": media,
                        "digest": sha256(manifest),
                        "size": len(manifest),
                        "platform": {"architecture": "arm", "os": "linux", "variant": "v7"},
                    },
                    {
                        "mediaType": media,
                        "digest": sha256(manifest),
                        "size": len(manifest),
                        "platform": {"architecture": "amd64", "os": "linux"},
                    },
                ],
            }
            manifest, media = json.dumps(body).encode(), DOCKER_LIST
        put_manifest(client, base, name, tag, manifest, media)
        return sha256(manifest)


def upload_blob(client: httpx.Client, base: str, name: str, blob: bytes) -> None:
    started = client.post(f"{base}/v2/{name}/blobs/uploads/")
    assert started.status_code == 202, started.text
    location = started.headers["location"]
    if location.startswith("/"):
        location = base + location
    sep = "&" if "?" in location else "?"
    done = client.put(f"{location}{sep}digest={sha256(blob)}", content=blob)
    assert done.status_code == 201, done.text


def put_manifest(client: httpx.Client, base: str, name: str, ref: str, body: bytes, media: str) -> None:
    done = client.put(f"{base}/v2/{name}/manifests/{ref}", content=body, headers={"Content-Type": media})
    assert done.status_code == 201, done.text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    """Debian's docker-registry on 127.0.0.1, storage in ``directory``; stop() always."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.host = f"127.0.0.1:{self.port}"
        self.log = directory / "registry.log"
        config = directory / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: info\n"
            f"storage:\n  filesystem:\n    rootdirectory: {directory / 'data'}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n"
        )
        binary = shutil.which("docker-registry")
        assert binary is not None
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(
            [binary, "serve", str(config)], stdout=self._log_file, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.base}/v2/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"docker-registry did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def blob_gets(self, digest: str) -> list[str]:
        """Access-log lines of GETs of one blob."""
        return [
            line
            for line in self.log.read_text(errors="replace").splitlines()
            if "GET /v2/" in line and f"/blobs/{digest}" in line and "HTTP/1.1" in line
        ]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


def snapshot(*directories: Path) -> dict[str, tuple[int, int, int]]:
    """(mode, size, mtime_ns) of every path under ``directories`` (links not followed)."""
    seen: dict[str, tuple[int, int, int]] = {}
    for top in directories:
        for dirpath, dirnames, filenames in os.walk(top):
            for name in [*dirnames, *filenames]:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                seen[path] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


class AuthFront:
    """A token-auth front for the registry, as Docker Hub and most registries work: ``/v2/...`` answers
    401 with ``WWW-Authenticate: Bearer realm=...`` unless it carries a token, and ``/token`` gives
    tokens for Basic credentials ``user:password`` only. Everything else is passed to the registry."""

    TOKEN = "t0ken-for-tests"

    def __init__(
        self,
        upstream: str,
        user: str = "alice",
        password: str = "s3cret-pw",
        *,
        require_token: bool = True,
        stall: tuple[str, int] | None = None,
    ) -> None:
        """``stall=(digest, n)``: the first GET of that blob sends ``n`` bytes, then waits for ``release``."""
        import base64
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, str, str]] = []  # method, path, Authorization header
        self.ranges: list[tuple[str, str]] = []  # (path, Range header) of blob GETs
        self.release = threading.Event()
        self._stall = stall
        expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                auth = self.headers.get("Authorization", "")
                front.requests.append(("GET", self.path, auth))
                if self.path.startswith("/token"):
                    if auth != expected:
                        self.send_response(401)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    body = json.dumps({"token": AuthFront.TOKEN}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if require_token and auth != f"Bearer {AuthFront.TOKEN}":
                    self.send_response(401)
                    realm = f"http://127.0.0.1:{front.port}/token"
                    self.send_header("WWW-Authenticate", f'Bearer realm="{realm}",service="test"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("accept", "range")}
                if "/blobs/" in self.path:
                    front.ranges.append((self.path, self.headers.get("Range", "")))
                with httpx.stream("GET", upstream + self.path, headers=headers, timeout=60) as r:
                    body = r.read()
                    self.send_response(r.status_code)
                    for key in ("content-type", "docker-content-digest", "content-range"):
                        if key in r.headers:
                            self.send_header(key, r.headers[key])
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    stall = front._stall
                    if stall is not None and self.path.endswith(f"/blobs/{stall[0]}"):
                        front._stall = None
                        self.wfile.write(body[: stall[1]])
                        self.wfile.flush()
                        front.release.wait(timeout=120)
                        return  # the client was killed meanwhile: the rest is never sent
                    self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.host = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=30)
