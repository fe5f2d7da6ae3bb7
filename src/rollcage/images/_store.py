"""The image store: one per node, content-addressed, safe for many processes at once.

Layout (``$ROLLCAGE_IMAGE_STORE``, default ``~/.cache/rollcage/images``)::

    blobs/sha256/HEX        registry layer blobs, verified (removed once unpacked)
    layers/HEX/root/        an unpacked layer, HEX its diff_id; meta.json beside root/
    images/HEX.json         an image's record (HEX the config digest: the image id)
    roots/HEX/              the image's flattened root, the read-only lower of every rollout
    refs/KEY.json           a reference (docker://…, oci:…, docker-archive:…) and the image it names
    tmp/                    partial downloads (HEX.partial) and unpacks in progress
    locks/                  flock files
    leases/HEX/ID.lease     one per running use of an image, flock'ed by its holder

Everything appears by ``rename`` once complete, so a path under ``layers/``, ``roots/`` or
``images/`` is whole or absent; a SIGKILLed pull leaves only ``tmp/``, which the next pull of the
same layer clears (an unpack) or continues (a download). Locks (``flock``, so they hold across
processes and vanish with their holder): one per image while it is pulled, one per layer while it
is fetched and unpacked, and the store's own, shared by pulls and taken whole by ``prune``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from rollcage.durable import publish_bytes
from rollcage.errors import ImagePullError, ImageReferenceError, ImageRefusedError
from rollcage.images._ref import ImageRef, parse_ref
from rollcage.images._sources import LayerSpec, Plan, Source, open_source
from rollcage.images._unpack import Budget, LayerMeta, Limits, flatten, remove_tree, unpack_layer

__all__ = [
    "STORE_ENV",
    "ImageConfig",
    "ImageEntry",
    "ImageStore",
    "PreparedImage",
    "PruneReport",
    "default_store_path",
]

STORE_ENV: Final = "ROLLCAGE_IMAGE_STORE"
_LOCK_WAIT_S: Final = 3600.0


def default_store_path() -> Path:
    """``$ROLLCAGE_IMAGE_STORE``, else ``~/.cache/rollcage/images`` (``$XDG_CACHE_HOME`` honoured)."""
    explicit = os.environ.get(STORE_ENV)
    if explicit:
        return Path(explicit).expanduser().absolute()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "rollcage" / "images"


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """The parts of an image's config a sandbox applies (the entrypoint only for the record)."""

    env: tuple[str, ...] = ()
    """``Env``: ``NAME=value`` strings."""
    working_dir: str | None = None
    """``WorkingDir``; ``None`` when the image sets none."""
    user: str | None = None
    """``User`` (``name``, ``uid``, ``uid:gid``); ``None`` when the image sets none."""
    entrypoint: tuple[str, ...] | None = None
    """``Entrypoint``, recorded, never run."""
    cmd: tuple[str, ...] | None = None
    """``Cmd``, recorded, never run."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageConfig:
        """Read the ``config`` member of an OCI/Docker image config."""
        inner = config.get("config") or {}

        def strings(value: Any) -> tuple[str, ...] | None:
            return tuple(str(v) for v in value) if isinstance(value, list) else None

        return cls(
            env=strings(inner.get("Env")) or (),
            working_dir=inner.get("WorkingDir") or None,
            user=inner.get("User") or None,
            entrypoint=strings(inner.get("Entrypoint")),
            cmd=strings(inner.get("Cmd")),
        )


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """An image ready to be the read-only lower of a rollout's root."""

    ref: str
    """The reference it was prepared from, canonical."""
    root: Path
    """The unpacked root file system. Read-only by contract: mount it as an overlay's lower."""
    config: ImageConfig
    """What the image's config says to apply."""
    digest: str | None
    """The image id (config digest); ``None`` for ``dir:``, which is used in place."""
    manifest_digest: str | None = None
    """The manifest's digest, where the image came with one."""


@dataclass(frozen=True, slots=True)
class ImageEntry:
    """One line of ``rollcage images ls``."""

    ref: str
    digest: str
    bytes: int
    in_use: int


@dataclass(slots=True)
class PruneReport:
    """What ``prune`` removed."""

    images: list[str] = field(default_factory=list)
    layers: int = 0
    other: int = 0


