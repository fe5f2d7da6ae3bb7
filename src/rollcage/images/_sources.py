"""Where an image's manifest, config and layers come from: a registry, an OCI layout, a docker archive.

Each source resolves its reference to a :class:`Plan` (the config, verified against its digest, and
the layer descriptors in order) and opens each layer's blob as a stream; the store unpacks it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import tarfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, Protocol

from rollcage.errors import ImageReferenceError, ImageRefusedError
from rollcage.images._ref import ImageRef
from rollcage.images._registry import RegistryClient

__all__ = ["LayerSpec", "Plan", "Source", "open_source"]

_CONFIG_LIMIT: Final = 16 << 20
_INDEX_TYPES: Final = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_REF_NAME: Final = "org.opencontainers.image.ref.name"
_ARCH: Final = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "ppc64le": "ppc64le",
}


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One layer as the manifest and config describe it."""

    digest: str | None
    """The blob's digest (``None`` where the source names none: an old ``docker save`` archive)."""
    size: int | None
    """The blob's size in bytes, where stated."""
    diff_id: str
    """sha256 of the uncompressed tar, from the config's ``rootfs.diff_ids``."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What pulling an image needs, resolved and verified."""

    manifest_digest: str | None
    """The manifest's digest (``None`` for a docker archive, which has no manifest blob)."""
    config_digest: str
    """sha256 of the config blob: the image's identity in the store."""
    config: dict[str, Any]
    """The config blob, parsed."""
    layers: tuple[LayerSpec, ...]
    """Layers, lowest first."""


class Source(Protocol):
    """An image source: resolve once, then open layers."""

    def plan(self) -> Plan:
        """Resolve the reference and verify the manifest and config."""
        ...

    def open_layer(
        self, layer: LayerSpec, blob_dir: Path, tmp_dir: Path, limit: int
    ) -> AbstractContextManager[IO[bytes]]:
        """The layer's blob as a stream (a registry blob is downloaded into ``blob_dir`` first)."""
        ...

    def close(self) -> None:
        """Release what the source holds open."""
        ...


def open_source(ref: ImageRef, *, insecure: bool = False) -> Source:
    """The source for a reference (not ``dir:``, which has no layers)."""
    if ref.transport == "docker":
        return _RegistrySource(ref, insecure=insecure)
    if ref.transport == "oci":
        return _LayoutSource(ref)
    if ref.transport == "docker-archive":
        return _ArchiveSource(ref)
    raise ValueError(f"{ref}: no layers to pull")


def host_platform() -> tuple[str, str]:
    """(os, architecture) as OCI spells them, for picking from an index."""
    machine = platform.machine().lower()
    return "linux", _ARCH.get(machine, machine)


def _json(body: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise ImageRefusedError(f"{what} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ImageRefusedError(f"{what} is not a JSON object")
    return value


def _pick_platform(index: dict[str, Any], what: str) -> dict[str, Any]:
    want_os, want_arch = host_platform()
    found = []
    for entry in index.get("manifests") or []:
        plat = entry.get("platform") or {}
        found.append(f"{plat.get('os')}/{plat.get('architecture')}")
        if plat.get("os") == want_os and plat.get("architecture") == want_arch:
            return dict(entry)
    raise ImageRefusedError(
        f"{what} has no {want_os}/{want_arch} image (it has {', '.join(found) or 'none'})"
    )


def _layers_of(manifest: dict[str, Any], config: dict[str, Any], what: str) -> tuple[LayerSpec, ...]:
    if manifest.get("schemaVersion") == 1:
        raise ImageRefusedError(f"{what}: Docker schema 1 manifests are not supported")
    layers = manifest.get("layers")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids")
    if not isinstance(layers, list) or not isinstance(diff_ids, list) or len(layers) != len(diff_ids):
        raise ImageRefusedError(
            f"{what}: the manifest's layers and the config's rootfs.diff_ids do not match"
        )
    specs = []
    for layer, diff_id in zip(layers, diff_ids, strict=True):
        digest = layer.get("digest")
        _check_digest(digest, what)
        _check_digest(diff_id, what)
        media = str(layer.get("mediaType", ""))
        if "nondistributable" in media or "foreign" in media:
            raise ImageRefusedError(
                f"{what}: layer {digest} is a foreign layer ({media}), not in the registry"
            )
        specs.append(LayerSpec(digest=digest, size=layer.get("size"), diff_id=diff_id))
    return tuple(specs)


def _check_digest(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.startswith("sha256:") or len(value) != 71:
        raise ImageRefusedError(f"{what}: {value!r} is not a sha256 digest")
    try:
        int(value[7:], 16)
    except ValueError as exc:
        raise ImageRefusedError(f"{what}: {value!r} is not a sha256 digest") from exc
    return value


def _verified(body: bytes, digest: str, what: str) -> bytes:
    actual = "sha256:" + hashlib.sha256(body).hexdigest()
    if actual != digest:
        raise ImageRefusedError(f"{what}: its digest is {actual}, expected {digest}")
    return body


# --------------------------------------------------------------------------- registry


class _RegistrySource:
    def __init__(self, ref: ImageRef, *, insecure: bool) -> None:
        self.ref = ref
        self.client = RegistryClient(ref, insecure=insecure)

    def plan(self) -> Plan:
        body, media_type, digest = self.client.manifest(self.ref.manifest_reference)
        manifest = _json(body, f"{self.ref}: manifest")
        if media_type in _INDEX_TYPES or "manifests" in manifest:
            entry = _pick_platform(manifest, f"{self.ref}")
            _check_digest(entry.get("digest"), f"{self.ref}: index")
            body, media_type, digest = self.client.manifest(entry["digest"])
            manifest = _json(body, f"{self.ref}: manifest")
        config_desc = manifest.get("config") or {}
        config_digest = _check_digest(config_desc.get("digest"), f"{self.ref}: manifest config")
        config = _json(self.client.blob_bytes(config_digest, _CONFIG_LIMIT), f"{self.ref}: config")
        return Plan(digest, config_digest, config, _layers_of(manifest, config, str(self.ref)))

    @contextmanager
    def open_layer(self, layer: LayerSpec, blob_dir: Path, tmp_dir: Path, limit: int) -> Iterator[IO[bytes]]:
        assert layer.digest is not None
        hexdigest = layer.digest[7:]
        final = blob_dir / hexdigest
        if not final.exists():
            self.client.download(layer.digest, tmp_dir / f"{hexdigest}.partial", final, limit)
        with final.open("rb") as f:
            yield f

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------- OCI image layout


class _LayoutSource:
    def __init__(self, ref: ImageRef) -> None:
        assert ref.path is not None
        self.ref = ref
        self.root = ref.path

    def _blob(self, digest: str, limit: int, what: str) -> bytes:
        path = self.root / "blobs" / "sha256" / digest[7:]
        try:
            with path.open("rb") as f:
                body = f.read(limit + 1)
        except OSError as exc:
            raise ImageRefusedError(f"{self.ref}: {what} {digest}: {exc.strerror}") from exc
        if len(body) > limit:
            raise ImageRefusedError(f"{self.ref}: {what} {digest} is over {limit} bytes")
        return _verified(body, digest, f"{self.ref}: {what}")

    def plan(self) -> Plan:
        try:
            index = _json((self.root / "index.json").read_bytes(), f"{self.ref}: index.json")
        except OSError as exc:
            raise ImageReferenceError(
                f"{self.ref}: no OCI image layout there ({exc.strerror}: index.json)"
            ) from exc
        entries = list(index.get("manifests") or [])
        if self.ref.tag is not None:
            entries = [e for e in entries if (e.get("annotations") or {}).get(_REF_NAME) == self.ref.tag]
            if not entries:
                raise ImageReferenceError(f"{self.ref}: the layout has no image tagged {self.ref.tag!r}")
        if len(entries) != 1:
            raise ImageReferenceError(
                f"{self.ref}: the layout holds {len(entries)} images; name one with oci:PATH:TAG"
            )
        entry = entries[0]
        _check_digest(entry.get("digest"), f"{self.ref}: index.json")
        body = self._blob(entry["digest"], 4 << 20, "manifest")
        manifest = _json(body, f"{self.ref}: manifest")
        digest = entry["digest"]
        if entry.get("mediaType") in _INDEX_TYPES or "manifests" in manifest:
            inner = _pick_platform(manifest, str(self.ref))
            _check_digest(inner.get("digest"), f"{self.ref}: index")
            digest = inner["digest"]
            manifest = _json(self._blob(digest, 4 << 20, "manifest"), f"{self.ref}: manifest")
        config_digest = _check_digest((manifest.get("config") or {}).get("digest"), f"{self.ref}: config")
        config = _json(self._blob(config_digest, _CONFIG_LIMIT, "config"), f"{self.ref}: config")
        return Plan(digest, config_digest, config, _layers_of(manifest, config, str(self.ref)))

    @contextmanager
    def open_layer(self, layer: LayerSpec, blob_dir: Path, tmp_dir: Path, limit: int) -> Iterator[IO[bytes]]:
        assert layer.digest is not None
        path = self.root / "blobs" / "sha256" / layer.digest[7:]
        try:
            f = path.open("rb")
        except OSError as exc:
            raise ImageRefusedError(f"{self.ref}: layer {layer.digest}: {exc.strerror}") from exc
        with f:
            yield f

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- docker save archive


class _ArchiveSource:
    def __init__(self, ref: ImageRef) -> None:
        assert ref.path is not None
        self.ref = ref
        try:
            self.archive = tarfile.open(ref.path, mode="r:*")
        except (OSError, tarfile.TarError) as exc:
            raise ImageReferenceError(f"{self.ref}: not a readable docker save archive: {exc}") from exc

    def _member(self, name: str, limit: int) -> bytes:
        try:
            f = self.archive.extractfile(name)
        except KeyError:
            f = None
        if f is None:
            raise ImageRefusedError(f"{self.ref}: the archive has no file {name!r}")
        body = f.read(limit + 1)
        if len(body) > limit:
            raise ImageRefusedError(f"{self.ref}: {name!r} is over {limit} bytes")
        return body

    def plan(self) -> Plan:
        raw = self._member("manifest.json", 4 << 20)
        try:
            entries = json.loads(raw)
        except ValueError as exc:
            raise ImageRefusedError(f"{self.ref}: manifest.json is not JSON") from exc
        if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
            raise ImageReferenceError(f"{self.ref}: the archive must hold exactly one image")
        entry = entries[0]
        config_name = str(entry.get("Config", ""))
        body = self._member(config_name, _CONFIG_LIMIT)
        config_digest = "sha256:" + hashlib.sha256(body).hexdigest()
        stem = Path(config_name).name.removesuffix(".json")
        if len(stem) == 64 and stem != config_digest[7:]:
            raise ImageRefusedError(
                f"{self.ref}: config {config_name!r} does not match its digest {config_digest}"
            )
        config = _json(body, f"{self.ref}: config")
        names = entry.get("Layers")
        diff_ids = (config.get("rootfs") or {}).get("diff_ids")
        if not isinstance(names, list) or not isinstance(diff_ids, list) or len(names) != len(diff_ids):
            raise ImageRefusedError(
                f"{self.ref}: manifest.json's Layers and the config's diff_ids do not match"
            )
        layers = []
        self.names: dict[str, str] = {}
        for name, diff_id in zip(names, diff_ids, strict=True):
            _check_digest(diff_id, str(self.ref))
            parts = str(name).split("/")
            digest = f"sha256:{parts[-1]}" if len(parts) == 3 and parts[:2] == ["blobs", "sha256"] else None
            self.names[diff_id] = str(name)
            layers.append(LayerSpec(digest=digest, size=None, diff_id=diff_id))
        return Plan(None, config_digest, config, tuple(layers))

    @contextmanager
    def open_layer(self, layer: LayerSpec, blob_dir: Path, tmp_dir: Path, limit: int) -> Iterator[IO[bytes]]:
        name = self.names[layer.diff_id]
        try:
            f = self.archive.extractfile(name)
        except KeyError:
            f = None
        if f is None:
            raise ImageRefusedError(f"{self.ref}: the archive has no layer {name!r}")
        with f:
            yield f

    def close(self) -> None:
        self.archive.close()