def _hex(digest: str) -> str:
    return digest.removeprefix("sha256:")


def _ref_key(ref: ImageRef) -> str:
    return hashlib.sha256(str(ref).encode()).hexdigest()[:40]


class ImageStore:
    """A node's image store at ``path`` (made on first use). Safe to use from many processes."""

    def __init__(
        self, path: Path | None = None, *, limits: Limits | None = None, insecure: bool = False
    ) -> None:
        self.path = (path or default_store_path()).absolute()
        self.limits = limits or Limits()
        self.insecure = insecure
        """Allow plain http to non-loopback registries."""
        self._made = False

    def _dir(self, name: str) -> Path:
        if not self._made:
            for sub in ("blobs/sha256", "layers", "images", "roots", "refs", "tmp", "locks", "leases"):
                (self.path / sub).mkdir(parents=True, exist_ok=True)
            self._made = True
        return self.path / name

    # ----------------------------------------------------------------------- locks

    @contextlib.contextmanager
    def _lock(self, name: str, *, shared: bool = False, wait_s: float = _LOCK_WAIT_S) -> Iterator[bool]:
        """Hold ``locks/NAME.lock``; with ``wait_s == 0`` yield ``False`` at once if someone else holds it.

        **Cancellation:** polls every 50 ms, so a signal ends the wait promptly.
        """
        fd = os.open(self._dir("locks") / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        if wait_s == 0:
                            yield False
                            return
                        raise ImagePullError(
                            f"waited {wait_s:.0f}s for another process holding the image store lock {name}"
                        ) from None
                    time.sleep(0.05)
            yield True
        finally:
            os.close(fd)

    # ----------------------------------------------------------------------- pull and prepare

    def pull(self, ref: ImageRef | str) -> PreparedImage:
        """Fetch and unpack an image (a registry is always asked what its tag names now).

        Raises ``ImageReferenceError`` (no such image), ``ImageRefusedError`` (unsafe, corrupt, too
        large: nothing of it is used) or ``ImagePullError`` (the registry failed; pulling again
        continues where this stopped).

        **Cancellation:** blocking (network, disk, locks). A signal that ends the process leaves only
        ``tmp/`` behind: the next pull continues the download and redoes the unpack.
        """
        parsed = parse_ref(ref) if isinstance(ref, str) else ref
        if parsed.transport == "dir":
            return self._dir_image(parsed)
        source = open_source(parsed, insecure=self.insecure)
        try:
            with self._lock("store", shared=True):
                plan = source.plan()
                return self._install(parsed, source, plan)
        finally:
            source.close()

    def prepare(self, ref: ImageRef | str) -> PreparedImage:
        """The image ready for use: from the store when it is there, pulled otherwise.

        A registry reference already in the store is used without asking the registry (pull
        again to refresh a tag); local layouts and archives are re-read, which is cheap. Concurrent
        prepares of one registry reference in one store, from any processes, pull it once.

        **Cancellation:** as :meth:`pull`.
        """
        parsed = parse_ref(ref) if isinstance(ref, str) else ref
        if parsed.transport == "dir":
            return self._dir_image(parsed)
        if parsed.transport == "docker":
            known = self._known(parsed)
            if known is not None:
                return known
            # Many processes of one node (a Ray node's rollouts, say) may ask for the same image at
            # once: one pulls, the others wait and find it in the store, so the registry is asked once.
            with self._lock(f"ref-{_ref_key(parsed)}"):
                known = self._known(parsed)
                if known is not None:
                    return known
                return self.pull(parsed)
        return self.pull(parsed)

    def _dir_image(self, ref: ImageRef) -> PreparedImage:
        assert ref.path is not None
        if not ref.path.is_dir():
            raise ImageReferenceError(f"{ref}: not a directory")
        return PreparedImage(str(ref), ref.path, ImageConfig(), None)

    def _known(self, ref: ImageRef) -> PreparedImage | None:
        try:
            record = json.loads((self._dir("refs") / f"{_ref_key(ref)}.json").read_bytes())
            return self._prepared(str(ref), record["image"], record.get("manifest_digest"))
        except (OSError, ValueError, KeyError):
            return None

    def _prepared(self, ref: str, digest: str, manifest_digest: str | None) -> PreparedImage:
        image = json.loads((self._dir("images") / f"{_hex(digest)}.json").read_bytes())
        root = self._dir("roots") / _hex(digest)
        if not root.is_dir():
            raise FileNotFoundError(root)
        return PreparedImage(ref, root, ImageConfig.from_config(image["config"]), digest, manifest_digest)

    def _install(self, ref: ImageRef, source: Source, plan: Plan) -> PreparedImage:
        hexid = _hex(plan.config_digest)
        with self._lock(f"image-{hexid}"):
            root = self._dir("roots") / hexid
            if not root.is_dir():
                budget = Budget(self.limits)
                metas = [self._layer(ref, source, layer, budget) for layer in plan.layers]
                record = {
                    "config_digest": plan.config_digest,
                    "layers": [layer.diff_id for layer in plan.layers],
                    "bytes": sum(meta.bytes for _, meta in metas),
                    "config": plan.config,
                }
                publish_bytes(self._dir("images") / f"{hexid}.json", json.dumps(record).encode(), mode=0o644)
                tmp = self._dir("tmp") / f"root-{hexid}"
                remove_tree(tmp)
                tmp.mkdir()
                flatten(metas, tmp)
                os.rename(tmp, root)
            ref_record = {
                "ref": str(ref),
                "image": plan.config_digest,
                "manifest_digest": plan.manifest_digest,
            }
            publish_bytes(
                self._dir("refs") / f"{_ref_key(ref)}.json", json.dumps(ref_record).encode(), mode=0o644
            )
        return self._prepared(str(ref), plan.config_digest, plan.manifest_digest)

    def _layer(
        self, ref: ImageRef, source: Source, layer: LayerSpec, budget: Budget
    ) -> tuple[Path, LayerMeta]:
        hexid = _hex(layer.diff_id)
        final = self._dir("layers") / hexid
        what = f"{ref}: layer {layer.digest or layer.diff_id}"
        with self._lock(f"layer-{hexid}"):
            if final.is_dir():
                meta = LayerMeta.from_json(json.loads((final / "meta.json").read_bytes()))
                budget.take_bytes(meta.bytes, what)
                for _ in range(meta.entries):
                    budget.take_entry(what)
                return final / "root", meta
            tmp = self._dir("tmp") / f"layer-{hexid}"
            remove_tree(tmp)
            (tmp / "root").mkdir(parents=True)
            blob_limit = 2 * self.limits.max_image_bytes
            with source.open_layer(layer, self._dir("blobs/sha256"), self._dir("tmp"), blob_limit) as stream:
                try:
                    meta = unpack_layer(
                        stream,
                        tmp / "root",
                        what=what,
                        digest=layer.digest,
                        diff_id=layer.diff_id,
                        budget=budget,
                    )
                except ImageRefusedError:
                    remove_tree(tmp)
                    if layer.digest is not None:
                        (self._dir("blobs/sha256") / _hex(layer.digest)).unlink(missing_ok=True)
                    raise
            publish_bytes(tmp / "meta.json", json.dumps(meta.to_json()).encode(), mode=0o644)
            os.rename(tmp, final)
            if layer.digest is not None:
                (self._dir("blobs/sha256") / _hex(layer.digest)).unlink(missing_ok=True)
            return final / "root", meta

    # ----------------------------------------------------------------------- leases

    @contextlib.contextmanager
    def lease(self, image: PreparedImage) -> Iterator[PreparedImage]:
        """Mark ``image`` in use while the block runs: ``rm`` and ``prune`` keep it.

        The lease is an flock'ed file, so a holder killed by SIGKILL releases it. Raises
        ``ImageReferenceError`` if the image was removed before the lease was taken (prepare again).

        **Cancellation:** taking it waits (bounded) while the same image is being pulled.
        """
        if image.digest is None:
            yield image  # dir: is the user's own directory; nothing of the store to keep
            return
        hexid = _hex(image.digest)
        directory = self._dir("leases") / hexid
        with self._lock(f"image-{hexid}"):
            if not image.root.is_dir():
                raise ImageReferenceError(
                    f"{image.ref}: the image was removed from the store; prepare it again"
                )
            directory.mkdir(exist_ok=True)
            path = directory / f"{os.getpid()}-{secrets.token_hex(8)}.lease"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield image
        finally:
            path.unlink(missing_ok=True)
            os.close(fd)

    def _live_leases(self, hexid: str, *, reap: bool = True) -> int:
        """Leases held now; with ``reap`` (under the image lock) stale ones, their holder dead, go."""
        directory = self._dir("leases") / hexid
        live = 0
        for path in directory.glob("*.lease") if directory.is_dir() else ():
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live += 1
            else:
                if reap:
                    path.unlink(missing_ok=True)
            finally:
                os.close(fd)
        return live

    # ----------------------------------------------------------------------- ls, rm, prune

    def _refs(self) -> list[tuple[Path, dict[str, Any]]]:
        found = []
        for path in sorted(self._dir("refs").glob("*.json")):
            try:
                found.append((path, json.loads(path.read_bytes())))
            except (OSError, ValueError):
                continue
        return found

    def list(self) -> list[ImageEntry]:
        """Every reference in the store, with its image id, size and current uses."""
        entries = []
        for _, record in self._refs():
            digest = str(record.get("image"))
            try:
                image = json.loads((self._dir("images") / f"{_hex(digest)}.json").read_bytes())
            except (OSError, ValueError):
                continue
            in_use = self._live_leases(_hex(digest), reap=False)  # no lock: ls never waits on a pull
            entries.append(ImageEntry(str(record.get("ref")), digest, int(image.get("bytes", 0)), in_use))
        return sorted(entries, key=lambda e: e.ref)

    def remove(self, ref: ImageRef | str) -> bool:
        """Forget a reference; its image goes too when nothing else names or uses it.

        Returns whether the image's files were removed (``False``: another reference names it, or a
        rollout uses it, and ``prune`` removes it later). Raises ``ImageReferenceError`` for an
        unknown reference.
        """
        parsed = parse_ref(ref) if isinstance(ref, str) else ref
        path = self._dir("refs") / f"{_ref_key(parsed)}.json"
        try:
            digest = str(json.loads(path.read_bytes())["image"])
        except (OSError, ValueError, KeyError) as exc:
            raise ImageReferenceError(f"{parsed}: not in the image store {self.path}") from exc
        path.unlink(missing_ok=True)
        named = {str(r.get("image")) for _, r in self._refs()}
        if digest in named:
            return False
        with self._lock("store", wait_s=0) as free:
            return bool(free) and self._drop_image(_hex(digest))

    def _drop_image(self, hexid: str) -> bool:
        with self._lock(f"image-{hexid}", wait_s=0) as free:
            if not free or self._live_leases(hexid):
                return False
            remove_tree(self._dir("roots") / hexid)
            (self._dir("images") / f"{hexid}.json").unlink(missing_ok=True)
            remove_tree(self._dir("leases") / hexid)
            return True

    def prune(self, *, everything: bool = False) -> PruneReport:
        """Remove images no reference names (``everything``: and those it does) that no rollout uses,
        then layers no image needs, then leftovers of interrupted pulls.

        **Cancellation:** waits (bounded) for pulls in progress to finish first.
        """
        report = PruneReport()
        with self._lock("store"):
            named = {_hex(str(r.get("image"))) for _, r in self._refs()}
            for path in sorted(self._dir("images").glob("*.json")):
                hexid = path.name.removesuffix(".json")
                if (everything or hexid not in named) and self._drop_image(hexid):
                    if everything:
                        for ref_path, record in self._refs():
                            if _hex(str(record.get("image"))) == hexid:
                                ref_path.unlink(missing_ok=True)
                    report.images.append(f"sha256:{hexid}")
            for root in self._dir("roots").iterdir():
                if not (self._dir("images") / f"{root.name}.json").exists():
                    remove_tree(root)
                    report.other += 1
            needed: set[str] = set()
            for path in self._dir("images").glob("*.json"):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    needed.update(_hex(d) for d in json.loads(path.read_bytes())["layers"])
            for layer in self._dir("layers").iterdir():
                if layer.name not in needed:
                    remove_tree(layer)
                    report.layers += 1
            for leftover in [*self._dir("tmp").iterdir(), *self._dir("blobs/sha256").iterdir()]:
                remove_tree(leftover)
                report.other += 1
        return report
